"""Checkpoint I/O cost on one process: save, and load with and without the crc32 check.

What it does
    Builds a Llama of the given size (fp32 masters, one AdamW step so the moments exist: 12 bytes
    per parameter on disk), saves one checkpoint, and loads it back `--repeat` times each way, with
    the page cache warm (the check is then pure CPU: its worst case relative to the load) and cold
    (the files evicted with posix_fadvise first, so the load reads the disk). Prints one table.

Run
    python -m bench.bench_ckpt --hidden 1024 --layers 8 --repeat 3

Builds on: checkpoint.py, checkpoint_load.py, model.py, precision.py, weights.py
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

import checkpoint as CK
import checkpoint_load as CL
import model as M
import precision as P
import weights as W


def evict(folder: Path) -> None:
    """Drop the folder's clean pages from the page cache (no root needed)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = p.parse_args()
    h = args.hidden
    if h < 128 or h % 128:
        p.error(f"--hidden must be a positive multiple of 128 (heads of 64, two per kv head), got {h}")
    if args.layers < 1:
        p.error(f"--layers must be at least 1, got {args.layers}")
    cfg = M.LlamaConfig(vocab_size=32000, hidden_size=h, intermediate_size=h * 8 // 3 // 64 * 64,
                        num_hidden_layers=args.layers, num_attention_heads=h // 64,
                        num_key_value_heads=h // 128, head_dim=64)
    model = W.materialize(M.build(cfg), "cpu", seed=0)
    opt = P.MixedPrecisionOptimizer(model.named_parameters(), P.OptimConfig(lr=1e-4), torch.float32)
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt.step(1e-4)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        t = time.perf_counter()
        path = CK.save_checkpoint(root, 1, opt, cfg, {}, CK.Layout())
        save_s = time.perf_counter() - t
        gb = sum(f.stat().st_size for f in path.iterdir()) / 1e9
        CL.load_checkpoint(path, opt, cfg, {}, CK.Layout())  # warm-up: allocations, imports
        times: dict[tuple[str, bool], float] = {}
        for _ in range(args.repeat):  # alternating, best of `repeat`: this machine is shared
            for cache in ("warm", "cold"):
                for verify in (False, True):
                    if cache == "cold":
                        evict(path)
                    t = time.perf_counter()
                    CL.load_checkpoint(path, opt, cfg, {}, CK.Layout(), verify=verify)
                    dt = time.perf_counter() - t
                    times[cache, verify] = min(times.get((cache, verify), dt), dt)
    print(f"{cfg.num_params() / 1e6:.0f}M params, checkpoint {gb:.2f} GB, save {save_s:.2f} s "
          f"({gb / save_s:.2f} GB/s, fsynced)\n")
    print("| page cache | load s | load + crc32 s | check's share |\n|---|---|---|---|")
    for cache in ("warm", "cold"):
        plain, checked = times[cache, False], times[cache, True]
        print(f"| {cache} | {plain:.2f} | {checked:.2f} | +{(checked - plain) / plain:.0%} |")


if __name__ == "__main__":
    main()
