"""Context parallelism: the sequence is split over ranks, and attention runs as a ring.

What it does
    With cp ranks, each rank holds S/cp tokens of every activation.
    Norms, MLPs and projections work per token: they need nothing.
    Only attention mixes tokens. `ring_attention` computes it exactly.
    `apply_cp` puts the ring into a model from outside.

The core idea
    The K/V blocks travel around the ring of cp ranks, point to point.
    Each rank attends its queries to the block it holds, then passes the block on.
    The next block is in flight while the current one is computed.
    Partial results merge by log-sum-exp: l = log Σ_j exp(l_j), o = Σ_j exp(l_j − l)·o_j.
    Backward runs a second ring. Each block's dK/dV travel with it, back to their owner.
    Zigzag shards balance the causal triangle: rank r holds chunks r and 2cp−1−r of 2cp.
    docs/cp.md derives the blocks, the merge and the backward.

Reference
    Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context".
    Zigzag load balance: Megatron-LM's context parallelism, zhuzilin/ring-flash-attention.
    Striped attention (Brandon et al. 2023) balances the same triangle another way.
    Dao 2023 (FlashAttention-2): the log-sum-exp bookkeeping of the backward.

Run
    torchrun --nproc_per_node 4 train.py --cp 2 --tp 2 --seq-len 512

Invariants (tests/test_cp.py unless named)
    - cp = 1 is plain causal SDPA, bit for bit (test_ring_attention_equals_sdpa_cp2_cp4_gqa).
    - The ring's output and gradients equal one-process SDPA, fp32 ≤ 1e-5 (the same test).
    - Every ring step costs every rank the same work (test_zigzag_blocks_cover_...).
    - `shard_sequence` at cp = 1 returns its input (test_shard_roundtrip_and_errors).
    - A mask or a short sliding window raises (test_foreign.py::test_cp_copied_alone).
      So does a Llama layer's short window, model.Attention.window (test_families.py).
    - `group=None` is the default group, as in torch.distributed (the same test).
    - Packed documents raise: the blocks are causal only. The CLI refuses --cp --sft.
    - A mixture of experts' load-balancing loss pools every token of the rows: its router
      statistics are summed over cp, forward and backward (tests/test_moe_layouts.py: cp2, ep2·cp2).

Reading order
    The public functions come first: `shard_sequence`, `ring_attention`, `apply_cp`.
    Then the ring itself: `_pairs`, `_ring_forward`, `_ring_backward`.
    Refinements follow, each after a `# --- refinement:` banner.
"""
from __future__ import annotations

import math
import weakref
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

Group = dist.ProcessGroup | None


# ------------------------------------------------------------------------ the public functions
def _cp_size_rank(group: Group) -> tuple[int, int]:
    """(size, rank) in `group`. None is the default group, as in torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks, of 2·cp, that rank `rank` holds. One is early, one is late."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full sequence along `dim`: (.., S, ..) → (.., S/cp, ..).

    They are chunk r, then chunk 2cp−1−r. S must be a multiple of 2·cp."""
    if cp == 1:
        return x
    S = x.shape[dim]
    if S % (2 * cp):
        raise ValueError(f"context parallelism: sequence length {S} is not a multiple of 2·cp = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard_sequence(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order. It inverts shard_sequence."""
    cp = len(pieces)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, piece in enumerate(pieces):
        a, b = zigzag_chunks(cp, r)
        chunks[a], chunks[b] = piece.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None,
                   scale: float | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence, for zigzag shards of q, k and v.

    q is (B, nh, S/cp, hd); k and v are (B, nkv, S/cp, hd). The result has q's shape.
    `group` None is the default group. On a group of one this is plain causal SDPA, exactly."""
    cp, _ = _cp_size_rank(group)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = dist.group.WORLD if group is None else group
    return _ring_op(q, k, v, group.group_name, scale)[0]  # the ring below, as one custom op


def apply_cp(model: nn.Module, cp_group: Group, *, layers: str | None = None,
             attention: str | None = None, positions: str | None = None) -> None:
    """Context parallelism from outside: every attention becomes the ring over cp_group.

    cp_group None is the default group. It finds the attention by itself in two layouts:
      - attotron's Llama, meta or materialized: each `attn_fn`, and RoPE's table;
      - transformers' layout: its attention interface, and position_ids.
    Any other model names its parts, as dotted paths:
      - `layers`: its layer list;
      - `attention`: the module in each layer that calls F.scaled_dot_product_attention;
      - `positions`: the module called with the positions 0..s-1 (a learned embedding).
    The caller feeds each rank its zigzag shard of input_ids and labels (`shard_sequence`).
    It passes no position_ids. It sums the target count and the gradients over the cp ranks.
    (The cp ranks hold the same parameters, as dp replicas do.)
    A model's sums over all tokens (its `token_sum_fn`) are summed over cp_group.
    A model whose attention cannot be swapped raises. cp = 1: checked, then nothing changes."""
    cp, rank = _cp_size_rank(cp_group)
    if layers is not None:
        _apply_described(model, cp_group, cp, rank, layers, attention, positions)
    elif _transformers_layout(model):
        if cp > 1:
            _apply_transformers(model, cp_group, cp, rank)
    elif any(hasattr(m, "attn_fn") for m in model.modules()) and \
            hasattr(getattr(model, "model", None), "rotary_emb"):
        if cp > 1:
            for module in model.modules():
                if hasattr(module, "attn_fn"):
                    module.attn_fn = partial(_ring_attn_fn, group=cp_group,
                                             window=getattr(module, "window", None))
            model.model.rotary_emb.register_forward_pre_hook(partial(_global_positions, cp=cp, rank=rank))
            if hasattr(model, "token_sum_fn"):  # a sum over all tokens (an MoE's aux loss)
                model.token_sum_fn = partial(_all_tokens_stats, inner=model.token_sum_fn, group=cp_group)
    else:
        raise ValueError(f"apply_cp cannot find the attention of {type(model).__name__} (neither "
                         "attotron's Llama nor transformers' layout): pass layers=, attention= and "
                         "positions= (dotted paths, e.g. layers='transformer.h', attention='attn', "
                         "positions='transformer.wpe')")


def _ring_attn_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: object, *,
                  group: Group, window: int | None = None) -> torch.Tensor:
    """model.Attention.attn_fn under cp: this rank's zigzag tokens in, (B, s, nh, hd) out.

    q is (B, s, nh, hd); k and v are (B, s, nkv, hd).
    `window` is the layer's sliding window. Shorter than the whole sequence, it is refused.
    Longer, it masks nothing."""
    if docs is not None:
        raise ValueError("context parallelism does not support packed documents (position ids that "
                         "restart inside a row): the ring's blocks are causal only; use --cp 1 for them")
    if window is not None and window < q.shape[1] * dist.get_world_size(group):
        raise ValueError(f"context parallelism does not support a sliding window (sliding_window={window}) "
                         f"shorter than the sequence ({q.shape[1] * dist.get_world_size(group)} tokens): "
                         f"the ring's blocks are causal only; use --cp 1 or a shorter sequence")
    y = ring_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group)  # (B, nh, s, hd)
    return y.transpose(1, 2)  # (B, s, nh, hd)


def _all_tokens_stats(stats: torch.Tensor, *, inner: Callable[[torch.Tensor], torch.Tensor],
                      group: Group) -> torch.Tensor:
    """model.token_sum_fn under cp: an MoE forward's router statistics, whole-row sums.

    moe.router_stats sums over rows, so this rank's (2E + 2,) covers only its zigzag tokens.
    Summed over cp they are the whole rows' (after `inner`: tp's sum under sp, else nothing).
    Backward is a sum too: rank r's loss is its targets · aux(all stats), and the cp ranks'
    losses add up (their gradients are summed as dp replicas'), so every rank's statistics get
    every rank's gradient (`_SumOverRanks`)."""
    return _SumOverRanks.apply(inner(stats), group)


class _SumOverRanks(torch.autograd.Function):
    """y = Σ_ranks x, forward and backward. torch.distributed.nn.functional.all_reduce does the same
    but warns on every call (deprecated in torch 2.13)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()  # contiguous: NCCL's rule; a copy: autograd owns `grad`
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _global_positions(module: nn.Module, args: tuple, *, cp: int, rank: int, check: bool = False) -> tuple:
    """Pre-hook of the module that reads the positions (RoPE's table, a position embedding).

    The model numbers the s local tokens 0..s-1. They need their places in the whole sequence.
    Let c = s/2. Local index p < c is in chunk r: it becomes r·c + p.
    Local index p ≥ c is in chunk 2cp−1−r: it becomes (2cp−1−r)·c + p − c."""
    position_ids, *rest = args  # (B, s) or (s,)
    c = position_ids.shape[-1] // 2
    local = torch.arange(2 * c, device=position_ids.device).expand_as(position_ids)  # 0..s-1
    if check and not torch.equal(position_ids, local):
        raise ValueError(f"apply_cp: {type(module).__name__} got positions other than 0..s-1; the "
                         "ring maps the local 0..s-1 to global positions itself (no packed documents)")
    late = position_ids + (2 * cp - 2 - rank) * c
    return (torch.where(position_ids < c, position_ids + rank * c, late), *rest)


# ------------------------------------------------------------------------------------ the ring
def _pairs(step: int, rank: int, cp: int) -> list[tuple[int, int, bool]]:
    """The blocks (query half, key half, causal) computed at ring step `step`.

    Half 0 is the early chunk and half 1 the late one. That holds for this rank's queries.
    It holds for the K/V block in hand too. docs/cp.md tabulates the cases."""
    if step == 0:
        return [(0, 0, True), (1, 0, False), (1, 1, True)]
    if step <= rank:  # the block came from an earlier rank: t < r
        return [(0, 0, False), (1, 0, False)]
    return [(1, 0, False), (1, 1, False)]  # t > r


def _exchange(send: torch.Tensor, group: dist.ProcessGroup, cp: int, rank: int) -> tuple:
    """Post a send of `send` to the next rank, and a receive from the previous one.

    Returns (works, received buffer). Wait on the works before reading the buffer.
    Wait on them before freeing `send`, too."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % cp),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % cp)]
    return dist.batch_isend_irecv(ops), recv


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries over every rank's K/V: out (B, nh, s, d), l (B, nh, s) in fp32."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, c = q.shape[1], q.shape[2] // 2
    qs = q.split(c, dim=2)  # early and late query chunk, (B, nh, c, d) each
    out: list[torch.Tensor | None] = [None, None]  # merged output per query chunk, fp32
    lse: list[torch.Tensor | None] = [None, None]  # merged log-sum-exp per query chunk, fp32
    kv = torch.stack([k, v]).contiguous()  # (2, B, nkv, s, d): one message per step
    for step in range(cp):
        works, nxt = _exchange(kv, group, cp, rank) if step < cp - 1 else ([], None)
        # the next block is in flight meanwhile
        ks, vs = (_expand(t, heads).split(c, dim=2) for t in kv)  # (B, nh, c, d) each
        for i, j, causal in _pairs(step, rank, cp):
            o, l = _block(qs[i], ks[j], vs[j], causal, scale)
            if out[i] is None:
                out[i], lse[i] = o.float(), l
            else:  # l = log(e^l_acc + e^l_new). Rescale each part to the common normalizer.
                new = torch.logaddexp(lse[i], l)
                out[i] = out[i] * (lse[i] - new).exp()[..., None] + o.float() * (l - new).exp()[..., None]
                lse[i] = new
        _wait(works)
        kv = nxt if nxt is not None else kv
    return torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)  # (B, nh, s, d), (B, nh, s)


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, l: torch.Tensor, group: dist.ProcessGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of this rank's shard, by a second ring. docs/cp.md derives it."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, kv_heads, c = q.shape[1], k.shape[1], q.shape[2] // 2
    # early and late chunks: (B, nh, c, d) each; l's are (B, nh, c)
    qs, os_, ls, dos = q.split(c, 2), o.split(c, 2), l.split(c, 2), dout.contiguous().split(c, 2)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dqs = dq.split(c, dim=2)  # views of dq, (B, nh, c, d) each
    kv = torch.stack([k, v]).contiguous()  # (2, B, nkv, s, d): travels as in forward
    hop: tuple = ([], None)  # last step's dK/dV hop: (works, the buffer it receives)
    for step in range(cp):
        works, nxt = _exchange(kv, group, cp, rank) if step < cp - 1 else ([], None)
        ks, vs = (_expand(t, heads).split(c, dim=2) for t in kv)  # (B, nh, c, d) each
        dks = [torch.zeros_like(ks[0], dtype=torch.float32) for _ in range(2)]  # (B, nh, c, d)
        dvs = [torch.zeros_like(vs[0], dtype=torch.float32) for _ in range(2)]
        for i, j, causal in _pairs(step, rank, cp):
            dq_ij, dk_ij, dv_ij = _block_backward(dos[i], qs[i], ks[j], vs[j], os_[i], ls[i], causal, scale)
            dqs[i].add_(dq_ij)
            dks[j] += dk_ij
            dvs[j] += dv_ij
        # This block's dK/dV from earlier ranks arrived while we computed. Add ours, pass them on.
        # The last hop takes them home to their owner.
        _wait(hop[0])
        dkv = hop[1] if hop[1] is not None else torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        dkv[0] += _fold(torch.cat(dks, dim=2), kv_heads)
        dkv[1] += _fold(torch.cat(dvs, dim=2), kv_heads)
        hop = _exchange(dkv, group, cp, rank)  # `dkv` stays referenced until the hop is waited on
        _wait(works)
        kv = nxt if nxt is not None else kv
    _wait(hop[0])
    dkv = hop[1]  # (2, B, nkv, s, d): this rank's own dK, dV, summed over all queries
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _math_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, h, n, d) over one key block k, v (B, h, m, d).

    Returns (out, l), with l = log Σ exp(s). The plain math, for any device and dtype."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, h, n, m)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)  # (B, h, n)
    return ((s - lse[..., None]).exp() @ v.float()).to(q.dtype), lse


def _math_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, causal: bool,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's share of dq, dk, dv. It takes the FINAL out and l (docs/cp.md)."""
    qf, kf, vf, do = q.float(), k.float(), v.float(), dout.float()
    s = (qf @ kf.transpose(-1, -2)) * scale  # (B, h, n, m)
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    p = (s - lse[..., None]).exp()  # (B, h, n, m): probabilities under the final normalizer
    D = (do * out.float()).sum(-1, keepdim=True)  # (B, h, n, 1)
    ds = p * (do @ vf.transpose(-1, -2) - D)  # (B, h, n, m)
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, p.transpose(-1, -2) @ do


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: (B, n_kv, m, d) → (B, heads, m, d). Query head h reads kv head h // (heads / n_kv)."""
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of an expanded kv, (B, heads, m, d) → (B, n_kv, m, d). Sums each GQA group."""
    B, h, m, d = grad.shape
    return grad if h == kv_heads else grad.view(B, kv_heads, h // kv_heads, m, d).sum(2)  # (B, n_kv, m, d)


# --- refinement: fused kernels for each block
# A fused kernel returns l too, and its backward takes the final out and l.
# CPU: the CPU flash kernel. CUDA in bf16/fp16: the flash kernel. Anything else: _math_block.
def use_flash(q: torch.Tensor) -> bool:
    """Use the CUDA flash kernel for a block: fp16/bf16 only.

    It is a predicate of its own so that tests/cuda_contract.py can point it at meta.
    Then this branch runs on CPU."""
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _fused(q: torch.Tensor) -> str | None:
    if q.device.type == "cpu":
        return "cpu"
    if use_flash(q):
        return "cuda"
    return None


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q over one key block: out (B, h, n, d), l (B, h, n) fp32. Heads are already expanded."""
    kind = _fused(q)
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    if kind == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    return _math_block(q, k, v, causal, scale)


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kind = _fused(q)
    if kind == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kind == "cuda":
        # cum_seq None, not empty tensors: a defined one selects the kernel's varlen branch.
        # lse is read through its data pointer as (B, h, n) contiguous. A chunk of the merged l is a view.
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: unused
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal,
            seed, seed, scale=scale)
    return _math_block_backward(dout, q, k, v, out, lse, causal, scale)


# --- refinement: one custom op for autograd, activation checkpointing and torch.compile
# Selective AC sees a single op. So it never caches the per-block results inside (O(S) per rank).
# It recomputes the whole ring if a checkpointed layer needs it. Compile does not trace into the P2P.
@torch.library.custom_op("attotron::ring_attention", mutates_args=())
def _ring_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, _resolve(group_name), scale)


@_ring_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    # The real outputs are contiguous, whatever q's strides. (q is a transposed view here.)
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _save(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, group_name, scale = inputs
    ctx.save_for_backward(q, k, v, *output)  # this shard's q, k, v, out, l: O(S/cp) per rank
    ctx.group_name, ctx.scale = group_name, scale


def _backward(ctx, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    q, k, v, o, l = ctx.saved_tensors  # dlse is unused: l is an output only for backward's sake
    return (*_ring_backward(dout, q, k, v, o, l, _resolve(ctx.group_name), ctx.scale), None, None)


_ring_op.register_autograd(_backward, setup_context=_save)


def _resolve(group_name: str) -> dist.ProcessGroup:
    return dist.distributed_c10d._resolve_process_group(group_name)


# --- refinement: transformers' models, through their attention interface
def _apply_transformers(model: nn.Module, cp_group: Group, cp: int, rank: int) -> None:
    """Register the ring in transformers' attention interface and name it in the layers' config."""
    calls = [0]  # one entry per model: its own count of the ring's calls
    name = f"attotron_ring_{id(calls)}"
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # imported only for its models
    ALL_ATTENTION_FUNCTIONS.register(name, partial(_hf_ring, group=cp_group, calls=calls))
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = name  # usually one config object for all
    hook = partial(_hf_positions, cp=cp, rank=rank, calls=calls)
    model.model.register_forward_pre_hook(hook, with_kwargs=True)
    model.model.register_forward_hook(partial(_hf_ring_ran, calls=calls))


def _transformers_layout(model: nn.Module) -> bool:
    """transformers' decoder layout: a config with _attn_implementation, model.model.layers."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return hasattr(getattr(model, "config", None), "_attn_implementation") and \
        isinstance(layers, nn.ModuleList) and all(hasattr(layer, "self_attn") for layer in layers)


def _hf_ring(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attention_mask: torch.Tensor | None, *, group: Group, calls: list[int], dropout: float = 0.0,
             scaling: float | None = None, sliding_window: int | None = None,
             **kwargs) -> tuple[torch.Tensor, None]:
    """The ring as a function of transformers' attention interface (AttentionInterface).

    q is (B, nh, s, hd); k and v are (B, nkv, s, hd). It returns ((B, s, nh, hd), no weights).
    It refuses what the ring does not compute."""
    cp, _ = _cp_size_rank(group)
    S = q.shape[2] * cp
    bad = [f"{name}={value!r}" for name, value in kwargs.items()
           if name not in _HF_IGNORED and value is not None and value is not False]
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        bad.append("non-causal attention")
    if attention_mask is not None:
        bad.append("an attention mask")
    if dropout:
        bad.append(f"attention dropout {dropout}")
    if sliding_window is not None and sliding_window < S:
        bad.append(f"sliding_window={sliding_window} < sequence length {S}")
    if k.shape[2] != q.shape[2]:
        bad.append(f"{k.shape[2]} keys for {q.shape[2]} queries (a KV cache)")
    if bad:
        raise ValueError(f"apply_cp: {type(module).__name__} asks for {', '.join(bad)}; the ring computes "
                         "plain causal attention over the whole sequence only")
    calls[0] += 1
    y = ring_attention(q, k, v, group, scaling)  # (B, nh, s, hd)
    return y.transpose(1, 2).contiguous(), None  # (B, s, nh, hd)


# Keyword arguments transformers passes that change nothing here. is_causal is checked apart.
# output_attentions=True would ask for weights: refused.
_HF_IGNORED = {"position_ids", "use_cache", "cache_position", "is_causal"}


def _hf_positions(backbone: nn.Module, args: tuple, kwargs: dict, *, cp: int, rank: int,
                  calls: list[int]) -> tuple:
    """Pre-hook of transformers' backbone (model.model). It feeds RoPE the global zigzag positions."""
    calls[0] = 0  # the ring's calls in this forward: _hf_ring counts, _hf_ring_ran checks
    if kwargs.get("position_ids") is not None:
        raise ValueError("apply_cp: call the model without position_ids: it feeds each token's global "
                         "position itself (packed documents are not supported)")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("apply_cp: the attention mask hides some tokens (padding?); the ring computes "
                         "plain causal attention only")
    x = kwargs.get("input_ids", args[0] if args else None)
    x = kwargs.get("inputs_embeds") if x is None else x
    s = x.shape[1]
    kwargs["position_ids"] = shard_sequence(torch.arange(s * cp, device=x.device)[None], cp, rank)  # (1, s)
    return args, kwargs


def _hf_ring_ran(backbone: nn.Module, args: tuple, out: object, *, calls: list[int]) -> None:
    """Forward hook of the backbone: every layer must have called the ring."""
    if calls[0] < len(backbone.layers):
        raise ValueError(f"apply_cp: {calls[0]} of {len(backbone.layers)} attention layers of "
                         f"{type(backbone).__name__} called transformers' attention interface; the others "
                         "cannot be replaced by the ring")


# --- refinement: described models, whose F.scaled_dot_product_attention call becomes the ring
def _apply_described(model: nn.Module, cp_group: Group, cp: int, rank: int, layers: str,
                     attention: str | None, positions: str | None) -> None:
    """apply_cp on a model that names its parts: swap each SDPA call, hook the positions."""
    if attention is None or positions is None:
        raise ValueError("apply_cp on a described model needs attention= (the module in each layer "
                         "that calls F.scaled_dot_product_attention) and positions= (the module "
                         "called with the positions 0..s-1)")
    found = model.get_submodule(layers)
    targets = [(f"{layers}.{name}.{attention}", layer.get_submodule(attention))
               for name, layer in found.named_children()]
    position_module = model.get_submodule(positions)
    if cp > 1:
        for where, module in targets:
            _swap_sdpa(module, cp_group, where)
        hook = partial(_global_positions, cp=cp, rank=rank, check=True)
        position_module.register_forward_pre_hook(hook)


def _ring_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False, *, group: Group, where: str) -> torch.Tensor:
    """F.scaled_dot_product_attention inside a described attention module.

    It runs the ring if the call is causal, with no mask and no dropout.
    Anything else raises, naming the module."""
    if not is_causal or attn_mask is not None or dropout_p:
        raise ValueError(f"apply_cp: {where} calls scaled_dot_product_attention with is_causal={is_causal}, "
                         f"attn_mask={'given' if attn_mask is not None else None}, dropout_p={dropout_p}; "
                         "the ring computes causal attention only (no mask, no dropout)")
    return ring_attention(q, k, v, group, scale)


class _SdpaToRing(torch.overrides.TorchFunctionMode):
    """While a described attention module runs, its SDPA call becomes the ring.

    Host cost: one Python call per torch function that the module calls."""

    def __init__(self, group: Group, where: str):
        super().__init__()
        self.group, self.where, self.calls = group, where, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return _ring_sdpa(*args, **(kwargs or {}), group=self.group, where=self.where)
        return func(*args, **(kwargs or {}))


def _swap_sdpa(module: nn.Module, group: Group, where: str) -> None:
    """Replace the module's forward by one that runs it under _SdpaToRing.

    The new forward is an instance attribute: no new module, no name changes.
    It raises if the module computed its attention some other way."""
    own, ref = module.__dict__.get("forward"), weakref.ref(module)  # weakref: no module → closure cycle

    def forward(*args, **kwargs):
        mode = _SdpaToRing(group, where)
        with mode:
            out = (own or partial(type(ref()).forward, ref()))(*args, **kwargs)
        if mode.calls == 0:
            raise ValueError(f"apply_cp: {where} ran without calling F.scaled_dot_product_attention, so "
                             "its attention cannot be replaced by the ring")
        return out
    module.forward = forward
