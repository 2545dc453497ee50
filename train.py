"""attotron's trainer: flags, process grid, composition in a fixed order, loop, logging.

Run
    python train.py                                   # tiny Llama on the default corpus, 1 process
    torchrun --nproc_per_node 8 train.py --tp 2 --pp 2 --zero 2 --ac --micro-batches 4

Builds on: every feature file (this is the composer).

Composition order (each step an exact no-op at degree 1, so one code path serves every layout)
    1. validate every flag against the config and world size, all at once — before heavy work
    2. process grid: tp innermost, then cp, then dp, then pp (tp peers are neighbours: fastest links)
    3. build the model on the meta device (no memory)
    4. pp.split_stage: drop the layers/embedding/head this stage does not own
    5. tp.apply_tp: swap in column/row/vocab-parallel layers; returns the shard map;
       cp.apply_cp: ring attention over the cp ranks, RoPE at global (zigzag) positions
    6. weights.param_reader: this rank's values from --init-from or the --seed init (the full
       weights never depend on the layout); the parameters stay on the meta device, only the RoPE
       buffers are allocated (weights.materialize_buffers)
    7. ac.apply_ac: checkpoint decoder layers (wrapping keeps parameter names); --compile:
       model.compile_layers compiles each layer's forward (the checkpoint inside it too) at its first call
    8. zero3.apply_zero: fp32 masters + AdamW (precision.py) with dp gradient sync / ZeRO-1/2/3,
       built parameter by parameter from the reader — ZeRO-3 reads only its own shard, so no rank
       ever holds the whole model
    9. checkpoint.load_checkpoint (--resume): masters, moments and sampler position, any layout

Invariants
    - The order of training sequences is a function of (seed, data) only: the sampler shards the same
      global batch over dp ranks, so every layout trains on the same global batches; the cp ranks of
      a dp rank read the same rows, each its zigzag share of their tokens (cp.shard_sequence).
    - Step loss = sum of token losses / target tokens of the whole step (precision.normalized_loss).
    - The device is chosen once, here: CUDA + NCCL when available, else CPU + gloo.
    - A step that does not log waits for the device once: precision.step reads the grad norm (its
      non-finite check decides the update). The target count stays on the device (the loss is
      divided there), the loss is copied to host memory in stream order and read after that sync,
      the batch is made by a thread one step ahead (pinned) and copied with non_blocking, and the
      pipeline's peer check runs on the host over gloo. No collective runs on a group of one rank:
      a single process runs none in its step (tests/test_step_comm.py counts both).
    - "peak mem" in the log line is the training peak (forward, backward, step) of rank 0, measured
      by memory.PeakMeter at the allocator — not setup, data preparation, saving or export, whose
      peaks the last line lists per phase.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import queue
import resource
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

import torch
import torch.distributed as dist

import ac as AC
import checkpoint as CK
import cp as CP
import data
import dp
import export as EX
import memory as MEM
import model as M
import pp as PP
import precision as P
import sft
import tp as TP
import weights as W
import zero as Z
import zero3 as Z3


# ------------------------------------------------------------------------------------------ flags
class HelpWithDefaults(argparse.HelpFormatter):
    """Show a flag's default in --help when it has a meaningful one (not None / off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`, not `in`: 0 == False, and a default of 0 is meaningful (--save-every 0, --clip 0)
        off = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not off and "default" not in text:
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
    a("--val-fraction", type=float, default=0.01,
      help="share of the documents held out (whole documents, spread over the corpus) when --data "
           "is prepared: the split of the validation loss")
    a("--seq-len", type=int, default=None, help="tokens per training sequence (default 256; 1024 with --sft)")
    a("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    a("--micro-batches", type=int, default=None,
      help="gradient-accumulation micro-batches per dp rank (default 1; with --pp: 4·pp for gpipe/1f1b, "
           "2·pp for interleaved/zb, or the largest divisor of the dp rank's rows below that)")
    a("--steps", type=int, default=50, help="optimizer steps")
    a("--lr", type=float, default=None, help="peak learning rate (default 1e-3; 2e-4 with --sft: "
                                              "post-training wants a lower rate than pretraining)")
    a("--min-lr", type=float, default=None, help="final learning rate of the cosine decay (default lr/10)")
    a("--warmup", type=int, default=10, help="linear warm-up steps")
    a("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (not norms/biases)")
    a("--clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
      help="compute dtype, masters stay fp32 (auto: bf16 on CUDA, fp32 on CPU; fp32 on CUDA uses TF32)")
    a("--seed", type=int, default=0, help="init and data-order seed")
    a("--metrics", default=None, help="JSONL file: one object per step (rank 0)")
    a("--export-hf", default=None, help="write an HF-loadable model dir here at the end")
    a("--save", default=None, help="checkpoint dir (step_XXXXXXXX/ folders: safetensors + JSON)")
    a("--save-every", type=int, default=0, help="save every N steps (0: only after the last step)")
    a("--resume", default=None, help="a checkpoint folder, or 'auto' = the newest complete one in --save "
                                     "(any layout can resume any other)")
    a("--keep", type=int, default=3, help="complete checkpoints kept in --save")
    a("--skip-checksums", action="store_true", help="resume without the crc32 check of the checkpoint's "
                                                    "files (one more read of them; sizes are still checked)")
    a("--log-every", type=int, default=1, help="print a log line every N steps")
    a("--eval-every", type=int, default=0,
      help="evaluate every N steps and after the last (0: only after the last): the validation loss "
           "on the held-out split; with --sft, exact-match accuracy on the built-in held-out chats")
    a("--eval-batches", type=int, default=None,
      help="global batches of the held-out split per validation loss (default 10, fewer when the "
           "split is smaller)")
    # supervised fine-tuning
    a("--sft", action="store_true", help="SFT on chat JSONL (--data) or the built-in arithmetic chats")
    a("--packing", default="ffd", choices=["ffd", "none"],
      help="--sft: FFD-pack conversations or one per row")
    a("--overlong", default="truncate", choices=["truncate", "drop"],
      help="--sft: what to do with conversations longer than --seq-len (counted and reported)")
    a("--skip-bad", action="store_true", help="--sft: skip and count malformed JSONL lines")
    a("--reply-end", default=None, help="--sft: the token that ends an assistant reply (default: detected "
                                        "from the chat template, e.g. <|eot_id|>; the built-in one: eos)")
    a("--timeout", type=float, default=600.0,
      help="seconds a collective may wait before the run stops with a message naming the stage")
    a("--io-timeout", type=float, default=3600.0,
      help="seconds ranks wait for each other around checkpoint and export I/O (a gloo group of its "
           "own: writing 12 bytes/param per rank can outlast --timeout)")
    a("--max-bad-steps", type=int, default=3,
      help="abort after this many consecutive steps with a non-finite loss or grad norm (each skipped)")
    # parallelism: world = tp · dp · pp, dp is what is left
    a("--tp", type=int, default=1, help="tensor-parallel degree (innermost in the grid)")
    a("--cp", type=int, default=1, help="context-parallel degree: each rank holds seq-len/cp tokens of "
                                        "every row, attention runs as a ring (cp.py)")
    a("--sp", action="store_true", help="sequence parallelism with --tp: norms and residuals hold "
                                        "seq-len/tp tokens per rank (Megatron)")
    a("--pp", type=int, default=1, help="pipeline stages")
    a("--pp-layers", default=None, help="layers per (virtual) stage, e.g. 3,3,2 (default: balanced, the "
                                        "last stage's lm_head + loss counted as layers by their FLOPs)")
    a("--schedule", default="1f1b", choices=sorted(PP.SCHEDULES), help="pipeline schedule")
    a("--virtual-stages", type=int, default=None,
      help="model chunks per pp rank for interleaved / zb (default: 2 for interleaved, else 1)")
    a("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the dp group")
    a("--bucket-mb", type=float, default=25.0, help="gradient bucket size for dp / ZeRO-1/2 (MB)")
    a("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
      help="dtype of gradient accumulation over micro-batches and of dp/ZeRO reductions; bf16 halves "
           "their bytes but loses precision (README: measured error)")
    a("--prefetch", type=int, default=1, help="ZeRO-3: units all-gathered ahead of use")
    a("--ac", action="store_true", help="activation checkpointing (selective unless --ac-mode)")
    a("--ac-mode", default=None, choices=["full", "selective"], help="implies --ac")
    a("--ac-every", type=int, default=1, help="checkpoint layers whose global index is a multiple of k")
    a("--compile", action="store_true", help="torch.compile each decoder layer (hooks, pipeline "
                                             "executor, embedding and head stay eager)")
    a("--peak-tflops", type=float, default=None,
      help="the accelerator's dense peak TFLOP/s for MFU (default: from the GPU's name, GPU_PEAK_TFLOPS)")
    args = p.parse_args(argv)
    # `is None`, never `or`: a user's 0 must reach validate, not turn into the default
    if args.seq_len is None:
        args.seq_len = sft.DEFAULT_SEQ_LEN if args.sft else 256
    if args.lr is None:
        args.lr = 2e-4 if args.sft else 1e-3
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
    io_group: dist.ProcessGroup | None = None  # gloo, --io-timeout: checkpoint and export I/O waits
    cp_group: dist.ProcessGroup | None = None
    pp_check: dist.ProcessGroup | None = None  # gloo, the pp group's ranks: run_pipeline's host-side check
    cp: int = 1  # context-parallel degree; `at` counts dp · cp replicas (see make_grid)

    @property
    def data(self) -> tuple[int, int]:
        """(rank, size) among the replicas that read different rows: dp. The cp ranks of a replica
        read the same rows, each its own tokens of them."""
        return self.at.dp_rank // self.cp, self.at.dp // self.cp


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
        # device_id (CUDA): the NCCL communicator starts here, and every new_group splits it at
        # once (make_grid) — none starts lazily at its first collective, inside a backward hook
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device if cuda else None)
    return Grid(dist.get_rank(), dist.get_world_size(), device)


def make_grid(grid: Grid, tp: int, pp: int, timeout_s: float = 600.0, io_timeout_s: float = 3600.0,
              cp: int = 1) -> None:
    """rank = ((pp_rank·dp + dp_rank)·cp + cp_rank)·tp + tp_rank: tp innermost (its all-reduces are
    the most frequent: the fastest links), then cp (a ring of P2P every layer), then dp (one
    reduction per step), then pp (point-to-point between stages: the slowest links will do). The
    cp ranks hold the same parameters as dp replicas do and reduce gradients with them, so `at` —
    what ZeRO shards over and checkpoints record — counts dp·cp replicas, index dp_rank·cp + cp_rank,
    and grid.dp_group spans them all. Every rank creates every group, in the same order (new_group
    is collective), and keeps the ones it belongs to: all of them here, before any training (with
    setup's device_id, each NCCL communicator is made now, by splitting the default one). Then two
    gloo groups: checkpoint/export I/O waits (long timeout) and the pipeline's host-side check."""
    w = grid.world
    dpn = w // (tp * pp)  # dp · cp
    grid.at = CK.Layout(tp, dpn, pp, grid.rank % tp, grid.rank // tp % dpn, grid.rank // (tp * dpn))
    grid.cp = cp

    def mine(rank_lists: list[list[int]], backend: str | None = None) -> dist.ProcessGroup | None:
        found = None
        for ranks in rank_lists:
            g = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
            found = g if grid.rank in ranks else found
        return found

    at = lambda p, d, t: CK.Layout(tp, dpn, pp, t, d, p).rank  # noqa: E731
    grid.tp_group = mine([[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dpn)])
    grid.dp_group = mine([[at(p, d, t) for d in range(dpn)] for p in range(pp) for t in range(tp)])
    pp_lists = [[at(p, d, t) for p in range(pp)] for d in range(dpn) for t in range(tp)]
    grid.pp_group = mine(pp_lists)
    grid.cp_group = mine([[at(p, d + c, t) for c in range(cp)] for p in range(pp)
                          for d in range(0, dpn, cp) for t in range(tp)])
    grid.embed_group = mine(PP.tied_embedding_ranks(w, pp))
    grid.io_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=io_timeout_s))
    grid.pp_check = mine(pp_lists, backend="gloo")


class StageError(RuntimeError):
    """A collective failed or timed out; the message names the training stage."""


@contextlib.contextmanager
def stage(name: str, grid: Grid):
    """Name the training stage in which a collective failed or timed out (a peer died, hung, or
    disagreed) — a bare gloo/NCCL timeout does not say where the run was. Out of memory is reported
    as such, with the memory numbers (it is a RuntimeError too, but no peer is to blame)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        raise StageError(f"rank {grid.rank}: out of memory during {name}: {memory_report(grid.device)}. "
                         f"Lower the memory per rank: more --micro-batches (smaller micro-batches), "
                         f"--ac, --zero 2/3, a larger --tp or --pp. ({str(e).splitlines()[0]})") from e
    except (RuntimeError, dist.DistError) as e:
        raise StageError(f"rank {grid.rank}: distributed operation failed during {name}: {e}") from e


def memory_report(device: torch.device) -> str:
    """What the allocator holds when memory ran out (CUDA), or the process's peak RSS (CPU)."""
    if device.type != "cuda":
        return f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MB"
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    free, total = torch.cuda.mem_get_info(device)
    cuda = torch.cuda
    return (f"{mib(cuda.memory_allocated(device))} allocated, {mib(cuda.memory_reserved(device))} reserved, "
            f"peak {mib(cuda.max_memory_allocated(device))} allocated; {mib(free)} free of {mib(total)} "
            f"on {cuda.get_device_name(device)}")


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
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "steps" else 1):
            errors.append(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.seq_len > cfg.max_position_embeddings:
        errors.append(f"--seq-len {args.seq_len} > max_position_embeddings {cfg.max_position_embeddings}")
    if args.tp < 1 or args.pp < 1 or args.cp < 1 or grid.world % (args.tp * args.cp * args.pp):
        errors.append(f"world size {grid.world} is not divisible by --tp {args.tp} × --cp {args.cp} × "
                      f"--pp {args.pp}")
        return errors
    dp_size = grid.world // (args.tp * args.cp * args.pp)
    errors += validate_cp(args)
    try:
        TP.tp_validate(cfg, args.tp, seq_len=args.seq_len if args.sp else None)
    except ValueError as e:
        errors.append(str(e))
    errors += validate_pipeline(args, cfg)
    micro = micro_batches(args, grid.world)
    if micro >= 1 and args.batch_size % (dp_size * micro):
        errors.append(f"--batch-size {args.batch_size} is not divisible by dp size {dp_size} × "
                      f"--micro-batches {micro}")
    if args.ac_every < 1 or (args.ac_every != 1 and not (args.ac or args.ac_mode)):
        errors.append(f"--ac-every {args.ac_every} needs to be >= 1 and goes with --ac / --ac-mode")
    if args.sft and (args.pp > 1 or args.sp) and not args.data:
        errors.append("the built-in SFT eval generates with the whole model at any length: use --pp 1 "
                      "and no --sp with --sft (or give --data, which has no eval set)")
    if (args.packing != "ffd" or args.overlong != "truncate" or args.skip_bad
            or args.reply_end is not None) and not args.sft:
        errors.append("--packing / --overlong / --skip-bad / --reply-end go with --sft")
    if args.sft and args.eval_batches is not None:
        errors.append("--eval-batches sizes the validation loss of pretraining; --sft evaluates "
                      "exact-match accuracy on its built-in held-out chats")
    if args.resume == "auto" and not args.save:
        errors.append("--resume auto needs --save DIR (where to look)")
    if args.save_every < 0 or args.keep < 1:
        errors.append(f"need --save-every >= 0 and --keep >= 1, got {args.save_every} and {args.keep}")
    if args.io_timeout <= 0:
        errors.append(f"--io-timeout must be > 0 seconds, got {args.io_timeout}")
    if args.export_hf and (problem := W.export_problem(args.export_hf)):
        errors.append(f"--export-hf: {problem}")
    if args.bucket_mb <= 0 or args.prefetch < 0 or args.max_bad_steps < 1:
        errors.append("--bucket-mb must be > 0, --prefetch >= 0, --max-bad-steps >= 1")
    if args.warmup < 0 or args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        errors.append(f"need 0 <= --min-lr <= --lr and --warmup >= 0 (got lr {args.lr}, "
                      f"min-lr {args.min_lr}, warmup {args.warmup})")
    return errors + validate_more(args)


def validate_more(args: argparse.Namespace) -> list[str]:
    """The flags whose 0, negative or NaN value would otherwise be taken silently or crash late,
    and every output path (a run must not train for hours, then fail to write its result)."""
    errors = []
    floats = ("lr", "min_lr", "weight_decay", "clip", "bucket_mb", "timeout", "io_timeout", "val_fraction")
    nan = [f"--{f.replace('_', '-')} {getattr(args, f)}" for f in floats
           if not math.isfinite(getattr(args, f))]
    if nan:
        errors.append(f"need finite numbers, got {', '.join(nan)}")
    if args.weight_decay < 0 or args.clip < 0:
        errors.append(f"--weight-decay and --clip must be >= 0 (--clip 0 turns clipping off), got "
                      f"{args.weight_decay} and {args.clip}")
    if not args.timeout > 0:
        errors.append(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.log_every < 1 or args.eval_every < 0 or (args.eval_batches is not None and args.eval_batches < 1):
        errors.append(f"need --log-every >= 1, --eval-every >= 0 and --eval-batches >= 1, got "
                      f"{args.log_every}, {args.eval_every} and {args.eval_batches}")
    if not 0 <= args.val_fraction < 1:
        errors.append(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.sp and args.tp < 2:
        errors.append("--sp splits each sequence over the tp ranks: it needs --tp > 1")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        errors.append(f"--peak-tflops must be a positive number, got {args.peak_tflops}")
    return errors + check_outputs(args)


def check_outputs(args: argparse.Namespace) -> list[str]:
    """--save and --export-hf are folders (created as needed), --metrics a file in an existing
    folder: each must be creatable and writable, and no two may be the same."""
    errors, seen = [], {}
    for flag, path, folder in (("--save", args.save, True), ("--export-hf", args.export_hf, True),
                               ("--metrics", args.metrics, False)):
        if path is None:
            continue
        p = Path(path).resolve()
        if p in seen:
            errors.append(f"{flag} and {seen[p]} are the same path {path}")
        seen[p] = flag
        if folder:
            nearest = next(q for q in (p, *p.parents) if q.exists())  # the root always exists
            if p.exists() and not p.is_dir():
                errors.append(f"{flag} {path} is a file; it must be a folder (or not exist yet)")
            elif not nearest.is_dir():
                errors.append(f"{flag} {path} cannot be created: {nearest} is a file")
            elif not os.access(nearest, os.W_OK):
                errors.append(f"{flag} {path}: {nearest} is not writable")
        elif p.is_dir():
            errors.append(f"{flag} {path} is a folder; it must be a file")
        elif not p.parent.is_dir():
            errors.append(f"{flag} {path}: its folder {p.parent} does not exist")
        elif not os.access(p.parent, os.W_OK) or p.exists() and not os.access(p, os.W_OK):
            errors.append(f"{flag} {path}: it or its folder is not writable")  # replaced by rename
    return errors


def virtual_stages(args: argparse.Namespace) -> int:
    if args.virtual_stages is not None:  # (not `or`: 0 is an error to report, not a default)
        return args.virtual_stages
    return 2 if args.schedule == "interleaved" else 1


def micro_batches(args: argparse.Namespace, world: int) -> int:
    """--micro-batches, or pp.default_microbatches for this layout (a divisor of the dp rank's rows)."""
    if args.micro_batches is not None:
        return args.micro_batches
    dp_size = max(world // max(args.tp * args.cp * args.pp, 1), 1)
    rows = args.batch_size // dp_size if args.batch_size >= dp_size else 1
    return PP.default_microbatches(args.schedule, max(args.pp, 1), max(rows, 1))


def layer_ranges(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[range]:
    """Layers of each virtual stage (pp · v of them): --pp-layers, or balanced with the head's cost."""
    return PP.partition(cfg.num_hidden_layers, args.pp * virtual_stages(args), parse_layers(args.pp_layers),
                        head=PP.head_cost(cfg, args.seq_len))


def validate_cp(args: argparse.Namespace) -> list[str]:
    """Context parallelism: zigzag chunks of equal length, and no packed documents."""
    errors = []
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        errors.append(f"--cp {args.cp}: --seq-len {args.seq_len} must be a multiple of 2·cp = {2 * args.cp} "
                      f"(each rank holds two of 2·cp equal chunks)")
    if args.cp > 1 and args.sp and args.seq_len // args.cp % args.tp:
        errors.append(f"--cp {args.cp} with --sp: each rank's seq-len/cp = {args.seq_len // args.cp} tokens "
                      f"must split into --tp {args.tp} equal shards")
    if args.cp > 1 and args.sft:
        errors.append("--cp with --sft: SFT rows are packed documents (and the eval generates whole "
                      "sequences), which context parallelism does not support; use --cp 1")
    return errors


def validate_pipeline(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[str]:
    """Schedule, virtual stages and layer split (the pipeline part of validate)."""
    errors, v = [], virtual_stages(args)
    if v < 1 or (v > 1 and (args.schedule not in ("interleaved", "zb") or args.pp < 2)):
        errors.append(f"--virtual-stages {v} needs >= 1, and more than 1 goes with --schedule interleaved "
                      f"or zb and --pp >= 2")
    elif args.schedule == "interleaved" and v < 2:  # (v = 1 would silently be 1f1b)
        errors.append("--schedule interleaved needs --virtual-stages >= 2 (1 is --schedule 1f1b)")
    else:
        try:
            layer_ranges(args, cfg)
        except ValueError as e:
            errors.append(str(e))
    if args.schedule == "zb" and (args.ac or args.ac_mode):
        errors.append("--schedule zb with --ac: each W would recompute the checkpointed layers again; use "
                      "--schedule interleaved (or 1f1b) with --ac")
    if args.compile and args.schedule == "zb":
        errors.append("--compile with --schedule zb: a compiled layer's backward is one autograd node, so "
                      "the B/W split would run it twice; use --schedule interleaved (or 1f1b) with --compile")
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


# Ranks wait this long for rank 0 to prepare --data (tokenizing a large corpus takes hours).
DATA_WAIT = datetime.timedelta(hours=24)


def prepared_data(args: argparse.Namespace) -> Path:
    """Rank 0: the prepared folder of --data, preparing it when missing or stale (another corpus
    content, tokenizer or --val-fraction: data.is_prepared)."""
    if args.data is None:
        return data.default_corpus(val_fraction=args.val_fraction)
    want = str(Path(args.tokenizer).resolve()) if args.tokenizer not in (None, "bytes") else None
    if (Path(args.data) / "meta.json").is_file():  # already prepared: used as is
        got = data.read_meta(Path(args.data)).get("tokenizer_path")
        if args.tokenizer is not None and got != want:
            raise ValueError(f"--data {args.data} was prepared with the tokenizer {got or 'bytes'}, not "
                             f"--tokenizer {args.tokenizer}: drop --tokenizer, or prepare the corpus again")
        return Path(args.data)
    path = Path(str(args.data).rstrip("/") + ".attotron")  # prepared next to the corpus
    if not data.is_prepared(path, args.data, args.tokenizer, val_fraction=args.val_fraction):
        print(f"preparing {args.data} into {path}", flush=True)
        try:
            data.prepare(args.data, path, args.tokenizer, val_fraction=args.val_fraction)
        except PermissionError as e:
            raise ValueError(f"cannot write the prepared data {path} next to the corpus ({e.strerror}): "
                             f"prepare it where you can write (python -c \"import data; data.prepare("
                             f"'{args.data}', 'OUT')\") and pass --data OUT") from None
    return path


def prepared_once(prepare: Callable[[], Path], grid: Grid) -> Path:
    """Rank 0 runs `prepare()` (find or make a prepared folder) while the others wait on a gloo group
    with a DATA_WAIT timeout — not in a barrier of the default group, whose NCCL watchdog would kill
    them after --timeout. Rank 0's outcome (the folder, or its error) reaches every rank; then every
    rank checks that it reads the very meta.json rank 0 wrote: a multi-node run needs the data on a
    shared filesystem."""
    group = dist.new_group(backend="gloo", timeout=DATA_WAIT) if grid.world > 1 else None
    outcome = [None]
    if grid.rank == 0:
        try:
            path = prepare()
            outcome[0] = (str(path), (path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            outcome[0] = (None, str(e))
    if group is not None:
        dist.broadcast_object_list(outcome, src=0, group=group)
    path, meta = outcome[0]
    if path is None:
        raise ValueError(meta)  # rank 0's error, raised on every rank
    try:
        seen = "same" if (Path(path) / "meta.json").read_text() == meta else "a different meta.json"
    except OSError as e:
        seen = str(e)
    views = [None] * grid.world
    if group is not None:
        dist.all_gather_object(views, seen, group=group)
        dist.destroy_process_group(group)
    else:
        views = [seen]
    blind = [r for r, v in enumerate(views) if v != "same"]
    if blind:
        raise ValueError(f"ranks {blind} do not see the data rank 0 prepared at {path} (rank {blind[0]}: "
                         f"{views[blind[0]]}): a multi-node run needs --data on a filesystem every "
                         f"node shares, or the prepared folder copied to the same path on each node")
    return Path(path)


def load_data(args: argparse.Namespace, grid: Grid) -> data.TokenDataset:
    """The pretraining rows, prepared once by rank 0 (`prepared_once`)."""
    return data.TokenDataset(prepared_once(lambda: prepared_data(args), grid), args.seq_len)


def load_val(args: argparse.Namespace, ds: data.TokenDataset,
             grid: Grid) -> tuple[data.TokenDataset | None, int]:
    """The held-out split of the prepared data and the global batches of it each evaluation reads;
    (None, 0) when there is none — an error if --eval-every asked for it."""
    want = 10 if args.eval_batches is None else args.eval_batches
    n_docs = ds.meta.get("num_val_documents", 0)
    try:
        val = data.TokenDataset(ds.data_dir, args.seq_len, split="val")
        batches = min(want, len(val) // args.batch_size)
        if not batches:
            raise ValueError(f"its {len(val)} rows of --seq-len {args.seq_len} do not fill one "
                             f"--batch-size {args.batch_size}")
    except ValueError as e:
        frac = ds.meta.get("val_fraction") or 0
        why = (f"the held-out split of {ds.data_dir} is too small: {e}" if n_docs else
               f"{ds.data_dir} was prepared without a held-out split (val_fraction 0)" if not frac else
               f"{ds.data_dir} has no held-out split: {ds.meta['num_documents']} documents × val_fraction "
               f"{frac} < 1 (a .txt file is one document: use a .jsonl, one document per line, or a folder)")
        if args.eval_every:
            raise ValueError(f"--eval-every {args.eval_every}: {why}") from None
        if grid.rank == 0:
            print(f"note: no validation loss: {why}", flush=True)
        return None, 0
    if grid.rank == 0:
        print(f"validation loss: {batches} batches × {args.batch_size} rows of the held-out split "
              f"({n_docs} documents, {len(val)} rows)", flush=True)
    return val, batches


@torch.no_grad()
def val_loss(chunks: list[M.Llama], val: data.TokenDataset, batches: int, args: argparse.Namespace,
             grid: Grid) -> float:
    """Mean token loss over the first `batches` global batches of the held-out split (the same rows
    at every evaluation), forward only through the same pipeline, tp and ZeRO code as training and
    normalized like its loss (sum of token losses / all target tokens): the single-process value in
    every layout."""
    fwd = PP.forward_only(PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp,
                                                      args.virtual_stages))
    dp_rank, dp_size = grid.data
    per = args.batch_size // dp_size  # this dp rank's contiguous slice, as DPSampler takes it
    first = [b * args.batch_size + dp_rank * per for b in range(batches)]
    micro = [get_batch(val, list(range(i, i + per)), args.micro_batches, grid) for i in first]
    targets = dp.global_count(sum(P.count_targets(m["labels"]) for mb in micro for m in mb), grid.dp_group)
    total = torch.zeros((), dtype=torch.float32, device=grid.device)
    for mb in micro:
        total += PP.run_pipeline(chunks, fwd, mb, grid.pp_group if args.pp > 1 else None, targets,
                                 seq_shards=args.tp if args.sp else 1, check_group=grid.pp_check)
    if grid.at.dp > 1:  # (dp · cp replicas; no collective on a group of one)
        dist.all_reduce(total, group=grid.dp_group)
    return total.item()


def load_sft(args: argparse.Namespace, grid: Grid) -> tuple[sft.SFTDataset, sft.ChatTemplate, list]:
    """Chats from --data (no eval set) or the built-in arithmetic set (train + held-out eval), tokenized
    once by rank 0 into a cache every rank maps (sft.prepare_sft: next to --data, in ~/.cache/attotron
    for the built-in set), re-made when the data, the tokenizer or the chat template changes."""
    tok = data.load_tokenizer(args.tokenizer)
    tpl = sft.chat_template(tok, args.reply_end)
    if args.data:
        out = Path(str(args.data).rstrip("/") + ".attotron-sft")
        key = lambda: {"sha256": sft.file_digest(args.data), "skip_bad": args.skip_bad}  # noqa: E731
        load = lambda: sft.load_jsonl(args.data, skip_bad=args.skip_bad)  # noqa: E731
        eval_set = []
    else:
        convs, eval_set = sft.arithmetic_chats()
        out = Path.home() / ".cache" / "attotron" / "sft-arithmetic"
        key = lambda: hashlib.sha256(json.dumps(convs).encode()).hexdigest()  # noqa: E731
        load = lambda: (convs, 0)  # noqa: E731
    def prepare() -> Path:
        sft.prepare_sft(out, key, load, tpl)
        return out
    tokenized = sft.read_cache(prepared_once(prepare, grid))
    if tokenized is None:  # prepared_once checked its meta.json: only its arrays can be missing
        raise ValueError(f"the SFT cache {out} rank 0 wrote is incomplete on rank {grid.rank}")
    ds = sft.SFTDataset(tokenized, tok, args.seq_len, args.packing, args.overlong, template=tpl)
    if grid.rank == 0:
        bad = tokenized.skipped
        print(ds.report() + (f"\n  {bad} malformed lines skipped" if bad else ""), flush=True)
    return ds, tpl, eval_set


def host_batch(ds: data.TokenDataset | sft.SFTDataset, rows: list[int], micro_batches: int,
               grid: Grid) -> list[dict]:
    """This rank's rows as micro-batches of (b, S) host tensors: input_ids, labels (already shifted)
    and, for packed SFT rows, position_ids (restarting per conversation) and `docs`, their document
    boundaries (attention.Documents: derived here, on the host, once per micro-batch, so no layer
    builds a mask and the step never waits for a device→host copy). Pinned on CUDA, so that
    `to_device` copies them without blocking the host."""
    items = [ds[i] for i in rows]
    if isinstance(items[0], dict):
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    else:
        tokens = torch.stack(items)  # (b, S+1)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    if grid.cp > 1:  # this cp rank's zigzag tokens of every row (packed rows are refused with --cp)
        batch = {k: CP.shard_sequence(v, grid.cp, grid.at.dp_rank % grid.cp) for k, v in batch.items()}
    micro = [dict(zip(batch, parts)) for parts in zip(*(v.chunk(micro_batches) for v in batch.values()))]
    for mb in micro:
        if "position_ids" in mb:
            mb["docs"] = M.Documents.from_position_ids(mb["position_ids"], "cpu")
    if grid.device.type == "cuda":
        micro = [{k: v.pin_memory() for k, v in mb.items()} for mb in micro]
    return micro


def to_device(micro: list[dict], device: torch.device) -> list[dict]:
    """Start each micro-batch's copy to the device and return at once (non_blocking: from pinned
    memory the copy runs in stream order while the host goes on; on CPU the tensors themselves)."""
    return [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in micro]


def get_batch(ds: data.TokenDataset | sft.SFTDataset, rows: list[int], micro_batches: int,
              grid: Grid) -> list[dict]:
    """`host_batch` on the device: what evaluation reads (training prefetches: `Prefetcher`)."""
    return to_device(host_batch(ds, rows, micro_batches, grid), grid.device)


class Prefetcher:
    """The next steps' batches, made in a background thread while this step computes: the sampler's
    rows, the memmap reads, the micro-batch split, pinned host memory on CUDA (`host_batch`).
    `next()` hands the oldest one over with the sampler state after it — what a checkpoint of that
    step records, the thread being ahead — and starts its copies to the device (`to_device`). At
    most two batches wait (one queued, one made); an error in the thread is raised by next(). The
    thread owns the sampler from start to end (its state is loaded before: resume)."""

    def __init__(self, load: Callable[[list[int]], list[dict]], sampler: dp.DPSampler, steps: int,
                 device: torch.device):
        self.device = device
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._run, args=(load, sampler, steps), daemon=True,
                                        name="attotron-prefetch")
        self._thread.start()

    def _run(self, load: Callable[[list[int]], list[dict]], sampler: dp.DPSampler, steps: int) -> None:
        try:
            if self.device.type == "cuda":  # pinning on this thread: this rank's GPU, not GPU 0
                torch.cuda.set_device(self.device)
            for _ in range(steps):
                rows = sampler.next_batch()
                self._queue.put((sampler.state_dict(), load(rows)))
        except BaseException as e:  # noqa: BLE001 - the training thread raises it
            self._queue.put(e)

    def next(self) -> tuple[dict, list[dict]]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        state, micro = item
        return state, to_device(micro, self.device)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A device value copied to host memory without waiting (CUDA: into pinned memory, in stream
    order): read it after a later host sync — the step's grad norm — and the read costs nothing."""
    return t.detach().to("cpu", non_blocking=True)


def pipeline_summary(args: argparse.Namespace, cfg: M.LlamaConfig) -> str:
    """One line: the schedule, the split, and its simulated bubble with each virtual stage's cost
    (layers + the head's layer-equivalents; F=1, B=2 per layer, zb: B=W=1)."""
    ranges, p, v, m = layer_ranges(args, cfg), args.pp, args.virtual_stages, args.micro_batches
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


def flops_per_token(cfg: M.LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, the usual convention (PaLM, Appendix B; Megatron, torchtitan):
    6N for the matmuls of forward + backward, N = every parameter a matmul reads — all but the input
    embedding when untied (a lookup, no FLOPs); tied, the shared matrix counts once, as lm_head —
    plus 12·L·H·Q·T for attention's two matmuls (H heads of Q dims over T tokens), counted over the
    full T×T (the causally masked half too), as those references do, so MFUs compare."""
    n = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


# Dense (no sparsity) peak TFLOP/s (bf16, tf32) by GPU name, as torch.cuda.get_device_name reports it;
# the first key found in the name wins (so "H100 PCIe" before "H100", "GH200" before "H200").
GPU_PEAK_TFLOPS = {
    "A100": (312, 156), "A800": (312, 156), "H100 PCIe": (756, 378), "H100 NVL": (835, 418),
    "H100": (989, 495), "H800": (989, 495), "GH200": (989, 495), "H200 NVL": (835, 418),
    "H200": (989, 495), "B200": (2250, 1100), "L40S": (362, 183), "L4": (121, 60), "MI300X": (1307, 654),
}


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    """--peak-tflops, or the GPU's dense peak for the compute dtype (bf16, or tf32 for fp32 on CUDA);
    None where unknown (CPU, a GPU not in GPU_PEAK_TFLOPS): the log then shows no MFU."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = next((v for k, v in GPU_PEAK_TFLOPS.items() if k.lower() in name.lower()), None)
    return None if found is None else found[args.dtype != "bf16"] * 1e12


def device_defaults(args: argparse.Namespace, device: torch.device) -> str:
    """--dtype auto becomes bf16 on CUDA, fp32 on CPU; fp32 on CUDA turns TF32 matmuls on (10-bit
    mantissa inputs, fp32 accumulation: ~8x the fp32 rate). Returns what to say in the log."""
    if args.dtype == "auto":
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda" and args.dtype == "fp32":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.fp32_precision = "tf32"
        return "fp32 with TF32 matmuls"
    return args.dtype


# ------------------------------------------------------------------------------------------ build
def build_model(args: argparse.Namespace, cfg: M.LlamaConfig, grid: Grid) -> tuple[M.Llama, dict, Z.Init]:
    """Steps 3-7 of the composition order (module docstring): the parameters stay on the meta
    device; the returned reader gives their values to make_optimizer."""
    model = M.build(cfg)
    PP.split_stage(model, grid.at.pp_rank, args.pp, layer_ranges(args, cfg))
    shards = TP.apply_tp(model, grid.tp_group, sequence_parallel=args.sp)
    CP.apply_cp(model, grid.cp_group)
    init = W.param_reader(model, seed=args.seed, hf_dir=args.init_from, shards=shards)
    W.materialize_buffers(model, grid.device)
    if args.ac or args.ac_mode:
        AC.apply_ac(model, args.ac_mode or "selective", args.ac_every)
    if args.compile:
        M.compile_layers(model)
    return model, shards, init


def make_optimizer(args: argparse.Namespace, model: M.Llama, shards: dict, init: Z.Init,
                   grid: Grid) -> Z.DataParallel:
    """Grad-norm bookkeeping: tp shards are summed over tp, stages over pp (and ZeRO adds dp);
    a tp-replicated parameter counts on tp rank 0 only, a tied copy on the first stage only.
    With pp > 1 a tied embedding's two copies sum their gradients over grid.embed_group in step()."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.reduce_dtype]
    ocfg = P.OptimConfig(lr=args.lr, weight_decay=args.weight_decay, clip=args.clip)
    pp_counted = PP.norm_counted(model)
    counted = lambda n: pp_counted(n) and (n in shards or grid.at.tp_rank == 0)  # noqa: E731
    return Z3.apply_zero(model, args.zero, grid.dp_group, ocfg, dtype, bucket_mb=args.bucket_mb,
                         reduce_dtype=reduce_dtype, prefetch=args.prefetch,
                         norm_groups=[grid.tp_group, grid.pp_group], counted=counted,
                         tied=PP.tied_copy(model), embed_group=grid.embed_group,
                         init=init, device=grid.device)


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


# resuming with a flag that differs from the checkpoint's run: an error where the saved sampler
# position would point into other rows or another order; silence for flags that change nothing
# the run computes; a note for the rest (another layout, schedule or data path is legitimate)
RESUME_ERRORS = {"seed": "the data order changes", "batch_size": "the global batch changes",
                 "seq_len": "the rows change", "sft": "the rows change", "packing": "the rows change",
                 "overlong": "the rows change"}
RESUME_QUIET = {"metrics", "export_hf", "save", "save_every", "resume", "keep", "log_every", "timeout",
                "io_timeout", "max_bad_steps", "eval_every", "steps", "skip_checksums", "peak_tflops"}
SCHEDULE = ("lr", "min_lr", "warmup", "steps")


def plan_resume(args: argparse.Namespace, grid: Grid) -> Path | None:
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
        fail(f"cannot resume from {path}: {path / 'meta.json'} is missing or unreadable ({e})", grid)
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
        then = lr_at(step, argparse.Namespace(**{k: saved[k] for k in SCHEDULE}))
        if not math.isclose(then, lr_at(step, args)):
            notes.append(f"the lr of step {step + 1} is {lr_at(step, args):.3g} with these flags, "
                         f"{then:.3g} on the checkpoint's schedule")
    if errors:
        fail("\n  ".join([f"cannot resume from {path} with these flags:"] + errors), grid)
    if grid.rank == 0:
        if notes:
            print("\n  ".join([f"note: resuming {path} with flags that differ from its run:"] + notes),
                  flush=True)
        later = [p.name for s, p in CK.complete_checkpoints(path.parent) if s > step]
        if later:
            print(f"note: {path.parent} also holds later checkpoints ({', '.join(later[-3:])}): a restart "
                  f"with --resume auto would continue from those, not from this run's saves", flush=True)
    return path


def resume(path: Path | None, args: argparse.Namespace, opt: Z.DataParallel, cfg: M.LlamaConfig,
           shards: dict, sampler: dp.DPSampler, grid: Grid) -> int:
    """Load the planned checkpoint (plan_resume) into the optimizer, parameters and sampler; return
    the step to continue from (0 when there is nothing to resume). The ranks agree over the io
    group: a file only one rank reads (and finds corrupt) stops them all."""
    if path is None:
        return 0
    try:
        got = CK.load_checkpoint(path, opt, cfg, shards, grid.at, group=grid.io_group,
                                 verify=not args.skip_checksums)
        sampler.load_state_dict(got.extra["sampler"])  # the global position: layout-free
    except (OSError, ValueError, KeyError) as e:
        fail(f"cannot resume from {path}: {e}", grid)
    if grid.rank == 0:
        print(f"resumed from {path} at step {got.step} (saved as {got.saved_layout})"
              + ("" if got.rng_restored else "; RNG states not restored (other layout)"), flush=True)
    return got.step


def save(args: argparse.Namespace, step: int, opt: Z.DataParallel, cfg: M.LlamaConfig, shards: dict,
         sampler_state: dict, grid: Grid, metrics: TextIO | None) -> None:
    """Checkpoint `step` (a finite one: a skipped step never saves) once its metrics record is
    durable, so a kill between the two loses no record. The ranks wait for each other in the io
    group (long timeout), and rank 0 prunes to --keep inside the save, up to this step only.
    sampler_state: the sampler after this step's batch (Prefetcher.next)."""
    if metrics:
        os.fsync(metrics.fileno())
    opt.finish_gathers()  # the checkpoint sees complete parameters (ZeRO-1/2 gather into the next forward)
    extra = {"sampler": sampler_state, "args": vars(args)}
    try:
        with stage("checkpoint save", grid):
            CK.save_checkpoint(args.save, step, opt, cfg, shards, grid.at, extra, group=grid.io_group,
                               keep=args.keep)
    except OSError as e:  # the same on every rank (a full disk, no shared filesystem...)
        fail(str(e), grid)


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    grid = setup(args.timeout if 0 < args.timeout < math.inf else 600.0)  # validate reports a bad one
    numerics = device_defaults(args, grid.device)
    meter = MEM.PeakMeter(grid.device)  # from here on every CPU block is counted (memory.py)
    meter.phase("data")
    try:
        cfg = M.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    except (OSError, ValueError) as e:
        fail(str(e), grid)
    errors = validate(args, cfg, grid)
    if errors:
        fail("\n  ".join(["invalid configuration:"] + errors), grid)
    args.virtual_stages, args.micro_batches = virtual_stages(args), micro_batches(args, grid.world)
    ckpt = plan_resume(args, grid)
    try:
        ds, tpl, eval_set = load_sft(args, grid) if args.sft else (load_data(args, grid), None, [])
        ds.check_vocab(cfg.vocab_size)
        val, val_batches = (None, 0) if args.sft else load_val(args, ds, grid)
        make_grid(grid, args.tp, args.pp, args.timeout, args.io_timeout, args.cp)
        # small SFT sets: the last global batch of an epoch wraps around instead of being dropped
        sampler = dp.DPSampler(len(ds), args.batch_size, *grid.data, args.seed,
                               remainder="wrap" if args.sft else "drop")
    except (OSError, ValueError) as e:
        fail(str(e), grid)
    meter.phase("setup")
    try:
        model, shards, init = build_model(args, cfg, grid)
        opt = make_optimizer(args, model, shards, init, grid)
    except (OSError, ValueError) as e:  # a missing, truncated or mismatched --init-from checkpoint
        fail(str(e), grid)
    start = resume(ckpt, args, opt, cfg, shards, sampler, grid)
    try:
        export_tok = export_tokenizer(args, ds) if args.export_hf else None
    except (OSError, ValueError) as e:
        fail(f"--export-hf: the tokenizer to export: {e}", grid)
    actions = PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp, args.virtual_stages)
    chunks = PP.stage_chunks(model, layer_ranges(args, cfg), grid.at.pp_rank, args.pp)
    for chunk in chunks:
        meter.watch(chunk)  # each forward is "forward", what follows it until the step "backward"
    pp_group = grid.pp_group if args.pp > 1 else None

    log = grid.rank == 0
    metrics = open_metrics(args.metrics, start) if args.metrics and log else None
    tokens_per_step = args.batch_size * args.seq_len
    fpt = flops_per_token(cfg, args.seq_len)
    peak = peak_flops(args, grid.device)
    if log:
        print(f"model {cfg.num_params() / 1e6:.2f}M params · data {len(ds)} sequences of {args.seq_len} · "
              f"world {grid.world} = tp {grid.at.tp} × cp {grid.cp} × dp {grid.data[1]} × pp {grid.at.pp} · "
              f"zero {args.zero} · {numerics} on {grid.device.type}"
              + (f", reductions in {args.reduce_dtype}" if args.dtype == "bf16" else "")
              + (" · compiled layers" if args.compile else "")
              + (f" · MFU vs {peak / 1e12:.0f} TFLOP/s" if peak else ""), flush=True)
        if args.pp > 1:
            print(pipeline_summary(args, cfg), flush=True)
    prefetch = Prefetcher(lambda rows: host_batch(ds, rows, args.micro_batches, grid), sampler,
                          max(args.steps - start, 0), grid.device)
    t_start, bad, good = time.time(), 0, 0
    for step in range(start, args.steps):
        t0 = time.time()
        logs = log and (step % args.log_every == 0 or step == args.steps - 1)
        meter.phase("data")
        sampler_state, micro = prefetch.next()  # made while the last step ran; copies start here
        with stage("counting the step's target tokens (dp all-reduce)", grid):
            # a device tensor, never read on the host: the loss is divided by it there
            targets = dp.global_count(sum(P.count_targets(m["labels"]) for m in micro), grid.dp_group)
        with stage(f"forward/backward ({args.schedule} pipeline over {args.pp} stage(s))", grid):
            loss = PP.run_pipeline(chunks, actions, micro, pp_group, targets, no_sync=opt.no_sync,
                                   seq_shards=args.tp if args.sp else 1, check_group=grid.pp_check)
        with stage(f"gradient reduction (dp / ZeRO-{args.zero})", grid):
            opt.finish()  # dp / ZeRO reductions land
            if grid.at.dp > 1:  # (dp · cp replicas; no collective on a group of one)
                dist.all_reduce(loss, group=grid.dp_group)
        meter.settle()  # nothing in flight: the one point of the step where the meter may restart
        loss_host = host_copy(loss)  # read after the step's sync, below: free
        lr = lr_at(step, args)
        meter.phase("step")
        with stage("optimizer step (tied-copy sum, grad-norm all-reduce, parameter all-gather)", grid):
            grad_norm = opt.step(lr)  # the step's one host sync: the grad norm decides the update
        meter.phase(None)  # logging, eval: not training memory
        loss_value = float(loss_host)
        if logs and grid.device.type == "cuda":
            torch.cuda.synchronize()  # the logged time includes this step's optimizer kernels
        dt = time.time() - t0  # host time; the step's sync keeps it within a step of the device's
        tps = tokens_per_step / dt
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            bad += 1
            if log:
                print(f"warning: step {step + 1} skipped: loss {loss_value} grad norm {grad_norm} "
                      f"({bad} in a row, limit {args.max_bad_steps})", file=sys.stderr, flush=True)
            if bad >= args.max_bad_steps:
                fail(f"{bad} consecutive non-finite steps: lower --lr, check the data, or use --clip", grid)
            continue
        bad, good = 0, good + 1
        if logs:
            # steps run by this process only: a resumed run did not do the first `start`
            eta = (time.time() - t_start) / (step + 1 - start) * (args.steps - step - 1)
            mfu = f"{100 * tps * fpt / (peak * grid.world):.1f}%" if peak else "n/a"
            print(f"step {step + 1}/{args.steps} · loss {loss_value:.4f} · lr {lr:.2e} · "
                  f"grad norm {grad_norm:.3f} · {dt * 1000:.0f} ms · {tps:,.0f} tok/s "
                  f"({tps / grid.world:,.0f}/rank) · MFU {mfu} · "
                  f"peak mem {peak_text(meter.peak(*MEM.TRAINING))}"
                  f" · ETA {eta:.0f}s", flush=True)
        record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                  "tokens": tokens_per_step * (step + 1), "tokens_per_s": tps, "step_time_s": dt}
        evaluate = step + 1 == args.steps or args.eval_every and (step + 1) % args.eval_every == 0
        if evaluate:
            opt.finish_gathers()  # evaluation reads complete parameters
        if eval_set and evaluate:
            with stage("SFT eval (generation)", grid), opt.gathered():  # all ranks: tp runs inside
                record["eval_exact_match"] = sft.evaluate(model, None, eval_set, template=tpl)
            if log:
                print(f"eval step {step + 1}: held-out exact match {record['eval_exact_match']:.1%}",
                      flush=True)
        if val is not None and evaluate:
            with stage("validation loss (forward over the held-out split)", grid):
                record["val_loss"] = val_loss(chunks, val, val_batches, args, grid)
            if log:
                print(f"eval step {step + 1}: val loss {record['val_loss']:.4f}", flush=True)
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if args.save and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            with meter.during("save"):
                save(args, step + 1, opt, cfg, shards, sampler_state, grid, metrics)
    if args.steps > start and not good:
        fail(f"every step of this run ({args.steps - start}) was skipped as non-finite: nothing was "
             f"trained; lower --lr, check the data, or use --clip", grid)
    opt.finish_gathers()  # the run ends with complete parameters (the last step's gathers)
    if args.export_hf:
        try:
            with stage("HF export", grid), meter.during("export"):
                EX.export_hf(model, opt, shards, cfg, grid.at, args.export_hf, grid.tp_group, grid.io_group,
                             export_tok)
        except (OSError, ValueError) as e:  # the same on every rank
            fail(str(e), grid)
        if log:
            print(f"exported HF model to {args.export_hf}", flush=True)
    meter.close()  # the last settle: the final step's, the save's and the export's peaks
    if log and meter.available:
        print("peak memory by phase (rank 0): " + " · ".join(
            f"{name} {peak_text(meter.peak(name))}" for name in meter.peaks), flush=True)
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
