"""QLoRA: LoRA on a frozen base stored in 4-bit NormalFloat, in plain PyTorch (Dettmers et al. 2023).

What it does
    `quantize_nf4(w)` stores a weight as 4-bit codes, two to a byte, with one scale per block of
    64 elements. The scales are quantized again: 8 bits each, with one fp32 scale per 256 of them
    (double quantization). `dequantize_nf4` gives the weight back, in any dtype.
    `apply_qlora(model, full_weight)` swaps each LoRA layer's frozen weight for its NF4 form.
    The layer then dequantizes its weight at each use, per layer, in forward and in backward.

The core idea
    NF4's 16 levels are quantiles of a normal distribution, scaled to [-1, 1]. Weights are roughly
    normal, so each level is used about equally often: the most information per 4 bits.
    A block's elements are divided by the block's absmax, then rounded to the nearest level.
    The absmax of each block is an fp32 number per 64 weights: 0.5 bits per weight. Quantizing the
    absmaxes to 8 bits (after subtracting their mean) brings that to about 0.127 bits per weight.

Layout-free
    Each weight is quantized whole, then sharded: the codes and scales never depend on the layout.
    A rank keeps the codes of its own slice and every scale of the weight (1/64 byte per weight).
    Its slice's elements find their block from their index in the whole weight.
    So every layout dequantizes to the same values as one process.
    The codes and scales are frozen parameters (`nf4_codes`, ...). So ZeRO-3 shards them over dp too.
    A meta model gets their values from `reader`: one weight quantized whole at a time, then cut.
    So ZeRO-3's build keeps its shard of each, and never holds every code.

Reference
    Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs", §3 (NF4, double
    quantization). bitsandbytes' quantize_4bit(quant_type="nf4", compress_statistics=True): the
    same levels, packing (first element in the high nibble), blocks and 8-bit dynamic map.

Run
    torchrun --nproc_per_node 4 train.py --init-from DIR --sft --lora 8 --qlora --tp 2 --zero 3

Invariants
    - Codes, 8-bit scale codes and dequantized values equal bitsandbytes' 0.50.2 CPU path
      (tests/test_qlora.py::test_nf4_equals_bitsandbytes).
    - Every layout equals one process with --qlora (test_qlora.py::test_qlora_layouts_equal_one_process).
    - The codes a dp2 ZeRO-3 rank builds are its slice of the whole weight's, bit for bit. Its build
      holds its shards plus one weight (tests/test_lora.py::test_build_peak_of_a_frozen_base).

Builds on: lora.py (the adapters on top of the quantized layers).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

BLOCK, SCALE_BLOCK = 64, 256
_SHIFT = 6  # BLOCK = 2^6: a shift (an integer division is far slower on CPU)

# NF4: the 16 levels (bitsandbytes' table; QLoRA's appendix E builds them from normal quantiles).
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0])


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic map (Dettmers 2016) of the scales' codes, 256 sorted values.
    Each decade 10^-6 .. 10^0 holds levels at the midpoints of an even split of [0.1, 1]:
    2^i + 1 boundaries in decade i. The arithmetic follows bitsandbytes' create_dynamic_map:
    all in float32, as bitsandbytes' create_dynamic_map (its values to the bit)."""
    data = []
    for i in range(7):  # 7 exponent bits
        b = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0  # float32
        data += (10 ** (-6 + i) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _blockwise(x: torch.Tensor, block: int, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x flat fp32 → (the nearest level's index per element, the absmax per block). The last block
    may be short. A block of zeros keeps absmax 0 (its elements dequantize to 0)."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.cat([x, x.new_zeros(blocks * block - n)]).view(blocks, block)  # (blocks, block)
    absmax = padded.abs().amax(1)  # (blocks,)
    scaled = (padded * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp_(-1, 1).reshape(-1)[:n]
    bounds = (levels[:-1] + levels[1:]) / 2  # nearest level = bucket between midpoints
    # int32 indices, not int64: a whole weight's temporaries stay small (the build reads one at a time)
    return torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8), absmax


@dataclass
class NF4:
    """A weight in NF4 with double-quantized scales. codes: this rank's elements, two to a byte
    (the first in the high nibble). scale_codes (blocks,) uint8, scale_absmax (blocks/256,) fp32,
    offset fp32: every block of the whole weight. shape: the whole weight's; local: this rank's
    (rows [start, start+size) of dimension dim)."""
    codes: torch.Tensor
    scale_codes: torch.Tensor
    scale_absmax: torch.Tensor
    offset: torch.Tensor
    shape: tuple[int, ...]
    local: tuple[int, ...]
    dim: int = 0
    start: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale_codes, self.scale_absmax, self.offset))


def quantize_nf4(w: torch.Tensor) -> NF4:
    """The whole weight → NF4 codes (blocks of 64), and its block absmaxes → 8-bit codes around
    their mean (blocks of 256)."""
    q, absmax = _blockwise(w.detach().reshape(-1).float(), BLOCK, _table(w.device, "nf4"))
    offset = absmax.mean()
    scale_codes, scale_absmax = _blockwise(absmax - offset, SCALE_BLOCK, _table(w.device, "dynamic"))
    return NF4(_pack(q), scale_codes, scale_absmax, offset, tuple(w.shape), tuple(w.shape))


def _pack(q: torch.Tensor) -> torch.Tensor:
    q = torch.cat([q, q.new_zeros(q.numel() % 2)])  # an odd count: one padding code
    return (q[::2] << 4) | q[1::2]  # (n/2,) uint8


def _unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.stack([packed >> 4, packed & 0xF], 1).reshape(-1)[:n].long()  # (n,)


@functools.lru_cache
def _table(device: torch.device, which: str) -> torch.Tensor:
    return (dynamic_map() if which == "dynamic" else NF4_LEVELS).to(device)


def block_scales(t: NF4) -> torch.Tensor:
    """Every block's absmax, fp32: the 8-bit code's level times its group's scale, plus the mean."""
    groups = t.scale_absmax.repeat_interleave(SCALE_BLOCK)[:t.scale_codes.numel()]  # (blocks,)
    return _table(groups.device, "dynamic").index_select(0, t.scale_codes.long()) * groups + t.offset


def shard(t: NF4, dim: int, start: int, size: int) -> NF4:
    """This rank's slice (`size` rows of `dim` from `start`) of a whole-weight NF4: its codes only."""
    q = _unpack(t.codes, torch.Size(t.shape).numel()).view(t.shape).narrow(dim, start, size).reshape(-1)
    local = list(t.shape)
    local[dim] = size
    return NF4(_pack(q.to(torch.uint8)), t.scale_codes, t.scale_absmax, t.offset, t.shape, tuple(local), dim, start)


def dequantize_nf4(t: NF4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's slice of the weight, in `dtype`: level × its block's absmax, in fp32, then cast."""
    n = torch.Size(t.local).numel()
    device = t.codes.device
    if t.local == t.shape:
        block = torch.arange(n, device=device) >> _SHIFT  # (n,) each element's block (// 64)
    else:  # the element's index in the whole weight gives its block
        idx = [torch.arange(s, device=device) for s in t.local]
        idx[t.dim] = idx[t.dim] + t.start
        strides = torch.empty(t.shape, device="meta").stride()
        flat = sum(i.view([-1 if d == k else 1 for k in range(len(t.local))]) * strides[d]
                   for d, i in enumerate(idx))  # (local...) index in the whole weight
        block = flat.reshape(-1) >> _SHIFT  # // 64
    levels = _table(device, "nf4").index_select(0, _unpack(t.codes, n))  # (n,)
    return (levels * block_scales(t).index_select(0, block)).to(dtype).view(t.local)


# --- refinement: the frozen base of LoRA layers in NF4
# The layer's `weight` parameter goes. A subclass's `weight` property dequantizes it at each use.
# So the layer's own forward (tp's comm included) runs unchanged, on the dequantized weight.
# Autograd keeps that bf16 weight until the layer's backward; with activation checkpointing the
# layer's forward reruns in backward, so only one layer's weights are ever dequantized at a time.
class _Quantized:
    @property
    def weight(self) -> torch.Tensor:
        return dequantize_nf4(self.nf4, self.compute_dtype)


FIELDS = ("codes", "scale_codes", "scale_absmax", "offset")  # NF4's tensors: the layer's nf4_* parameters


def apply_qlora(model: nn.Module, full_weight, compute_dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str | None = None) -> list[str]:
    """Swap the weight of every LoRA layer (lora.apply_lora first) for NF4, on `device` (default:
    the weight's own). full_weight(name) → the whole weight `name` (parameter name), fp32:
    quantized whole, then cut to this rank's slice with the layer's tp Shard.
    A meta weight gives meta NF4 parameters of the right shapes: `reader` then gives their values.
    A merge is then refused: the base is not a parameter. Returns the quantized names."""
    done = []
    for n, m in list(model.named_modules()):
        if not hasattr(m, "lora_A") or isinstance(m, _Quantized):
            continue
        t = quantize_nf4(full_weight(f"{n}.weight").to(device or m.weight.device))
        if hasattr(m, "shards") and tuple(m.weight.shape) != t.shape:
            s = m.shards()["weight"]
            t = shard(t, s.dim, s.start, s.size)
        del m._parameters["weight"]
        for field in FIELDS:  # frozen parameters, so ZeRO-3 shards them too
            setattr(t, field, nn.Parameter(getattr(t, field), requires_grad=False))
            setattr(m, f"nf4_{field}", getattr(t, field))
        m.nf4, m.compute_dtype = t, compute_dtype
        m.__class__ = type(f"NF4{type(m).__name__}", (_Quantized, type(m)), {})
        done.append(f"{n}.weight")
    return done


# --- refinement: a meta model, filled shard by shard
# A trainer keeps the base on the meta device. ZeRO-3 then reads each rank's shard (zero3.py).
# The NF4 parameters' values come from this reader. It quantizes the whole weight, then cuts.
# So the codes a rank holds are the slice of the whole weight's: layout-free.
Reader = Callable[[str, int, int], torch.Tensor]  # (name, start, stop) → fp32 flat elements


def reader(model: nn.Module, base: Reader, full_weight: Callable[[str], torch.Tensor]) -> Reader:
    """base's reader (name, start, stop) → fp32 elements, plus the NF4 parameters (`*.nf4_codes`, ...).
    Their values: the whole weight full_weight(name) quantized, cut as the layer's NF4 (apply_qlora's).
    One weight's NF4 is kept between calls, so its fields read it once in a row. The next drops it."""
    last: dict[str, NF4] = {}

    def read(name: str, start: int, stop: int) -> torch.Tensor:
        layer, dot, field = name.rpartition(".nf4_")
        if not dot:
            return base(name, start, stop)
        if layer not in last:
            last.clear()  # one weight at a time
            like, t = model.get_submodule(layer).nf4, quantize_nf4(full_weight(f"{layer}.weight"))
            last[layer] = t if like.local == t.shape else shard(t, like.dim, like.start, like.local[like.dim])
        return getattr(last[layer], field).reshape(-1)[start:stop].float()  # uint8 codes: exact in fp32
    return read
