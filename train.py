"""attotron's trainer: flags, process grid, composition in a fixed order, loop, logging.

Run
    python train.py                                   # tiny Llama on the default corpus, 1 process
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --ac --micro-batches 4

Builds on every feature file: this is the composer. Its parts: cli.py (flags), grid.py (process
grid, failure reports), feed.py (data, batches, validation loss).
`run` is the table of contents: configure, load_data, build, choose_loss, announce, train, finish.

Composition order. Each step is an exact no-op at degree 1, so one code path serves every layout.
    1. `cli.validate` checks every flag against the config and world size, all at once.
    2. `grid.make_grid` puts tp innermost, then cp, dp, pp: tp peers get the fastest links.
    3. `model.build` builds on the meta device: no memory yet.
    4. `pp.split_stage` drops the layers, embedding and head this stage does not own.
    5. `tp.apply_tp` swaps in column-, row- and vocab-parallel layers and returns the shard map.
       `cp.apply_cp` puts ring attention over the cp ranks, RoPE at global (zigzag) positions.
    6. `weights.param_reader` gives this rank's values, from --init-from or the --seed init.
       The full weights never depend on the layout. Only the RoPE buffers are allocated now.
    7. `ac.apply_ac` checkpoints decoder layers and keeps parameter names.
       With --compile, `model.compile_layers` compiles each layer's forward at its first call.
    8. `zero3.apply_zero` builds fp32 masters and AdamW, with dp gradient sync or ZeRO-1/2/3.
       It goes parameter by parameter through the reader. ZeRO-3 reads only its own shard.
    9. `checkpoint_load.load_checkpoint` (--resume) loads masters, moments, sampler position.
       It runs after the loss is chosen: DPO's and GRPO's references are the --init-from weights.

Extensions, each at its step
    5. `moe.shard_experts` (--ep): each rank keeps its 1/ep of every MoE layer's experts.
       They stay whole on every tp rank. Their rows of the global (E, ...) tensors join the shard map.
    7. --compile leaves a layer eager where a graph break would fall in its checkpoint (logged).
    8. The experts reduce and shard over the ranks holding the same experts (grid.replica_group).
       --optimizer muon: `muon.MuonRule` steps the hidden matrices (precision's update-rule seam).
    `--ep N` equals one process: losses, grad norms, resume, export (tests/test_moe_ep.py).

Invariants
    - The order of training sequences is a function of (seed, data) only. The sampler shards each
      global batch over the dp ranks, so every layout trains on the same batches. The cp ranks of
      a dp rank read the same rows, each its zigzag share (cp.shard_sequence).
    - Step loss = sum of token losses / target tokens of the whole step (precision.normalized_loss).
    - grid.setup chooses the device once: CUDA and NCCL when available, else CPU and gloo.
    - A step that does not log waits for the device once: precision.step reads the grad norm,
      whose finite check decides the update. The target count stays on the device, which divides
      the loss by it. The host reads the loss after that sync. A thread makes each batch a step
      ahead, pinned (feed.Prefetcher). The pipeline's peer check runs on the host, over gloo.
      No collective runs on a group of one rank. tests/test_step_comm.py counts both.
    - SIGTERM and SIGUSR1 stop every rank at the same step (preempt.py). That step is saved, then
      the run exits with 128 + signal. One run at a time writes a --save folder (docs/cluster.md).
    - "peak mem" in the log is rank 0's training peak: forward, backward, step (memory.PeakMeter).
      The last line lists the other phases' peaks: setup, data, save, export.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TextIO

if __name__ == "__main__":  # the flags first: --help and a mistyped flag answer before torch loads
    import cli
    cli.parse_args()

import torch
import torch.distributed as dist

import ac as AC
import checkpoint as CK
import checkpoint_load as CL
import cli
import cp as CP
import data
import deepseek as DS
import dp
import dpo as DPO
import export as EX
import feed
import fp8 as FP8
import grid as G
import grpo as GR
import lora as LO
import memory as MEM
import model as M
import offload as OFF
import moe as MOE
import pairing as PA
import muon as MU
import pp as PP
import precision as P
import preempt as PR
import qlora as QL
import trackers as TK
import sft
import tp as TP
import weights as W
import zero as Z
import zero3 as Z3


# ------------------------------------------------------------------------------------------ the run
@dataclass
class Run:
    """What the phases share. `configure` fills the first group; each later phase adds its own."""
    args: argparse.Namespace
    grid: G.Grid
    cfg: M.LlamaConfig
    numerics: str  # the compute dtype, as the log says it
    meter: MEM.PeakMeter
    stopper: PR.StopSignal
    lock: PR.SaveLock | None
    ckpt: Path | None  # the checkpoint --resume names, found but not read yet
    # load_data
    ds: data.TokenDataset | sft.SFTDataset | None = None
    tpl: sft.ChatTemplate | None = None
    eval_set: list = field(default_factory=list)  # held-out questions (chat modes)
    held: GR.PromptSet | DPO.PairDataset | None = None  # --grpo / --dpo --data: held out, scored at evals
    val: data.TokenDataset | None = None  # the validation split (pretraining)
    val_batches: int = 0
    sampler: dp.DPSampler | None = None
    # build
    model: M.Llama | None = None
    shards: dict = field(default_factory=dict)
    opt: Z.DataParallelOptimizer | None = None
    start: int = 0  # the first step to run: the checkpoint's, or 0
    export_tok: object = None
    chunks: list = field(default_factory=list)  # this rank's pipeline chunks (the model at pp = 1)
    actions: list = field(default_factory=list)  # this rank's pipeline schedule
    # choose_loss
    count: Callable[[dict], torch.Tensor] | None = None  # a micro-batch's loss denominator
    preference: DPO.DPOLoss | None = None
    rl: GR.Trainer | None = None
    # announce
    metrics: TextIO | None = None
    trackers: TK.Trackers | None = None  # --log-to: TensorBoard, W&B (rank 0)


def main(argv: list[str] | None = None) -> None:
    with contextlib.ExitStack() as cleanup:  # the --save folder's lock goes however the run ends
        run(argv, cleanup)


def run(argv: list[str] | None, cleanup: contextlib.ExitStack) -> None:
    """The whole run, phase by phase. `cleanup` releases the --save lock and the signal handlers at
    any exit. A stop on SIGTERM/SIGUSR1 saves the step the ranks agreed on and exits 128 + signal."""
    r = configure(argv, cleanup)  # flags, device, config, lock, the checkpoint to resume
    load_data(r)  # the data set, validation split, process grid and sampler
    build(r)  # model, transforms, optimizer, pipeline chunks
    choose_loss(r)  # tokens, preference pairs (--dpo) or rollouts (--grpo)
    # after choose_loss: DPO's and GRPO's references are the run's starting weights, not the resumed ones
    r.start = resume(r.ckpt, r.args, r.opt, r.cfg, r.shards, r.sampler, r.grid)
    announce(r)  # the run's first log lines and its metrics file
    stopped = train(r)  # the steps: each one step, its log, evaluation, saving
    finish(r, stopped)  # export, peak memory, teardown


def configure(argv: list[str] | None, cleanup: contextlib.ExitStack) -> Run:
    """Flags, the device, the model config and the --save lock: every check before any heavy work."""
    args = cli.parse_args(argv)
    grid = G.setup(args.timeout if 0 < args.timeout < math.inf else 600.0)  # cli.validate reports a bad one
    numerics = cli.device_defaults(args, grid.device)
    meter = MEM.PeakMeter(grid.device)  # from here on every CPU block is counted (memory.py)
    meter.phase("data")
    try:
        cfg = W.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    except (OSError, ValueError) as e:
        G.fail(str(e), grid)
    cfg, problems = PA.settle(args, cfg)  # the tokenizer: --init-from's own, checked; a preset sized to it
    errors = problems + cli.validate(args, cfg, grid)
    if errors:
        G.fail("\n  ".join(["invalid configuration:"] + errors), grid)
    args.virtual_stages, args.micro_batches = cli.virtual_stages(args), cli.micro_batches(args, grid.world)
    stopper = PR.StopSignal(speaks=grid.rank == 0)
    cleanup.callback(stopper.close)
    if lock := take_lock(args, grid):
        cleanup.callback(lock.release)  # before stopper.close: the stack runs backwards
    return Run(args, grid, cfg, numerics, meter, stopper, lock, plan_resume(args, grid))


def load_data(r: Run) -> None:
    """The mode's training set, its validation split or eval set, the process grid, the sampler.
    The grid comes after the data: rank 0 may prepare the data while the others wait."""
    args, grid = r.args, r.grid
    chats = args.sft or args.dpo or args.grpo
    try:
        r.ds, r.tpl, r.eval_set = (DPO.load(args, grid) if args.dpo else GR.load(args, grid) if args.grpo
                                   else feed.load_sft(args, grid) if args.sft else (feed.load_data(args, grid), None, []))
        if (args.grpo or args.dpo) and args.data:  # some held out: scored at each evaluation
            r.ds, r.held = (feed.split_prompts if args.grpo else feed.split_pairs)(args, r.ds, grid)
        r.ds.check_vocab(r.cfg.vocab_size)
        r.val, r.val_batches = (feed.chat_val(args, r.ds, unread_keys(r)) if chats
                                else feed.load_val(args, r.ds, grid))
        G.make_grid(grid, args.tp, args.pp, args.timeout, args.io_timeout, args.cp, args.ep)
        # small SFT sets: the last global batch of an epoch wraps around instead of being dropped
        r.sampler = dp.DPSampler(len(r.ds), args.batch_size, *grid.data, args.seed,
                                 remainder="wrap" if chats else "drop")
        if args.epochs is not None:  # the run's length, now that an epoch's steps are known
            args.steps = cli.steps_for_epochs(args, r.sampler.steps_per_epoch)
            if (note := cli.fit_warmup(args)) and grid.rank == 0:
                print(note, flush=True)
    except (OSError, ValueError) as e:
        G.fail(str(e), grid)


def build(r: Run) -> None:
    """The model and its optimizer (steps 3-8), the pipeline chunks and schedule. The resumed
    state (step 9) comes after choose_loss. The export's tokenizer is read now, so a missing one
    fails before training."""
    args, grid = r.args, r.grid
    r.meter.phase("setup")  # the memory peak meter's phase, until the first step's data
    try:
        with G.stage("building the model and the optimizer state", grid, collectives=False):
            r.model, r.shards, init = build_model(args, r.cfg, grid)
            r.opt = make_optimizer(args, r.model, r.shards, init, grid)
            r.opt.state_buffers = W.state_buffers(r.model)  # checkpointed with the masters (checkpoint.py)
    except (OSError, ValueError) as e:  # a missing, truncated or mismatched --init-from checkpoint
        G.fail(str(e), grid)
    try:
        r.export_tok = export_tokenizer(args, r.ds, r.tpl) if args.export_hf else None
    except (OSError, ValueError) as e:
        G.fail(f"--export-hf: the tokenizer to export: {e}", grid)
    r.actions = PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp, args.virtual_stages)
    r.chunks = PP.stage_chunks(r.model, cli.layer_ranges(args, r.cfg), grid.at.pp_rank, args.pp)
    for chunk in r.chunks:
        r.meter.watch(chunk)  # each forward is "forward", what follows it until the step "backward"


def build_model(args: argparse.Namespace, cfg: M.LlamaConfig, grid: G.Grid) -> tuple[M.Llama, dict, Z.Init]:
    """Steps 3-7 of the composition order (module docstring). The parameters stay on the meta
    device. The returned reader gives their values to make_optimizer."""
    model = M.build(cfg)
    PP.split_stage(model, grid.at.pp_rank, args.pp, cli.layer_ranges(args, cfg))
    shards = TP.apply_tp(model, grid.tp_group, sequence_parallel=args.sp)
    CP.apply_cp(model, grid.cp_group)
    if args.fp8:  # the layers' linears in FP8; each amax spans the ranks splitting its tensor
        args.fp8_kept = FP8.use_fp8(model, groups=(grid.tp_group, grid.cp_group))
    shards |= shard_experts(model, cfg, grid)
    init = W.param_reader(model, seed=args.seed, hf_dir=args.init_from, shards=shards)
    init = add_lora(args, model, shards, init, grid)
    W.materialize_buffers(model, grid.device, init)
    balance_experts(model, cfg, args, grid)
    if args.ac or args.ac_mode:
        AC.apply_ac(model, args.ac_mode or "selective", args.ac_every)
    if args.compile:  # the layers left eager: named in the log line
        args.eager_layers = M.compile_layers(model, packed=(args.sft or args.dpo) and args.packing == "ffd")
    return model, shards, init


def make_optimizer(args: argparse.Namespace, model: M.Llama, shards: dict, init: Z.Init,
                   grid: G.Grid) -> Z.DataParallelOptimizer:
    """Step 8. The grad norm sums tp shards over tp and stages over pp; ZeRO adds dp. A
    tp-replicated parameter counts on tp rank 0 only, a tied copy on the first stage only.
    With pp > 1, a tied embedding's two copies sum their gradients over grid.embed_group.
    The experts' own groups come from `expert_reduction` (extensions, at the end)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.reduce_dtype]
    ocfg = P.OptimConfig(lr=args.lr, weight_decay=args.weight_decay, clip=args.clip)
    pp_counted = PP.norm_counted(model)
    # an expert is sharded by ep, not tp: whole on every tp rank, so counted on tp rank 0
    tp_sharded = lambda n: n in shards and not W.expert_tensor(n)  # noqa: E731
    counted = lambda n: pp_counted(n) and (tp_sharded(n) or grid.at.tp_rank == 0)  # noqa: E731
    make = OFF.apply_offload if args.offload else Z3.apply_zero  # offload: the step on the host
    return make(model, args.zero, grid.dp_group, ocfg, dtype, bucket_mb=args.bucket_mb,
                reduce_dtype=reduce_dtype, prefetch=args.prefetch,
                norm_groups=[grid.tp_group, grid.pp_group], counted=counted,
                tied=trained(PP.tied_copy(model)), embed_group=grid.embed_group,
                init=init, device=grid.device, group_of=expert_reduction(model, grid),
                rule=update_rule(args, shards, grid))


def export_tokenizer(args: argparse.Namespace, ds: data.TokenDataset | sft.SFTDataset, tpl: sft.ChatTemplate | None):
    """The tokenizer the trained ids come from (--tokenizer, or the one --data was prepared with),
    with the chat template the run trained with (pairing.export_tokenizer)."""
    path = ds.meta.get("tokenizer_path") if isinstance(ds, data.TokenDataset) else args.tokenizer
    return PA.export_tokenizer(args, path, tpl)


def choose_loss(r: Run) -> None:
    """The loss, chosen once, through pp.run_pipeline's loss_fn seam. Pretraining and SFT count
    target tokens. --dpo counts preference pairs against frozen reference log-probs. --grpo
    samples each step's batch from the policy itself. Its sampler gives prompt indices."""
    args = r.args
    r.opt.finish_gathers()  # the references read complete parameters (ZeRO-1/2 gather lazily)
    r.count = DPO.count_pairs if args.dpo else lambda m: P.count_targets(m["labels"])
    if args.dpo:  # the DPO loss also sums the step's implicit rewards for the log
        with G.stage("DPO reference log-probs (one forward over every pair)", r.grid):
            r.preference = DPO.prepare(r.chunks, r.ds, args, r.grid)
            if r.held is not None:  # the held-out pairs' reference sums, by the same starting policy
                DPO.precompute_reference(r.chunks, r.preference, r.held, args, r.grid)
    if args.grpo:
        r.rl = GR.Trainer(r.model, args, r.tpl, r.grid.device)


def announce(r: Run) -> None:
    """Rank 0 prints the run's shape (and the pipeline's) and opens the metrics file."""
    args, grid, cfg = r.args, r.grid, r.cfg
    if grid.rank != 0:
        return
    r.metrics = open_metrics(args.metrics, r.start) if args.metrics else None
    r.trackers = TK.Trackers(args.log_to, args.metrics, vars(args)) if args.log_to else None
    peak = cli.peak_flops(args, grid.device)
    print(f"model {cfg.num_params() / 1e6:.2f}M params" + active_text(cfg)
          + f" · data {len(r.ds)} sequences of {args.seq_len} · "
          f"world {grid.world} = tp {grid.at.tp} × cp {grid.cp} × dp {grid.data[1]} × pp {grid.at.pp} · "
          + ep_text(grid)
          + f"zero {args.zero} · {r.numerics} on {grid.device.type}"
          + (f", reductions in {args.reduce_dtype}" if args.dtype == "bf16" else "")
          + (" · compiled layers" + eager_text(args) if args.compile else "")
          + (" · fp8 linears" + fp8_text(args) if args.fp8 else "")
          + (f" · MFU vs {peak / 1e12:.0f} TFLOP/s" if peak else "")
          + f" · {getattr(args, 'tokenizer_note', 'tokenizer bytes')}" + feed.cache_text(args), flush=True)
    if args.pp > 1:
        print(pipeline_summary(args, cfg), flush=True)


def train(r: Run) -> int:
    """The steps from r.start to --steps. Each runs one step, logs it, evaluates, saves and checks
    for a stop. Returns the signal that stopped the run (0: it ran to the end)."""
    args, grid = r.args, r.grid
    drop = unread_keys(r)
    load = (lambda rows: [{"rows": rows}]) if r.rl else (  # GRPO: the prompt rows stay on the host
        lambda rows: [{k: v for k, v in mb.items() if k not in drop}
                      for mb in feed.host_batch(r.ds, rows, args.micro_batches, grid)])
    prefetch = feed.Prefetcher(load, r.sampler, max(args.steps - r.start, 0), grid.device)
    if r.rl and r.eval_set and r.start == 0:  # GRPO's "before": the same eval on the starting policy
        write_record(r.metrics, {"step": 0, **held_out_eval(r, 0)}, r.trackers)
    # positions a step runs: --dpo --packing none has two rows a pair (--batch-size counts pairs)
    tokens_per_step = args.batch_size * args.seq_len * (2 if args.dpo and args.packing == "none" else 1)
    # tokens trained so far; GRPO's steps differ in size, so a resumed GRPO run counts from its resume
    tokens_seen = 0 if r.rl else tokens_per_step * r.start
    t_start, bad, good, stopped = time.time(), 0, 0, 0
    for step in range(r.start, args.steps):
        t0 = time.time()
        logs = grid.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1)
        r.meter.phase("data")
        sampler_state, micro = prefetch.next()  # made while the last step ran; copies start here
        loss, grad_norm, lr, stats = one_step(r, step, micro)
        if logs and grid.device.type == "cuda":
            torch.cuda.synchronize()  # the logged time includes this step's optimizer kernels
        dt = time.time() - t0  # host time; the step's sync keeps it within a step of the device's
        step_tokens = stats["positions"] if r.rl else tokens_per_step  # GRPO: its rollouts' rows
        tokens_seen += step_tokens
        tps = step_tokens / dt
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            bad += 1
            skip_step(r, step, loss, grad_norm, bad)
            continue
        bad, good = 0, good + 1
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens": tokens_seen, "tokens_per_s": tps, "step_time_s": dt,
                  "epoch": (step + 1) / r.sampler.steps_per_epoch, **stats}
        if logs:
            # steps run by this process only: a resumed run did not do the first `start`
            log_step(r, record, (time.time() - t_start) / (step + 1 - r.start) * (args.steps - step - 1))
        evaluate(r, step + 1, record)
        write_record(r.metrics, record, r.trackers)
        stopped = save_or_stop(r, step + 1, sampler_state)
        if stopped:
            break
    if args.steps > r.start and not good:
        G.fail(f"every step of this run ({args.steps - r.start}) was skipped as non-finite: nothing was "
               f"trained; lower --lr, check the data, or use --clip", grid)
    return stopped


def one_step(r: Run, step: int, micro: list[dict]) -> tuple[float, float, float, dict]:
    """One step on its batch: forward and backward through the pipeline, gradient reduction, the
    optimizer's update. Returns the loss, grad norm, lr and the mode's log statistics."""
    args, grid, opt, meter = r.args, r.grid, r.opt, r.meter
    if r.rl:
        with G.stage("GRPO rollouts (generation, rewards, old log-probs)", grid):
            try:
                micro = r.rl.rollout_batch(opt, r.ds, micro[0]["rows"], step, args.micro_batches)
            except GR.VerifierError as e:  # every rank raises it: one message, exit 2, no hang
                G.fail(str(e), grid)
    with G.stage("counting the step's target tokens (dp all-reduce)", grid):
        # a device tensor, never read on the host: the loss is divided by it there
        targets = dp.global_count(sum(r.count(m) for m in micro), grid.dp_group)
    lr = cli.lr_at(step, args)
    losses, norms, log_sums = [], [], None
    # GRPO: μ optimizer updates on one rollout batch (--grpo-updates). The old log-probs stay the
    # rollout policy's, so from the second update on the ratio leaves 1 and the clip acts.
    updates = args.grpo_updates if r.rl else 1
    for update in range(updates):
        with G.stage(f"forward/backward ({args.schedule} pipeline over {args.pp} stage(s))", grid):
            loss = PP.run_pipeline(r.chunks, r.actions, micro, grid.pp_group, targets, no_sync=opt.no_sync,
                                   seq_shards=args.tp if args.sp else 1, check_group=grid.pp_check,
                                   peer_groups=grid.pp_peers, hidden_size=r.cfg.hidden_size)
        with G.stage(f"gradient reduction (dp / ZeRO-{args.zero})", grid):
            opt.finish()  # dp / ZeRO reductions land
            if grid.at.dp > 1:  # (dp · cp replicas; no collective on a group of one)
                dist.all_reduce(loss, group=grid.dp_group)
            # The log's sums are complete after the last backward. Reduce them now, read them after
            # the optimizer's sync. GRPO's go over dp: tp ranks hold the same rows. DPO's go over
            # the world: pair losses live on the head's pp stage.
            if update == updates - 1 and (r.rl or r.preference):
                log_sums = feed.host_copy(r.rl.reduce_log(grid.dp_group) if r.rl else
                                          r.preference.reduce_log(grid.device))
        meter.settle()  # nothing in flight: the one point of an update where the meter may restart
        losses.append(feed.host_copy(loss))  # read after the update's sync, below: free
        meter.phase("step")
        with G.stage("optimizer step (tied-copy sum, grad-norm all-reduce, parameter all-gather)", grid):
            norms.append(opt.step(lr))  # an update's one host sync: the grad norm decides it
            after_step(r)
    stats = r.rl.stats(log_sums) if r.rl else r.preference.stats(log_sums) if r.preference else {}
    meter.phase(None)  # logging, eval: not training memory
    # the step's loss and grad norm: its updates' mean (one update but under --grpo-updates)
    return sum(map(float, losses)) / len(losses), sum(norms) / len(norms), lr, stats


def evaluate(r: Run, step: int, record: dict) -> None:
    """Evaluation at every --eval-every steps and the last, added to the step's record. Chat modes
    measure held-out exact match. Pretraining measures the validation loss."""
    args, grid = r.args, r.grid
    if not (step == args.steps or args.eval_every and step % args.eval_every == 0):
        return
    r.opt.finish_gathers()  # evaluation reads complete parameters
    if r.eval_set:
        record.update(held_out_eval(r, step))
    if r.held is not None:
        record.update(held_out_reward(r, step) if r.rl else held_out_pairs(r, step))
    if args.sample_prompts:
        record["samples"] = sample_replies(r, step)
    if r.val is not None:
        with G.stage("validation loss (forward over the held-out split)", grid):
            record["val_loss"] = feed.val_loss(r.chunks, r.val, r.val_batches, args, grid)
        if grid.rank == 0:
            print(f"eval step {step}: val loss {record['val_loss']:.4f}", flush=True)


def save_or_stop(r: Run, step: int, sampler_state: dict) -> int:
    """Save at every --save-every steps and the last. Then the ranks agree on a stop signal. A
    stopped run saves this step too. Returns the signal (0: go on)."""
    args = r.args
    saving = args.save and ((args.save_every and step % args.save_every == 0) or step == args.steps)
    if saving:
        with r.meter.during("save"):
            save(args, step, r.opt, r.cfg, r.shards, sampler_state, r.grid, r.metrics, r.lock)
    # Every rank gets the same answer: a signal some rank had by the previous step. None after the last.
    stopped = r.stopper.poll(r.grid.io_group) if step < args.steps else 0
    if stopped:
        if args.save and not saving:
            with r.meter.during("save"):
                save(args, step, r.opt, r.cfg, r.shards, sampler_state, r.grid, r.metrics, r.lock)
        if r.grid.rank == 0:
            print(f"stopped by {signal.Signals(stopped).name} after step {step}: " + (
                  f"saved {args.save}; to continue, run the same command with --resume auto" if args.save
                  else "no --save, nothing saved"), flush=True)
    return stopped


def finish(r: Run, stopped: int) -> None:
    """The export (--export-hf, not after a stop), the peak memory of each phase, then teardown.
    A stopped run exits with 128 + signal: launchers read "stopped, not done" (docs/cluster.md)."""
    args, grid, meter = r.args, r.grid, r.meter
    r.opt.finish_gathers()  # the run ends with complete parameters (the last step's gathers)
    if args.export_hf and not stopped:
        try:
            with G.stage("HF export", grid), meter.during("export"):
                export(r)
        except (OSError, ValueError) as e:  # the same on every rank
            G.fail(str(e), grid)
        if grid.rank == 0:
            print(f"exported HF model to {args.export_hf}", flush=True)
    if args.export_adapter and not stopped:
        with G.stage("LoRA adapter export", grid), meter.during("export"):
            export_adapter(r)
    meter.close()  # the last settle: the final step's, the save's and the export's peaks
    if grid.rank == 0 and meter.available:
        print("peak memory by phase (rank 0): " + " · ".join(
            f"{name} {peak_text(meter.peak(name))}" for name in meter.peaks), flush=True)
    if r.metrics:
        r.metrics.close()
    if r.trackers:
        r.trackers.close()
    r.stopper.wait()  # the agreement in flight, before its group goes
    r.opt.teardown()
    dist.destroy_process_group()
    if stopped:
        sys.exit(PR.exit_status(stopped))


def export(r: Run) -> None:
    """The trained weights as a transformers model folder (export.py), with the tokenizer."""
    with merged(r):
        EX.export_hf(r.model, r.opt, r.shards, r.cfg, r.grid.at, r.args.export_hf, r.grid.tp_group,
                     r.grid.io_group, r.export_tok, ep_group=r.grid.ep_group)


# ------------------------------------------------------------------------------------------ logging
def log_step(r: Run, record: dict, eta: float) -> None:
    """Rank 0's line for a step: its record, MFU, peak memory and the mode's statistics."""
    args, grid, rec = r.args, r.grid, record
    peak = cli.peak_flops(args, grid.device)
    # GRPO's rows are as long as its rollouts, not --seq-len: attention's FLOPs at their length
    fpt = cli.flops_per_token(r.cfg, rec["row_len"] if r.rl else args.seq_len)
    tps = rec["tokens_per_s"]
    mfu = f"{100 * tps * fpt / (peak * grid.world):.1f}%" if peak else "n/a"
    print(f"step {rec['step']}/{args.steps} · loss {rec['loss']:.4f} · lr {rec['lr']:.2e} · "
          f"grad norm {rec['grad_norm']:.3f} · {rec['step_time_s'] * 1000:.0f} ms · {tps:,.0f} tok/s "
          f"({tps / grid.world:,.0f}/rank) · MFU {mfu} · "
          f"peak mem {peak_text(r.meter.peak(*MEM.TRAINING))}"
          + (f" · {GR.stats_text(rec)}" if r.rl else f" · {DPO.stats_text(rec)}" if r.preference else "")
          + (f" · epoch {rec['epoch']:.2f}/{args.epochs:g}" if args.epochs else "")
          + f" · ETA {eta:.0f}s", flush=True)


def skip_step(r: Run, step: int, loss: float, grad_norm: float, bad: int) -> None:
    """A non-finite step made no update (precision.step checks the grad norm). Rank 0 warns; the
    run stops after --max-bad-steps such steps in a row."""
    if r.grid.rank == 0:
        print(f"warning: step {step + 1} skipped: loss {loss} grad norm {grad_norm} "
              f"({bad} in a row, limit {r.args.max_bad_steps})", file=sys.stderr, flush=True)
    if bad >= r.args.max_bad_steps:
        G.fail(f"{bad} consecutive non-finite steps: lower --lr, check the data, or use --clip", r.grid)


def write_record(metrics: TextIO | None, record: dict, trackers: TK.Trackers | None = None) -> None:
    """One JSON line, flushed (rank 0 with --metrics; open_metrics opened the file). --log-to's
    trackers get the same record."""
    if metrics:
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
    if trackers:
        trackers.write(record)


def held_out_eval(r: Run, step: int) -> dict[str, float]:
    """Exact match on the built-in set's held-out questions (feed.evaluate, sharded over dp; tp runs
    inside), printed on rank 0. Greedy first. Under --grpo also sampled as GRPO samples: its
    temperature, G draws a prompt. That is the accuracy GRPO optimizes; greedy shows it only once
    the mode flips."""
    args, tpl, grid = r.args, r.tpl, r.grid
    with G.stage("held-out eval (generation)", r.grid), r.opt.gathered():
        # each dp rank decodes its shard of the answers; the shares sum over dp (cp ranks: the same shard)
        out = {"eval_exact_match": feed.evaluate(r.model, None, r.eval_set, template=tpl, shard=grid.data)}
        if args.grpo:
            out["eval_sampled"] = feed.evaluate(r.model, None, r.eval_set, template=tpl, samples=args.grpo_group,
                                                temperature=args.grpo_temperature, seed=args.seed, shard=grid.data)
        if grid.data[1] > 1:
            t = torch.tensor(list(out.values()), dtype=torch.float64, device=grid.device)
            dist.all_reduce(t, group=grid.dp_group)
            out = dict(zip(out, (t / (grid.at.dp // grid.data[1])).tolist()))
    if r.grid.rank == 0:
        print(f"eval step {step}: held-out exact match {out['eval_exact_match']:.1%}"
              + (f" greedy, {out['eval_sampled']:.1%} sampled (temperature {args.grpo_temperature:g}, "
                 f"{args.grpo_group} draws a prompt)" if args.grpo else ""), flush=True)
    return out


def held_out_pairs(r: Run, step: int) -> dict[str, float]:
    """--dpo --data: the implicit rewards of the held-out pairs (feed.dpo_val), printed on rank 0."""
    with G.stage("held-out DPO rewards (forward over the held-out pairs)", r.grid):
        stats = r.preference.stats(feed.dpo_val(r.chunks, r.held, r.preference, r.args, r.grid))
    if r.grid.rank == 0:
        print(f"eval step {step}: held-out {DPO.stats_text(stats)}", flush=True)
    return {f"val_{k}": v for k, v in stats.items()}


def held_out_reward(r: Run, step: int) -> dict[str, float]:
    """--grpo --data: the verifier's mean reward on the held-out prompts' greedy replies (all ranks
    generate: tp runs inside), printed on rank 0."""
    held, tpl = r.held, r.tpl
    with G.stage("held-out reward (generation)", r.grid), r.opt.gathered():
        replies = feed.greedy_replies(r.model, held.prompts, tpl.end_id, r.args.grpo_max_new)
    reward = sum(float(r.rl.verifier(tpl.decode(reply), gold)) for reply, gold in zip(replies, held.golds))
    reward /= len(held.golds)
    if r.grid.rank == 0:
        print(f"eval step {step}: held-out reward {reward:.3f} (greedy, {len(held.golds)} prompts)", flush=True)
    return {"val_reward": reward}


def sample_replies(r: Run, step: int) -> list[str]:
    """--sample-prompts: each prompt's greedy reply (feed.sample_replies, all ranks: tp runs inside),
    printed on rank 0."""
    prompts = feed.read_sample_prompts(r.args.sample_prompts)
    tok = None if r.tpl else export_tokenizer(r.args, r.ds)
    with G.stage("sample replies (generation)", r.grid), r.opt.gathered():
        replies = feed.sample_replies(r.model, prompts, tok, r.tpl)
    if r.grid.rank == 0:
        for prompt, reply in zip(prompts, replies):
            print(f"sample step {step}: {prompt!r} → {reply!r}", flush=True)
    return replies


def pipeline_summary(args: argparse.Namespace, cfg: M.LlamaConfig) -> str:
    """One line: the schedule, the split, and its simulated bubble. A virtual stage costs its
    layers plus the head's layer-equivalents. F=1 and B=2 per layer (zb: B=W=1)."""
    ranges, p, v, m = cli.layer_ranges(args, cfg), args.pp, args.virtual_stages, args.micro_batches
    cost = [len(r) + PP.head_cost(cfg, args.seq_len) * (k == p * v - 1) for k, r in enumerate(ranges)]
    sim = PP.simulate([PP.SCHEDULES[args.schedule](m, s, p, v) for s in range(p)], 1,
                      1 if args.schedule == "zb" else 2, 1, weights=[cost[s::p] for s in range(p)])
    return (f"pipeline: {args.schedule}, {p} stages x {v} chunk(s), {m} micro-batches, layers per virtual "
            f"stage {[len(r) for r in ranges]} (head = {cost[-1] - len(ranges[-1]):.1f} layers), simulated "
            f"bubble {float(sim.bubble):.1%}" + ("" if m >= p else " (fewer micro-batches than stages)"))


def peak_text(peak: MEM.Peak | None) -> str:
    """'123 MB' (allocated), with the CUDA cache's reserved bytes when known; 'n/a' if unmeasured."""
    if peak is None:
        return "n/a"
    reserved = f" ({peak.reserved / 2**20:,.0f} MB reserved)" if peak.reserved is not None else ""
    return f"{peak.allocated / 2**20:,.0f} MB{reserved}"


def open_metrics(path: str, start: int) -> TextIO:
    """A resumed run keeps the records up to its checkpoint. It drops those of steps it will redo;
    a fresh run starts empty. The kept lines are written to a temporary file, fsynced, and renamed
    over the old one. So a crash leaves the old or the new file, never a truncated one. The file is
    then appended to, one flushed line per step. A torn last line (a kill mid-write) is dropped."""
    kept, torn = [], 0
    if start and os.path.exists(path):
        for line in open(path):
            try:
                if line.strip() and json.loads(line)["step"] <= start:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                torn += 1
    if torn:
        print(f"note: {path}: {torn} unreadable line(s) dropped (a run killed while writing)", flush=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return open(path, "a")


# ------------------------------------------------------------------------------------------ save and resume
def take_lock(args: argparse.Namespace, grid: G.Grid) -> PR.SaveLock | None:
    """The --save folder's lock (preempt.SaveLock), held by rank 0 for the whole run. Rank 0's
    outcome reaches every rank, so a refusal stops them all with one message: the holder. None
    without --save, and on ranks other than 0. Reading a --resume folder needs no lock."""
    if not args.save:
        return None
    lock, problem = PR.SaveLock(args.save, *PR.job_of(os.environ)), None
    if grid.rank == 0:
        try:
            if note := lock.acquire():
                print(f"note: {note}", flush=True)
        except (PR.LockedError, OSError) as e:
            problem = str(e)
    refused = torch.tensor([problem is not None], dtype=torch.int32, device=grid.device)
    if grid.world > 1:
        dist.broadcast(refused, src=0)
    if refused.item():
        G.fail(problem or "rank 0 could not take the --save folder's lock", grid)
    return lock if grid.rank == 0 else None


# resuming with a flag that differs from the checkpoint's run: an error where the saved sampler
# position would point into other rows or another order; silence for flags that change nothing
# the run computes; a note for the rest (another layout, schedule or data path is legitimate)
RESUME_ERRORS = {"seed": "the data order changes", "batch_size": "the global batch changes",
                 "seq_len": "the rows change", "sft": "the rows change", "packing": "the rows change",
                 "overlong": "the rows change", "dpo": "the rows change", "grpo": "the rows change"}
RESUME_QUIET = {"metrics", "export_hf", "save", "save_every", "resume", "keep", "log_every", "timeout",
                "io_timeout", "max_bad_steps", "eval_every", "steps", "skip_checksums", "peak_tflops",
                "fit_to_data", "log_to", "grpo_rollout_rows"}  # fit_to_data: which defaults the data shrank; their values are compared
SCHEDULE = ("lr", "min_lr", "warmup", "steps")


def plan_resume(args: argparse.Namespace, grid: G.Grid) -> Path | None:
    """The checkpoint --resume names, or the newest complete one for 'auto'. Only its meta.json is
    read, before any heavy work. Flags that differ from its saved args are printed. Those that
    cannot work stop the run: a --steps below its step, another data order."""
    if not args.resume:
        return None
    path = CK.latest_checkpoint(args.save) if args.resume == "auto" else Path(args.resume)
    if path is None:
        if grid.rank == 0:
            print(f"note: no complete checkpoint in {args.save}: starting fresh", flush=True)
        return None
    try:
        meta = json.loads((path / "meta.json").read_text())
        step, saved = int(meta["step"]), meta["extra"].get("args", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        G.fail(f"cannot resume from {path}: {path / 'meta.json'} is missing or unreadable ({e})", grid)
    now, errors, notes = vars(args), [], []
    for k in sorted(set(saved) & set(now) - RESUME_QUIET):
        if saved[k] != now[k]:
            line = f"--{k.replace('_', '-')} {now[k]} (checkpoint: {saved[k]})"
            if k in RESUME_ERRORS:
                errors.append(f"{line}: {RESUME_ERRORS[k]}, so the saved data position would point elsewhere")
            else:
                notes.append(line)
    steps = step if args.steps is None else args.steps  # --epochs: counted in load_data, not yet
    if 0 < steps < step:
        errors.append(f"--steps {args.steps} is below the checkpoint's step {step}: nothing would be "
                      f"trained (continue with --steps > {step}; --steps 0 only exports)")
    elif steps > step and all(k in saved for k in SCHEDULE):
        if args.steps != saved["steps"]:
            notes.append(f"--steps {args.steps} (checkpoint's run: {saved['steps']}): the cosine decay now "
                         f"ends at step {args.steps}")
        then = cli.lr_at(step, argparse.Namespace(**{k: saved[k] for k in SCHEDULE}))
        if not math.isclose(then, cli.lr_at(step, args)):
            notes.append(f"the lr of step {step + 1} is {cli.lr_at(step, args):.3g} with these flags, "
                         f"{then:.3g} on the checkpoint's schedule")
    if errors:
        G.fail("\n  ".join([f"cannot resume from {path} with these flags:"] + errors), grid)
    if grid.rank == 0:
        if notes:
            print("\n  ".join([f"note: resuming {path} with flags that differ from its run:"] + notes),
                  flush=True)
        later = [p.name for s, p in CK.complete_checkpoints(path.parent) if s > step]
        if later:
            print(f"note: {path.parent} also holds later checkpoints ({', '.join(later[-3:])}): a restart "
                  f"with --resume auto would continue from those, not from this run's saves", flush=True)
    return path


def resume(path: Path | None, args: argparse.Namespace, opt: Z.DataParallelOptimizer, cfg: M.LlamaConfig,
           shards: dict, sampler: dp.DPSampler, grid: G.Grid) -> int:
    """Load the planned checkpoint (plan_resume) into the optimizer, parameters and sampler.
    Returns the step to continue from, 0 when there is nothing to resume. The ranks agree over
    the io group: a corrupt file that only one rank reads stops them all."""
    if path is None:
        return 0
    try:
        got = CL.load_checkpoint(path, opt, cfg, shards, grid.at, group=grid.io_group,
                                 verify=not args.skip_checksums, shapes=trained_shapes(args, cfg))
        sampler.load_state_dict(got.extra["sampler"])  # the global position: layout-free
    except (OSError, ValueError, KeyError) as e:
        G.fail(f"cannot resume from {path}: {e}", grid)
    if grid.rank == 0:
        print(f"resumed from {path} at step {got.step} (saved as {got.saved_layout})"
              + ("" if got.rng_restored else "; RNG states not restored (other layout)"), flush=True)
    return got.step


def save(args: argparse.Namespace, step: int, opt: Z.DataParallelOptimizer, cfg: M.LlamaConfig, shards: dict,
         sampler_state: dict, grid: G.Grid, metrics: TextIO | None, lock: PR.SaveLock | None = None) -> None:
    """Checkpoint `step` once its metrics record is durable: a kill between the two loses no
    record. A skipped, non-finite step never saves. The ranks wait for each other in the io group
    (long timeout). Rank 0 prunes to --keep inside the save, up to this step only.
    sampler_state: the sampler after this step's batch (feed.Prefetcher.next)."""
    t0 = time.time()
    if metrics:
        os.fsync(metrics.fileno())
    opt.finish_gathers()  # the checkpoint sees complete parameters (ZeRO-1/2 gather into the next forward)
    extra = {"sampler": sampler_state, "args": vars(args)}
    try:
        with G.stage("checkpoint save", grid):
            CK.save_checkpoint(args.save, step, opt, cfg, shards, grid.at, extra, group=grid.io_group,
                               shapes=trained_shapes(args, cfg),
                               keep=args.keep, guard=lock.check if lock else None)
    except OSError as e:  # the same on every rank (a full disk, no shared filesystem...)
        G.fail(str(e), grid)
    if grid.rank == 0:  # a stop must fit torchrun's --shutdown-timeout: the log shows what a save takes
        print(f"saved step {step} to {Path(args.save) / f'step_{step:08d}'} in {time.time() - t0:.1f} s", flush=True)

# ------------------------------------------------------------------------------------------ extensions
# Expert parallelism and compiled layers, as the composition's steps 5, 7 and 8 call them.
def shard_experts(model: M.Llama, cfg: M.LlamaConfig, grid: G.Grid) -> dict[str, TP.Shard]:
    """Step 5's expert parallelism (--ep). Each rank keeps its 1/ep of every MoE layer's experts,
    still on the meta device. Tokens travel over grid.ep_group. Returns the experts' shards
    (rows of the global (E, ...) tensors) for the reader, checkpoints and export. At ep = 1 there
    are none: the experts stay whole, and moe.shard_experts changes nothing."""
    if not MOE.moe_blocks(model):  # a dense model, or a pipeline stage without a sparse layer
        return {}
    MOE.shard_experts(model, MOE.EPGroups(grid.ep_group, grid.replica_group, grid.ep, grid.ep_rank))
    if grid.ep == 1:
        return {}
    local = cfg.num_experts // grid.ep
    ours = {id(p) for p in MOE.expert_parameters(model)}
    return {n: TP.Shard(0, grid.ep_rank * local, local) for n, p in model.named_parameters() if id(p) in ours}


def expert_reduction(model: M.Llama, grid: G.Grid) -> Z.GroupOf:
    """Step 8's expert parallelism (--ep): zero3.apply_zero's parameter → group function. The
    experts reduce over grid.replica_group, the ranks holding the same experts; the ep group holds
    the others. zero.py counts each expert once in the grad norm."""
    return MOE.grad_reduce_plan(model, MOE.EPGroups(grid.ep_group, grid.replica_group, grid.ep, grid.ep_rank))


def balance_experts(model: M.Llama, cfg: M.LlamaConfig, args: argparse.Namespace, grid: G.Grid) -> None:
    """Step 6's aux-loss-free balancing (deepseek_v3): the routers' bias moves after each step,
    from the loads summed over the ranks that route tokens of their own (dp·cp; tp too under sp)."""
    if DS.routers(model) and cfg.bias_update_speed:
        model.bias_balancer = DS.BiasBalancer(model, cfg.bias_update_speed,
                                              [grid.dp_group, grid.tp_group if args.sp else None])


def after_step(r: Run) -> None:
    """What moves once per optimizer step besides the parameters: DeepSeek-V3's router bias."""
    balancer = getattr(r.model, "bias_balancer", None)
    if balancer is not None:
        balancer.step()


def update_rule(args: argparse.Namespace, shards: dict, grid: G.Grid) -> P.UpdateRule | None:
    """Step 8's update rule: AdamW (None), or --optimizer muon (muon.py).
    Muon gathers a tp-sharded matrix over tp: it needs each one's shard dim. Experts are whole."""
    if args.optimizer != "muon":
        return None
    cfg = MU.MuonConfig(lr=args.muon_lr, weight_decay=args.muon_weight_decay)
    tp_dim = {n: s.dim for n, s in shards.items() if not W.expert_tensor(n)}
    return MU.MuonRule(cfg, tp_group=grid.tp_group, tp_dim=tp_dim)


def unread_keys(r: Run) -> tuple[str, ...]:
    """Row keys that no part of the model reads. sft.py's rows mark their padding (real_tokens) for
    moe.py's router statistics; a dense model's forward takes no such keyword."""
    return () if r.cfg.num_experts else ("real_tokens",)


def active_text(cfg: M.LlamaConfig) -> str:
    """The log's parameters a token reads, for a mixture of experts."""
    return f" ({cli.active_params(cfg) / 1e6:.2f}M active per token)" if cfg.num_experts else ""


def ep_text(grid: G.Grid) -> str:
    """The log's expert-parallel degree, when there is one."""
    return f"ep {grid.ep} (experts over dp·cp) · " if grid.ep > 1 else ""


def eager_text(args: argparse.Namespace) -> str:
    """The layers --compile left eager (model.compile_layers): whole layers, then '<layer>.mlp' blocks."""
    eager = getattr(args, "eager_layers", [])
    whole, blocks = [n for n in eager if "." not in n], [n for n in eager if "." in n]
    return ((f" ({len(whole)} checkpointed run eagerly: their attention, packed rows, the cp ring or an "
             f"MoE block would break the graph inside the checkpoint)" if whole else "")
            + (f" (eager between two graphs, for their data-dependent shapes: the MoE blocks "
               f"{', '.join(blocks)})" if blocks else ""))


def fp8_text(args: argparse.Namespace) -> str:
    """The linears --fp8 left in the compute dtype: a local shape not a multiple of 16 (fp8.fits)."""
    kept = args.fp8_kept
    return f" ({len(kept)} kept unquantized, dims not multiples of 16: {', '.join(kept)})" if kept else ""


# ------------------------------------------------------------------------------------------ LoRA
def add_lora(args: argparse.Namespace, model: M.Llama, shards: dict, init: Z.Init, grid: G.Grid) -> Z.Init:
    """Step 5's LoRA (--lora R, lora.py): the model frozen, adapters on the targets, after tp split
    the layers. The adapters' shards join the map. The frozen base takes the compute dtype.
    ZeRO-3 leaves it on the meta device: the optimizer reads each rank's shard, one weight at a time.
    Stages 0-2 fill it now, whole on every dp rank. The optimizer trains only the adapters.
    Returns the reader that also gives the adapters (and QLoRA's NF4 codes)."""
    if not args.lora:
        return init
    LO.apply_lora(model, args.lora, args.lora_alpha, args.lora_dropout, tuple(args.lora_targets.split(",")))
    shards |= LO.shards(model)
    adapters = LO.load_peft(args.init_adapter)[1] if args.init_adapter else None
    if adapters is not None and (missing := set(LO.adapter_names(model)) - set(adapters)):
        raise ValueError(f"--init-adapter {args.init_adapter}: no tensors for {sorted(missing)[:4]}...")
    read = LO.reader(model, init, args.seed, adapters)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    LO.frozen_dtype(model, dtype)
    if args.qlora:  # NF4 parameters on meta; the reader quantizes each weight whole, then cuts this rank's slice
        whole, shapes = W.param_reader(M.build(model.config), args.seed, args.init_from), M.global_shapes(model.config)
        QL.apply_qlora(model, lambda n: torch.empty(shapes[n], device="meta"), dtype, "meta")
        read = QL.reader(model, read, lambda n: whole(n, 0, math.prod(shapes[n])).view(shapes[n]).to(grid.device))
    if args.zero < 3:
        LO.materialize_frozen(model, read, grid.device)
    return read


@contextlib.contextmanager
def merged(r: Run) -> Iterator[None]:
    """--export-hf with --lora: the adapters merged into the weights while the export runs."""
    if not r.args.lora:
        yield
        return
    with r.opt.gathered():
        LO.merge(r.model)
    try:
        yield
    finally:
        with r.opt.gathered():
            LO.unmerge(r.model)


def export_adapter(r: Run) -> None:
    """--export-adapter DIR: PEFT's adapter folder. Each stage's (dp 0, tp 0) rank writes its
    layers' full adapters to a part file; rank 0 joins the parts into one file."""
    args, grid = r.args, r.grid
    out = Path(args.export_adapter)
    with r.opt.gathered():
        full = LO.gather_adapters(r.model)
    part = out / f".part-{grid.at.pp_rank}.safetensors"
    from safetensors.torch import load_file, save_file
    if grid.at.dp_rank == 0 and grid.at.tp_rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: t.float().contiguous().cpu() for n, t in full.items()}, part)
    CK.exchange({}, grid.io_group)  # every part is written
    if grid.rank == 0:
        parts = sorted(out.glob(".part-*.safetensors"))
        joined = {n: t for p in parts for n, t in load_file(p).items()}
        LO.save_peft(joined, LO.LoraConfig(args.lora, args.lora_alpha or args.lora, args.lora_dropout,
                                           tuple(args.lora_targets.split(","))), out, args.init_from)
        for p in parts:
            p.unlink()
    CK.exchange({}, grid.io_group)


def trained_shapes(args: argparse.Namespace, cfg: M.LlamaConfig) -> dict | None:
    """What a --lora checkpoint holds: the adapters' full shapes (the base is --init-from's)."""
    return LO.adapter_shapes(M.global_shapes(cfg), args.lora, tuple(args.lora_targets.split(","))) if args.lora else None


def trained(p: torch.nn.Parameter | None) -> torch.nn.Parameter | None:
    """A tied embedding the optimizer steps; None when frozen (--lora)."""
    return p if p is not None and p.requires_grad else None


if __name__ == "__main__":
    try:
        main()
    except G.StageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # peers may be stuck in a collective: exit without waiting for them
    except KeyboardInterrupt:  # Ctrl-C outside the loop's handler (setup, teardown): nothing to save
        print("\ninterrupted before training started or after it ended: nothing saved", file=sys.stderr, flush=True)
        os._exit(PR.exit_status(signal.SIGINT))
