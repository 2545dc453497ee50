"""The decoder layer's elementwise ops as lean autograd Functions: RMSNorm, RoPE, SwiGLU.

What it does
    Each op is one autograd node. Its backward keeps only what it cannot cheaply recompute. It
    computes only the gradients the backward pass asks for (`wanted_grads`).
      rms_norm    aten's fused RMSNorm: one kernel forward and one backward on CUDA. On CPU it
                  runs HF's ops (HF's bits in fp32) and the backward formula here. It keeps x, w
                  and the per-token fp32 rstd. HF keeps an fp32 copy of x and x·rsqrt: in bf16,
                  8h + 4 bytes per token instead of 2h + 4.
      apply_rope  q and k in one node: HF's products and sum (the same bits), in 4 kernels
                  instead of 5 per tensor. It keeps only the cos/sin tables shared by all layers.
                  A rotation's gradient is the inverse rotation.
      swiglu      silu(gate)·up, keeping gate and up. Autograd's two ops would also keep
                  silu(gate); the backward recomputes it.
    Under torch.compile (model.compile_layers), inductor traces these Functions. It fuses their
    forward and backward kernels.

Reference
    Zhang & Sennrich 2019 (RMSNorm), Su et al. 2021 (RoPE), Shazeer 2020 (SwiGLU). The numerics
    follow transformers/models/llama/modeling_llama.py.

Run
    torchrun --nproc_per_node 1 train.py --model small --compile

Invariants
    - fp32 forward outputs equal HF's bit for bit (tests/test_model.py compares logits).
      Gradients agree to rounding: the backward formulas are the analytic ones, in fp32.
    - Saved tensors: exactly those named above (ac.py's byte formulas count them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def wanted_grads(ctx, n: int) -> tuple[bool, ...]:
    """Which of a custom autograd Function's first n inputs (its tensors) this backward pass will
    use. Autograd's own nodes check the same before computing each output.
    Why: a pipeline's B pass asks for input gradients only, its W pass for weight gradients only
    (pp.py). In between, ZeRO-3 may free the weights again: a W pass must not read them.
    Under torch.compile (traced once for every pass) and inside torch.autograd.grad, the engine
    cannot say. Then all inputs that need a gradient count."""
    if torch.compiler.is_compiling():
        return tuple(ctx.needs_input_grad[:n])
    try:
        return tuple(node is not None and torch._C._will_engine_execute_node(node)
                     for node, _ in ctx.next_functions[:n])
    except RuntimeError:  # inside torch.autograd.grad() the engine cannot tell: all that need one
        return tuple(ctx.needs_input_grad[:n])


def use_fused_rms_backward(x: torch.Tensor) -> bool:
    """aten's one-kernel RMSNorm backward (CUDA); elsewhere the formula in RMSNormFunction. It is a
    predicate of its own, so that tests/cuda_contract.py can point it at the meta device."""
    return x.is_cuda


class RMSNormFunction(torch.autograd.Function):
    """y = w · x / rms(x), in fp32 (as HF), by aten's fused RMSNorm. On CUDA, forward and backward
    are one kernel each. On CPU it runs HF's ops, and the backward is the formula below.
    It keeps x, w and the per-token fp32 rstd: 2h + 4 bytes per token in bf16 (HF's: 8h + 4)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)  # rstd (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        want_x, want_w = wanted_grads(ctx, 2)
        if use_fused_rms_backward(x):
            gx, gw = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight,
                                                             [want_x, want_w])
            return gx, gw, None
        xhat, g = x.float() * rstd, grad.float()  # (..., h) normalized x; fp32 gradient
        gw = (g * xhat).flatten(0, -2).sum(0).to(weight.dtype) if want_w else None  # (h,)
        gx = None
        if want_x:  # d(x·rstd)/dx applied to gxhat: rstd · (gxhat − xhat · mean(gxhat · xhat))
            gxhat = g * weight.float()  # (..., h)
            gx = (rstd * (gxhat - xhat * (gxhat * xhat).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (RMSNormFunction); model.py's and tp.py's sequence-parallel norm."""
    return RMSNormFunction.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """HF's x·cos + rotate_half(x)·sin, computed as x·cos + swap(x)·sin. swap exchanges the two
    halves of the head dim (a roll by hd/2), and sin carries rotate_half's sign. These are HF's
    products and sum, so HF's bits, in 4 kernels (HF: 5). sign = -1 rotates back. The transposed
    rotation is x·cos − swap(x)·sin: swap is its own inverse and flips sin's sign.
    x (B, S, heads, hd), cos/sin (B, S, 1, hd)."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1) * sin
    return x * cos + swapped if sign > 0 else x * cos - swapped


class RoPEFunction(torch.autograd.Function):
    """Rotary position embedding of q and k in one autograd node. A rotation's gradient is the
    inverse rotation of the output gradient. So it keeps only cos/sin, shared by all layers."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos[:, :, None], sin[:, :, None]  # (B, S, 1, hd)
        ctx.save_for_backward(cos, sin)
        return _rotate(q, cos, sin, 1.0), _rotate(k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, gq: torch.Tensor, gk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(gq, cos, sin, -1.0), _rotate(gk, cos, sin, -1.0), None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, S, nh, hd), k (B, S, nkv, hd) rotated by position (cos, sin: Rotary's (B, S, hd))."""
    return RoPEFunction.apply(q, k, cos, sin)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) · up, keeping only gate and up for backward. Autograd's two ops would also keep
    silu(gate): one more intermediate-sized tensor per token. The backward recomputes it."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (SwiGLUFunction)."""
    return SwiGLUFunction.apply(gate, up)
