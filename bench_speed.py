"""bench.py's one-process speed sections: compiled vs eager layers, activation checkpointing's host
overhead per layer.

What it does
    sec_compile  train.py --compile (model.compile_layers) vs the eager layers on the same model and
                 batches, steps alternating: an ours-vs-peer row (same losses and grad norm, 1e-5
                 in fp32: inductor reorders the norms' reductions) whose ratio is compiled / eager.
    ac_host      one decoder layer's forward + backward on a 1 × 8 batch (the compute is nearly
                 nothing, so the time is the host's: Python, dispatch, autograd) under no AC, full
                 AC, ac.py's selective mode, and torch's op-level selective checkpoint
                 (create_selective_checkpoint_contexts with ac.SAVE_OPS in eager: a Python
                 TorchDispatchMode around every aten op, what ac.py's selective mode used to be) —
                 alternating, median µs per layer and the overhead over no AC.

Run
    torchrun --nproc_per_node 1 bench.py --model small --only compile,ac --steps 20

Builds on: bench_ctx.py, ac.py, model.py, precision.py
"""
from __future__ import annotations

import statistics
import time
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import ac as AC
import model as M
import precision as P
from bench_ctx import Ctx, side


def sec_compile(ctx: Ctx) -> None:
    """One process (rank 0) on the whole global batch: compiled layers vs eager, alternating."""
    if ctx.rank == 0:
        sides = {}
        for compiled in (True, False):
            model = ctx.fresh()
            if compiled:
                M.compile_layers(model)
            opt = P.MixedPrecisionOptimizer(model.named_parameters(), ctx.ocfg)
            sides[compiled] = side(ctx, model, partial(opt.step, ctx.args.lr))
        sides[True](0)  # compile outside the race: a first step of minutes would be its median's noise
        r = ctx.race({"compiled": sides[True], "eager": sides[False]}, distributed=False)
        ctx.add_row("compile", "model.compile_layers (--compile, 1 process)", "eager layers", r["compiled"],
                    r["eager"])
        torch._dynamo.reset()
    dist.barrier()


def _op_level_selective(layer: torch.nn.Module) -> None:
    """torch's op-level selective checkpoint in eager, with ac.py's compile policy (the reference)."""
    plain = layer.forward
    layer.forward = lambda *args: checkpoint(
        plain, *args, use_reentrant=False, preserve_rng_state=False,
        context_fn=partial(create_selective_checkpoint_contexts, AC._compile_policy))


def ac_host(ctx: Ctx) -> None:
    """Host time per decoder layer (forward + backward, 1 × 8 tokens) by AC mode; rank 0 only."""
    modes = ("none", "full", "selective", "op-level SAC")
    layers = {}
    for mode in modes:
        model = ctx.fresh()
        if mode in ("full", "selective"):
            AC.apply_ac(model, mode)
        layer = model.model.layers["0"]
        if mode == "op-level SAC":
            _op_level_selective(layer)
        layers[mode] = (model, layer)
    x = torch.randn(1, 8, ctx.cfg.hidden_size, device=ctx.device, requires_grad=True)
    cos, sin = layers["none"][0].model.rotary_emb(torch.arange(8, device=ctx.device)[None], x.dtype)
    reps = 5 if ctx.args.quick else 50
    times = {m: [] for m in modes}
    for i in range(ctx.args.warmup + ctx.args.steps):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            layer = layers[mode][1]
            t0 = time.perf_counter()
            for _ in range(reps):
                layer(x, cos, sin, None).sum().backward()
            if i >= ctx.args.warmup:
                times[mode].append((time.perf_counter() - t0) / reps * 1e6)
    us = {m: statistics.median(t) for m, t in times.items()}
    ctx.table("Activation checkpointing: host time per decoder layer (forward + backward, 1 x 8 tokens)",
              ["AC mode", "µs per layer", "over no AC", "overhead / full AC's"],
              [[m, f"{us[m]:.0f}", f"{us[m] - us['none']:+.0f}",
                f"{(us[m] - us['none']) / (us['full'] - us['none']):.2f}" if m != "none" else "-"] for m in modes],
              note=f"{ctx.cfg.num_hidden_layers}-layer `{ctx.args.model}` config, one layer, {reps} calls per "
                   f"sample, modes alternating, median of {ctx.args.steps} samples; at this size the compute is "
                   f"negligible, so the time is the host's (Python, dispatch, autograd)")
