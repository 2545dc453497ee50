"""Benchmark: moe.MoE forward + backward against transformers' own sparse MoE block, on CPU.

Both blocks hold the same weights and see the same input and the same output gradient in the
same process; the blocks take turns step by step, so a load change on the machine hits all.
transformers runs its `grouped_mm` experts implementation (and, for reference, its eager
per-expert loop); ours runs `experts_impl="auto"` (grouped_mm on CPU) and "loop". Reported: the
median over `--reps` fwd+bwd steps after warm-up of the process's CPU time (one intra-op thread by
default: on a shared machine CPU time counts the work, wall time the neighbours) and of the wall
time; ratio = the median over the steps of (this block's CPU time / transformers grouped_mm's
CPU time in the same turn): pairing the turns cancels most of a shared machine's drift.

Builds on: moe.py

Run
    python -m bench.bench_moe                     # the default shapes, a table on stdout
    python -m bench.bench_moe --threads 2 --reps 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

import moe

SHAPES = {  # name: (tokens, hidden, intermediate per expert, experts, top_k)
    "mixtral-like": (512, 256, 512, 8, 2),
    "qwen3-moe-like": (512, 256, 128, 32, 4),
}


def hf_block(family: str, tokens_hidden_inter_e_k: tuple, impl: str) -> torch.nn.Module:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    _, h, i, e, k = tokens_hidden_inter_e_k
    if family == "mixtral-like":
        cfg = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                            num_experts_per_tok=k)
        cls = MixtralSparseMoeBlock
    else:
        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                             num_experts_per_tok=k, norm_topk_prob=True)
        cls = Qwen3MoeSparseMoeBlock
    cfg._experts_implementation = impl
    block = cls(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return block, cfg


def step_time(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one forward + backward."""
    xi = x.detach().requires_grad_()
    cpu, wall = time.process_time(), time.perf_counter()
    block(xi).backward(g)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    block.zero_grad(set_to_none=True)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, fwd+bwd, "
          f"median of {args.reps}")
    print(f"{'shape':<16}{'impl':<26}{'cpu ms':>9}{'wall ms':>9}{'ratio':>8}")
    for name, shape in SHAPES.items():
        torch.manual_seed(0)
        theirs, cfg = hf_block(name, shape, "grouped_mm")
        eager, _ = hf_block(name, shape, "eager")
        eager.load_state_dict(theirs.state_dict())
        blocks = {"transformers grouped_mm": theirs, "transformers eager": eager}
        for impl in ("auto", "loop"):
            ours = moe.MoE(moe.MoEConfig.from_hf(cfg, experts_impl=impl))
            ours.load_state_dict(theirs.state_dict())
            blocks[f"moe.py {impl}"] = ours
        x = torch.randn(1, shape[0], shape[1])
        g = torch.randn_like(x)
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in blocks}
        for r in range(args.warmup + args.reps):
            for k, b in blocks.items():
                dt = step_time(b, x, g)
                if r >= args.warmup:
                    times[k].append(dt)
        base = times["transformers grouped_mm"]
        for k, ts in times.items():
            cpu, wall = (statistics.median(t[i] for t in ts) for i in (0, 1))
            ratio = statistics.median(t[0] / b[0] for t, b in zip(ts, base))
            print(f"{name:<16}{k:<26}{cpu * 1e3:>9.1f}{wall * 1e3:>9.1f}{ratio:>8.3f}")


if __name__ == "__main__":
    main()
