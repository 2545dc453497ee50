"""Benchmark: moe.MoE forward + backward against transformers' own sparse MoE block, on CPU.

Both blocks hold the same weights and see the same input and the same output gradient in the
same process; the blocks take turns step by step, so a load change on the machine hits all.
transformers runs its `grouped_mm` experts implementation (and, for reference, its eager
per-expert loop); ours runs `experts_impl="auto"` (grouped_mm on CPU) and "loop". Reported: the
median over `--reps` fwd+bwd steps after warm-up of the process's CPU time (one intra-op thread by
default: on a shared machine CPU time counts the work, wall time the neighbours) and of the wall
time; ratio = the median over the steps of (this block's CPU time / transformers grouped_mm's
CPU time in the same turn): pairing the turns cancels most of a shared machine's drift.

`--ep`: expert parallelism over forked gloo ranks (one intra-op thread each). Every rank holds
the same weights and its own slice of the same global tokens; the block runs at ep = 1, 2, 4 (the
divisors of --world that divide E), taking turns step by step after a barrier. Reported: each
rank's median fwd+bwd CPU and wall time, averaged over the ranks, and the ratio to ep = 1 (the
median over steps of the paired CPU times). Then the all-to-all bytes per layer per rank, counted
at `torch.distributed.all_to_all_single` (what each call sends to other ranks: the token rows of
moe._AllToAll, apart from the per-expert counts), forward and backward, against the formula
2·N·k·H·b·(ep−1)/ep per direction, under three routings: the real one (the router at its init on
Gaussian tokens: close to uniform), a skewed one ("zipf": expert e drawn with odds 1/(e+1)) and a balanced
one (token t picks experts t·k … t·k+k−1 mod E: every expert gets N·k/E rows from every rank).

Builds on: moe.py

Run
    python -m bench.bench_moe                     # the default shapes, a table on stdout
    python -m bench.bench_moe --threads 2 --reps 20
    python -m bench.bench_moe --ep --world 4      # ep = 1, 2, 4: step time and all-to-all bytes
"""
from __future__ import annotations

import argparse
import collections
import copy
import math
import socket
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.distributed as dist

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
    ap.add_argument("--ep", action="store_true", help="expert parallelism over --world forked gloo ranks")
    ap.add_argument("--world", type=int, default=4, help="--ep: how many ranks to fork")
    args = ap.parse_args()
    if args.ep:
        with socket.socket() as sock:  # a free port for the ranks' rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.multiprocessing.start_processes(ep_main, (args.world, port, args), nprocs=args.world,
                                              start_method="fork")
        return
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


# --- refinement: expert parallelism (--ep): step time at ep = 1, 2, 4 and the all-to-all bytes


class AllToAllBytes:
    """Inside `with`: count the bytes every `dist.all_to_all_single` sends to the other ranks of its
    group, keyed (phase, "rows" | "counts"): split sizes given (moe._AllToAll's token rows) or not
    (the per-expert counts sent first). Set `phase` before each forward and backward."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.sent: dict[tuple[str, str], int] = collections.defaultdict(int)

    def __enter__(self) -> "AllToAllBytes":
        self.original = dist.all_to_all_single
        dist.all_to_all_single = self.call  # moe.py looks it up on the module at each call
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single = self.original

    def call(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        n, me = dist.get_world_size(group), dist.get_rank(group)
        splits = input_split_sizes or [input.shape[0] // n] * n  # rows to each rank of the group
        row = math.prod(input.shape[1:]) * input.element_size()
        kind = "rows" if input_split_sizes is not None else "counts"
        self.sent[self.phase, kind] += sum(r for d, r in enumerate(splits) if d != me) * row
        return self.original(output, input, output_split_sizes, input_split_sizes, group=group, **kw)


def all_to_all_formula(tokens: int, top_k: int, hidden: int, itemsize: int, ep: int) -> float:
    """Bytes a rank sends per layer and direction under balanced routing: its N·k rows of H·b bytes,
    (ep−1)/ep of them to other ranks, out (dispatch) and back (combine). Backward sends the same."""
    return 2 * tokens * top_k * hidden * itemsize * (ep - 1) / ep


def fixed_routing(block: moe.MoE, kind: str, seed: int = 0) -> None:
    """Replace the block's router by a fixed one, weights 1/k; `del block.gate.forward` restores
    the learned router. "balanced": token t picks experts t·k … t·k+k−1 mod E, so every expert gets
    N·k/E of a rank's rows when E divides N·k. "zipf": each token draws k distinct experts, expert
    e with odds 1/(e+1) (seeded): the low experts, on the low ep ranks, are hot."""
    E, k = block.cfg.num_experts, block.cfg.top_k
    odds = 1 / torch.arange(1, E + 1, dtype=torch.float32)  # (E,)

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        if kind == "balanced":
            experts = torch.arange(n * k, device=x.device).view(n, k) % E  # (N, k)
        else:
            experts = torch.multinomial(odds.expand(n, E), k, generator=torch.Generator().manual_seed(seed))
        return x.new_zeros(n, E), torch.full((n, k), 1 / k, device=x.device), experts.to(x.device)
    if kind not in ("balanced", "zipf"):
        raise ValueError(f"routing {kind!r}: balanced or zipf")
    block.gate.forward = route


def count_bytes(block: moe.MoE, x: torch.Tensor, g: torch.Tensor) -> dict[tuple[str, str], int]:
    """The all-to-all bytes of one forward + backward of the block on this rank."""
    with AllToAllBytes() as counter:
        y = block(x.detach().requires_grad_())
        counter.phase = "backward"
        y.backward(g)
    block.zero_grad(set_to_none=True)
    return dict(counter.sent)


def ep_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One forked rank of `--ep`: every shape at every ep; rank 0 prints the two tables."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    times, sent = {}, {}
    for name, (n, h, i, e, k) in SHAPES.items():
        torch.manual_seed(0)  # the same weights on every rank
        full = moe.MoE(moe.MoEConfig(hidden=h, intermediate=i, num_experts=e, top_k=k))
        eps = [ep for ep in (1, 2, 4, 8) if ep <= world and world % ep == 0 and e % ep == 0]
        blocks = {ep: moe.shard_experts(copy.deepcopy(full), moe.ep_groups(ep)) for ep in eps}
        gen = torch.Generator().manual_seed(1)  # the same global tokens; this rank's n of them
        x = torch.randn(world * n, h, generator=gen)[rank * n:(rank + 1) * n]
        g = torch.randn(world * n, h, generator=gen)[rank * n:(rank + 1) * n]
        steps = {ep: [] for ep in eps}
        for r in range(args.warmup + args.reps):
            for ep, block in blocks.items():
                dist.barrier()  # every rank starts the step together
                dt = step_time(block, x, g)
                if r >= args.warmup:
                    steps[ep].append(dt)
        for ep, block in blocks.items():
            times[name, ep] = steps[ep]
            sent[name, ep, "real"] = count_bytes(block, x, g)
            for kind in ("zipf", "balanced"):
                fixed_routing(block, kind, seed=rank)
                sent[name, ep, kind] = count_bytes(block, x, g)
                del block.gate.forward
    everyone = [None] * world
    dist.all_gather_object(everyone, (times, sent))
    if rank == 0:
        print_ep_tables(everyone, world, args)
    dist.destroy_process_group()


def print_ep_tables(everyone: list, world: int, args: argparse.Namespace) -> None:
    print(f"torch {torch.__version__}, {world} gloo ranks (forked, 1 thread each), fp32, fwd+bwd, "
          f"median of {args.reps}; tokens per rank as the shape says, the same global tokens at every ep")
    print(f"{'shape':<16}{'ep':>3}{'cpu ms':>9}{'wall ms':>9}{'cpu vs ep=1':>13}")
    for (name, ep), _ in everyone[0][0].items():
        per_rank = [t[name, ep] for t, _ in everyone]
        cpu = statistics.mean(statistics.median(s[0] for s in ts) for ts in per_rank)
        wall = statistics.mean(statistics.median(s[1] for s in ts) for ts in per_rank)
        base = [t[name, 1] for t, _ in everyone]
        ratio = statistics.mean(statistics.median(a[0] / b[0] for a, b in zip(ts, bs))
                                for ts, bs in zip(per_rank, base))
        print(f"{name:<16}{ep:>3}{cpu * 1e3:>9.1f}{wall * 1e3:>9.1f}{ratio:>13.3f}")
    print("all-to-all bytes per layer per rank (KiB): the token rows, mean and max over the ranks, "
          "against 2·N·k·H·b·(ep−1)/ep; + the counts sent first")
    print(f"{'shape':<16}{'ep':>3}{'routing':>10}{'formula':>10}{'fwd mean':>10}{'fwd max':>9}"
          f"{'bwd mean':>10}{'bwd max':>9}{'max/formula':>13}{'counts B':>10}")
    for (name, ep, routing), _ in everyone[0][1].items():
        n, h, _, _, k = SHAPES[name]
        formula = all_to_all_formula(n, k, h, 4, ep)
        fwd = [s[name, ep, routing].get(("forward", "rows"), 0) for _, s in everyone]
        bwd = [s[name, ep, routing].get(("backward", "rows"), 0) for _, s in everyone]
        counts = everyone[0][1][name, ep, routing].get(("forward", "counts"), 0)
        worst = f"{max(fwd + bwd) / formula:.3f}" if formula else "-"  # ep = 1 sends nothing
        print(f"{name:<16}{ep:>3}{routing:>10}{formula / 1024:>10.1f}{statistics.mean(fwd) / 1024:>10.1f}"
              f"{max(fwd) / 1024:>9.1f}{statistics.mean(bwd) / 1024:>10.1f}{max(bwd) / 1024:>9.1f}"
              f"{worst:>13}{counts:>10}")


if __name__ == "__main__":
    main()
