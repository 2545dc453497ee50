"""Textbook versions of core algorithms, a few lines each, to read beside the production code.
tests/test_naive.py asserts each equal to the production path.

TP's textbook MLP (f, g and tp_mlp) lives in tp.py itself, above the production layers.

zero1_step: one ZeRO-1 optimizer step in its three phases: reduce-scatter the gradients, AdamW on
this rank's slice of the flat fp32 parameters, all-gather the updated slices.
Production: dp.ReduceScatterSync, precision.MixedPrecisionOptimizer.step, zero.ZeroOptimizer
(buckets, overlap, weight-decay groups and clipping on top).

The third, 1F1B's textbook order, is production code: pp_schedules.textbook_1f1b.
tests/test_naive.py asserts it equal to the general order (interleaved chunks, the zero-bubble split).

References: Rajbhandari et al. 2020 (ZeRO); Narayanan et al. 2021 (1F1B as PipeDream-Flush).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def zero1_step(params: list[torch.Tensor], master: torch.Tensor, opt: torch.optim.Optimizer,
               group: dist.ProcessGroup | None = None) -> None:
    """params hold this rank's local gradients; master is this rank's slice (S,) of the flat fp32
    parameters (padded to a multiple of the dp size); opt is an AdamW over [master]."""
    n = dist.get_world_size(group)
    grads = torch.cat([p.grad.reshape(-1) for p in params])  # (Ψ,)
    grads = F.pad(grads, (0, master.numel() * n - grads.numel()))  # (n·S,)
    master.grad = torch.empty_like(master)
    dist.reduce_scatter_tensor(master.grad, grads, group=group)  # 1. the dp sum of my slice only
    opt.step()  # 2. AdamW on my slice only
    full = torch.empty(master.numel() * n)  # (n·S,)
    dist.all_gather_into_tensor(full, master.detach(), group=group)  # 3. every rank's updated slice
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
