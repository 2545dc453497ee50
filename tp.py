"""Tensor parallelism (Megatron-LM): every projection split across the ranks of a tp group.

What it does
    `apply_tp(model, tp_group)` rewrites a model in place.
    Each rank then holds 1/tp of every matrix.
    Together the ranks compute exactly the single-process model.
    It returns the shard map {parameter name: Shard}: `weights.materialize` reads slices with it.
    Models: attotron's Llama (on meta), transformers' decoders, any other described by `Parts`.

The core idea
    A block (attention, MLP) is column layers, then one row layer.
    A column layer holds rows of W: its output stays split.
    A row layer holds columns of W: each rank gets a partial sum.
    Two conjugate operators carry a block, each an autograd Function:
      f  copy_to_region      forward identity     backward all-reduce   (input of column layers)
      g  reduce_from_region  forward all-reduce   backward identity     (output of row layers)
    With f once at the block's input, a block costs one all-reduce each way (the refinement).
    Read `tp_mlp` first: the textbook MLP in a few lines. Production follows it.
    The embedding and the head split the vocab rows the same way.

Seams
    The layer plan is data: {path inside a layer: style} (`LLAMA_PLAN`, `Parts.plan`).
    A module may bring its own style: apply_tp then calls its `tp_style(layer, group, sp)`.
    Under sequence parallelism `model.token_sum_fn` sums over tp (each rank holds S/tp tokens).
    Refinements, after their banners at the end:
      one backward all-reduce per block (the block's input enters the region once);
      sequence parallelism (between the blocks each rank keeps S/tp tokens);
      a q/k norm over the whole projection, split as the heads.

Reference
    Shoeybi et al. 2019, "Megatron-LM", Fig. 3 (f and g).
    Korthikanti et al. 2022, "Reducing Activation Recomputation...", §4.2.2 (sequence parallelism).
    More: docs/tp.md (collective counts, sequence parallelism, the seams).

Run
    torchrun --nproc_per_node 2 train.py --model tiny --tp 2 --steps 20
    torchrun --nproc_per_node 4 train.py --model tiny --tp 2 --pp 2 --sp --steps 20

Invariants
    - tp=1 is the plain model: nothing changes, and each op returns its input (tests/test_tp.py).
    - Every layout equals the single-process model over 5 steps (test_tp.py, test_sp.py).
    - Per layer: 2 all-reduces forward, 2 backward (test_tp.py counts them on gloo).
    - Replicated parameters get the same gradient on every tp rank (test_tp.py, test_sp.py).
    - No rank holds a [tokens, vocab] tensor in training (test_tp.py).
    - Padded vocab rows stay zero, and users never see them (test_tp.py).
    - What cannot be split raises before the model changes (tests/test_foreign_tp_pp.py).
    - `tp_mlp` equals the production layers bit for bit (tests/test_naive.py).

Builds on: loss.py (the vocab-parallel loss without (T, V) logits), ops.py (rms_norm).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from functools import partial
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from loss import VocabParallelLinearCrossEntropy, reduce_loss
from ops import rms_norm

Group = dist.ProcessGroup | None


# ------------------------------------------------------------------------------------- the textbook
# Megatron's MLP as the paper draws it: f, the column matmul, SiLU, the row matmul, g.
# Production is below: the same numbers, bit for bit (tests/test_naive.py).
class _f(torch.autograd.Function):
    """Identity forward, all-reduce backward: where a replicated input enters the split region."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
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
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None  # the full sum depends on each partial with slope 1


def tp_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, group: Group = None) -> torch.Tensor:
    """x (..., H) replicated; w1 (I/tp, H) this rank's rows of W1; w2 (H, I/tp) its columns of W2."""
    h = F.silu(_f.apply(x, group) @ w1.T)  # (..., I/tp): this rank's slice of the hidden features
    return _g.apply(h @ w2.T, group)  # (..., H): the sum over ranks is the full product


# ------------------------------------------------------------------------------------- f and g
# Production's pair changes three things.
# f's forward returns a view: nothing writes to it, so a copy is waste.
# The all-reduce is a functional collective, into a new tensor, not dist.all_reduce in place:
# a Function must not change its input, nor a gradient autograd hands it.
# Selective AC can then keep its output, so a recompute reuses it.
# On one rank each op returns its input object itself: no copy, no autograd node.
def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    name = (group or dist.group.WORLD).group_name
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name))


class CopyToRegion(torch.autograd.Function):
    """f: identity in forward, all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce (sum) in forward, identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ReduceFromRegion.apply(x, group)


# ------------------------------------------------------------------------------------- column, row
class ColumnParallelLinear(nn.Module):
    """y_r = f(x) W_r^T + b_r. This rank holds output features [start, start+n) of W and b.
    The input x is full (replicated); the output stays split along its last dim.
    parts: a fused weight (q, k, v stacked). This rank holds 1/tp of each part (whole heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 parts: tuple[int, ...] = ()):
        super().__init__()
        self.group, self.parts = group, tuple(parts)
        if self.parts and sum(self.parts) != out_features:
            raise ValueError(f"fused parts {self.parts} sum to {sum(self.parts)}, not out_features={out_features}")
        for p in self.parts:
            _slice(group, p, "a fused part's rows")
        self.start, self.n = _slice(group, out_features, "out_features")
        self.weight = nn.Parameter(torch.empty(self.n, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.n, device=device, dtype=dtype)) if bias else None
        self.linear_fn: Callable[..., torch.Tensor] = F.linear  # the matmul: F.linear's signature

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n, self.parts), "bias": Shard(0, self.start, self.n, self.parts)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_region(x, self.group)  # f. Backward: each rank's dL/dx is partial → all-reduce
        return self.linear_fn(x, self.weight, self.bias)  # (..., n)


class RowParallelLinear(nn.Module):
    """y = g(sum_r x_r W_r^T) + b. This rank holds input features [start, start+n) of W.
    Its input x_r is the split output of a column layer.
    The bias is replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.group = group
        self.start, self.n = _slice(group, in_features, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.n, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.linear_fn: Callable[..., torch.Tensor] = F.linear  # the matmul: F.linear's signature

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(1, self.start, self.n)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_region(self.linear_fn(x, self.weight), self.group)  # g: (..., out) full sum on every rank
        return y if self.bias is None else y + self.bias


# ------------------------------------------------------------------------------------- slices
@dataclass(frozen=True)
class Shard:
    """This rank holds rows [start, start+size) of the global tensor along `dim`.
    Rows at or past the global size are padding (a vocab padded to a multiple of tp).
    Padding is zero, never read or written.
    parts: a fused weight's stacked blocks (q, k, v), in global row counts.
    This rank then holds 1/tp of each block, stacked.
    start and size count in that rank-major order."""
    dim: int
    start: int
    size: int
    parts: tuple[int, ...] = ()


def _size_rank(group: Group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _slice(group: Group, size: int, what: str) -> tuple[int, int]:
    """(start, n) of this rank's equal slice of `size` rows."""
    tp, rank = _size_rank(group)
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tp={tp}")
    return rank * (size // tp), size // tp


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to a multiple of tp, so every rank holds an equal slice."""
    return -(-vocab_size // tp) * tp


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


# ------------------------------------------------------------------------------------- the vocab
# The second pair moves split logits: gather them for users, split a full input.
def _all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=dim)  # tp * n along dim, in rank order


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    tp, rank = _size_rank(group)
    if x.shape[-1] % tp:
        raise ValueError(f"cannot split a last dim of {x.shape[-1]} into tp={tp} equal parts")
    return x.chunk(tp, dim=-1)[rank].contiguous()  # (..., n / tp)


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


def gather_from_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ScatterToRegion.apply(x, group)


class VocabParallelEmbedding(nn.Module):
    """This rank holds rows [start, start+n) of the (padded) table.
    An id outside the slice looks up row 0, which is then zeroed.
    After the all-reduce each token has exactly its one real row.
    padding_idx (nn.Embedding's): that row gets no gradient, on the rank that holds it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 padding_idx: int | None = None):
        super().__init__()
        self.group = group
        self.num_embeddings = num_embeddings  # the true vocab size; rows past it are zero padding
        vocab = padded_vocab(num_embeddings, dist.get_world_size(group))
        self.start, self.n = _slice(group, vocab, "padded vocab")
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(self.n, embedding_dim, device=device, dtype=dtype))

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n)}

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows for the ids it holds, zero for the others: (B, S, H)."""
        local = ids - self.start  # (B, S) row in this rank's slice, if it is here
        outside = (local < 0) | (local >= self.n)
        pad = None if self.padding_idx is None else self.padding_idx - self.start
        pad = pad if pad is not None and 0 <= pad < self.n else None
        h = F.embedding(local.masked_fill(outside, 0), self.weight, padding_idx=pad)  # (B, S, H)
        return h.masked_fill(outside[..., None], 0.0)  # zero rows also block gradient to row 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(self._lookup(ids), self.group)  # (B, S, H)


class VocabParallelHead(ColumnParallelLinear):
    """A column-parallel lm_head whose logits are all-gathered to the true vocab: (..., V).
    Any loss the model computes itself (transformers', a GPT's) then sees the full logits.
    Padding rows are cut."""

    def __init__(self, in_features: int, vocab_size: int, bias: bool, group: Group, **kw: Any):
        super().__init__(in_features, padded_vocab(vocab_size, dist.get_world_size(group)), bias, group, **kw)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_region(super().forward(x), self.group)[..., :self.vocab_size]  # (..., V)


class ReplicatedRMSNorm(nn.Module):
    """An RMSNorm (ops.rms_norm, as model.RMSNorm) whose replicated weight meets part of the input.
    Qwen3's per-head q/k norms see this rank's heads only.
    Under sequence parallelism a norm sees its S/tp tokens only.
    So the weight enters through f: backward all-reduces its gradient over tp."""

    def __init__(self, norm: nn.Module, group: Group):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(norm.weight.shape[0], device="meta"))  # materialize fills it
        self.eps, self.group = norm.eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, copy_to_region(self.weight, self.group), self.eps)  # as model.RMSNorm


# ------------------------------------------------------------------------------------- loss, logits
def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                        reduction: str = "mean", *, group: Group, vocab_size: int,
                                        sequence_parallel: bool = False,
                                        chunk: int | None = None) -> torch.Tensor:
    """`loss.linear_cross_entropy` for a vocab-parallel lm_head: the model's loss seam under tp.
    hidden (..., H) is replicated over tp; weight is this rank's (n, H) rows.
    Backward sums the partial dL/dh over tp: by f here.
    Under sequence parallelism the final norm's gather produced `hidden`.
    Its reduce-scatter sums dL/dh instead, so f is skipped."""
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
    """Style of a column weight that stacks several projections: their row counts.
    Example: GPT's c_attn, [q; k; v], (3·H, H).
    Each part is split alone, so every rank holds whole heads of each."""
    parts: tuple[int, ...]


Style = Union[str, Fused]  # "colwise" (output features split), "rowwise" (input features split), Fused

# The layer plan as data: {module path inside each layer (fnmatch pattern): style}.
# transformers' decoders name their layers this way too. Their `config.base_model_tp_plan` says the same.
LLAMA_PLAN: dict[str, Style] = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}
# the names of fused q/k/v (or gate/up) weights in common models: "colwise" on one of them raises
FUSED_NAMES = ("c_attn", "qkv", "qkv_proj", "wqkv", "query_key_value", "w_pack", "in_proj", "gate_up_proj")


@dataclass
class Parts:
    """Where a model keeps its parts (dotted attribute paths), and how TP splits its layers.
    The embedding becomes vocab-parallel.
    The head becomes vocab-parallel, with gathered logits.
    The norm stays replicated, as does anything not named (a learned position table, say).
    heads: integer attributes inside each layer that count heads (GPT's `attn.n_head`).
    apply_tp divides them by tp."""
    embed: str | None = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str | None = "model.norm"
    head: str | None = "lm_head"
    plan: dict[str, Style] = field(default_factory=lambda: dict(LLAMA_PLAN))
    heads: tuple[str, ...] = ()


def _get(root: nn.Module, path: str | None, missing: Any = AttributeError) -> Any:
    """The attribute at a dotted path; None where the path (or a part of it) is None.
    A path that does not exist raises, unless `missing` is given: then it is returned."""
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
    """attotron's Llama (model.py): layers in a ModuleDict by global index, and the loss_fn seam."""
    return isinstance(_get(model, "model.layers", None), nn.ModuleDict) and hasattr(model, "loss_fn")


def default_parts(model: nn.Module) -> Parts:
    """Parts of attotron's Llama, or of a transformers decoder (model.model.layers a ModuleList).
    A decoder's plan comes from its own `config.base_model_tp_plan`.
    Any other model raises: pass Parts."""
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


def _matches(layer: nn.Module, plan: dict[str, Style], own: list[str]) -> list[tuple[str, Style]]:
    """(module name inside the layer, style) for every module a plan pattern names.
    The modules named in `own` have a style of their own: they, and all inside them, are left out."""
    inside = lambda name: any(name == o or name.startswith(o + ".") for o in own)  # noqa: E731
    plan = {pattern: style for pattern, style in plan.items() if not inside(pattern)}
    found = [(name, style) for name, _ in layer.named_modules() for pattern, style in plan.items()
             if name and not inside(name) and fnmatch(name, pattern)]
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
    """Put `new` (built on meta) at `path`.
    Where the old module holds real weights, `new` moves to their device.
    It is then filled with this rank's slice of them; replicated ones are copied whole."""
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


def _planned(model: nn.Module, parts: Parts, tp: int, ours: bool,
             sequence_parallel: bool) -> tuple[list[tuple[str, Style]], list[tuple[nn.Module, nn.Module]], bool]:
    """Every check of apply_tp, before its first change: a call that raises leaves the model as it was.
    Returns the plan's [(module path, style)] and the [(layer, module)] with a style of their own.
    A module with its own style is left out of the plan, and so is everything inside it.
    Last comes whether the head is tied to the embedding."""
    if sequence_parallel and not ours:
        raise ValueError("apply_tp: sequence parallelism needs attotron's Llama (its RMSNorms and RoPE); "
                         "use sequence_parallel=False for this model")
    if ours:
        tp_validate(model.config, tp)
    _check_heads(model, tp)
    meta = {p.device.type == "meta" for p in model.parameters()}
    if ours and meta != {True}:
        raise ValueError("apply_tp must run on the meta-device model, before weights.materialize")
    if len(meta) > 1:
        raise ValueError("apply_tp: the model is partly on the meta device; materialize it all, or none")
    todo, own = [], []
    for i, layer in _get(model, parts.layers).named_children():  # i: the global index (a pipeline stage keeps it)
        styled = [n for n, m in layer.named_modules() if n and hasattr(m, "tp_style")]
        own += [(layer, layer.get_submodule(n)) for n in styled]
        todo += [(f"{parts.layers}.{i}.{name}", _checked_style(f"{parts.layers}.{i}.{name}", style,
                                                               layer.get_submodule(name), parts))
                 for name, style in _matches(layer, parts.plan, styled)]
        for attr in parts.heads:
            if _get(layer, attr) % tp:
                raise ValueError(f"tp={tp} must divide {parts.layers}.{i}.{attr}={_get(layer, attr)} "
                                 f"(each rank holds whole heads)")
    if meta == {True} and any(isinstance(s, Fused) for _, s in todo):
        raise ValueError("apply_tp: a fused weight's slice is not one Shard that materialize could read; "
                         "apply tp to the materialized model")
    embed, head = _get(model, parts.embed), _get(model, parts.head)
    if embed is not None and (not isinstance(embed, nn.Embedding) or embed.max_norm is not None
                              or embed.scale_grad_by_freq):
        raise ValueError(f"apply_tp: {parts.embed} must be a plain nn.Embedding, got {embed}")
    tied = embed is not None and head is not None and head.weight is embed.weight
    if tied and head.bias is not None:
        raise ValueError(f"apply_tp: a head tied to the embedding with a bias ({parts.head}) is not supported")
    return todo, own, tied


# ------------------------------------------------------------------------------------- the model
def tp_validate(cfg: Any, tp: int, seq_len: int | None = None) -> None:
    """Raise ValueError naming the numbers if this config (model.LlamaConfig) cannot be split over tp ranks.
    The vocab needs no check: it is padded.
    seq_len: check it too, for sequence parallelism."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallelism: tp={tp} must divide the sequence length {seq_len} "
                         f"(each rank holds seq_len/tp tokens between the blocks)")
    # only a plain MLP splits intermediate_size (an `is_sparse` layer brings a block of its own)
    mlp = not all(map(getattr(cfg, "is_sparse", lambda i: False), range(cfg.num_hidden_layers)))
    bad = [f"{k}={v}" for k, v in (("num_attention_heads", cfg.num_attention_heads),
                                   ("num_key_value_heads", cfg.num_key_value_heads),
                                   ("intermediate_size", cfg.intermediate_size if mlp else 0)) if v % tp]
    if bad:
        raise ValueError(f"tp={tp} must divide {', '.join(bad)} (each rank holds whole attention "
                         f"heads, whole kv heads and an equal share of the MLP)")


def apply_tp(model: nn.Module, tp_group: Group, sequence_parallel: bool = False,
             parts: Parts | None = None) -> dict[str, Shard]:
    """Replace the model's layers by their tensor-parallel versions, in place.
    Returns {parameter name: Shard} for every sharded parameter.
    attotron's Llama: on the meta device (pass the map to `weights.materialize`).
    Its head stays vocab-sharded behind the loss_fn seam.
    Any other model (transformers' decoders, or one described by `parts`): meta or materialized.
    Materialized, each rank keeps its slice of the weights.
    Its head gathers full logits for the model's own loss.
    sequence_parallel: Megatron's sequence parallelism on top (refinement below), attotron's Llama only."""
    tp, _ = _size_rank(tp_group)
    if tp == 1:
        return {}  # the plain model is the tp=1 model
    ours = parts is None and _is_attotron(model)
    parts = parts or default_parts(model)
    todo, own, tied = _planned(model, parts, tp, ours, sequence_parallel)
    # ours: the block's input enters the region once, not per column layer (refinements below)
    column = ColumnParallelLinearInRegion if ours else ColumnParallelLinear
    row = SequenceParallelRowLinear if sequence_parallel else RowParallelLinear
    for path, style in todo:  # the plan's styles: "colwise", tp.Fused (a column layer by parts), "rowwise"
        old = _get(model, path)
        cls = row if style == "rowwise" else partial(column, parts=getattr(style, "parts", ()))
        _swap(model, path, cls(old.in_features, old.out_features, old.bias is not None, tp_group,
                               device="meta", dtype=old.weight.dtype))
    for layer in _get(model, parts.layers).children():
        for attr in parts.heads:
            _set(layer, attr, _get(layer, attr) // tp)
        if ours:
            _llama_layer(layer, tp_group, sequence_parallel, model.model.rotary_emb)
    for layer, module in own:  # the modules with a style of their own (see the module docstring)
        module.tp_style(layer, tp_group, sequence_parallel)
    _vocab_parallel(model, parts, tp_group, ours, sequence_parallel, tied)
    if sequence_parallel:
        _sequence_parallel(model, tp_group)
    # the map names each sharded parameter once, as named_parameters() does (tied head: the embedding)
    params = dict(model.named_parameters())
    return {f"{name}.{p}": shard for name, mod in model.named_modules() if hasattr(mod, "shards")
            for p, shard in mod.shards().items() if f"{name}.{p}" in params}


def _llama_layer(layer: nn.Module, group: Group, sequence_parallel: bool, rotary: nn.Module) -> None:
    """attotron's decoder layer: its q/k norms, and the hooks of the refinements below."""
    a = layer.self_attn
    norm = ShardedRMSNorm if a.qk_norm_whole else ReplicatedRMSNorm  # per head (Qwen3): replicated
    for name in ("q_norm", "k_norm"):
        if getattr(a, name) is not None:
            setattr(a, name, norm(getattr(a, name), group))
    if sequence_parallel:  # the norms before the blocks gather their output (SequenceParallelRMSNorm)
        a.register_forward_pre_hook(partial(_full_sequence_rope, rotary=rotary))
        return
    for block in (a, layer.mlp):  # f once per block: see _enter_region
        if not hasattr(block, "tp_style"):  # a block with its own style enters the region its own way
            block.register_forward_pre_hook(partial(_enter_region, group=group))


def _vocab_parallel(model: nn.Module, parts: Parts, group: Group, ours: bool, sequence_parallel: bool,
                    tied: bool) -> None:
    """The embedding and the head split their vocab rows, padded to a multiple of tp."""
    tp, embed, head = dist.get_world_size(group), _get(model, parts.embed), _get(model, parts.head)
    if embed is not None:
        cls = SequenceParallelEmbedding if sequence_parallel else VocabParallelEmbedding
        embed = _swap(model, parts.embed, cls(embed.num_embeddings, embed.embedding_dim, group, device="meta",
                                              dtype=embed.weight.dtype, padding_idx=embed.padding_idx))
    if head is None:
        return
    if ours:  # under sequence parallelism the final norm's gather already sums dL/dh
        vocab = model.config.vocab_size
        cls = ColumnParallelLinearInRegion if sequence_parallel else ColumnParallelLinear
        new = cls(head.in_features, padded_vocab(vocab, tp), False, group, device="meta")
        model.loss_fn = partial(vocab_parallel_linear_cross_entropy, group=group, vocab_size=vocab,
                                sequence_parallel=sequence_parallel)
        model.logits_fn = partial(gather_logits, group=group, vocab_size=vocab)
    else:
        new = VocabParallelHead(head.in_features, head.out_features, head.bias is not None, group,
                                device="meta", dtype=head.weight.dtype)
    if tied:
        new.weight = embed.weight  # one sharded weight (the same rows: the same vocab slice)
    (_set if tied else _swap)(model, parts.head, new)  # _swap would fill a copy of the tied weight


# ------------------------------------------------------------------------------------- export
@torch.no_grad()
def gather_tensor(local: torch.Tensor, shard: Shard, full_size: int, group: Group) -> torch.Tensor:
    """The full tensor from the equal, rank-ordered slices of a tp group; padding rows cut.
    A fused weight's blocks (shard.parts) are put back in their order: [q_0 q_1 ...; k_0 k_1 ...; ...]."""
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
    """{hf_name: local tensor} (params, grads, optimizer moments…) → {hf_name: full tensor}.
    Every tp rank gets the result, in HF layout, with the true vocab size (cfg.vocab_size).
    Replicated entries are returned as they are.
    All tp ranks must call it with the same names in the same order.
    Feed the result to save_hf."""
    tp, out = dist.get_world_size(tp_group), {}
    for name, t in tensors.items():
        if (shard := shards.get(name)) is None:
            out[name] = t.detach()
        else:
            full = cfg.vocab_size if name in VOCAB_SHARDED else t.shape[shard.dim] * tp
            out[name] = gather_tensor(t, shard, full, tp_group)
    return out


# --- refinement: one backward all-reduce per block
# The core column layer applies f to its own input: correct whatever calls it.
# But attention's three column layers read the same x:
#   q = x Wq_r^T    k = x Wk_r^T    v = x Wv_r^T          (this rank's rows of each)
# Backward gives three partial gradients of x, one per layer: dq Wq_r, dk Wk_r, dv Wv_r.
# With f in each layer, each is all-reduced alone: 3 all-reduces, plus 2 for gate/up.
# An all-reduce is a sum, so it is linear:
#   AR(dq Wq_r) + AR(dk Wk_r) + AR(dv Wv_r) = AR(dq Wq_r + dk Wk_r + dv Wv_r)
# So apply f once, to the block's input, before it fans out.
# Autograd sums the three partials locally; one all-reduce carries the total.
# Per layer: 2 backward all-reduces instead of 5 (tests/test_tp.py counts them).
# Megatron gets the same from its fused qkv and fc1 weights.
# The hook needs the block's input as its first argument: attotron's Llama only.
# Other models keep f in each column layer.
def _enter_region(block: nn.Module, args: tuple, *, group: Group) -> tuple:
    """self_attn / mlp forward pre-hook: the block's input enters the tp region (f) once."""
    return (copy_to_region(args[0], group), *args[1:])


class ColumnParallelLinearInRegion(ColumnParallelLinear):
    """A column layer whose input is already in the tp region: the matmul alone, no f.
    Something before it sums dL/dx in backward: `_enter_region`, or a SequenceParallelRMSNorm's gather."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fn(x, self.weight, self.bias)  # (..., n)


# --- refinement: sequence parallelism
# Between the blocks (residual stream, adds, RMSNorms) the core keeps all S tokens on every rank.
# That work and memory are replicated. Sequence parallelism splits them along the sequence instead:
# each rank keeps its S/tp tokens, (B, S/tp, H).
# A ring all-reduce is a reduce-scatter plus an all-gather, so g splits in two:
#   row layer output   g → reduce-scatter along the sequence   (ReduceScatterToSequenceRegion)
#   norm output        all-gather along the sequence → column layers   (GatherFromSequenceRegion)
# The bytes moved stay plain TP's.
# The gather's backward is a reduce-scatter: it sums the column layers' partial dL/dx, as f did.
# So the column layers after a gathered norm skip f (ColumnParallelLinearInRegion).
# Replicated weights (norm weights, row biases) now meet only S/tp tokens.
# They enter through f, so backward all-reduces their gradients.
# That happens inside autograd, before any dp/ZeRO hook reads them.
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


def gather_from_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else GatherFromSequenceRegion.apply(x, group)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ReduceScatterToSequenceRegion.apply(x, group)


class SequenceParallelRowLinear(RowParallelLinear):
    """A row layer whose partial sums are reduce-scattered along the sequence: (B, S/tp, out).
    The bias now meets only this rank's tokens: it enters through f (its gradient is all-reduced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_scatter_to_sequence_region(self.linear_fn(x, self.weight), self.group)  # (B, S/tp, out)
        return y if self.bias is None else y + copy_to_region(self.bias, self.group)


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """The vocab-parallel embedding, reduce-scattered: each rank keeps its S/tp tokens, (B, S/tp, H)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return reduce_scatter_to_sequence_region(self._lookup(ids), self.group)  # (B, S/tp, H)


class SequenceParallelRMSNorm(ReplicatedRMSNorm):
    """The RMSNorm of this rank's S/tp tokens (its weight enters through f, as ReplicatedRMSNorm's).
    Its output is all-gathered for the column layers after it: (B, S/tp, H) → (B, S, H)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence_region(super().forward(x), self.group)  # (B, S/tp, H) → (B, S, H)


def _full_sequence_rope(attn: nn.Module, args: tuple, *, rotary: nn.Module) -> tuple | None:
    """self_attn pre-hook: attention runs on the gathered sequence, so it needs cos/sin of 0..S-1.
    Without position_ids the model numbers only the S/tp tokens it holds, 0..S/tp-1.
    Given position_ids cover the full sequence already.
    Recomputed per layer: 2·S·head_dim values, shared over the batch."""
    x, cos, sin, mask = args  # x: (B, S, H) gathered; cos, sin: (B, S or S/tp, hd)
    if cos.shape[1] == x.shape[1]:
        return None
    cos, sin = rotary(torch.arange(x.shape[1], device=x.device)[None], cos.dtype)  # (1, S, hd) each
    return x, cos, sin, mask


def _sequence_parallel(model: nn.Module, group: Group) -> None:
    """Every RMSNorm left (the two of each layer, the final one) keeps S/tp tokens and gathers its output.
    A sum over this rank's tokens is then part of the forward's: `token_sum_fn` all-reduces it."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child).__name__ == "RMSNorm":
                setattr(parent, name, SequenceParallelRMSNorm(child, group))
    if hasattr(model, "token_sum_fn"):
        model.token_sum_fn = partial(reduce_from_region, group=group)


# --- refinement: a q/k norm over the whole projection (OLMoE), split as the heads
# Qwen3's q/k norm spans one head: each rank holds whole heads, so the weight is replicated.
# OLMoE's spans the whole projection, all heads at once.
# Its statistics then need every rank's features: the sum of squares is all-reduced.
# Its weight is split as the heads (features), so each rank holds its heads' part.
class ShardedRMSNorm(nn.Module):
    """An RMSNorm over features split across tp: this rank holds the weight of its heads' features.
    The sum of squares is all-reduced before the rsqrt (g).
    Its gradient is all-reduced in backward too (f): every rank's output depends on every rank's features.
    The numerics are transformers' (fp32)."""

    def __init__(self, norm: nn.Module, group: Group):
        super().__init__()
        self.features, self.eps, self.group = norm.weight.shape[0], norm.eps, group
        self.start, self.n = _slice(group, self.features, "the q/k norm's features")
        self.weight = nn.Parameter(torch.ones(self.n, device="meta"))  # materialize fills it

    def shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.start, self.n)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # (B, S, n) this rank's features
        local = xf.pow(2).sum(-1, keepdim=True)  # (B, S, 1)
        squares = copy_to_region(reduce_from_region(local, self.group), self.group)  # all features' sum
        return self.weight * (xf * torch.rsqrt(squares / self.features + self.eps)).to(x.dtype)
