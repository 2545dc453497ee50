"""Tensor parallelism (Megatron-style): every projection split across the ranks of a tp group.

What it does
    `apply_tp(model, tp_group)` rewrites a meta-device `Llama` in place so that each of the tp ranks
    holds 1/tp of every matrix and the ranks together compute exactly the single-process model:
      q/k/v, gate/up   ColumnParallelLinear  weight rows (output features) split; output stays split
      o, down          RowParallelLinear     weight columns (input features) split; partial sums are
                                             all-reduced, then the (replicated) bias is added once
      embed_tokens     VocabParallelEmbedding  vocab rows split; ids outside the slice give 0, all-reduce
      lm_head          ColumnParallelLinear  vocab rows split; logits stay vocab-sharded, the loss is
                                             loss.py's vocab-parallel cross-entropy
      q_norm, k_norm   ReplicatedRMSNorm     (Qwen3's per-head norms) weight replicated; each rank's
                                             heads give part of its gradient, all-reduced in backward
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
                qkv / fc1 weights would; a copy per column layer would make it 5
      + selective AC: nothing more (row outputs come from a functional collective the policy keeps);
        full AC: 1 more, o_proj's in the recompute (the recompute stops before down_proj's)
    and per step outside the layers: forward 1 (embedding) + 3 per-token scalars of the loss (row
    max, target logit, sum of exps: loss.VocabParallelLinearCrossEntropy); backward 1 (the head's
    input).
    Attention needs no change: model.py derives head counts from weight shapes, and column-splitting
    q/k/v by whole heads gives each rank nh/tp query heads with their own nkv/tp kv heads (GQA groups
    never straddle ranks because tp divides both counts).

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
    - No rank ever holds a [tokens, vocab] tensor in training, not even its vocab slice: the loss
      (vocab_parallel_linear_cross_entropy) runs lm_head block by block over this rank's vocab
      rows, (T, chunk) fp32 logits at a time, and all-reduces only per-token scalars (max, sum of
      exps, target logit); backward recomputes each block and needs no communication.
    - Composition order: build (meta) → pp split → apply_tp → materialize → ac → precision/dp/zero.
      A pipeline stage may lack embed_tokens / norm / lm_head and hold only some layers.

Builds on: model.py, loss.py (the vocab-parallel loss without (T, V) logits)
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loss import VocabParallelLinearCrossEntropy, reduce_loss
from model import Llama, LlamaConfig, RMSNorm, Shard, global_shapes, rms_norm

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
def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to a multiple of tp, so every rank holds an equal slice."""
    return -(-vocab_size // tp) * tp


def _slice(group: Group, size: int, what: str) -> tuple[int, int]:
    """(start, n) of this rank's equal slice of `size` rows."""
    tp, rank = _size_rank(group)
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tp={tp}")
    return rank * (size // tp), size // tp


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r, where this rank holds output features [start, start+n) of W and b.
    The input is the full (replicated) x; the output stays split along its last dim. copy_input:
    enter the tp region here (copy_to_region: backward all-reduces dL/dx). apply_tp turns it off for
    the column layers of a block, whose shared input enters the region once for all of them (see
    `_enter_region`), or is gathered by a SequenceParallelRMSNorm, whose backward sums dL/dx."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 copy_input: bool = True):
        super().__init__()
        self.group, self.copy_input = group, copy_input
        self.start, self.n = _slice(group, out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(self.n, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.n, device=device, dtype=dtype)) if bias else None

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n), "bias": Shard(0, self.start, self.n)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # backward: every rank's dL/dx is a partial sum over its output features → all-reduce
        x = copy_to_region(x, self.group) if self.copy_input else x
        return F.linear(x, self.weight, self.bias)  # (..., n)


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
    sequence_parallel: a reduce-scatter instead, so each rank keeps its S/tp tokens: (B, S/tp, H)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings = num_embeddings  # the true vocab size; rows past it are zero padding
        vocab = padded_vocab(num_embeddings, dist.get_world_size(group))
        self.start, self.n = _slice(group, vocab, "padded vocab")
        self.weight = nn.Parameter(torch.empty(self.n, embedding_dim, device=device, dtype=dtype))

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start  # (B, S) row in this rank's slice, if it is here
        outside = (local < 0) | (local >= self.n)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, S, H)
        h = h.masked_fill(outside[..., None], 0.0)  # zero rows also block gradient to row 0
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(h, self.group)  # (B, S/tp, H)
        return reduce_from_region(h, self.group)


class ReplicatedRMSNorm(RMSNorm):
    """model.RMSNorm whose replicated weight meets only this rank's part of the input — Qwen3's
    per-head q/k norms see this rank's heads; under sequence parallelism a norm sees its S/tp tokens:
    the weight enters through copy_to_region, so backward all-reduces its gradient over tp."""

    def __init__(self, norm: RMSNorm, group: Group):
        with torch.device("meta"):  # like the other new layers; materialize fills it
            super().__init__(norm.weight.shape[0], norm.eps)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_region(self.weight, self.group), self.eps)  # as model.RMSNorm


class SequenceParallelRMSNorm(ReplicatedRMSNorm):
    """model.RMSNorm of this rank's S/tp tokens, then all-gathered to the full sequence for the
    column-parallel layers after it: (B, S/tp, H) → (B, S, H). The replicated weight sees only this
    rank's tokens, so it enters through copy_to_region: backward all-reduces its gradient over tp."""

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


# ------------------------------------------------------------------------------------- the model
def tp_validate(cfg: LlamaConfig, tp: int, seq_len: int | None = None) -> None:
    """Raise ValueError naming the numbers if this config cannot be split over tp ranks (the vocab
    needs no check: it is padded). seq_len: check it too, for sequence parallelism."""
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


def apply_tp(model: Llama, tp_group: Group, sequence_parallel: bool = False) -> dict[str, Shard]:
    """Replace the model's layers by their tensor-parallel versions (in place, on the meta device)
    and return {hf_name: Shard} for every sharded parameter; pass it to `weights.materialize`.
    sequence_parallel: Megatron's sequence parallelism on top (module docstring); the sequence
    length must then be a multiple of tp."""
    tp, _ = _size_rank(tp_group)
    if tp == 1:
        return {}  # the plain model is the tp=1 model
    cfg = model.config
    tp_validate(cfg, tp)
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("apply_tp must run on the meta-device model, before weights.materialize")
    # new layers are meta too; materialize fills them
    new = dict(group=tp_group, device="meta", sequence_parallel=sequence_parallel)
    column = dict(group=tp_group, device="meta", copy_input=False)  # the block enters the region
    for layer in model.model.layers.values():
        a, m = layer.self_attn, layer.mlp
        if sequence_parallel:  # the norms before a and m gather their output (SequenceParallelRMSNorm)
            a.register_forward_pre_hook(partial(_full_sequence_rope, rotary=model.model.rotary_emb))
        else:
            a.register_forward_pre_hook(partial(_enter_region, group=tp_group))
            m.register_forward_pre_hook(partial(_enter_region, group=tp_group))
        for parent, name in ((a, "q_proj"), (a, "k_proj"), (a, "v_proj"), (m, "gate_proj"), (m, "up_proj")):
            old = getattr(parent, name)
            setattr(parent, name, ColumnParallelLinear(old.in_features, old.out_features,
                                                       old.bias is not None, **column))
        for name in ("q_norm", "k_norm"):  # Qwen3's per-head norms: replicated, grads summed over tp
            if getattr(a, name, None) is not None:
                setattr(a, name, ReplicatedRMSNorm(getattr(a, name), tp_group))
        for parent, name in ((a, "o_proj"), (m, "down_proj")):
            old = getattr(parent, name)
            setattr(parent, name, RowParallelLinear(old.in_features, old.out_features,
                                                    old.bias is not None, **new))
    embed = model.model.embed_tokens
    if embed is not None:
        embed = model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **new)
    if sequence_parallel:  # every RMSNorm: the two of each layer and the final one
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if type(child) is RMSNorm:
                    setattr(parent, name, SequenceParallelRMSNorm(child, tp_group))
    if model.lm_head is not None:
        head = ColumnParallelLinear(cfg.hidden_size, padded_vocab(cfg.vocab_size, tp), False, tp_group,
                                    device="meta", copy_input=not sequence_parallel)
        if cfg.tie_word_embeddings and embed is not None:
            head.weight = embed.weight  # tied: one sharded weight (same rows: the same vocab slice)
        model.lm_head = head
        model.loss_fn = partial(vocab_parallel_linear_cross_entropy, group=tp_group,
                                vocab_size=cfg.vocab_size, sequence_parallel=sequence_parallel)
        model.logits_fn = partial(gather_logits, group=tp_group, vocab_size=cfg.vocab_size)
    # the map names each sharded parameter once, as named_parameters() does (tied head: the embedding)
    params = dict(model.named_parameters())
    return {f"{mod_name}.{p}": shard for mod_name, mod in model.named_modules()
            if isinstance(mod, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
            for p, shard in mod.shards().items() if f"{mod_name}.{p}" in params}


# ------------------------------------------------------------------------------------- export
@torch.no_grad()
def gather_tensor(local: torch.Tensor, shard: Shard, full_size: int, group: Group) -> torch.Tensor:
    """The full tensor from the equal, rank-ordered slices of a tp group; padding rows cut."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.detach().contiguous(), group=group)
    return torch.cat(pieces, dim=shard.dim).narrow(shard.dim, 0, full_size).contiguous()


@torch.no_grad()
def gather_full(tensors: dict[str, torch.Tensor], shards: dict[str, Shard], tp_group: Group,
                cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """{hf_name: local tensor} (params, grads, optimizer moments…) → {hf_name: full tensor} on every
    tp rank, in HF layout with the true vocab size; replicated entries are returned as they are.
    All tp ranks must call it with the same names in the same order. Feed the result to save_hf."""
    shapes = global_shapes(cfg)
    out = {}
    for name, t in tensors.items():
        shard = shards.get(name)
        if shard is None:
            out[name] = t.detach()
            continue
        # a tied head held apart from the embedding (last pipeline stage) has the embedding's shape
        key = "model.embed_tokens.weight" if name == "lm_head.weight" and cfg.tie_word_embeddings else name
        out[name] = gather_tensor(t, shard, shapes[key][shard.dim], tp_group)
    return out
