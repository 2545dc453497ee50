"""Causal attention over packed documents without an S×S mask.

What it does
    A packed row holds several documents back to back (sft.py's FFD rows). A token may attend only
    to earlier tokens of its own document. `Documents.from_position_ids` finds the boundaries once
    per batch, on the host where the rows are built. A document starts at every row start and
    wherever the position does not continue. Documents keeps them as host lengths plus
    `cu_seqlens`: flash attention's cumulative boundaries over the flattened B·S tokens.
    `attend` is the model's attention (model.Attention.attn_fn, a seam cp.py's ring swaps):
      docs None                    plain causal SDPA. fp32 GQA on CUDA expands k/v (`expand_kv`).
      Documents, CUDA, bf16/fp16   torch.nn.attention.varlen.varlen_attn: flash, GQA, no mask
      Documents, otherwise (CPU)   documents grouped by length, one causal SDPA per group (below)
      (B, 1, S, S) bool tensor     `attention_mask`, the dense reference (tests only: S² memory).
                                   GQA under a mask on CUDA folds heads into rows (`fold_gqa`).
    A sliding window (`attend(..., window=W)`: query i sees keys i - W < j <= i) applies on every
    path. On CUDA it is flash's window_size (W - 1, 0), and plain rows become one document each. On
    CPU it is a W-band mask per length group longer than W, or over the row.

Run
    torchrun --nproc_per_node 1 train.py --sft      (FFD-packed chats: feed.get_batch builds Documents)

Reference
    Dao 2023 (FlashAttention-2, variable-length batches via cu_seqlens); Krell et al. 2021 ("Efficient
    sequence packing without cross-contamination"); transformers' packed-sequence masks
    (masking_utils.find_packed_sequence_indices: the same boundary rule).

Why varlen_attn and not FlexAttention
    varlen_attn takes exactly what packing produces (cu_seqlens, max length). It runs the flash
    kernel with GQA and needs no compilation. FlexAttention needs torch.compile to be fast and a
    BlockMask per batch (O(S²/128²) blocks). It has no CPU backward in torch 2.13.
    varlen_attn runs only on CUDA with bf16/fp16, and no GPU runs in CI. tests/test_cuda_paths.py
    runs that branch on the meta device, under a contract of the kernel's argument rules.
    bench/bench_gpu.py checks its numbers on one GPU. The boundaries and the seam are shared with
    the tested CPU path.

The CPU path: length groups
    Each document's length L is rounded up to a bucket Lb (`bucket`). The documents of one bucket
    are gathered into a dense (n, Lb) batch, run through causal SDPA, and scattered back. It is
    exact: a document's slots L..Lb-1 come after all of its real tokens. So causality hides them
    from every real query. Their own outputs are dropped, so their gradients are exact zeros.
    Cost grows with Σ Lb² over documents, not with S² per row, and its kernel calls with the
    buckets. Backward keeps O(S): the gathered q, k, v, the output, the log-sum-exp, the indices.

Invariants
    - A document never crosses a row: boundaries always include every row start.
    - Loss and gradients equal the dense block-diagonal mask's (1e-6 in fp32, the kernels'
      summation order) and transformers' on packed position_ids (tests/test_model.py).
    - Nothing S²-sized is built or saved on the Documents paths (ac.SavedActivationMeter).
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

GRANULE = 16  # smallest bucket step of the CPU path, in tokens (see `bucket`)


def attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The dense reference: a block-diagonal causal mask (B, 1, S, S), with the boundary rule of
    `Documents.from_position_ids`. S² memory; training passes Documents instead."""
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = start.cumsum(-1)  # (B, S) document index of every token
    S = position_ids.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]  # (B, 1, S, S)


def bucket(n: int) -> int:
    """The slot of a document of n tokens on the CPU path: bucket(n) >= n tokens. n is rounded up to
    a multiple of max(GRANULE, 2^(floor(log2 n) - 3)). So there are at most 8 buckets per octave of
    length, and at most 1/8 (or GRANULE tokens) of padding. That trades kernel calls against padded
    work. Measured on the default SFT set at seq 1024, one layer's attention forward + backward
    (tiny model, one thread, CPU time): steps of 8 or 16 8.3-9.2 ms, 32 9.5-10.5, 64 12.0-12.7.
    Exact lengths take 9.2-9.5 ms; the same conversations padded to the batch's longest, 14 ms."""
    step = max(GRANULE, 1 << max(n.bit_length() - 4, 0))
    return -(-n // step) * step


class Documents:
    """Document boundaries of a packed (B, S) batch, shared by every layer, the backward and any
    recompute.
        lengths     host tuple: each document's length, row by row, in token order (sum B·S)
        cu_seqlens  (D+1,) int32 on `device`: 0, l0, l0+l1, ..., B·S (flash's convention)
        max_len     the longest document (flash's max_seqlen)
    """

    def __init__(self, lengths: Sequence[int], shape: tuple[int, int],
                 device: torch.device | str | None = None):
        self.lengths, self.shape = tuple(int(n) for n in lengths), tuple(shape)
        B, S = self.shape
        ends, total = set(), 0
        for n in self.lengths:
            total += n
            ends.add(total)
        if min(self.lengths, default=0) < 1 or total != B * S or not {S * r for r in range(1, B + 1)} <= ends:
            raise ValueError(f"document lengths {self.lengths[:8]}... must be positive, sum to B·S = "
                             f"{B}·{S} and end at every row end (a document never crosses a row)")
        self.max_len = max(self.lengths)
        cu = torch.tensor((0, *self.lengths), dtype=torch.int64).cumsum(0)  # (D+1,)
        self.cu_seqlens = cu.to(device=device, dtype=torch.int32)
        self._plans: dict[torch.device, tuple] = {}  # device → CPU-path gather/scatter plan

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor,
                          device: torch.device | str | None = None) -> "Documents":
        """A document starts at every row start and wherever the position does not continue (packed
        rows restart at 0). It reads position_ids on the host. So call it where the rows are built:
        a CUDA tensor here costs a device→host copy."""
        pos = position_ids.detach().cpu()  # (B, S)
        start = torch.ones_like(pos, dtype=torch.bool)
        start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        first = start.flatten().nonzero().squeeze(1)  # (D,) flat index of every document's start
        lengths = torch.diff(first, append=torch.tensor([pos.numel()]))
        return cls(lengths.tolist(), tuple(pos.shape), position_ids.device if device is None else device)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Documents":
        """The same boundaries with cu_seqlens on `device`. non_blocking copies from pinned memory,
        as the batch's tensors are copied: the host does not wait."""
        if self.cu_seqlens.device == torch.device(device):
            return self
        return self._with(self.cu_seqlens.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Documents":
        return self._with(self.cu_seqlens.pin_memory())

    def _with(self, cu_seqlens: torch.Tensor) -> "Documents":
        out = copy.copy(self)
        out.cu_seqlens, out._plans = cu_seqlens, {}
        return out

    def plan(self, device: torch.device) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
        """The CPU path's plan, built once per batch and device. groups: [(n documents, bucket Lb)].
        `gather` (Σ n·Lb,): the flat token index of every slot, group after group, document after
        document. `scatter` (B·S,): the slot holding each token's output."""
        if device not in self._plans:
            lens = torch.tensor(self.lengths)  # (D,)
            starts = torch.tensor((0, *self.lengths[:-1])).cumsum(0)  # (D,)
            buckets = torch.tensor([bucket(n) for n in self.lengths])  # (D,)
            groups, gathers, scatter, base = [], [], torch.empty(sum(self.lengths), dtype=torch.int64), 0
            for lb in sorted(set(buckets.tolist())):
                d = (buckets == lb).nonzero().squeeze(1)  # documents of this bucket
                j = torch.arange(lb)  # (lb,) slot within the document
                real = j < lens[d, None]  # (n, lb)
                idx = starts[d, None] + torch.minimum(j, lens[d, None] - 1)  # (n, lb) padding: last token
                slots = base + torch.arange(len(d) * lb).view(len(d), lb)  # (n, lb)
                scatter[idx[real]] = slots[real]
                groups.append((len(d), lb))
                gathers.append(idx.flatten())
                base += len(d) * lb
            self._plans[device] = (groups, torch.cat(gathers).to(device), scatter.to(device))
        return self._plans[device]


# --- the kernel decisions: one small predicate each, so that tests/cuda_contract.py can point them
# at the meta device and run the CUDA branches (with their autograd) on a CPU-only machine
def use_varlen(q: torch.Tensor) -> bool:
    """Packed documents through varlen_attn (flash: CUDA, fp16/bf16 only)."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def expand_kv(q: torch.Tensor) -> bool:
    """Causal GQA in fp32 on CUDA: expand k/v to the query heads before SDPA. Flash takes half
    precision only. torch 2.13's memory-efficient kernel does not take enable_gqa. (See
    cuda/sdp_utils.cpp, can_use_mem_efficient_attention; pytorch PR 191085 adds it later.)
    SDPA would then fall back to its math backend: an fp32 upcast, (B, nh, S, S) probabilities
    per layer. Expanded, the efficient kernel runs. It reads nh/nkv times the k/v bytes, and
    saves nothing S²-sized. Folding (`fold_gqa`) does not fit here. is_causal masks by row index,
    and folded row j·s + i is query i. Each position needs its own causal row: an S² mask."""
    return q.is_cuda and q.dtype == torch.float32


def fold_gqa(q: torch.Tensor) -> bool:
    """GQA under a mask on CUDA (the KV cache's prefill and decode, any dtype): fold the query heads
    into rows (`_sdpa_folded`). Flash takes no mask, and the efficient kernel no enable_gqa. Folded,
    the efficient kernel reads each cached k/v byte once."""
    return q.is_cuda


def _sdpa_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GQA under a boolean mask without copying k/v. q (b, s, nh, hd); k, v (b, T, nkv, hd); mask
    broadcast to (b, 1, s, T). Returns (b, s, nh, hd).
    Query head h reads kv head h // g, with g = nh/nkv (repeat_interleave's order). So the g heads
    of one kv head are one bigger batch of queries for it: g·s rows, member-major. Each row's
    softmax reads only its own scores and its own mask row. So the mask row of folded row j·s + i
    is row i: the mask repeated g times along the rows. k and v stay as they are, and SDPA sees
    no GQA: the efficient kernel runs. Bytes read: the cache's own. The copies are q's and the
    mask's, s rows each per head."""
    b, s, nh, hd = q.shape
    T, nkv = k.shape[1], k.shape[2]
    g = nh // nkv
    qf = q.view(b, s, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, g * s, hd)  # (b, nkv, g·s, hd)
    mf = mask.expand(b, 1, s, T).repeat(1, 1, g, 1)  # (b, 1, g·s, T): row j·s + i is mask row i
    y = F.scaled_dot_product_attention(qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mf)  # (b, nkv, g·s, hd)
    return y.view(b, nkv, g, s, hd).permute(0, 3, 1, 2, 4).reshape(b, s, nh, hd)  # (b, s, nh, hd)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on (b, s, heads, hd) tensors (views, no copies): causal, or under a boolean mask."""
    gqa = q.shape[2] != k.shape[2]
    if gqa and mask is not None and fold_gqa(q):
        return _sdpa_folded(q, k, v, mask)
    if gqa and mask is None and expand_kv(q):
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))  # (b, s, nh, hd)
        gqa = False
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, is_causal=mask is None,
                                       enable_gqa=gqa)  # (b, nh, s, hd)
    return y.transpose(1, 2)  # (b, s, nh, hd)


def window_mask(n: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(n, n) bool, the sliding window within one sequence. Query i sees keys i - window < j <= i:
    transformers' sliding mask, flash's window_size (window - 1, 0)."""
    i = torch.arange(n, device=device)
    gap = i[:, None] - i[None, :]  # (n, n) query index - key index
    return (gap >= 0) & (gap < window)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           docs: Documents | torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """Causal attention within documents. q (B, S, nh, hd), k and v (B, S, nkv, hd), RoPE applied;
    returns (B, S, nh, hd). docs: None (one document per row), Documents, or a dense boolean
    (B, 1, S, S) mask (the reference path). window: a sliding window, applied on every path.
    model.Attention binds its layer's. One at least as long as every document changes nothing."""
    B, S, nh, hd = q.shape
    if window is not None and window >= (docs.max_len if isinstance(docs, Documents) else S):
        window = None  # no query reaches past its window: plain causal attention, bit for bit
    if docs is None or isinstance(docs, torch.Tensor):
        if window is None:
            return _sdpa(q, k, v, docs)
        if docs is None and use_varlen(q):  # flash's window, each row one sequence: no S² mask
            cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device)  # (B+1,)
            y = varlen_attn(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, S, S,
                            window_size=(window - 1, 0), enable_gqa=nh != k.shape[2])  # (B·S, nh, hd)
            return y.view(B, S, nh, hd)
        band = window_mask(S, window, q.device)  # (S, S), broadcast over rows and heads
        return _sdpa(q, k, v, band if docs is None else docs & band)
    if use_varlen(q):
        cu = docs.cu_seqlens
        y = varlen_attn(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, docs.max_len,
                        docs.max_len, window_size=(-1, 0) if window is None else (window - 1, 0),
                        enable_gqa=nh != k.shape[2])  # (B·S, nh, hd)
        return y.view(B, S, nh, hd)
    groups, gather, scatter = docs.plan(q.device)
    qs, ks, vs = (t.flatten(0, 1).index_select(0, gather) for t in (q, k, v))  # (slots, heads, hd)
    sizes = [n * lb for n, lb in groups]

    def group_mask(lb: int) -> torch.Tensor | None:  # lb <= window: every real query sees all its keys
        return None if window is None or lb <= window else window_mask(lb, window, q.device)

    ys = [_sdpa(*(t.view(n, lb, *t.shape[1:]) for t in parts), group_mask(lb)).reshape(n * lb, nh, hd)
          for (n, lb), *parts in zip(groups, qs.split(sizes), ks.split(sizes), vs.split(sizes))]
    return torch.cat(ys).index_select(0, scatter).view(B, S, nh, hd)  # (B, S, nh, hd)
