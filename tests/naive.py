"""Textbook versions of core algorithms, a few lines each, to read beside the production code.
tests/test_naive.py asserts each equal to the production path.

tp_mlp: Megatron's tensor-parallel MLP as the paper draws it. Two conjugate operators: f is the
identity forward and an all-reduce backward; g is an all-reduce forward and the identity backward.
The first matmul holds rows of W1 (column parallel), the second columns of W2 (row parallel).
Production: tp.py's CopyToRegion / ReduceFromRegion, ColumnParallelLinear / RowParallelLinear.

The ZeRO-1 step is production code: zero.zero1_step, above the production optimizer.
1F1B's textbook order is production code too: pp_schedules.textbook_1f1b.
tests/test_naive.py asserts it equal to the general order (interleaved chunks, the zero-bubble split).

References: Shoeybi et al. 2019 (Megatron-LM, Fig. 3); Rajbhandari et al. 2020 (ZeRO);
Narayanan et al. 2021 (1F1B as PipeDream-Flush).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _f(torch.autograd.Function):
    """Identity forward, all-reduce backward: where a replicated input enters the split region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's dL/dx is a partial sum
        return grad, None


class _g(torch.autograd.Function):
    """All-reduce forward, identity backward: where the partial outputs leave the split region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def tp_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """x (..., H) replicated; w1 (I/tp, H) this rank's rows of W1; w2 (H, I/tp) its columns of W2."""
    h = F.silu(_f.apply(x, group) @ w1.T)  # (..., I/tp): this rank's slice of the hidden features
    return _g.apply(h @ w2.T, group)  # (..., H): the sum over ranks is the full product
