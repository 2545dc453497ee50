"""FP8 training: the decoder layers' linears multiply in 8-bit floats, with dynamic tensorwise scales.

What it does
    `use_fp8(model, groups)` makes every linear inside the decoder layers an FP8 linear.
    The embedding, the head, the norms and an MoE router stay as they are (bf16).
    A linear whose local shape is not a multiple of 16 stays too. The call returns their names.
    Nothing else changes: parameters, names, the optimizer and checkpoints are the model's own.

The core idea (Micikevicius et al. 2022; torchao's default "tensorwise" recipe)
    y = x W^T runs as (s_x x)_fp8 (s_w W)_fp8^T / (s_x s_w), accumulated in fp32.
    A scale maps the tensor's largest magnitude onto the format's largest value: s = max_fp8 / amax.
    The scale is fp32, computed afresh each call from the tensor itself ("dynamic").
    The input and the weight are e4m3: 3 mantissa bits, range ±448.
    The output gradient is e5m2: 2 mantissa bits, range ±57344. Gradients need the range more.
    Backward reuses the forward's FP8 input and weight: dL/dx = g W, dL/dW = g^T x.
    The bias is added after the product, in the compute dtype.

The scale is global (the seam with parallelism)
    Under tp, sp and cp, each rank holds a piece of x, of W or of the gradient.
    A scale from one piece would differ per rank, and the layout would no longer equal one process.
    So every amax is all-reduced (MAX) over `groups`: tp and cp. Where a tensor is whole, MAX changes nothing.
    tp.py's column and row layers take their matmul from a `linear_fn` attribute; FP8 sets it there.
    ZeRO-3 gathers each weight before its layer runs, so its amax is already the full weight's.

Reference
    Micikevicius et al. 2022, "FP8 Formats for Deep Learning". torchao.float8 (Float8Linear, tensorwise).

Run
    torchrun --nproc_per_node 2 train.py --fp8 --tp 2 --dtype bf16

Invariants
    - Forward and backward equal torchao's Float8Linear(emulate=True) in fp32 within 1e-5 of the largest output.
      Test: tests/test_fp8.py::test_matches_torchao_emulate.
    - The FP8 codes equal torchao's bit for bit. Test: the same.
    - tp2, pp2, cp2 and dp2 with ZeRO-1/2/3 equal one process. Every rank uses the same scales.
      Test: tests/test_fp8.py::test_layouts_match_one_process.
    - On CUDA the matmul's rules hold (sm89+, dims of 16, column-major second operand, fp32 scales).
      Test: tests/test_cuda_paths.py::test_fp8_linear_under_the_contract.

Builds on: tp.py (its `linear_fn` seam, when the model is tensor-parallel). Imports torch only.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # the smallest amax a scale divides by: an all-zero tensor gets a large, finite scale
ALIGN = 16  # cuBLAS's FP8 GEMM wants every dim of its operands a multiple of 16

Groups = Sequence[dist.ProcessGroup | None]


def amax(x: torch.Tensor, groups: Groups = ()) -> torch.Tensor:
    """max |x| over this tensor and its pieces on the other ranks of `groups`, fp32, 0-dim."""
    a = x.detach().abs().max().float()
    for g in groups:
        if g is not None and dist.get_world_size(g) > 1:  # no collective on a group of one
            a = funcol.all_reduce(a, "max", g)  # traceable: torch.compile keeps it in the graph
    return a


def scale_of(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """s = max_fp8 / amax, in float64 then fp32 (torchao's rule: compile and eager agree)."""
    return (torch.finfo(dtype).max / torch.clamp(a.double(), min=EPS)).float()


def quantize(x: torch.Tensor, dtype: torch.dtype, groups: Groups = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale): codes = saturate(x · s) in `dtype`, s the global fp32 scale."""
    s = scale_of(amax(x, groups), dtype)
    top = torch.finfo(dtype).max
    return (x.float() * s).clamp(-top, top).to(dtype), s


def scaled_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a / sa) @ (b / sb) through torch._scaled_mm: a (M, K) row-major, b (K, N) column-major."""
    b = b if b.stride(0) == 1 else b.t().contiguous().t()  # (K, N), column-major as cuBLAS wants
    return torch._scaled_mm(a.contiguous(), b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(),
                            out_dtype=out_dtype)  # (M, N)


class _Fp8Matmul(torch.autograd.Function):
    """x (M, K) @ w (N, K)^T with FP8 operands. Saves the FP8 codes, not x and w: half their bytes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, groups: Groups) -> torch.Tensor:
        xq, sx = quantize(x, E4M3, groups)  # (M, K)
        wq, sw = quantize(w, E4M3, groups)  # (N, K)
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.groups, ctx.dtypes = groups, (x.dtype, w.dtype)
        return scaled_mm(xq, sx, wq.t(), sw, x.dtype)  # (M, N)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = quantize(grad, E5M2, ctx.groups)  # (M, N)
        grad_x = scaled_mm(gq, sg, wq, sw, ctx.dtypes[0])  # (M, N) @ (N, K) → (M, K)
        grad_w = scaled_mm(gq.t(), sg, xq, sx, ctx.dtypes[1])  # (N, M) @ (M, K) → (N, K)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               groups: Groups = ()) -> torch.Tensor:
    """F.linear's signature, in FP8. x (..., K), weight (N, K) → (..., N)."""
    if x.is_cuda and x.shape[:-1].numel() % ALIGN:  # dL/dW's inner dim is the token count
        raise ValueError(f"fp8: {x.shape[:-1].numel()} tokens per matmul; FP8 on CUDA needs a multiple "
                         f"of {ALIGN} (change --seq-len or the micro-batch rows)")
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, tuple(groups))  # (B·S, N)
    y = y.reshape(*x.shape[:-1], weight.shape[0])  # (..., N)
    return y if bias is None else y + bias.to(y.dtype)


class Float8Linear(nn.Linear):
    """An nn.Linear whose forward is `fp8_linear`. It shares the original's parameters."""

    amax_groups: tuple = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.amax_groups)


def fits(weight: torch.Tensor) -> bool:
    """Whether a (local) weight's two dims suit the FP8 GEMM."""
    return weight.ndim == 2 and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            raise ValueError(f"use_fp8: the model has no '{path}' (pass layers='<path of the decoder layers>')")
    return root


def use_fp8(model: nn.Module, groups: Groups = (), layers: str = "model.layers") -> list[str]:
    """Every linear under `layers` multiplies in FP8, its amax all-reduced over `groups` (tp, cp).
    A plain nn.Linear is swapped for a Float8Linear sharing its parameters (meta ones too).
    A tensor-parallel layer (tp.py) gets `linear_fn`. Returns the linears left as they were."""
    kept, groups = [], tuple(groups)
    container = _get(model, layers)
    for name, module in list(container.named_modules()):
        full = f"{layers}.{name}"
        if hasattr(module, "linear_fn"):  # tp.py's column and row layers: their local shard
            if fits(module.weight):
                module.linear_fn = _with_groups(groups)
            else:
                kept.append(full)
        elif type(module) is nn.Linear:
            if fits(module.weight):
                _swap(container, name, module, groups)
            else:
                kept.append(full)
    return kept


def _with_groups(groups: tuple) -> Callable[..., torch.Tensor]:
    """F.linear's signature, in FP8, with the amax groups bound: a tp layer's `linear_fn`."""
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, weight, bias, groups)
    return linear


def _swap(container: nn.Module, name: str, old: nn.Linear, groups: tuple) -> None:
    new = Float8Linear.__new__(Float8Linear)
    nn.Module.__init__(new)
    new.in_features, new.out_features = old.in_features, old.out_features
    new.weight, new.bias = old.weight, old.bias  # the same Parameters: names and values unchanged
    new.amax_groups = groups
    parent, _, leaf = name.rpartition(".")
    setattr(container.get_submodule(parent) if parent else container, leaf, new)
