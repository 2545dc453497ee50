"""Tensor parallelism (Megatron-style): every projection split across the ranks of a tp group.

What it does
    `apply_tp(model, tp_group, parts=None)` rewrites a model in place so that each of the tp ranks
    holds 1/tp of every matrix and the ranks together compute exactly the single-process model.
    The layer plan is data, {module path inside each layer: style} (`LLAMA_PLAN`, `Parts.plan`):
      "colwise"  ColumnParallelLinear  weight rows (output features) split; output stays split
      Fused(..)  ColumnParallelLinear  a fused q/k/v (GPT's c_attn): each part split alone, by heads
      "rowwise"  RowParallelLinear     weight columns (input features) split; partial sums are
                                       all-reduced, then the (replicated) bias is added once
    and outside the layers: the embedding VocabParallelEmbedding (vocab rows split; ids outside the
    slice give 0, all-reduce), the head vocab-split too. Three kinds of model:
      attotron's Llama        on the meta device; logits stay vocab-sharded, the loss is loss.py's
                              vocab-parallel cross-entropy (the model's loss_fn seam)
      transformers' decoders  Llama, Qwen2 (its q/k/v biases split with their rows), Mistral, ...: the
                              plan from their own `config.base_model_tp_plan`; meta or materialized
      any other model         `Parts(embed=, layers=, head=, plan=, heads=)`: dotted paths and the plan
    Those two gather the head's logits (VocabParallelHead), so the model's own loss runs unchanged.
    Qwen3's per-head q/k norms (attotron's Llama) become ReplicatedRMSNorm: the weight replicated, its
    gradient all-reduced over tp (each rank's heads give part of it).
    Each block (attention, MLP) pairs column layers with one row layer; a reader sees every collective
    in the autograd Functions below, each with its backward:
      copy_to_region      forward identity           backward all-reduce    (input of column layers)
      reduce_from_region  forward all-reduce         backward identity      (output of row layers)
      gather_from_region  forward all-gather last dim backward split        (logits for users)
      scatter_to_region   forward split last dim     backward all-gather    (a row layer fed a full
                                                                             input; sequence parallel)
    Collectives per step at tp > 1 (tests/test_tp.py counts them on gloo), per decoder layer:
      forward   2 all-reduces: the outputs of o_proj and down_proj (reduce_from_region)
      backward  2 all-reduces: one per column GROUP — a pre-hook on self_attn / mlp enters the block's
                input into the region once (`_enter_region`), so autograd first sums the partial input
                gradients of q, k, v (gate, up) and the sum is all-reduced once, as Megatron's fused
                qkv / fc1 weights would; a copy per column layer would make it 5 (as on other models:
                there each column layer copies its own input, correct whatever calls it)
      + selective AC: nothing more (row outputs come from a functional collective the policy keeps);
        full AC: 1 more, o_proj's in the recompute (the recompute stops before down_proj's)
    and per step outside the layers: forward 1 (embedding) + 3 per-token scalars of the loss (row
    max, target logit, sum of exps: loss.VocabParallelLinearCrossEntropy); backward 1 (the head's
    input).
    Attention needs no change where head counts come from shapes: model.py derives them from the
    weights, transformers views q/k/v as (-1, head_dim) and its GQA ratio is the same on every rank
    (tp divides both head counts, so GQA groups never straddle ranks). A model that stores a head
    count (GPT's `n_head`) names it in `Parts.heads`: apply_tp divides it by tp.

Sequence parallelism (`apply_tp(model, tp_group, sequence_parallel=True)`)
    Between the blocks (residual stream, adds, RMSNorms) each rank keeps only its S/tp tokens,
    (B, S/tp, H), instead of all S on every rank. The embedding and o/down reduce-scatter along the
    sequence instead of all-reducing; each RMSNorm (SequenceParallelRMSNorm) all-gathers its output
    once for the column layers reading it (q/k/v, gate/up, lm_head), which then skip copy_to_region:
      gather_from_sequence_region        forward all-gather dim 1   backward reduce-scatter
      reduce_scatter_to_sequence_region  forward reduce-scatter     backward all-gather
    A ring all-reduce is a reduce-scatter plus an all-gather, so the bytes moved are plain TP's. The
    replicated norm weights and row biases now meet S/tp tokens: they enter through copy_to_region,
    so autograd all-reduces their gradients (small, one per parameter and backward) before any dp/ZeRO
    hook reads them. Attention runs on the gathered sequence; without position_ids the model numbers
    only the S/tp tokens it holds, so a pre-hook on self_attn gives it cos/sin of 0..S-1. Saved
    activations lose the norms' inputs and statistics; the gathered column inputs stay full length
    (Megatron saves the shard and gathers again in backward). S must be a multiple of tp.

Reference
    Shoeybi et al. 2019, "Megatron-LM" (column/row pairs, vocab-parallel embedding and cross-entropy);
    Narayanan et al. 2021 (tp inside a node, composed with dp and pp); Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", §4.2.2 (sequence parallelism).

Run
    torchrun --nproc_per_node 2 train.py --model tiny --tp 2 --steps 20
    torchrun --nproc_per_node 4 train.py --model tiny --tp 2 --pp 2 --sp --steps 20

Invariants
    - Degree 1 is the plain model: `apply_tp` on a group of one rank changes nothing and returns {}
      (bit-identical by construction), and each comm op returns its input object itself.
    - Parameter names stay HF's (`model.layers.0.self_attn.q_proj.weight`); `apply_tp` returns the
      shard map {name: Shard} of every sharded parameter, which `weights.materialize(shards=...)` uses to
      read only this rank's slice from safetensors or to slice the seeded full init — so every tp
      starts from the same weights. Parameters absent from the map are replicated, and their
      gradients are identical on all tp ranks (count them once, e.g. on tp rank 0, in a grad norm),
      with or without sequence parallelism.
    - The vocab is padded to a multiple of tp. Padded rows are zero, their logits are -inf in the
      loss (no probability mass, so they get zero gradient and stay zero under AdamW), and neither
      `logits_fn` nor `gather_full` ever shows them: users see the true vocab size.
    - attotron's Llama: no rank ever holds a [tokens, vocab] tensor in training, not even its slice: the loss
      (vocab_parallel_linear_cross_entropy) runs lm_head block by block over this rank's vocab
      rows, (T, chunk) fp32 logits at a time, and all-reduces only per-token scalars (max, sum of
      exps, target logit); backward recomputes each block and needs no communication.
    - What cannot be split raises before the model changes (tests/test_foreign_tp_pp.py): a fused
      q/k/v given as "colwise", a Fused one without Parts.heads, a plan path naming no module, head
      counts tp does not divide, sequence parallelism on a model other than attotron's Llama.
    - Composition order: build (meta) → pp split → apply_tp → materialize → ac → precision/dp/zero.
      A pipeline stage may lack embed_tokens / norm / lm_head and hold only some layers.

Builds on: loss.py (the vocab-parallel loss without (T, V) logits), ops.py (rms_norm)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from functools import partial
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loss import VocabParallelLinearCrossEntropy, reduce_loss
from ops import rms_norm

Group = dist.ProcessGroup | None


def _size_rank(group: Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)  # tp * n along dim, in rank order


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    tp, rank = _size_rank(group)
    if x.shape[-1] % tp:
        raise ValueError(f"cannot split a last dim of {x.shape[-1]} into tp={tp} equal parts")
    return x.chunk(tp, dim=-1)[rank].contiguous()  # (..., n / tp)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The sum over the group in a NEW tensor: a Function must not change its input (or a gradient
    autograd hands it) in place. The functional, out-of-place collective is also one selective AC
    keeps (ac.SAVE_OPS): a recompute reuses its output instead of all-reducing again."""
    name = (group or dist.group.WORLD).group_name
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name))


def _reduce_scatter_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(B, S, H) partial sums on every rank → (B, S/tp, H): this rank's tokens of the sum."""
    tp = dist.get_world_size(group)
    B, S, H = x.shape
    if S % tp:
        raise ValueError(f"sequence parallelism: a sequence of {S} tokens does not split into tp={tp} "
                         f"equal shards (the sequence length must be a multiple of tp)")
    flat = x.reshape(B, tp, S // tp, H).transpose(0, 1).contiguous()  # (tp, B, S/tp, H): rank r's at r
    out = x.new_empty(B, S // tp, H)
    dist.reduce_scatter_single(out.view(-1), flat.view(-1), group=group)  # gloo wants flat buffers
    return out


# ------------------------------------------------------------------------------------- comm ops
class CopyToRegion(torch.autograd.Function):
    """Identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim in forward, split (keep this rank's part) in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_last(grad, ctx.group), None


class ScatterToRegion(torch.autograd.Function):
    """Split along the last dim in forward, all-gather of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group, -1), None


class GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence (dim 1) in forward, reduce-scatter along it in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, 1)  # (B, S/tp, H) → (B, S, H)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(grad, ctx.group), None  # partial dL/dx (column layers) summed


class ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence (dim 1) in forward, all-gather along it in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)  # (B, S, H) partial sums → (B, S/tp, H)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group, 1), None


# On one rank every op is the identity: return the input object itself (no copy, no autograd node).
def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ScatterToRegion.apply(x, group)


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ReduceScatterToSequenceRegion.apply(x, group)


# ------------------------------------------------------------------------------------- layers
@dataclass(frozen=True)
class Shard:
    """This rank holds rows [start, start+size) of the global tensor along `dim`. Rows at or past the
    global size are padding (a vocab padded to a multiple of tp): zero, never read or written.
    parts: a fused weight's stacked blocks (q, k, v), global row counts; this rank then holds 1/tp
    of each block, stacked, and start/size count in that rank-major order."""
    dim: int
    start: int
    size: int
    parts: tuple[int, ...] = ()


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to a multiple of tp, so every rank holds an equal slice."""
    return -(-vocab_size // tp) * tp


def _slice(group: Group, size: int, what: str) -> tuple[int, int]:
    """(start, n) of this rank's equal slice of `size` rows."""
    tp, rank = _size_rank(group)
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tp={tp}")
    return rank * (size // tp), size // tp


def local_slice(full: torch.Tensor, shard: Shard, group: Group) -> torch.Tensor:
    """This rank's slice of a full tensor, padding rows zero (apply_tp on a materialized model)."""
    tp, rank = _size_rank(group)
    d = shard.dim
    if shard.parts:  # each block's rank-th 1/tp, stacked: (sum(parts) / tp, ...)
        return torch.cat([b.chunk(tp, d)[rank] for b in full.split(list(shard.parts), d)], d)
    have = max(0, min(shard.size, full.shape[d] - shard.start))  # real rows; the rest is padding
    x = full.narrow(d, min(shard.start, full.shape[d]), have)
    pad = list(x.shape)
    pad[d] = shard.size - have
    return torch.cat([x, x.new_zeros(pad)], d) if pad[d] else x


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r, where this rank holds output features [start, start+n) of W and b.
    The input is the full (replicated) x; the output stays split along its last dim. copy_input:
    enter the tp region here (copy_to_region: backward all-reduces dL/dx). apply_tp turns it off for
    the column layers of a block, whose shared input enters the region once for all of them (see
    `_enter_region`), or is gathered by a SequenceParallelRMSNorm, whose backward sums dL/dx.
    parts: a fused weight (q, k, v stacked): this rank holds 1/tp of each part (whole heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 copy_input: bool = True, parts: tuple[int, ...] = ()):
        super().__init__()
        self.group, self.copy_input, self.parts = group, copy_input, tuple(parts)
        if self.parts and sum(self.parts) != out_features:
            raise ValueError(f"fused parts {self.parts} sum to {sum(self.parts)}, not out_features={out_features}")
        for p in self.parts:
            _slice(group, p, "a fused part's rows")
        self.start, self.n = _slice(group, out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(self.n, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.n, device=device, dtype=dtype)) if bias else None

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n, self.parts), "bias": Shard(0, self.start, self.n, self.parts)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # backward: every rank's dL/dx is a partial sum over its output features → all-reduce
        x = copy_to_region(x, self.group) if self.copy_input else x
        return F.linear(x, self.weight, self.bias)  # (..., n)


class VocabParallelHead(ColumnParallelLinear):
    """A column-parallel lm_head whose logits are all-gathered to the true vocab, (..., V): any loss
    the model computes itself (transformers', a GPT's) then sees the full logits. Padding rows cut."""

    def __init__(self, in_features: int, vocab_size: int, bias: bool, group: Group, **kw: Any):
        super().__init__(in_features, padded_vocab(vocab_size, dist.get_world_size(group)), bias, group, **kw)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_region(super().forward(x), self.group)[..., :self.vocab_size]  # (..., V)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b, where this rank holds input features [start, start+n) of W and gets
    x_r (the split output of a column layer). The bias is replicated and added once, after the sum.
    sequence_parallel: the sum is reduce-scattered along the sequence, and the bias, now meeting only
    this rank's tokens, enters through copy_to_region (its gradient is all-reduced)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.start, self.n = _slice(group, in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.n, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(1, self.start, self.n)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(F.linear(x, self.weight), self.group)  # (B, S/tp, out)
            return y if self.bias is None else y + copy_to_region(self.bias, self.group)
        y = reduce_from_region(F.linear(x, self.weight), self.group)  # (..., out) full sum on every rank
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank holds rows [start, start+n) of the (padded) table. An id outside the slice looks up
    row 0 and is then zeroed, so after the all-reduce each token has exactly its one real row.
    padding_idx (nn.Embedding's): that row gets no gradient, on the rank that holds it.
    sequence_parallel: a reduce-scatter instead, so each rank keeps its S/tp tokens: (B, S/tp, H)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 sequence_parallel: bool = False, padding_idx: int | None = None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings = num_embeddings  # the true vocab size; rows past it are zero padding
        vocab = padded_vocab(num_embeddings, dist.get_world_size(group))
        self.start, self.n = _slice(group, vocab, "padded vocab")
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(self.n, embedding_dim, device=device, dtype=dtype))

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # (B, S) row in this rank's slice, if it is here
        outside = (local < 0) | (local >= self.n)
        pad = None if self.padding_idx is None else self.padding_idx - self.start
        pad = pad if pad is not None and 0 <= pad < self.n else None
        h = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)  # (B, S, H)
        h = h.masked_fill(outside[..., None], 0.0)  # zero rows also block gradient to row 0
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(h, self.group)  # (B, S/tp, H)
        return reduce_from_region(h, self.group)


class ReplicatedRMSNorm(nn.Module):
    """An RMSNorm (ops.rms_norm, as model.RMSNorm) whose replicated weight meets only this rank's
    part of the input — Qwen3's per-head q/k norms see this rank's heads; under sequence parallelism
    a norm sees its S/tp tokens: the weight enters through copy_to_region, so backward all-reduces
    its gradient over tp."""

    def __init__(self, norm: nn.Module, group: Group):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(norm.weight.shape[0], device="meta"))  # materialize fills it
        self.eps, self.group = norm.eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_region(self.weight, self.group), self.eps)  # as model.RMSNorm


class SequenceParallelRMSNorm(ReplicatedRMSNorm):
    """The RMSNorm of this rank's S/tp tokens, then all-gathered to the full sequence for the
    column-parallel layers after it: (B, S/tp, H) → (B, S, H)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence_region(super().forward(x), self.group)  # (B, S/tp, H) → (B, S, H)


def _enter_region(block: nn.Module, args: tuple, *, group: Group) -> tuple:
    """self_attn / mlp pre-hook (no sequence parallelism): the block's input enters the tp region
    once, so the partial input gradients of all its column layers (q, k, v or gate, up) are summed
    by autograd first and all-reduced ONCE in backward — not once per column layer (5 per layer)."""
    return (copy_to_region(args[0], group), *args[1:])


def _full_sequence_rope(attn: nn.Module, args: tuple, *, rotary: nn.Module) -> tuple | None:
    """self_attn pre-hook (sequence parallel): without position_ids the model numbers only the S/tp
    tokens it holds, 0..S/tp-1; attention needs cos/sin of the gathered sequence, 0..S-1 (given
    position_ids cover it already). Recomputed per layer: 2·S·head_dim values, shared over the batch."""
    x, cos, sin, mask = args  # x: (B, S, H) gathered; cos, sin: (B, S or S/tp, hd)
    if cos.shape[1] == x.shape[1]:
        return None
    cos, sin = rotary(torch.arange(x.shape[1], device=x.device)[None], cos.dtype)  # (1, S, hd) each
    return x, cos, sin, mask


# ------------------------------------------------------------------------------------- loss, logits
def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                        reduction: str = "mean", *, group: Group, vocab_size: int,
                                        sequence_parallel: bool = False,
                                        chunk: int | None = None) -> torch.Tensor:
    """`loss.linear_cross_entropy` for a vocab-parallel lm_head (the model's loss seam under tp):
    hidden (..., H) replicated over tp, weight this rank's (n, H) rows. The backward's partial dL/dh
    is summed over tp by copy_to_region — or, under sequence parallelism, by the reduce-scatter of
    the final norm's gather that produced `hidden`."""
    H = hidden.shape[-1]
    x = hidden if sequence_parallel else copy_to_region(hidden, group)
    loss = VocabParallelLinearCrossEntropy.apply(x.reshape(-1, H), weight, labels.reshape(-1), group,
                                                 vocab_size, chunk or H)
    return reduce_loss(loss, labels, reduction)


def gather_logits(logits: torch.Tensor, *, group: Group, vocab_size: int) -> torch.Tensor:
    """Vocab-sharded logits (B, S, n) → full logits (B, S, vocab_size) on every rank, padding cut."""
    return gather_from_region(logits, group)[..., :vocab_size]


# ------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Fused:
    """Style of a column weight that stacks several projections (GPT's c_attn: [q; k; v], (3·H, H)):
    their row counts. Each part is split alone, so every rank holds whole heads of each."""
    parts: tuple[int, ...]


Style = Union[str, Fused]  # "colwise" (output features split), "rowwise" (input features split), Fused

# The layer plan as data: {module path inside each layer (fnmatch pattern): style}. transformers'
# decoders name their layers this way too; their own `config.base_model_tp_plan` says the same.
LLAMA_PLAN: dict[str, Style] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
# the names of fused q/k/v (or gate/up) weights in common models: "colwise" on one of them raises
FUSED_NAMES = ("c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "w_pack", "in_proj", "gate_up_proj")


@dataclass
class Parts:
    """Where a model keeps its parts (dotted attribute paths) and how TP splits its layers. The
    embedding becomes vocab-parallel, the head vocab-parallel with gathered logits; the norm (and
    anything not named, such as a learned position table) stays replicated. heads: integer
    attributes inside each layer that count heads (GPT's `attn.n_head`), divided by tp."""
    embed: str | None = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str | None = "model.norm"
    head: str | None = "lm_head"
    plan: dict[str, Style] = field(default_factory=lambda: dict(LLAMA_PLAN))
    heads: tuple[str, ...] = ()


def _get(root: nn.Module, path: str | None, missing: Any = AttributeError) -> Any:
    """The attribute at a dotted path; None where the path (or a part of it) is None. A path that
    does not exist raises, unless `missing` is given (then returned)."""
    obj = root
    for name in (path.split(".") if path else [None]):
        if obj is not None and name is not None and not hasattr(obj, name):
            if missing is AttributeError:
                raise AttributeError(f"{type(root).__name__} has no {path!r} ({name!r} missing)")
            return missing
        obj = None if obj is None or name is None else getattr(obj, name)
    return obj


def _set(root: nn.Module, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, value)


def _is_attotron(model: nn.Module) -> bool:
    """attotron's Llama (model.py): layers in a ModuleDict by global index, the loss_fn seam."""
    return isinstance(_get(model, "model.layers", None), nn.ModuleDict) and hasattr(model, "loss_fn")


def default_parts(model: nn.Module) -> Parts:
    """Parts of attotron's Llama, or of a transformers decoder (model.model.layers a ModuleList) from
    its own `config.base_model_tp_plan`; any other model raises: pass Parts."""
    if _is_attotron(model):
        return Parts()
    plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not isinstance(_get(model, "model.layers", None), nn.ModuleList) or not plan:
        raise ValueError(f"apply_tp: {type(model).__name__} is neither attotron's Llama nor a transformers "
                         f"decoder with a tp plan; pass parts=tp.Parts(embed=..., layers=..., head=..., "
                         f"plan={{path inside a layer: 'colwise' | 'rowwise' | tp.Fused(...)}})")
    ours = {}
    for pattern, style in plan.items():
        if not pattern.startswith("layers.*.") or style not in ("colwise", "rowwise"):
            raise ValueError(f"apply_tp: transformers' tp plan entry {pattern!r}: {style!r} is not supported "
                             f"here (only 'layers.*.<path>': 'colwise' | 'rowwise'); pass parts=tp.Parts(plan=...)")
        ours[pattern.removeprefix("layers.*.")] = style
    return Parts(plan=ours)


def _matches(layer: nn.Module, plan: dict[str, Style]) -> list[tuple[str, Style]]:
    """(module name inside the layer, style) for every module a plan pattern names."""
    found = [(name, style) for name, _ in layer.named_modules() for pattern, style in plan.items()
             if name and fnmatch(name, pattern)]
    missing = [p for p in plan if not any(fnmatch(n, p) for n, _ in found)]
    if missing:
        raise ValueError(f"apply_tp: the plan's {missing} name no module of the layer "
                         f"({[n for n, _ in layer.named_modules() if n]})")
    return found


def _checked_style(name: str, style: Style, module: nn.Module, parts: Parts) -> Style:
    if not isinstance(module, nn.Linear):
        raise ValueError(f"apply_tp: {name} is a {type(module).__name__}, not an nn.Linear; the plan splits linears only")
    if isinstance(style, Fused):
        if not parts.heads:
            raise ValueError(f"apply_tp: the fused {name} splits by heads: name the attention's head-count "
                             f"attribute(s) in Parts.heads (e.g. 'attn.n_head'), which become per-rank counts")
        return style
    if style not in ("colwise", "rowwise"):
        raise ValueError(f"apply_tp: style {style!r} of {name}: use 'colwise', 'rowwise' or tp.Fused(parts)")
    if style == "colwise" and name.rsplit(".", 1)[-1].lower() in FUSED_NAMES:
        raise ValueError(f"apply_tp: {name} looks like a fused q/k/v (or gate/up) weight; as a plain 'colwise' "
                         f"layer its rows would split across q, k and v. Pass tp.Fused((q_rows, k_rows, v_rows)) "
                         f"(or tp.Fused(({module.out_features},)) if it really is one projection)")
    return style


def _check_heads(model: nn.Module, tp: int) -> None:
    """A transformers config: tp must divide its head counts (q/k/v split by whole heads)."""
    cfg = getattr(model, "config", None)
    bad = [f"{k}={getattr(cfg, k)}" for k in ("num_attention_heads", "num_key_value_heads")
           if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) % tp]
    if bad:
        raise ValueError(f"tp={tp} must divide {', '.join(bad)} (each rank holds whole heads)")


def _swap(model: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put `new` (built on meta) at `path`; where the old module holds real weights, `new` moves to
    their device and is filled with this rank's slice of them (replicated ones copied whole)."""
    old = _get(model, path)
    if old.weight.device.type != "meta":
        new = new.to_empty(device=old.weight.device)
        shards = new.shards()
        with torch.no_grad():
            for name, p in new.named_parameters(recurse=False):
                full = getattr(old, name)
                p.copy_(local_slice(full, shards[name], new.group) if name in shards else full)
                p.requires_grad_(full.requires_grad)
    _set(model, path, new)
    return new


def _planned(model: nn.Module, parts: Parts, tp: int, meta: bool) -> tuple[list, bool]:
    """Every check of apply_tp before its first change (a call that raises leaves the model as it
    was): [(layer, "layers.i.", name inside it, style)] of the plan, and whether the head is tied."""
    layers = _get(model, parts.layers)
    todo = [(layer, f"{parts.layers}.{i}.", name, _checked_style(f"{parts.layers}.{i}.{name}", style,
                                                                layer.get_submodule(name), parts))
            for i, layer in layers.named_children()  # i: the global index (a pipeline stage keeps it)
            for name, style in _matches(layer, parts.plan)]
    for i, layer in layers.named_children():
        for attr in parts.heads:
            if _get(layer, attr) % tp:
                raise ValueError(f"tp={tp} must divide {parts.layers}.{i}.{attr}={_get(layer, attr)} "
                                 f"(each rank holds whole heads)")
    if meta and any(isinstance(s, Fused) for *_, s in todo):
        raise ValueError("apply_tp: a fused weight's slice is not one Shard that materialize could read; "
                         "apply tp to the materialized model")
    embed, head = _get(model, parts.embed), _get(model, parts.head)
    if embed is not None and (not isinstance(embed, nn.Embedding) or embed.max_norm is not None
                              or embed.scale_grad_by_freq):
        raise ValueError(f"apply_tp: {parts.embed} must be a plain nn.Embedding, got {embed}")
    tied = embed is not None and head is not None and head.weight is embed.weight
    if tied and head.bias is not None:
        raise ValueError(f"apply_tp: a head tied to the embedding with a bias ({parts.head}) is not supported")
    return todo, tied


# ------------------------------------------------------------------------------------- the model
def tp_validate(cfg: Any, tp: int, seq_len: int | None = None) -> None:
    """Raise ValueError naming the numbers if this config (model.LlamaConfig) cannot be split over tp
    ranks (the vocab needs no check: it is padded). seq_len: check it too, for sequence parallelism."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallelism: tp={tp} must divide the sequence length {seq_len} "
                         f"(each rank holds seq_len/tp tokens between the blocks)")
    bad = [f"{k}={v}" for k, v in (("num_attention_heads", cfg.num_attention_heads),
                                   ("num_key_value_heads", cfg.num_key_value_heads),
                                   ("intermediate_size", cfg.intermediate_size)) if v % tp]
    if bad:
        raise ValueError(f"tp={tp} must divide {', '.join(bad)} (each rank holds whole attention "
                         f"heads, whole kv heads and an equal share of the MLP)")


def apply_tp(model: nn.Module, tp_group: Group, sequence_parallel: bool = False,
             parts: Parts | None = None) -> dict[str, Shard]:
    """Replace the model's layers by their tensor-parallel versions, in place, and return
    {parameter name: Shard} for every sharded parameter. attotron's Llama: on the meta device (pass
    the map to `weights.materialize`), its head vocab-sharded behind the loss_fn seam. Any other
    model (transformers' decoders, or one described by `parts`): meta or materialized (then each
    rank keeps its slice of the weights), its head gathering full logits for the model's own loss.
    sequence_parallel: Megatron's sequence parallelism on top, attotron's Llama only."""
    tp, _ = _size_rank(tp_group)
    if tp == 1:
        return {}  # the plain model is the tp=1 model
    ours = parts is None and _is_attotron(model)
    parts = parts or default_parts(model)
    if sequence_parallel and not ours:
        raise ValueError("apply_tp: sequence parallelism needs attotron's Llama (its RMSNorms and RoPE); "
                         "use sequence_parallel=False for this model")
    devices = {p.device.type == "meta" for p in model.parameters()}
    if ours:
        tp_validate(model.config, tp)
        if devices != {True}:
            raise ValueError("apply_tp must run on the meta-device model, before weights.materialize")
    else:
        _check_heads(model, tp)
        if len(devices) > 1:
            raise ValueError("apply_tp: the model is partly on the meta device; materialize it all, or none")
    todo, tied = _planned(model, parts, tp, meta=devices == {True})
    layers, embed, head = _get(model, parts.layers), _get(model, parts.embed), _get(model, parts.head)
    new = dict(group=tp_group, device="meta")
    for layer, prefix, name, style in todo:
        old = layer.get_submodule(name)
        kw = dict(new, dtype=old.weight.dtype)
        if style == "rowwise":
            layer_new = RowParallelLinear(old.in_features, old.out_features, old.bias is not None,
                                          sequence_parallel=sequence_parallel, **kw)
        else:  # ours: the block's input enters the region once (_enter_region), not per layer
            layer_new = ColumnParallelLinear(old.in_features, old.out_features, old.bias is not None,
                                             copy_input=not ours,
                                             parts=style.parts if isinstance(style, Fused) else (), **kw)
        _swap(model, prefix + name, layer_new)
    for _, layer in layers.named_children():
        for attr in parts.heads:
            _set(layer, attr, _get(layer, attr) // tp)
        if ours:
            a, m = layer.self_attn, layer.mlp
            for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms: replicated, grads summed over tp
                if getattr(a, name, None) is not None:
                    setattr(a, name, ReplicatedRMSNorm(getattr(a, name), tp_group))
            if sequence_parallel:  # the norms before a and m gather their output (SequenceParallelRMSNorm)
                a.register_forward_pre_hook(partial(_full_sequence_rope, rotary=model.model.rotary_emb))
            else:
                a.register_forward_pre_hook(partial(_enter_region, group=tp_group))
                m.register_forward_pre_hook(partial(_enter_region, group=tp_group))
    if embed is not None:
        embed = _swap(model, parts.embed, VocabParallelEmbedding(
            embed.num_embeddings, embed.embedding_dim, sequence_parallel=sequence_parallel,
            padding_idx=embed.padding_idx, dtype=embed.weight.dtype, **new))
    if sequence_parallel:  # every RMSNorm: the two of each layer and the final one
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if type(child).__name__ == "RMSNorm":
                    setattr(parent, name, SequenceParallelRMSNorm(child, tp_group))
    if head is not None:
        vocab = model.config.vocab_size if ours else head.out_features
        if ours:
            head_new = ColumnParallelLinear(head.in_features, padded_vocab(vocab, tp), False, tp_group,
                                            device="meta", copy_input=not sequence_parallel)
            model.loss_fn = partial(vocab_parallel_linear_cross_entropy, group=tp_group,
                                    vocab_size=vocab, sequence_parallel=sequence_parallel)
            model.logits_fn = partial(gather_logits, group=tp_group, vocab_size=vocab)
        else:
            head_new = VocabParallelHead(head.in_features, vocab, head.bias is not None, tp_group,
                                         device="meta", dtype=head.weight.dtype)
        if tied:
            head_new.weight = embed.weight  # tied: one sharded weight (same rows: the same vocab slice)
            _set(model, parts.head, head_new)
        else:
            _swap(model, parts.head, head_new)
    # the map names each sharded parameter once, as named_parameters() does (tied head: the embedding)
    params = dict(model.named_parameters())
    return {f"{mod_name}.{p}": shard for mod_name, mod in model.named_modules()
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
            for p, shard in mod.shards().items() if f"{mod_name}.{p}" in params}


# ------------------------------------------------------------------------------------- export
@torch.no_grad()
def gather_tensor(local: torch.Tensor, shard: Shard, full_size: int, group: Group) -> torch.Tensor:
    """The full tensor from the equal, rank-ordered slices of a tp group; padding rows cut. A fused
    weight's blocks (shard.parts) are put back in their order: [q_0 q_1 ...; k_0 k_1 ...; ...]."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    if shard.parts:
        tp, d = len(pieces), shard.dim
        blocks = [p.split([n // tp for n in shard.parts], d) for p in pieces]  # per rank: its 1/tp of each
        return torch.cat([blocks[r][j] for j in range(len(shard.parts)) for r in range(tp)], d)
    return torch.cat(pieces, dim=shard.dim).narrow(shard.dim, 0, full_size).contiguous()


VOCAB_SHARDED = ("model.embed_tokens.weight", "lm_head.weight")  # attotron's: rows padded to tp


@torch.no_grad()
def gather_full(tensors: dict[str, torch.Tensor], shards: dict[str, Shard], tp_group: Group,
                cfg: Any) -> dict[str, torch.Tensor]:
    """{hf_name: local tensor} (params, grads, optimizer moments…) → {hf_name: full tensor} on every
    tp rank, in HF layout with the true vocab size (cfg.vocab_size); replicated entries are returned
    as they are. All tp ranks must call it with the same names in the same order. Feed the result
    to save_hf."""
    tp = dist.get_world_size(tp_group)
    out = {}
    for name, t in tensors.items():
        shard = shards.get(name)
        if shard is None:
            out[name] = t.detach()
            continue
        full = cfg.vocab_size if name in VOCAB_SHARDED else t.shape[shard.dim] * tp
        out[name] = gather_tensor(t, shard, full, tp_group)
    return out
