"""attotron's trainer: flags, process grid, composition in a fixed order, loop, logging.

Run
    python train.py                                   # tiny Llama on the default corpus, 1 process
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --ac --micro-batches 4

Builds on: every feature file (this is the composer).

Composition order (each step an exact no-op at degree 1, so one code path serves every layout)
    1. validate every flag against the config and world size, all at once — before heavy work
    2. process grid: tp innermost, then dp, then pp (tp peers are neighbours: fastest links)
    3. build the model on the meta device (no memory)
    4. pp.split_stage: drop the layers/embedding/head this stage does not own
    5. tp.apply_tp: swap in column/row/vocab-parallel layers; returns the shard map
    6. weights.param_reader: this rank's values from --init-from or the --seed init (the full
       weights never depend on the layout); the parameters stay on the meta device, only the RoPE
       buffers are allocated (weights.materialize_buffers)
    7. ac.apply_ac: checkpoint decoder layers (wrapping keeps parameter names)
    8. zero.apply_zero: fp32 masters + AdamW (precision.py) with dp gradient sync / ZeRO-1/2/3,
       built parameter by parameter from the reader — ZeRO-3 reads only its own shard, so no rank
       ever holds the whole model
    9. checkpoint.load_checkpoint (--resume): masters, moments and sampler position, any layout

Invariants
    - The order of training sequences is a function of (seed, data) only: the sampler shards the same
      global batch over dp ranks, so every layout trains on the same global batches.
    - Step loss = sum of token losses / target tokens of the whole step (precision.normalized_loss).
    - The device is chosen once, here: CUDA + NCCL when available, else CPU + gloo.
    - "peak mem" in the log line is the training peak (forward, backward, step) of rank 0, measured
      by memory.PeakMeter at the allocator — not setup, data preparation, saving or export, whose
      peaks the last line lists per phase.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import ac as AC
import checkpoint as CK
import data
import dp
import memory as MEM
import model as M
import pp as PP
import precision as P
import sft
import tp as TP
import weights as W
import zero as Z


# ------------------------------------------------------------------------------------------ flags
class HelpWithDefaults(argparse.HelpFormatter):
    """Show a flag's default in --help when it has a meaningful one (not None / off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpWithDefaults)
    a = p.add_argument
    a("--model", default="tiny", choices=sorted(M.PRESETS), help="preset for random init")
    a("--init-from", default=None, help="HF model dir (config.json + safetensors) to start from")
    a("--data", default=None, help="prepared data dir, or a .txt/.jsonl/folder to prepare; "
                                   "default: the Python stdlib sources, byte-tokenized")
    a("--tokenizer", default=None, help="local HF tokenizer dir used to prepare --data (default: bytes)")
    a("--seq-len", type=int, default=None, help="tokens per training sequence (default 256; 1024 with --sft)")
    a("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    a("--micro-batches", type=int, default=1, help="gradient-accumulation micro-batches per dp rank")
    a("--steps", type=int, default=50, help="optimizer steps")
    a("--lr", type=float, default=None, help="peak learning rate (default 1e-3; 2e-4 with --sft: "
                                              "post-training wants a lower rate than pretraining)")
    a("--min-lr", type=float, default=None, help="final learning rate of the cosine decay (default lr/10)")
    a("--warmup", type=int, default=10, help="linear warm-up steps")
    a("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (not norms/biases)")
    a("--clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    a("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (masters stay fp32)")
    a("--seed", type=int, default=0, help="init and data-order seed")
    a("--metrics", default=None, help="JSONL file: one object per step (rank 0)")
    a("--export-hf", default=None, help="write an HF-loadable model dir here at the end")
    a("--save", default=None, help="checkpoint dir (step_XXXXXXXX/ folders: safetensors + JSON)")
    a("--save-every", type=int, default=0, help="save every N steps (0: only after the last step)")
    a("--resume", default=None, help="a checkpoint folder, or 'auto' = the newest complete one in --save "
                                     "(any layout can resume any other)")
    a("--keep", type=int, default=3, help="complete checkpoints kept in --save")
    a("--log-every", type=int, default=1, help="print a log line every N steps")
    # supervised fine-tuning
    a("--sft", action="store_true", help="SFT on chat JSONL (--data) or the built-in arithmetic chats")
    a("--packing", default="ffd", choices=["ffd", "none"],
      help="--sft: FFD-pack conversations or one per row")
    a("--overlong", default="truncate", choices=["truncate", "drop"],
      help="--sft: what to do with conversations longer than --seq-len (counted and reported)")
    a("--skip-bad", action="store_true", help="--sft: skip and count malformed JSONL lines")
    a("--eval-every", type=int, default=0,
      help="--sft: held-out exact-match accuracy every N steps (and at the end); 0 = only at the end")
    a("--timeout", type=float, default=600.0,
      help="seconds a collective may wait before the run stops with a message naming the stage")
    a("--max-bad-steps", type=int, default=3,
      help="abort after this many consecutive steps with a non-finite loss or grad norm (each skipped)")
    # parallelism: world = tp · dp · pp, dp is what is left
    a("--tp", type=int, default=1, help="tensor-parallel degree (innermost in the grid)")
    a("--sp", action="store_true", help="sequence parallelism with --tp: norms and residuals hold "
                                        "seq-len/tp tokens per rank (Megatron)")
    a("--pp", type=int, default=1, help="pipeline stages")
    a("--pp-layers", default=None, help="layers per stage, e.g. 3,3,2 (default: uniform, extra "
                                        "layers to the first stages so the last, with the head, is lightest)")
    a("--schedule", default="1f1b", choices=sorted(PP.SCHEDULES), help="pipeline schedule")
    a("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the dp group")
    a("--bucket-mb", type=float, default=25.0, help="gradient bucket size for dp / ZeRO-1/2 (MB)")
    a("--reduce-dtype", default=None, choices=["fp32", "bf16"],
      help="dtype of gradient reductions and ZeRO-2/3 accumulation (default: the compute dtype)")
    a("--prefetch", type=int, default=1, help="ZeRO-3: units all-gathered ahead of use")
    a("--ac", action="store_true", help="activation checkpointing (selective unless --ac-mode)")
    a("--ac-mode", default=None, choices=["full", "selective"], help="implies --ac")
    a("--ac-every", type=int, default=1, help="checkpoint layers whose global index is a multiple of k")
    args = p.parse_args(argv)
    args.seq_len = args.seq_len or (sft.DEFAULT_SEQ_LEN if args.sft else 256)
    args.lr = args.lr or (2e-4 if args.sft else 1e-3)
    args.min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    return args


# ------------------------------------------------------------------------------------------ setup
@dataclass
class Grid:
    rank: int
    world: int
    device: torch.device
    at: CK.Layout = CK.Layout()  # sizes and this rank's coordinates (also what checkpoints record)
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    embed_group: dist.ProcessGroup | None = None


def setup(timeout_s: float = 600.0) -> Grid:
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so the same
    collectives run (as no-ops) in both cases. A launcher that already formed the default group
    (the tests' forked ranks) is used as is."""
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:  # torchrun
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            # a torchrun restart (--max-restarts) reuses the agent's store: namespace each attempt,
            # or the new ranks may read a dead rank's address and fail to connect (torch 2.13, gloo)
            store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        else:
            store, rank, world = dist.HashStore(), 0, 1
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout)
    return Grid(dist.get_rank(), dist.get_world_size(), device)


def make_grid(grid: Grid, tp: int, pp: int, timeout_s: float = 600.0) -> None:
    """rank = pp_rank·(dp·tp) + dp_rank·tp + tp_rank. Every rank creates every group, in the same
    order (new_group is collective), and keeps the ones it belongs to."""
    w = grid.world
    dpn = w // (tp * pp)
    grid.at = CK.Layout(tp, dpn, pp, grid.rank % tp, grid.rank // tp % dpn, grid.rank // (tp * dpn))

    def mine(rank_lists: list[list[int]]) -> dist.ProcessGroup | None:
        found = None
        for ranks in rank_lists:
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
            found = g if grid.rank in ranks else found
        return found

    at = lambda p, d, t: CK.Layout(tp, dpn, pp, t, d, p).rank  # noqa: E731
    grid.tp_group = mine([[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dpn)])
    grid.dp_group = mine([[at(p, d, t) for d in range(dpn)] for p in range(pp) for t in range(tp)])
    grid.pp_group = mine([[at(p, d, t) for p in range(pp)] for d in range(dpn) for t in range(tp)])
    grid.embed_group = mine(PP.tied_embedding_ranks(w, pp))


class StageError(RuntimeError):
    """A collective failed or timed out; the message names the training stage."""


@contextlib.contextmanager
def stage(name: str, grid: Grid):
    """Name the training stage in which a collective failed or timed out (a peer died, hung, or
    disagreed) — a bare gloo/NCCL timeout does not say where the run was."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        raise StageError(f"rank {grid.rank}: distributed operation failed during {name}: {e}") from e


def fail(msg: str, grid: Grid | None = None) -> None:
    """One readable message on rank 0 and a non-zero exit on every rank — never a hang."""
    if grid is None or grid.rank == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(2)


def validate(args: argparse.Namespace, cfg: M.LlamaConfig, grid: Grid) -> list[str]:
    """Every check that needs no heavy work, all reported at once."""
    errors = []
    for flag in ("seq_len", "batch_size", "micro_batches", "steps"):
        if getattr(args, flag) < (0 if flag == "steps" else 1):
            errors.append(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.seq_len > cfg.max_position_embeddings:
        errors.append(f"--seq-len {args.seq_len} > max_position_embeddings {cfg.max_position_embeddings}")
    if args.tp < 1 or args.pp < 1 or grid.world % (args.tp * args.pp):
        errors.append(f"world size {grid.world} is not divisible by --tp {args.tp} × --pp {args.pp}")
        return errors
    dp_size = grid.world // (args.tp * args.pp)
    try:
        TP.tp_validate(cfg, args.tp, seq_len=args.seq_len if args.sp else None)
    except ValueError as e:
        errors.append(str(e))
    try:
        PP.partition(cfg.num_hidden_layers, args.pp, parse_layers(args.pp_layers))
    except ValueError as e:
        errors.append(str(e))
    if args.batch_size % (dp_size * args.micro_batches):
        errors.append(f"--batch-size {args.batch_size} is not divisible by dp size {dp_size} × "
                      f"--micro-batches {args.micro_batches}")
    if args.ac_every < 1 or (args.ac_every != 1 and not (args.ac or args.ac_mode)):
        errors.append(f"--ac-every {args.ac_every} needs to be >= 1 and goes with --ac / --ac-mode")
    if args.sft and (args.pp > 1 or args.sp) and not args.data:
        errors.append("the built-in SFT eval generates with the whole model at any length: use --pp 1 "
                      "and no --sp with --sft (or give --data, which has no eval set)")
    if (args.packing != "ffd" or args.overlong != "truncate" or args.skip_bad or args.eval_every) \
            and not args.sft:
        errors.append("--packing / --overlong / --skip-bad / --eval-every go with --sft")
    if args.resume == "auto" and not args.save:
        errors.append("--resume auto needs --save DIR (where to look)")
    if args.save_every < 0 or args.keep < 1:
        errors.append(f"need --save-every >= 0 and --keep >= 1, got {args.save_every} and {args.keep}")
    if args.bucket_mb <= 0 or args.prefetch < 0 or args.max_bad_steps < 1:
        errors.append("--bucket-mb must be > 0, --prefetch >= 0, --max-bad-steps >= 1")
    if args.warmup < 0 or args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        errors.append(f"need 0 < --min-lr <= --lr and --warmup >= 0 (got lr {args.lr}, "
                      f"min-lr {args.min_lr}, warmup {args.warmup})")
    return errors


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layers {text!r}: expected comma-separated integers like 3,3,2") from None


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


def load_data(args: argparse.Namespace, grid: Grid) -> data.TokenDataset:
    """A prepared dir is used as is; a raw corpus is prepared once (rank 0) into <corpus>.attotron."""
    if args.data is None:
        path = data.default_corpus() if grid.rank == 0 else None
    elif (Path(args.data) / "meta.json").is_file():
        path = Path(args.data)
    else:
        # prepared next to the corpus; prepared again when the tokenizer changed
        path = Path(str(args.data).rstrip("/") + ".attotron")
        want = str(Path(args.tokenizer).resolve()) if args.tokenizer not in (None, "bytes") else None
        meta = path / "meta.json"
        stale = not meta.is_file() or json.loads(meta.read_text()).get("tokenizer_path") != want
        if grid.rank == 0 and stale:
            data.prepare(args.data, path, args.tokenizer)
    dist.barrier()
    if path is None:
        path = data.default_corpus()  # prepared by rank 0 above: now only reused
    return data.TokenDataset(path, args.seq_len)


def load_sft(args: argparse.Namespace, grid: Grid) -> tuple[sft.SFTDataset, object, list]:
    """Chats from --data (no eval set) or the built-in arithmetic set (train + held-out eval)."""
    tok = data.load_tokenizer(args.tokenizer)
    if args.data:
        convs, bad = sft.load_jsonl(args.data, skip_bad=args.skip_bad)
        eval_set = []
    else:
        (convs, eval_set), bad = sft.arithmetic_chats(), 0
    ds = sft.SFTDataset(convs, tok, args.seq_len, args.packing, args.overlong)
    if grid.rank == 0:
        print(ds.report() + (f"\n  {bad} malformed lines skipped" if bad else ""), flush=True)
    return ds, tok, eval_set


def get_batch(ds: data.TokenDataset | sft.SFTDataset, rows: list[int], micro_batches: int,
              device: torch.device) -> list[dict[str, torch.Tensor]]:
    """This rank's rows as micro-batches of (b, S) tensors: input_ids, labels (already shifted)
    and, for packed SFT rows, position_ids (restarting per conversation)."""
    items = [ds[i] for i in rows]
    if isinstance(items[0], dict):
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    else:
        tokens = torch.stack(items)  # (b, S+1)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    batch = {k: v.to(device) for k, v in batch.items()}
    return [dict(zip(batch, parts)) for parts in zip(*(v.chunk(micro_batches) for v in batch.values()))]


def peak_text(peak: MEM.Peak | None) -> str:
    """'123 MB' (allocated), with the CUDA cache's reserved bytes when known; 'n/a' if unmeasured."""
    if peak is None:
        return "n/a"
    reserved = f" ({peak.reserved / 2**20:,.0f} MB reserved)" if peak.reserved is not None else ""
    return f"{peak.allocated / 2**20:,.0f} MB{reserved}"


def flops_per_token(cfg: M.LlamaConfig, seq_len: int) -> float:
    """6N for the matmuls of forward + backward, plus 12·L·H·Q·T for attention scores (PaLM App. B)."""
    n = cfg.num_params()
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


# ------------------------------------------------------------------------------------------ build
def build_model(args: argparse.Namespace, cfg: M.LlamaConfig, grid: Grid) -> tuple[M.Llama, dict, Z.Init]:
    """Steps 3-7 of the composition order (module docstring): the parameters stay on the meta
    device; the returned reader gives their values to make_optimizer."""
    model = M.build(cfg)
    ranges = PP.partition(cfg.num_hidden_layers, args.pp, parse_layers(args.pp_layers))
    PP.split_stage(model, grid.at.pp_rank, args.pp, ranges)
    shards = TP.apply_tp(model, grid.tp_group, sequence_parallel=args.sp)
    init = W.param_reader(model, seed=args.seed, hf_dir=args.init_from, shards=shards)
    W.materialize_buffers(model, grid.device)
    if args.ac or args.ac_mode:
        AC.apply_ac(model, args.ac_mode or "selective", args.ac_every)
    return model, shards, init


def make_optimizer(args: argparse.Namespace, model: M.Llama, shards: dict, init: Z.Init,
                   grid: Grid) -> Z.DataParallel:
    """Grad-norm bookkeeping: tp shards are summed over tp, stages over pp (and ZeRO adds dp);
    a tp-replicated parameter counts on tp rank 0 only, a tied copy on the first stage only.
    With pp > 1 a tied embedding's two copies sum their gradients over grid.embed_group in step()."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}[args.reduce_dtype]
    ocfg = P.OptimConfig(lr=args.lr, weight_decay=args.weight_decay, clip=args.clip)
    pp_counted = PP.norm_counted(model)
    counted = lambda n: pp_counted(n) and (n in shards or grid.at.tp_rank == 0)  # noqa: E731
    return Z.apply_zero(model, args.zero, grid.dp_group, ocfg, dtype, bucket_mb=args.bucket_mb,
                        reduce_dtype=reduce_dtype, prefetch=args.prefetch,
                        norm_groups=[grid.tp_group, grid.pp_group], counted=counted,
                        tied=PP.tied_copy(model), embed_group=grid.embed_group,
                        init=init, device=grid.device)


def export_hf(model: M.Llama, opt: Z.DataParallel, shards: dict, cfg: M.LlamaConfig, grid: Grid,
              out: str) -> None:
    """Gather the compute parameters (fp32 in fp32 mode, else the bf16 copy of the masters) over tp,
    then the stages over pp, to global rank 0, which writes the HF dir."""
    with opt.gathered():  # ZeRO-3: full parameters inside
        local = {n: p.detach().clone() for n, p in model.named_parameters()}
    full = TP.gather_full(local, shards, grid.tp_group, cfg)
    if grid.at.dp_rank == 0 and grid.at.tp_rank == 0:  # one pp group holds global rank 0
        cpu = {n: t.cpu() for n, t in full.items()}
        stages = [None] * grid.at.pp if grid.rank == 0 else None
        dist.gather_object(cpu, stages, dst=0, group=grid.pp_group)
        if grid.rank == 0:
            W.save_hf({k: v for st in stages for k, v in st.items()}, cfg, out)
    dist.barrier()


def open_metrics(path: str, start: int):
    """A resumed run keeps the records up to its checkpoint and drops those of steps it will redo."""
    kept = []
    if start and os.path.exists(path):
        kept = [line for line in open(path) if line.strip() and json.loads(line)["step"] <= start]
    f = open(path, "w")
    f.writelines(kept)
    return f


def resume(args: argparse.Namespace, opt: Z.DataParallel, cfg: M.LlamaConfig, shards: dict,
           sampler: dp.DPSampler, grid: Grid) -> int:
    """Load --resume (or the newest complete checkpoint for 'auto') into the optimizer, parameters
    and sampler; return the step to continue from (0 when there is nothing to resume)."""
    path = CK.latest_checkpoint(args.save) if args.resume == "auto" else args.resume
    if not path:
        if args.resume == "auto" and grid.rank == 0:
            print(f"note: no complete checkpoint in {args.save}: starting fresh", flush=True)
        return 0
    try:
        got = CK.load_checkpoint(path, opt, cfg, shards, grid.at)
        sampler.load_state_dict(got.extra["sampler"])  # the global position: layout-free
    except (OSError, ValueError, KeyError) as e:
        fail(f"cannot resume from {path}: {e}", grid)
    if grid.rank == 0:
        print(f"resumed from {path} at step {got.step} (saved as {got.saved_layout})"
              + ("" if got.rng_restored else "; RNG states not restored (other layout)"), flush=True)
    return got.step


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    grid = setup(args.timeout)
    meter = MEM.PeakMeter(grid.device)  # from here on every CPU block is counted (memory.py)
    meter.phase("data")
    try:
        cfg = M.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    except (OSError, ValueError) as e:
        fail(str(e), grid)
    errors = validate(args, cfg, grid)
    if errors:
        fail("\n  ".join(["invalid configuration:"] + errors), grid)
    try:
        ds, tok, eval_set = load_sft(args, grid) if args.sft else (load_data(args, grid), None, [])
        ds.check_vocab(cfg.vocab_size)
        make_grid(grid, args.tp, args.pp, args.timeout)
        # small SFT sets: the last global batch of an epoch wraps around instead of being dropped
        sampler = dp.DPSampler(len(ds), args.batch_size, grid.at.dp_rank, grid.at.dp, args.seed,
                               remainder="wrap" if args.sft else "drop")
    except (OSError, ValueError) as e:
        fail(str(e), grid)
    meter.phase("setup")
    try:
        model, shards, init = build_model(args, cfg, grid)
        opt = make_optimizer(args, model, shards, init, grid)
    except (OSError, ValueError) as e:  # a missing, truncated or mismatched --init-from checkpoint
        fail(str(e), grid)
    start = resume(args, opt, cfg, shards, sampler, grid)
    meter.watch(model)  # each forward is "forward", what follows it until the step "backward"
    actions = PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp)
    pp_group = grid.pp_group if args.pp > 1 else None

    log = grid.rank == 0
    metrics = open_metrics(args.metrics, start) if args.metrics and log else None
    tokens_per_step = args.batch_size * args.seq_len
    fpt = flops_per_token(cfg, args.seq_len)
    peak_flops = 989e12 if grid.device.type == "cuda" else None  # H100/H200 dense bf16
    if log:
        print(f"model {cfg.num_params() / 1e6:.2f}M params · data {len(ds)} sequences of {args.seq_len} · "
              f"world {grid.world} = tp {grid.at.tp} × dp {grid.at.dp} × pp {grid.at.pp} · "
              f"zero {args.zero} · "
              f"{args.dtype} on {grid.device.type}", flush=True)
        if 1 < args.pp > args.micro_batches:
            print(f"note: {args.micro_batches} micro-batches < {args.pp} stages: the pipeline bubble is "
                  f"{(args.pp - 1) / (args.micro_batches + args.pp - 1):.0%} of the step", flush=True)
    t_start, bad = time.time(), 0
    for step in range(start, args.steps):
        t0 = time.time()
        meter.phase("data")
        micro = get_batch(ds, sampler.next_batch(), args.micro_batches, grid.device)
        with stage("counting the step's target tokens (dp all-reduce)", grid):
            targets = dp.global_count(sum(P.count_targets(m["labels"]) for m in micro), grid.dp_group)
        with stage(f"forward/backward ({args.schedule} pipeline over {args.pp} stage(s))", grid):
            loss = PP.run_pipeline(model, actions, micro, pp_group, targets, no_sync=opt.no_sync,
                                   seq_shards=args.tp if args.sp else 1)
        with stage(f"gradient reduction (dp / ZeRO-{args.zero})", grid):
            opt.finish()  # dp / ZeRO reductions land
            dist.all_reduce(loss, group=grid.dp_group)
        lr = lr_at(step, args)
        meter.phase("step")
        with stage("optimizer step (tied-copy sum, grad-norm all-reduce, parameter all-gather)", grid):
            grad_norm = opt.step(lr)
        meter.phase(None)  # logging, eval: not training memory
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            with stage("checkpoint save", grid), meter.during("save"):
                extra = {"sampler": sampler.state_dict(), "args": vars(args)}
                CK.save_checkpoint(args.save, step + 1, opt, cfg, shards, grid.at, extra)
            if log:
                CK.prune(args.save, args.keep)
        if grid.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        tps = tokens_per_step / dt
        if not (math.isfinite(loss.item()) and math.isfinite(grad_norm)):
            bad += 1
            if log:
                print(f"warning: step {step + 1} skipped: loss {loss.item()} grad norm {grad_norm} "
                      f"({bad} in a row, limit {args.max_bad_steps})", file=sys.stderr, flush=True)
            if bad >= args.max_bad_steps:
                fail(f"{bad} consecutive non-finite steps: lower --lr, check the data, or use --clip", grid)
            continue
        bad = 0
        if log and (step % args.log_every == 0 or step == args.steps - 1):
            eta = (time.time() - t_start) / (step + 1) * (args.steps - step - 1)
            mfu = f"{100 * tps * fpt / (peak_flops * grid.world):.1f}%" if peak_flops else "n/a"
            print(f"step {step + 1}/{args.steps} · loss {loss.item():.4f} · lr {lr:.2e} · "
                  f"grad norm {grad_norm:.3f} · {dt * 1000:.0f} ms · {tps:,.0f} tok/s "
                  f"({tps / grid.world:,.0f}/rank) · MFU {mfu} · "
                  f"peak mem {peak_text(meter.peak(*MEM.TRAINING))}"
                  f" · ETA {eta:.0f}s", flush=True)
        record = {"step": step + 1, "loss": loss.item(), "lr": lr, "grad_norm": grad_norm,
                  "tokens": tokens_per_step * (step + 1), "tokens_per_s": tps, "step_time_s": dt}
        if eval_set and (step + 1 == args.steps or args.eval_every and (step + 1) % args.eval_every == 0):
            with stage("SFT eval (generation)", grid), opt.gathered():  # all ranks: tp runs inside
                record["eval_exact_match"] = sft.evaluate(model, tok, eval_set)
            if log:
                print(f"eval step {step + 1}: held-out exact match {record['eval_exact_match']:.1%}",
                      flush=True)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
    if args.export_hf:
        with meter.during("export"):
            export_hf(model, opt, shards, cfg, grid, args.export_hf)
        if log:
            print(f"exported HF model to {args.export_hf}", flush=True)
    if log and meter.available:
        print("peak memory by phase (rank 0): " + " · ".join(
            f"{name} {peak_text(meter.peak(name))}" for name in meter.peaks), flush=True)
    meter.close()
    if metrics:
        metrics.close()
    opt.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except StageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        os._exit(1)  # peers may be stuck in a collective: exit without waiting for them
