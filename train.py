"""attotron's trainer: flags, process grid, composition in a fixed order, loop, logging.

Run
    python train.py                                   # tiny Llama on the default corpus, 1 process
    torchrun --nproc_per_node 1 train.py --model small --steps 200 --dtype bf16

Composition order (each step an exact no-op at degree 1, so one code path serves every layout)
    1. validate every flag against the config and world size — before any heavy work
    2. build the model on the meta device (no memory)
    3. materialize: load from --init-from or init from --seed (the full weights never depend on the
       layout), recompute RoPE buffers
    4. mixed precision: fp32 masters + AdamW (precision.py)

Invariants
    - The order of training sequences is a function of (seed, data) only: the sampler shards the same
      global batch over dp ranks, so every layout trains on the same global batches.
    - Step loss = sum of token losses / target tokens of the whole step (precision.normalized_loss).
    - The device is chosen once, here: CUDA + NCCL when available, else CPU + gloo.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import data
import dp
import model as M
import precision as P


# ------------------------------------------------------------------------------------------ flags
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", choices=sorted(M.PRESETS), help="preset for random init")
    a("--init-from", default=None, help="HF model dir (config.json + safetensors) to start from")
    a("--data", default=None, help="prepared data dir, or a .txt/.jsonl/folder to prepare; "
                                   "default: the Python stdlib sources, byte-tokenized")
    a("--tokenizer", default=None, help="local HF tokenizer dir used to prepare --data (default: bytes)")
    a("--seq-len", type=int, default=256, help="tokens per training sequence")
    a("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    a("--micro-batches", type=int, default=1, help="gradient-accumulation micro-batches per dp rank")
    a("--steps", type=int, default=50, help="optimizer steps")
    a("--lr", type=float, default=1e-3, help="peak learning rate")
    a("--min-lr", type=float, default=1e-4, help="final learning rate of the cosine decay")
    a("--warmup", type=int, default=10, help="linear warm-up steps")
    a("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (not norms/biases)")
    a("--clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    a("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (masters stay fp32)")
    a("--seed", type=int, default=0, help="init and data-order seed")
    a("--metrics", default=None, help="JSONL file: one object per step (rank 0)")
    a("--export-hf", default=None, help="write an HF-loadable model dir here at the end")
    a("--log-every", type=int, default=1, help="print a log line every N steps")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ setup
@dataclass
class Grid:
    rank: int
    world: int
    device: torch.device


def setup() -> Grid:
    """torchrun sets RANK/WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so the
    same collectives run (as no-ops) in both cases."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        init = "env://"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rank, world, init = 0, 1, f"tcp://127.0.0.1:{port}"
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    return Grid(rank, world, device)


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
    dp_size = grid.world
    if args.batch_size % (dp_size * args.micro_batches):
        errors.append(f"--batch-size {args.batch_size} is not divisible by dp size {dp_size} × "
                      f"--micro-batches {args.micro_batches}")
    if args.warmup < 0 or args.lr <= 0 or args.min_lr < 0 or args.min_lr > args.lr:
        errors.append(f"need 0 < --min-lr <= --lr and --warmup >= 0 (got lr {args.lr}, "
                      f"min-lr {args.min_lr}, warmup {args.warmup})")
    return errors


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


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def flops_per_token(cfg: M.LlamaConfig, seq_len: int) -> float:
    """6N for the matmuls of forward + backward, plus 12·L·H·Q·T for attention scores (PaLM App. B)."""
    n = cfg.num_params()
    return 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * seq_len


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    grid = setup()
    try:
        cfg = M.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    except (OSError, ValueError) as e:
        fail(str(e), grid)
    errors = validate(args, cfg, grid)
    if errors:
        fail("\n  ".join(["invalid configuration:"] + errors), grid)
    try:
        ds = load_data(args, grid)
        ds.check_vocab(cfg.vocab_size)
    except (OSError, ValueError) as e:
        fail(str(e), grid)
    dp_size, dp_rank = grid.world, grid.rank
    sampler = dp.DPSampler(len(ds), args.batch_size, dp_rank, dp_size, args.seed)

    model = M.materialize(M.build(cfg), grid.device, seed=args.seed, hf_dir=args.init_from)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ocfg = P.OptimConfig(lr=args.lr, weight_decay=args.weight_decay, clip=args.clip)
    opt = P.MixedPrecisionOptimizer(model.named_parameters(), ocfg, dtype)

    log = grid.rank == 0
    metrics = open(args.metrics, "w") if args.metrics and log else None
    tokens_per_step = args.batch_size * args.seq_len
    fpt = flops_per_token(cfg, args.seq_len)
    peak_flops = 989e12 if grid.device.type == "cuda" else None  # H100/H200 dense bf16
    if log:
        print(f"model {cfg.num_params() / 1e6:.2f}M params · data {len(ds)} sequences of {args.seq_len} · "
              f"world {grid.world} · {args.dtype} on {grid.device.type}", flush=True)
    t_start = time.time()
    for step in range(args.steps):
        t0 = time.time()
        rows = torch.stack([ds[i] for i in sampler.next_batch()]).to(grid.device)  # (b, S+1)
        micro = rows.chunk(args.micro_batches)
        targets = sum(P.count_targets(m[:, 1:]) for m in micro)
        dist.all_reduce(targets)
        loss_sum = torch.zeros((), device=grid.device)
        for m in micro:
            loss = P.normalized_loss(model(m[:, :-1], labels=m[:, 1:], reduction="sum"), targets)
            loss.backward()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum)
        lr = lr_at(step, args)
        grad_norm = opt.step(lr)
        if grid.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.time() - t0
        tps = tokens_per_step / dt
        if log and (step % args.log_every == 0 or step == args.steps - 1):
            eta = (time.time() - t_start) / (step + 1) * (args.steps - step - 1)
            mfu = f"{100 * tps * fpt / (peak_flops * grid.world):.1f}%" if peak_flops else "n/a"
            print(f"step {step + 1}/{args.steps} · loss {loss_sum.item():.4f} · lr {lr:.2e} · "
                  f"grad norm {grad_norm:.3f} · {dt * 1000:.0f} ms · {tps:,.0f} tok/s · MFU {mfu} · "
                  f"peak mem {peak_memory_mb(grid.device):,.0f} MB · ETA {eta:.0f}s", flush=True)
        if metrics:
            metrics.write(json.dumps({"step": step + 1, "loss": loss_sum.item(), "lr": lr,
                                      "grad_norm": grad_norm, "tokens": tokens_per_step * (step + 1),
                                      "tokens_per_s": tps, "step_time_s": dt}) + "\n")
            metrics.flush()
    if args.export_hf:
        if log:  # the fp32 masters, not the bf16 compute copy
            M.save_hf(dict(zip(opt.names, opt.master)), cfg, args.export_hf)
            print(f"exported HF model to {args.export_hf}", flush=True)
    if metrics:
        metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
