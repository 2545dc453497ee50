"""bench.py's one-process sections: compiled vs eager layers, activation checkpointing's host
overhead per layer, the error of accumulating gradients in bf16.

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
    sec_optim    precision.MixedPrecisionOptimizer.step (fp32: the masters are the parameters) vs
                 torch's clip_grad_norm_ + AdamW (fused on CUDA) on the same gradients: an ours-vs-peer
                 row (the "loss" is the sum of the first parameter after the step).
    sec_accum    the error of train.py --reduce-dtype bf16: k bf16 gradients (k micro-batches of a
                 bf16 model, or k dp ranks: a ring all-reduce adds the pieces one by one, as
                 accumulation does) summed in bf16 and in fp32, each against their exact (fp64)
                 sum: the relative error of the whole gradient vector (L2).

Run
    python -m bench.bench --model small --only compile,ac,optim,accum --steps 20

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
from bench.bench_ctx import Ctx, adamw, side


def sec_compile(ctx: Ctx) -> None:
    """One process (rank 0) on the whole global batch: compiled layers vs eager, alternating."""
    if ctx.rank == 0:
        sides = {}
        for compiled in (True, False):
            model = ctx.fresh()
            if compiled:  # compile outside the race (a first step of a minute), weights unchanged
                M.compile_layers(model)
                x, y = ctx.batch(0)
                model(x, labels=y, reduction="sum").backward()
                model.zero_grad(set_to_none=True)
            opt = P.MixedPrecisionOptimizer(model.named_parameters(), ctx.ocfg)
            sides[compiled] = side(ctx, model, partial(opt.step, ctx.args.lr))
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
    reps = 5 if ctx.args.quick else 20
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


def sec_optim(ctx: Ctx) -> None:
    """The step alone (rank 0): the same random gradients each step on both sides, alternating."""
    if ctx.rank == 0:
        models = {k: ctx.fresh() for k in ("ours", "torch")}
        ours = P.MixedPrecisionOptimizer(models["ours"].named_parameters(), ctx.ocfg)
        peer = adamw(models["torch"], ctx.ocfg)
        shapes = [p.shape for p in models["ours"].parameters()]

        def grads(i: int) -> list[torch.Tensor]:
            g = torch.Generator().manual_seed(ctx.args.seed + i)
            return [torch.randn(s, generator=g).to(ctx.device) * 1e-2 for s in shapes]
        made = {i: grads(i) for i in range(ctx.args.warmup + ctx.args.steps)}

        def step(name: str, i: int) -> tuple[torch.Tensor, float]:
            params = list(models[name].parameters())
            for p, g in zip(params, made[i]):
                p.grad = g.clone()
            if name == "ours":
                norm = ours.step(ctx.args.lr)
            else:
                for group in peer.param_groups:
                    group["lr"] = ctx.args.lr
                norm = float(torch.nn.utils.clip_grad_norm_(params, ctx.ocfg.clip, foreach=True))
                peer.step()
                peer.zero_grad(set_to_none=True)
            return params[0].detach().sum(), norm
        r = ctx.race({k: partial(step, k) for k in models}, distributed=False)
        ctx.add_row("optim step", "MixedPrecisionOptimizer.step (fp32, 1 process)",
                    "clip_grad_norm_(foreach) + AdamW (fused on CUDA)", r["ours"], r["torch"])
    dist.barrier()


def sec_accum(ctx: Ctx) -> None:
    """bf16 vs fp32 sums of k real bf16 gradients (rank 0), k = 8, 32, 64."""
    if ctx.rank == 0:
        model = ctx.fresh().to(torch.bfloat16)
        ks, g = (8, 32, 64), torch.Generator().manual_seed(ctx.args.seed)
        pieces = []
        for _ in range(max(ks)):
            x = torch.randint(0, ctx.cfg.vocab_size, (1, ctx.args.seq_len + 1), generator=g).to(ctx.device)
            model.zero_grad(set_to_none=True)
            loss = model(x[:, :-1], labels=x[:, 1:], reduction="sum") / (max(ks) * ctx.args.seq_len)
            loss.backward()
            pieces.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # bf16
        rows = []
        for k in ks:
            exact = torch.stack(pieces[:k]).double().sum(0)
            bf16, fp32 = pieces[0].clone(), pieces[0].float()
            for p in pieces[1:k]:
                bf16 += p  # rounded to bf16 after every add, as AccumulateGrad and a bf16 ring do
                fp32 += p.float()
            err = lambda s: float((s.double() - exact).norm() / exact.norm())  # noqa: E731
            rows.append([k, f"{err(bf16):.1e}", f"{err(fp32):.1e}"])
        ctx.table("Gradient accumulation and reduction dtype: relative error of the summed gradient",
                  ["micro-batches or dp ranks summed", "bf16 (--reduce-dtype bf16)", "fp32 (default)"], rows,
                  note=f"`{ctx.args.model}` model in bf16, one row of {ctx.args.seq_len} random tokens per "
                       f"piece; L2 error of the whole gradient against the exact (fp64) sum of the same bf16 pieces")
    dist.barrier()
