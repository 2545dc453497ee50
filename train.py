"""attotron's trainer: flags, process grid, composition in a fixed order, loop, logging.

Run
    python train.py                                   # tiny Llama on the default corpus, 1 process
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --ac --micro-batches 4

Builds on: every feature file (this is the composer); its parts: cli.py (flags, checked before any
heavy work), grid.py (process grid, failure reporting), feed.py (data, batches, validation loss).

Composition order (each step an exact no-op at degree 1, so one code path serves every layout)
    1. validate every flag against the config and world size, all at once — before heavy work (cli.py)
    2. process grid: tp innermost, then cp, then dp, then pp (tp peers are neighbours: fastest links;
       grid.py)
    3. build the model on the meta device (no memory)
    4. pp.split_stage: drop the layers/embedding/head this stage does not own
    5. tp.apply_tp: swap in column/row/vocab-parallel layers; returns the shard map;
       cp.apply_cp: ring attention over the cp ranks, RoPE at global (zigzag) positions;
       moe.shard_experts (--ep): each rank keeps its 1/ep of every MoE layer's experts, whole on
       every tp rank, and adds their rows of the global (E, ...) tensors to the shard map — the
       transforms of a layer go tp, ep, (pp's cut, made above), ac
    6. weights.param_reader: this rank's values from --init-from or the --seed init (the full
       weights never depend on the layout); the parameters stay on the meta device, only the RoPE
       buffers are allocated (weights.materialize_buffers)
    7. ac.apply_ac: checkpoint decoder layers (wrapping keeps parameter names); --compile:
       model.compile_layers compiles each layer's forward (the checkpoint inside it too) at its first call;
       a checkpointed layer whose attention runs eagerly (packed rows, --cp) or that holds an MoE block
       stays eager, and an MoE block runs eagerly between two graphs of its layer, as the log says
    8. zero3.apply_zero: fp32 masters + AdamW (precision.py) with dp gradient sync / ZeRO-1/2/3,
       built parameter by parameter from the reader — ZeRO-3 reads only its own shard, so no rank
       ever holds the whole model; the experts (--ep) reduce and shard over the ranks holding the
       same experts (grid.replica_group), everything else over dp·cp
    9. checkpoint_load.load_checkpoint (--resume): masters, moments and sampler position, any layout

Invariants
    - --ep N equals one process: the same losses and grad norms within 1e-5, checkpoints that
      resume at another ep, an export transformers loads (tests/test_moe_ep.py).
    - The order of training sequences is a function of (seed, data) only: the sampler shards the same
      global batch over dp ranks, so every layout trains on the same global batches; the cp ranks of
      a dp rank read the same rows, each its zigzag share of their tokens (cp.shard_sequence).
    - Step loss = sum of token losses / target tokens of the whole step (precision.normalized_loss).
    - The device is chosen once, here (grid.setup): CUDA + NCCL when available, else CPU + gloo.
    - A step that does not log waits for the device once: precision.step reads the grad norm (its
      non-finite check decides the update). The target count stays on the device (the loss is
      divided there), the loss is copied to host memory in stream order and read after that sync,
      the batch is made by a thread one step ahead (pinned: feed.Prefetcher) and copied with
      non_blocking, and the pipeline's peer check runs on the host over gloo. No collective runs on
      a group of one rank: a single process runs none in its step (tests/test_step_comm.py counts both).
    - SIGTERM / SIGUSR1 stop every rank at the same step, one after the signal's (preempt.py: an
      async MAX all-reduce on the gloo io group, no host sync), which is saved to --save before the
      exit with status 128 + signal; one run at a time writes a --save folder (its LOCK.json); see
      docs/cluster.md (tests/test_preempt.py).
    - "peak mem" in the log line is the training peak (forward, backward, step) of rank 0, measured
      by memory.PeakMeter at the allocator — not setup, data preparation, saving or export, whose
      peaks the last line lists per phase.
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
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

import ac as AC
import checkpoint as CK
import checkpoint_load as CL
import cli
import cp as CP
import data
import dp
import dpo as DPO
import export as EX
import feed
import grid as G
import grpo as GR
import memory as MEM
import model as M
import moe as MOE
import pp as PP
import precision as P
import preempt as PR
import sft
import tp as TP
import weights as W
import zero as Z
import zero3 as Z3



# ------------------------------------------------------------------------------------------ logging
def pipeline_summary(args: argparse.Namespace, cfg: M.LlamaConfig) -> str:
    """One line: the schedule, the split, and its simulated bubble with each virtual stage's cost
    (layers + the head's layer-equivalents; F=1, B=2 per layer, zb: B=W=1)."""
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


# ------------------------------------------------------------------------------------------ build
def build_model(args: argparse.Namespace, cfg: M.LlamaConfig, grid: G.Grid) -> tuple[M.Llama, dict, Z.Init]:
    """Steps 3-7 of the composition order (module docstring): the parameters stay on the meta
    device; the returned reader gives their values to make_optimizer."""
    model = M.build(cfg)
    PP.split_stage(model, grid.at.pp_rank, args.pp, cli.layer_ranges(args, cfg))
    shards = TP.apply_tp(model, grid.tp_group, sequence_parallel=args.sp)
    CP.apply_cp(model, grid.cp_group)
    shards |= shard_experts(model, cfg, grid)
    init = W.param_reader(model, seed=args.seed, hf_dir=args.init_from, shards=shards)
    W.materialize_buffers(model, grid.device)
    if args.ac or args.ac_mode:
        AC.apply_ac(model, args.ac_mode or "selective", args.ac_every)
    if args.compile:  # the layers left eager: named in the log line
        args.eager_layers = M.compile_layers(model, packed=(args.sft or args.dpo) and args.packing == "ffd")
    return model, shards, init


def shard_experts(model: M.Llama, cfg: M.LlamaConfig, grid: G.Grid) -> dict[str, TP.Shard]:
    """Step 5's expert parallelism: each rank keeps its 1/ep of every MoE layer's experts (still on
    the meta device) and exchanges tokens over grid.ep_group. Returns the experts' shards (rows of
    the global (E, ...) tensors) for the reader, checkpoints and export; none at ep = 1, where the
    experts stay whole (moe.shard_experts changes nothing)."""
    if not MOE.moe_blocks(model):  # a dense model, or a pipeline stage without a sparse layer
        return {}
    MOE.shard_experts(model, MOE.EPGroups(grid.ep_group, grid.replica_group, grid.ep, grid.ep_rank))
    if grid.ep == 1:
        return {}
    local = cfg.num_experts // grid.ep
    ours = {id(p) for p in MOE.expert_parameters(model)}
    return {n: TP.Shard(0, grid.ep_rank * local, local) for n, p in model.named_parameters() if id(p) in ours}


def make_optimizer(args: argparse.Namespace, model: M.Llama, shards: dict, init: Z.Init,
                   grid: G.Grid) -> Z.DataParallelOptimizer:
    """Grad-norm bookkeeping: tp shards are summed over tp, stages over pp (and ZeRO adds dp);
    a tp-replicated parameter counts on tp rank 0 only, a tied copy on the first stage only. The
    experts (--ep) reduce over grid.replica_group; their norm is zero.py's (each expert once).
    With pp > 1 a tied embedding's two copies sum their gradients over grid.embed_group in step()."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.reduce_dtype]
    ocfg = P.OptimConfig(lr=args.lr, weight_decay=args.weight_decay, clip=args.clip)
    pp_counted = PP.norm_counted(model)
    # an expert's shard is ep's, not tp's: it is whole on every tp rank (counted on tp rank 0)
    tp_sharded = lambda n: n in shards and not W.expert_tensor(n)  # noqa: E731
    counted = lambda n: pp_counted(n) and (tp_sharded(n) or grid.at.tp_rank == 0)  # noqa: E731
    return Z3.apply_zero(model, args.zero, grid.dp_group, ocfg, dtype, bucket_mb=args.bucket_mb,
                         reduce_dtype=reduce_dtype, prefetch=args.prefetch,
                         norm_groups=[grid.tp_group, grid.pp_group], counted=counted,
                         tied=PP.tied_copy(model), embed_group=grid.embed_group,
                         init=init, device=grid.device,
                         expert=W.expert_tensor, replica_group=grid.replica_group, ep_group=grid.ep_group)


def export_tokenizer(args: argparse.Namespace, ds: data.TokenDataset | sft.SFTDataset):
    """The tokenizer the trained ids come from: SFT's --tokenizer, or the one --data was prepared with."""
    path = ds.meta.get("tokenizer_path") if isinstance(ds, data.TokenDataset) else args.tokenizer
    return data.load_tokenizer(path)


def open_metrics(path: str, start: int) -> TextIO:
    """A resumed run keeps the records up to its checkpoint and drops those of steps it will redo
    (a fresh run starts empty). The kept lines are rewritten atomically — a temporary file, fsynced,
    renamed over the old one — so a crash at any moment leaves the old or the new file, never a
    truncated one; the file is then appended to, one flushed line per step. A torn last line (a
    kill mid-write) is dropped."""
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


def take_lock(args: argparse.Namespace, grid: G.Grid) -> PR.SaveLock | None:
    """The --save folder's lock (preempt.SaveLock), taken by rank 0 for the whole run; rank 0's
    outcome reaches every rank, so a refusal stops them all (one message: the holder). None
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
                "io_timeout", "max_bad_steps", "eval_every", "steps", "skip_checksums", "peak_tflops"}
SCHEDULE = ("lr", "min_lr", "warmup", "steps")


def plan_resume(args: argparse.Namespace, grid: G.Grid) -> Path | None:
    """The checkpoint --resume names (the newest complete one for 'auto'), found before any heavy
    work: its meta.json only. Flags that differ from its saved args are printed; those that cannot
    work (a --steps below its step, another data order) stop the run."""
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
    if 0 < args.steps < step:
        errors.append(f"--steps {args.steps} is below the checkpoint's step {step}: nothing would be "
                      f"trained (continue with --steps > {step}; --steps 0 only exports)")
    elif args.steps > step and all(k in saved for k in SCHEDULE):
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
    """Load the planned checkpoint (plan_resume) into the optimizer, parameters and sampler; return
    the step to continue from (0 when there is nothing to resume). The ranks agree over the io
    group: a file only one rank reads (and finds corrupt) stops them all."""
    if path is None:
        return 0
    try:
        got = CL.load_checkpoint(path, opt, cfg, shards, grid.at, group=grid.io_group,
                                 verify=not args.skip_checksums)
        sampler.load_state_dict(got.extra["sampler"])  # the global position: layout-free
    except (OSError, ValueError, KeyError) as e:
        G.fail(f"cannot resume from {path}: {e}", grid)
    if grid.rank == 0:
        print(f"resumed from {path} at step {got.step} (saved as {got.saved_layout})"
              + ("" if got.rng_restored else "; RNG states not restored (other layout)"), flush=True)
    return got.step


def save(args: argparse.Namespace, step: int, opt: Z.DataParallelOptimizer, cfg: M.LlamaConfig, shards: dict,
         sampler_state: dict, grid: G.Grid, metrics: TextIO | None, lock: PR.SaveLock | None = None) -> None:
    """Checkpoint `step` (a finite one: a skipped step never saves) once its metrics record is
    durable, so a kill between the two loses no record. The ranks wait for each other in the io
    group (long timeout), and rank 0 prunes to --keep inside the save, up to this step only.
    sampler_state: the sampler after this step's batch (feed.Prefetcher.next)."""
    if metrics:
        os.fsync(metrics.fileno())
    opt.finish_gathers()  # the checkpoint sees complete parameters (ZeRO-1/2 gather into the next forward)
    extra = {"sampler": sampler_state, "args": vars(args)}
    try:
        with G.stage("checkpoint save", grid):
            CK.save_checkpoint(args.save, step, opt, cfg, shards, grid.at, extra, group=grid.io_group,
                               keep=args.keep, guard=lock.check if lock else None)
    except OSError as e:  # the same on every rank (a full disk, no shared filesystem...)
        G.fail(str(e), grid)


# ------------------------------------------------------------------------------------------ main
def held_out_eval(model: torch.nn.Module, opt: Z.DataParallelOptimizer, eval_set: list[sft.Conversation],
                  tpl: sft.ChatTemplate, args: argparse.Namespace, grid: G.Grid, step: int) -> dict[str, float]:
    """Exact match on the built-in set's held-out questions (feed.evaluate, all ranks: tp runs inside),
    printed on rank 0. Greedy; under --grpo also sampled as GRPO samples (its temperature, G draws a
    prompt): the accuracy GRPO optimizes, which greedy decoding shows only once the mode flips."""
    with G.stage("held-out eval (generation)", grid), opt.gathered():
        out = {"eval_exact_match": feed.evaluate(model, None, eval_set, template=tpl)}
        if args.grpo:
            out["eval_sampled"] = feed.evaluate(model, None, eval_set, template=tpl, samples=args.grpo_group,
                                                temperature=args.grpo_temperature, seed=args.seed)
    if grid.rank == 0:
        print(f"eval step {step}: held-out exact match {out['eval_exact_match']:.1%}"
              + (f" greedy, {out['eval_sampled']:.1%} sampled (temperature {args.grpo_temperature:g}, "
                 f"{args.grpo_group} draws a prompt)" if args.grpo else ""), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    with contextlib.ExitStack() as cleanup:  # the --save folder's lock goes however the run ends
        run(argv, cleanup)


def run(argv: list[str] | None, cleanup: contextlib.ExitStack) -> None:
    """The whole run; `cleanup` releases the --save lock and the signal handlers at any exit. A
    stop on SIGTERM/SIGUSR1 saves the step the ranks agreed on and exits 128 + the signal."""
    args = cli.parse_args(argv)
    grid = G.setup(args.timeout if 0 < args.timeout < math.inf else 600.0)  # cli.validate reports a bad one
    numerics = cli.device_defaults(args, grid.device)
    meter = MEM.PeakMeter(grid.device)  # from here on every CPU block is counted (memory.py)
    meter.phase("data")
    try:
        cfg = W.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    except (OSError, ValueError) as e:
        G.fail(str(e), grid)
    errors = cli.validate(args, cfg, grid)
    if errors:
        G.fail("\n  ".join(["invalid configuration:"] + errors), grid)
    args.virtual_stages, args.micro_batches = cli.virtual_stages(args), cli.micro_batches(args, grid.world)
    stopper = PR.StopSignal()
    cleanup.callback(stopper.close)
    if lock := take_lock(args, grid):  # before any heavy work
        cleanup.callback(lock.release)  # before stopper.close (the stack runs backwards)
    ckpt = plan_resume(args, grid)
    try:
        chats = args.sft or args.dpo or args.grpo
        ds, tpl, eval_set = (DPO.load(args, grid) if args.dpo else GR.load(args, grid) if args.grpo
                             else feed.load_sft(args, grid) if args.sft else (feed.load_data(args, grid), None, []))
        ds.check_vocab(cfg.vocab_size)
        val, val_batches = (None, 0) if chats else feed.load_val(args, ds, grid)
        G.make_grid(grid, args.tp, args.pp, args.timeout, args.io_timeout, args.cp, args.ep)
        # small SFT sets: the last global batch of an epoch wraps around instead of being dropped
        sampler = dp.DPSampler(len(ds), args.batch_size, *grid.data, args.seed,
                               remainder="wrap" if chats else "drop")
    except (OSError, ValueError) as e:
        G.fail(str(e), grid)
    meter.phase("setup")
    try:
        with G.stage("building the model and the optimizer state", grid, collectives=False):
            model, shards, init = build_model(args, cfg, grid)
            opt = make_optimizer(args, model, shards, init, grid)
    except (OSError, ValueError) as e:  # a missing, truncated or mismatched --init-from checkpoint
        G.fail(str(e), grid)
    start = resume(ckpt, args, opt, cfg, shards, sampler, grid)
    try:
        export_tok = export_tokenizer(args, ds) if args.export_hf else None
    except (OSError, ValueError) as e:
        G.fail(f"--export-hf: the tokenizer to export: {e}", grid)
    actions = PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp, args.virtual_stages)
    chunks = PP.stage_chunks(model, cli.layer_ranges(args, cfg), grid.at.pp_rank, args.pp)
    for chunk in chunks:
        meter.watch(chunk)  # each forward is "forward", what follows it until the step "backward"
    # the loss, chosen once: tokens (pretraining, SFT) or preference pairs (--dpo: the loss_fn seam)
    count = DPO.count_pairs if args.dpo else lambda m: P.count_targets(m["labels"])
    preference = None  # --dpo: the DPO loss, which also sums the step's implicit rewards for the log
    if args.dpo:
        with G.stage("DPO reference log-probs (one forward over every pair)", grid):
            preference = DPO.prepare(chunks, ds, args, grid)
    # --grpo: the step's batch is made by sampling from the policy itself (grpo.Trainer.rollout_batch),
    # the sampler giving prompt indices; the loss is grpo's through the same loss_fn seam
    rl = GR.Trainer(model, args, tpl, grid.device) if args.grpo else None

    log = grid.rank == 0
    metrics = open_metrics(args.metrics, start) if args.metrics and log else None
    # positions a step runs: --dpo --packing none has two rows a pair (--batch-size counts pairs)
    tokens_per_step = args.batch_size * args.seq_len * (2 if args.dpo and args.packing == "none" else 1)
    fpt = cli.flops_per_token(cfg, args.seq_len)
    peak = cli.peak_flops(args, grid.device)
    eager = getattr(args, "eager_layers", [])  # compile_layers: whole layers, then "<layer>.mlp" blocks
    whole, blocks = [n for n in eager if "." not in n], [n for n in eager if "." in n]
    if log:
        print(f"model {cfg.num_params() / 1e6:.2f}M params"
              + (f" ({cli.active_params(cfg) / 1e6:.2f}M active per token)" if cfg.num_experts else "")
              + f" · data {len(ds)} sequences of {args.seq_len} · "
              f"world {grid.world} = tp {grid.at.tp} × cp {grid.cp} × dp {grid.data[1]} × pp {grid.at.pp} · "
              + (f"ep {grid.ep} (experts over dp·cp) · " if grid.ep > 1 else "")
              + f"zero {args.zero} · {numerics} on {grid.device.type}"
              + (f", reductions in {args.reduce_dtype}" if args.dtype == "bf16" else "")
              + (" · compiled layers" if args.compile else "")
              + (f" ({len(whole)} checkpointed run eagerly: their attention, packed rows, the cp ring or an "
                 f"MoE block would break the graph inside the checkpoint)" if whole else "")
              + (f" (eager between two graphs, for their data-dependent shapes: the MoE blocks "
                 f"{', '.join(blocks)})" if blocks else "")
              + (f" · MFU vs {peak / 1e12:.0f} TFLOP/s" if peak else ""), flush=True)
        if args.pp > 1:
            print(pipeline_summary(args, cfg), flush=True)
    drop = () if cfg.num_experts else ("real_tokens",)  # sft.py's padding mask: only moe.py's hooks read it
    load = (lambda rows: [{"rows": rows}]) if rl else (  # GRPO: the prompt rows stay on the host
        lambda rows: [{k: v for k, v in mb.items() if k not in drop}
                      for mb in feed.host_batch(ds, rows, args.micro_batches, grid)])
    prefetch = feed.Prefetcher(load, sampler, max(args.steps - start, 0), grid.device)
    if rl and eval_set and start == 0:  # GRPO's "before": the same eval on the starting policy
        before = {"step": 0, **held_out_eval(model, opt, eval_set, tpl, args, grid, 0)}
        if metrics:
            metrics.write(json.dumps(before) + "\n")
    t_start, bad, good = time.time(), 0, 0
    # tokens trained so far; GRPO's steps differ in size, so a resumed GRPO run counts from its resume
    tokens_seen = 0 if rl else tokens_per_step * start
    stopped = 0
    for step in range(start, args.steps):
        t0 = time.time()
        logs = log and (step % args.log_every == 0 or step == args.steps - 1)
        meter.phase("data")
        sampler_state, micro = prefetch.next()  # made while the last step ran; copies start here
        if rl:
            with G.stage("GRPO rollouts (generation, rewards, old log-probs)", grid):
                micro = rl.rollout_batch(opt, ds, micro[0]["rows"], step, args.micro_batches)
        with G.stage("counting the step's target tokens (dp all-reduce)", grid):
            # a device tensor, never read on the host: the loss is divided by it there
            targets = dp.global_count(sum(count(m) for m in micro), grid.dp_group)
        lr = cli.lr_at(step, args)
        losses, norms, log_sums = [], [], None
        # GRPO: μ optimizer updates on one rollout batch (--grpo-updates). The old log-probs stay the
        # rollout policy's, so from the second update on the ratio leaves 1 and the clip acts.
        updates = args.grpo_updates if rl else 1
        for update in range(updates):
            with G.stage(f"forward/backward ({args.schedule} pipeline over {args.pp} stage(s))", grid):
                loss = PP.run_pipeline(chunks, actions, micro, grid.pp_group, targets, no_sync=opt.no_sync,
                                       seq_shards=args.tp if args.sp else 1, check_group=grid.pp_check,
                                       peer_groups=grid.pp_peers)
            with G.stage(f"gradient reduction (dp / ZeRO-{args.zero})", grid):
                opt.finish()  # dp / ZeRO reductions land
                if grid.at.dp > 1:  # (dp · cp replicas; no collective on a group of one)
                    dist.all_reduce(loss, group=grid.dp_group)
                # the log's sums are complete after the last backward: reduce them now, read them
                # after the optimizer's sync. GRPO's over dp (tp ranks hold the same rows); DPO's
                # over the world (pair losses live on the head's pp stage)
                if update == updates - 1 and (rl or preference):
                    log_sums = feed.host_copy(rl.reduce_log(grid.dp_group) if rl else
                                              preference.reduce_log(grid.device))
            meter.settle()  # nothing in flight: the one point of an update where the meter may restart
            losses.append(feed.host_copy(loss))  # read after the update's sync, below: free
            meter.phase("step")
            with G.stage("optimizer step (tied-copy sum, grad-norm all-reduce, parameter all-gather)", grid):
                norms.append(opt.step(lr))  # an update's one host sync: the grad norm decides it
        step_stats = rl.stats(log_sums) if rl else preference.stats(log_sums) if preference else {}
        meter.phase(None)  # logging, eval: not training memory
        # the step's loss and grad norm: its updates' mean (one update but under --grpo-updates)
        loss_value, grad_norm = sum(map(float, losses)) / len(losses), sum(norms) / len(norms)
        if logs and grid.device.type == "cuda":
            torch.cuda.synchronize()  # the logged time includes this step's optimizer kernels
        dt = time.time() - t0  # host time; the step's sync keeps it within a step of the device's
        step_tokens = step_stats["positions"] if rl else tokens_per_step  # GRPO: its rollouts' rows
        tokens_seen += step_tokens
        tps = step_tokens / dt
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            bad += 1
            if log:
                print(f"warning: step {step + 1} skipped: loss {loss_value} grad norm {grad_norm} "
                      f"({bad} in a row, limit {args.max_bad_steps})", file=sys.stderr, flush=True)
            if bad >= args.max_bad_steps:
                G.fail(f"{bad} consecutive non-finite steps: lower --lr, check the data, or use --clip", grid)
            continue
        bad, good = 0, good + 1
        if logs:
            # steps run by this process only: a resumed run did not do the first `start`
            eta = (time.time() - t_start) / (step + 1 - start) * (args.steps - step - 1)
            # GRPO's rows are as long as its rollouts, not --seq-len: attention's FLOPs at their length
            step_fpt = cli.flops_per_token(cfg, step_stats["row_len"]) if rl else fpt
            mfu = f"{100 * tps * step_fpt / (peak * grid.world):.1f}%" if peak else "n/a"
            print(f"step {step + 1}/{args.steps} · loss {loss_value:.4f} · lr {lr:.2e} · "
                  f"grad norm {grad_norm:.3f} · {dt * 1000:.0f} ms · {tps:,.0f} tok/s "
                  f"({tps / grid.world:,.0f}/rank) · MFU {mfu} · "
                  f"peak mem {peak_text(meter.peak(*MEM.TRAINING))}"
                  + (f" · {GR.stats_text(step_stats)}" if rl else f" · {DPO.stats_text(step_stats)}"
                     if preference else "") + f" · ETA {eta:.0f}s", flush=True)
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                  "tokens": tokens_seen, "tokens_per_s": tps, "step_time_s": dt, **step_stats}
        evaluate = step + 1 == args.steps or args.eval_every and (step + 1) % args.eval_every == 0
        if evaluate:
            opt.finish_gathers()  # evaluation reads complete parameters
        if eval_set and evaluate:
            record.update(held_out_eval(model, opt, eval_set, tpl, args, grid, step + 1))
        if val is not None and evaluate:
            with G.stage("validation loss (forward over the held-out split)", grid):
                record["val_loss"] = feed.val_loss(chunks, val, val_batches, args, grid)
            if log:
                print(f"eval step {step + 1}: val loss {record['val_loss']:.4f}", flush=True)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        saving = args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps)
        if saving:
            with meter.during("save"):
                save(args, step + 1, opt, cfg, shards, sampler_state, grid, metrics, lock)
        # the same answer on every rank: a signal some rank had by the previous step (none after the last)
        stopped = stopper.poll(grid.io_group) if step + 1 < args.steps else 0
        if stopped:
            if args.save and not saving:
                with meter.during("save"):
                    save(args, step + 1, opt, cfg, shards, sampler_state, grid, metrics, lock)
            if log:
                print(f"stopped by {signal.Signals(stopped).name} after step {step + 1}: " + (
                      f"saved {args.save}, --resume auto continues" if args.save else
                      "no --save, nothing saved"), flush=True)
            break
    if args.steps > start and not good:
        G.fail(f"every step of this run ({args.steps - start}) was skipped as non-finite: nothing was "
             f"trained; lower --lr, check the data, or use --clip", grid)
    opt.finish_gathers()  # the run ends with complete parameters (the last step's gathers)
    if args.export_hf and not stopped:
        try:
            with G.stage("HF export", grid), meter.during("export"):
                EX.export_hf(model, opt, shards, cfg, grid.at, args.export_hf, grid.tp_group, grid.io_group,
                             export_tok, ep_group=grid.ep_group)
        except (OSError, ValueError) as e:  # the same on every rank
            G.fail(str(e), grid)
        if log:
            print(f"exported HF model to {args.export_hf}", flush=True)
    meter.close()  # the last settle: the final step's, the save's and the export's peaks
    if log and meter.available:
        print("peak memory by phase (rank 0): " + " · ".join(
            f"{name} {peak_text(meter.peak(name))}" for name in meter.peaks), flush=True)
    if metrics:
        metrics.close()
    stopper.wait()  # the agreement in flight, before its group goes
    opt.teardown()
    dist.destroy_process_group()
    if stopped:
        sys.exit(PR.exit_status(stopped))  # a status that tells launchers "stopped, not done" (docs/cluster.md)


if __name__ == "__main__":
    try:
        main()
    except G.StageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # peers may be stuck in a collective: exit without waiting for them
