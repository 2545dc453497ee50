"""Mixture of experts: a top-k router, dropless SwiGLU experts and expert parallelism (EP).

What it does
    `MoE` replaces a decoder layer's MLP. A linear router scores every token against E experts.
    Each token goes to its top-k experts. Their outputs come back weighted by the router's
    probabilities. Nothing is dropped: an expert takes however many tokens chose it.
      route      fp32 softmax over the logits, top-k, optionally renormalized k weights
      dispatch   the N·k (token, expert) pairs sorted by expert (a stable sort). Each expert's
                 tokens are then one contiguous block; int32 offsets mark the blocks.
      experts    SwiGLU per expert on its block. One `grouped_mm` for all experts where the
                 kernel runs (`grouped_mm_runs`), else a loop of matmuls: the same numbers.
      combine    each output row times its weight, back in token order, summed over the k
    The weights keep transformers 5's layout (`Experts`), so its block's state_dict loads as a copy.

Core idea
    Sorting by expert turns "each token picks k experts" into "each expert multiplies one
    contiguous block". That gives grouped GEMMs, with no padding and no capacity factor. Under EP,
    rank p holds experts [p·E/ep, (p+1)·E/ep). The sort by expert then also sorts by destination
    rank, so the send buffer needs no second permutation.

Refinements, each below its banner
    - Expert parallelism (`shard_experts`) splits the E experts over the ep ranks of a group. One
      all-to-all sends each (token, expert) row to its expert's rank; a second brings it back.
    - The model: `use_experts` swaps a model.Llama's sparse MLPs for MoE blocks. Its forward
      hooks add the router losses to the loss (`RouterLosses`).
    - The losses: `load_balancing_loss` (Switch) and `router_z_loss` (ST-MoE), made of
      `router_stats`. These are sums over rows, so pipeline stages and sequence shards add up.

Reference
    Shazeer et al. 2017 (sparsely-gated MoE); Fedus et al. 2021, "Switch Transformers" (eq. 4-6);
    Zoph et al. 2022, "ST-MoE" (z-loss); Lepikhin et al. 2020, "GShard" (EP by all-to-all); Gale et
    al. 2022, "MegaBlocks" (dropless). Numerics follow transformers/models/{mixtral,qwen3_moe,olmoe}.

Run
    python -m pytest -q tests/test_moe.py            python -m bench.bench_moe

Builds on: ac.py, only for kept_for_recompute (without it a recompute syncs once more); tp.py, only
    for tp's block style (imported by apply_tp)

Invariants
    - fp32: output, router logits and every gradient equal transformers' three sparse blocks within
      1e-6, an expert with no token included. bf16: bit-equal to their grouped_mm path.
    - The grouped_mm and loop experts agree, forward and backward (test_grouped_mm_equals_loop).
    - load_balancing_loss equals transformers', with and without a padding mask. Activation
      checkpointing does not count a router twice (test_router_logits_once_under_checkpoint).
    - ep = 2 and ep = 4 give ep = 1's outputs and gradients (test_ep_matches_single_process).
    - Host syncs per layer: none at ep = 1 with grouped_mm (CPU, sm90, sm100); one for the loop
      (other GPUs). At ep > 1 one in forward (the counts size the buffers), none in backward,
      none in full AC's recompute. ep = 1 is the same path. Counted at the dispatcher (test_cuda_paths.py).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:  # full AC's recompute reuses the forward's host reads (ac.py); copied alone, each recompute reads again
    from ac import kept_for_recompute
except ImportError:
    def kept_for_recompute(read: Callable[[], Any]) -> Any:  # the same values, one more sync in a recompute
        return read()

Group = dist.ProcessGroup | None


@dataclass
class MoEConfig:
    hidden: int
    intermediate: int  # per expert (Qwen3-MoE's moe_intermediate_size)
    num_experts: int
    top_k: int
    renormalize: bool = True  # Mixtral always; Qwen3-MoE and OLMoE: config.norm_topk_prob
    # the combine weights' dtype: Mixtral keeps them fp32, Qwen3-MoE / OLMoE cast to the logits'
    fp32_weights: bool = True
    aux_loss_coef: float = 0.0  # config.router_aux_loss_coef
    z_loss_coef: float = 0.0
    experts_impl: str = "auto"  # "auto" (grouped_mm where it runs) | "grouped_mm" | "loop"

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.experts_impl not in ("auto", "grouped_mm", "loop"):
            raise ValueError(f"experts_impl={self.experts_impl!r}: use auto, grouped_mm or loop")

    @classmethod
    def from_hf(cls, config: Any, **overrides: Any) -> MoEConfig:
        """The MoE block of a transformers Mixtral, Qwen3-MoE or OLMoE config; keyword overrides
        replace any field (experts_impl="loop", z_loss_coef=...)."""
        kind = config.model_type
        if kind not in ("mixtral", "qwen3_moe", "olmoe"):
            raise ValueError(f"model_type {kind!r}: moe.py knows mixtral, qwen3_moe and olmoe")
        if getattr(config, "router_jitter_noise", 0.0):
            raise ValueError("router_jitter_noise > 0 is not implemented (Mixtral trains without)")
        mixtral = kind == "mixtral"
        fields = dict(hidden=config.hidden_size,
                      intermediate=getattr(config, "moe_intermediate_size", config.intermediate_size),
                      num_experts=config.num_local_experts if mixtral else config.num_experts,
                      top_k=config.num_experts_per_tok,
                      renormalize=True if mixtral else config.norm_topk_prob,
                      fp32_weights=mixtral, aux_loss_coef=config.router_aux_loss_coef)
        return cls(**{**fields, **overrides})


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          fp32_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) logits -> the top-k experts of each token (N, k) and their weights (N, k).
    The softmax runs in fp32 whatever the logits' dtype (as all three families)."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E) fp32
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (N, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights if fp32_weights else weights.to(logits.dtype), experts


class Router(nn.Module):
    """The linear gate: `weight` (E, H) as transformers' `*TopKRouter.weight`. Returns (logits,
    weights, experts) in transformers' order, so its logits can be recorded by a forward hook."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden))
        nn.init.normal_(self.weight, std=0.02)
        # a seam: the weight as the forward uses it. tp.py's sequence parallelism passes it through
        # its f (each tp rank routes its own tokens, so the gradient is summed over tp)
        self.weight_fn: Callable[[torch.Tensor], torch.Tensor] = lambda w: w

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight_fn(self.weight))  # (N, E) in x's dtype
        weights, experts = route(logits, self.cfg.top_k, self.cfg.renormalize, self.cfg.fp32_weights)
        return logits, weights, experts


def grouped_mm_runs(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `grouped_mm(x, w)` has its fast kernel for these tensors. Each path's host syncs:
    - CUDA sm90 and sm100 (H100, H200, B200), bf16: the fused kernel reads the offsets on the
      device. No host sync.
    - Other CUDA GPUs (A100, L40S, consumer cards): torch's grouped_mm would copy the offsets to
      the host (a blocking sync) and run a GEMM per expert. So `False`: the loop runs instead,
      with one sync a call of its own (counts.tolist()), none under EP (the counts are on the host).
    - CPU (torch >= 2.9): any float dtype. No device to wait for.
    CUDA and CPU both need every stride and the data pointers 16-byte aligned.
    Meta (the contract tests): always, so the grouped branch is traced there."""
    if not hasattr(F, "grouped_mm") and not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "meta":
        return True
    if x.device.type == "cuda":
        if w.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
            return False
    elif x.device.type != "cpu":
        return False
    size = x.element_size()
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())
               for t in (x, w))


_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: grouped_mm's CPU backward rejects
    the stride-0 gradient that `.sum().backward()` sends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _ZeroIdle(torch.autograd.Function):
    """Identity on an expert weight (E, ...) whose backward zeroes the gradient of every expert
    that got no rows. grouped_mm's backward may leave theirs uninitialized (pytorch #172439,
    Blackwell). torch.where, not a multiply by the mask: 0 · NaN is NaN."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counts)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (counts,) = ctx.saved_tensors
        used = (counts > 0).view(-1, *[1] * (grad.dim() - 1))  # (E, 1, 1)
        return torch.where(used, grad, 0.0), None


class _SwiGLU(torch.autograd.Function):
    """silu(gate)·up of the fused projection h = [gate | up] (M, 2I) -> (M, I), autograd's exact
    numbers. The backward writes both halves of dh into one (M, 2I) buffer, where chunk's
    backward would allocate and concatenate two."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)  # (M, I) each
        s = F.silu(gate)
        ctx.save_for_backward(h, s)
        return s * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        h, s = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        dh = torch.empty_like(h)  # (M, 2I)
        d_gate, d_up = dh.chunk(2, dim=-1)
        torch.mul(grad, s, out=d_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=d_gate)
        return dh


def experts_grouped(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert's block of x (M, H), as two grouped GEMMs. The rows are sorted by
    expert, counts (E,) rows each. No host sync: the int32 offsets stay on the device."""
    offs = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's block
    gate_up, down = _ZeroIdle.apply(gate_up, counts), _ZeroIdle.apply(down, counts)  # idle experts: grad 0
    # _ContiguousGrad is the identity (CPU's grouped_mm backward needs a contiguous gradient)
    h = _ContiguousGrad.apply(_grouped_mm(x, gate_up.transpose(1, 2), offs=offs))  # (M, 2I)
    a = _SwiGLU.apply(h)  # (M, I): silu(gate)·up of h = [gate | up]
    return _ContiguousGrad.apply(_grouped_mm(a, down.transpose(1, 2), offs=offs))  # (M, H)


def experts_loop(x: torch.Tensor, counts: Sequence[int], gate_up: torch.Tensor,
                 down: torch.Tensor) -> torch.Tensor:
    """The same as `experts_grouped`, one matmul pair per expert; counts are host ints."""
    outs = []
    # unbind: one backward node stacks all experts' grads (indexing gate_up[e] would add a full
    # (E, 2I, H) zero tensor per expert in backward). An expert without rows still multiplies its
    # empty block: its gradient is then zeros, not None, as grouped_mm's (dp.py needs one).
    for xe, gu, dn in zip(x.split(list(counts)), gate_up.unbind(0), down.unbind(0)):
        outs.append(_SwiGLU.apply(xe @ gu.t()) @ dn.t())  # (n, 2I) -> (n, I) -> (n, H)
    return torch.cat(outs)


class Experts(nn.Module):
    """E SwiGLU experts as two fused 3-D weights, transformers 5's in-memory layout:
    `gate_up_proj` (E, 2I, H) with the gate rows first, `down_proj` (E, H, I). Under EP this rank
    holds experts [first, first + E_local), and the weights' first dimension is E_local."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        E, H, I = cfg.num_experts, cfg.hidden, cfg.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))  # rows [:I] gate, [I:] up
        self.down_proj = nn.Parameter(torch.empty(E, H, I))
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(w, std=0.02)
        self.weight_fn: Callable[[torch.Tensor], torch.Tensor] = lambda w: w  # the seam of Router's

    def use_grouped(self, x: torch.Tensor) -> bool:
        impl = self.cfg.experts_impl
        runs = grouped_mm_runs(x, self.gate_up_proj) and grouped_mm_runs(x, self.down_proj)
        if impl == "grouped_mm" and not runs:
            raise RuntimeError(f"grouped_mm has no kernel for {x.dtype} on {x.device} at these "
                               "strides; use experts_impl='loop' or 'auto'")
        return impl == "grouped_mm" or (impl == "auto" and runs)

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                host_counts: list[int] | None = None) -> torch.Tensor:
        """x (M, H) sorted by local expert, counts (E_local,) on the device. host_counts: the same
        as ints, when the caller already has them (EP). The loop then costs no extra sync."""
        gate_up, down = self.weight_fn(self.gate_up_proj), self.weight_fn(self.down_proj)
        if self.use_grouped(x):
            return experts_grouped(x, counts, gate_up, down)
        return experts_loop(x, host_counts if host_counts is not None else counts.tolist(), gate_up, down)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, expert) pairs each expert got: (E,) int64, on the device with no sync
    (bincount would sync on CUDA to find its length)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))


class _Gather(torch.autograd.Function):
    """out = x[index // k], index a permutation of range(len(x)·k). Backward gathers the gradient
    by the inverse permutation and sums each source row's k copies. Indexing's own backward would
    scatter-add into zeros: it does not know the index is a permutation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor,
                k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x[index // k] if k > 1 else x[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        grad = grad[inverse]  # (len(x)·k, H) in source order
        if ctx.k > 1:
            grad = grad.view(-1, ctx.k, grad.shape[-1]).sum(dim=1)  # (len(x), H)
        return grad, None, None, None


def permutation(experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse) of the flattened (N·k,) expert ids. order sorts them by expert, and ties
    keep token order (a stable sort). inverse undoes it."""
    order = torch.argsort(experts.reshape(-1), stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order, inverse


class MoE(nn.Module):
    """The sparse MoE block: x (..., H) -> (..., H). `gate` and `experts` are named as in
    transformers' `*SparseMoeBlock`, so `load_state_dict(hf_block.state_dict())` is a copy."""
    compile_eager = True  # model.compile_layers: data-dependent shapes and, under EP, a host sync

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.ep_group: Group = None  # set by shard_experts; None with ep_size 1: no exchange
        self.ep_size = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, H)
        _, weights, experts = self.gate(x)  # (N, k), (N, k)
        k = experts.shape[1]
        order, inverse = permutation(experts)  # (N·k,) each: the pairs sorted by expert, and back
        rows = _Gather.apply(x, order, inverse, k)  # (N·k, H) each pair's token, sorted
        counts = expert_counts(experts, self.cfg.num_experts)  # (E,)
        if self.ep_size == 1:
            y = self.experts(rows, counts)  # (N·k, H)
        else:
            y = exchange_and_run(rows, counts, self.experts, self.ep_size, self.ep_group)
        # the same gather with order and inverse swapped un-sorts: back to (token, slot) order
        y = _Gather.apply(y, inverse, order, 1) * weights.reshape(-1, 1)  # (N·k, H)
        # sum over the k slots in slot order: deterministic (index_add_ would race on CUDA), in the
        # weights' dtype (fp32 for Mixtral) before the cast back, as transformers' grouped_mm path
        return y.view(-1, k, shape[-1]).sum(dim=1).to(x.dtype).view(shape)


# --- refinement: expert parallelism (all-to-all dispatch, the groups, gradient reduction) ---


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits. The backward sends the gradient the reverse way, with
    the splits swapped. They are kept from forward: no host sync in backward.
    The arguments follow all_to_all_single: the output's splits first, then the input's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group  # backward's output is our input
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        out = grad.new_empty(sum(out_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), out_splits, in_splits, group=ctx.group)
        return out, None, None, None


def exchange_counts(counts: torch.Tensor, ep: int, group: Group) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """counts (E,) rows per global expert → recv (ep, E_local): recv[s, e] rows come from rank s
    for my expert e; per_expert (E_local,); and on the host: rows to each rank, from each rank,
    per local expert (ep + ep + E_local ints). One all-to-all of the counts, one host sync."""
    send = counts.view(ep, -1)  # (ep, E_local) my rows for each rank's experts
    recv = torch.empty_like(send)  # (ep, E_local)
    dist.all_to_all_single(recv, send, group=group)
    per_expert = recv.sum(0)  # (E_local,)
    return recv, per_expert, torch.cat([send.sum(1), recv.sum(1), per_expert]).tolist()  # the one sync


def exchange_and_run(rows: torch.Tensor, counts: torch.Tensor, experts: Experts, ep: int,
                     group: Group) -> torch.Tensor:
    """rows (M, H) sorted by global expert, counts (E,) → (M, H) in the same order. Each row goes
    to the rank holding its expert, the local experts run there, and the results come back.
    One host sync: the exchanged counts must reach the host to size the receive buffer. Full AC's
    recompute makes none: it reuses the forward's counts (ac.kept_for_recompute)."""
    local = counts.numel() // ep
    recv, per_expert, host = kept_for_recompute(lambda: exchange_counts(counts, ep, group))
    send_splits, recv_splits, host_counts = host[:ep], host[ep:2 * ep], host[2 * ep:]
    got = _AllToAll.apply(rows, recv_splits, send_splits, group)  # (R, H), R = recv.sum(): by source, then expert
    # got is [source 0: its rows for my expert 0, for expert 1, ...][source 1: ...] ...
    # Label each row with its local expert, then sort stably: expert 0's rows of every source, then
    # expert 1's... Example, ep 2, E_local 2, recv [[1, 2], [3, 0]]: labels 0 1 1 0 0 0 → 0 0 0 0 1 1.
    ids = torch.arange(local, device=rows.device).repeat(ep)  # (ep·E_local,): 0 1 .. 0 1 ..
    ids = torch.repeat_interleave(ids, recv.reshape(-1), output_size=got.shape[0])  # (R,) each row's label
    order, inverse = permutation(ids)  # (R,) each
    y = experts(_Gather.apply(got, order, inverse, 1), per_expert, host_counts)  # (R, H)
    return _AllToAll.apply(_Gather.apply(y, inverse, order, 1), send_splits, recv_splits, group)


@dataclass
class EPGroups:
    """ep: the ranks that exchange tokens, each holding 1/ep of the experts. replica: the ranks
    that hold the same experts as this one. Its expert gradients are summed there."""
    ep: Group
    replica: Group
    ep_size: int
    ep_rank: int


def ep_groups(ep: int, group: Group = None) -> EPGroups:
    """Split `group` (None: the default group) of n ranks into n/ep blocks of ep consecutive ranks.
    These exchange tokens; consecutive ranks share a node on GPUs. ep strided groups are the
    replicas. Collective: every rank of `group` must call it, in the same order."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))
    n, me = len(ranks), ranks.index(dist.get_rank())
    if ep < 1 or n % ep:
        raise ValueError(f"ep={ep} must divide the {n} ranks of the group")
    mine = {}
    for b in range(n // ep):  # every rank creates every group, in one order (new_group's rule)
        g = dist.new_group(ranks[b * ep:(b + 1) * ep])
        if b == me // ep:
            mine["ep"] = g
    for j in range(ep):
        g = dist.new_group(ranks[j::ep])
        if j == me % ep:
            mine["replica"] = g
    return EPGroups(ep=mine["ep"], replica=mine["replica"], ep_size=ep, ep_rank=me % ep)


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def shard_experts(model: nn.Module, groups: EPGroups) -> nn.Module:
    """Keep on this rank only its 1/ep of every MoE block's experts and route through the ep
    group. In place; returns the model. At ep = 1 it keeps every expert and changes nothing."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("shard_experts: the model has no moe.MoE block")
    for block in blocks:
        E, ep = block.cfg.num_experts, groups.ep_size
        if E % ep:
            raise ValueError(f"ep={ep} must divide num_experts={E}")
        local = E // ep
        first = groups.ep_rank * local
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(block.experts, name)
            setattr(block.experts, name, nn.Parameter(w.detach()[first:first + local].clone()))
        block.ep_group, block.ep_size = groups.ep, ep
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters sharded by EP (the experts' weights); everything else is replicated."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


def grad_reduce_plan(model: nn.Module, groups: EPGroups) -> Callable[[str], tuple[Group, Group] | None]:
    """zero.py's parameter → group seam for expert parallelism: name → (group, across), or None.
    An expert sums its gradient over the ranks holding the same experts (groups.replica).
    Its gradient already holds the ep peers' tokens: the all-to-all's backward brought them.
    Summing over all of dp would count those tokens twice (the 2x gradient bug).
    The ep ranks hold the other experts in its place (across: the grad norm adds them).
    Everything else, the routers included, is reduced over all of dp (None)."""
    experts = {id(p) for p in expert_parameters(model)}
    names = {n for n, p in model.named_parameters() if id(p) in experts}
    return lambda name: (groups.replica, groups.ep) if name in names else None


# --- refinement: the MoE in a decoder (model.Llama): the module swap and the router losses ---
# Three seams of model.py carry it, and its forward has no line about experts:
#   the module swap   a sparse layer's `mlp` becomes an MoE block (`use_experts`)
#   forward hooks     the model's pre-hook takes this extension's keywords, its hook adds the loss
#   token_sum_fn      the model's sum over all tokens of a forward (sp and cp split the tokens)
# A pipeline stage declares what it passes on in `side_tensors` (pp.py sends it with h).


def layer_config(cfg: Any) -> MoEConfig:
    """The sparse layers' MoEConfig from a model.LlamaConfig. Mixtral keeps the combine weights in
    fp32; Qwen3-MoE and OLMoE cast them to the logits' dtype (`fp32_weights`)."""
    return MoEConfig(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                     num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                     renormalize=cfg.norm_topk_prob, fp32_weights=cfg.model_type == "mixtral",
                     aux_loss_coef=cfg.router_aux_loss_coef)


def use_experts(model: nn.Module) -> nn.Module:
    """Make a model.Llama a mixture of experts, in place, and return it. The MLP of each layer that
    `config.is_sparse` names becomes an MoE block. With `config.output_router_logits` the loss adds
    the router losses of the whole forward (`RouterLosses`). model.build calls it on meta."""
    cfg = model.config
    for name, layer in model.model.layers.items():
        if cfg.is_sparse(int(name)):
            layer.mlp = MoE(layer_config(cfg))
    losses = RouterLosses(layer_config(cfg))
    model.register_forward_pre_hook(losses.take_keys, with_kwargs=True)
    model.register_forward_hook(losses.add, with_kwargs=True)
    for router in (m for m in model.modules() if isinstance(m, Router)):
        router.register_forward_hook(losses.keep)
    if cfg.output_router_logits:  # a stage before the last passes its routers' statistics on
        model.side_tensors = {"router_stats": ((2 * cfg.num_experts + 2,), torch.float32)}
    return model


class RouterLosses:
    """The load-balancing (and z) loss of a whole forward, as transformers' *ForCausalLM. The loss
    adds coef · load_balancing_loss, every layer's tokens pooled. Three forward hooks make it.
      take_keys  (model pre-hook) takes two keywords off the call. `router_stats`: the earlier
                 pipeline stages' statistics. `real_tokens` (B, S) bool: False marks padding
                 (sft.py's rows). Padding counts in no statistic, as transformers' attention_mask.
      keep       (router hook) keeps each router's logits of this forward, one slot per router.
      add        (model hook) sums the statistics (`router_stats`) over all tokens
                 (model.token_sum_fn) and the earlier stages. The last stage adds the loss. A
                 stage before it returns (h, statistics), as `side_tensors` declares.
    Autograd thus reaches every router. Activation checkpointing reruns a router in backward, after
    `add`: `keep` then records nothing, so no router counts twice. With
    config.output_router_logits false, the hooks only drop the two keywords. The hooks live on the
    model and its Router modules: a file that replaces a Router must move its hooks too."""

    def __init__(self, cfg: MoEConfig):
        self.cfg = cfg
        self.logits: dict[nn.Module, torch.Tensor] | None = None  # open only during a forward
        self.earlier: torch.Tensor | None = None
        self.real_tokens: torch.Tensor | None = None

    def take_keys(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        self.earlier, self.real_tokens = kwargs.pop("router_stats", None), kwargs.pop("real_tokens", None)
        if self.real_tokens is not None and kwargs.get("cache") is not None:
            raise ValueError("a KVCache takes plain rows: no real_tokens")
        self.logits = {} if model.config.output_router_logits else None
        return args, kwargs

    def keep(self, router: nn.Module, args: tuple, out: tuple) -> None:
        if self.logits is not None:
            self.logits[router] = out[0]  # (N, E)

    def add(self, model: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        logits, earlier, real_tokens = self.logits, self.earlier, self.real_tokens
        self.logits = self.earlier = self.real_tokens = None  # this call's, used once
        call = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
        call.apply_defaults()
        labels, reduction = call.arguments["labels"], call.arguments["reduction"]
        if logits is None or call.arguments["cache"] is not None or (labels is None and model.lm_head is not None):
            return None  # no statistics: generation, or logits only
        routers = [logits[m] for m in model.modules() if m in logits]  # in layer order
        own = model.token_sum_fn(router_stats(routers, self.cfg.num_experts, self.cfg.top_k,
                                              real_tokens, device=out.device))  # (2E + 2,)
        stats = own if earlier is None else earlier + own
        if model.lm_head is None:
            return out, stats
        # a summed loss gets the term once per target token, so sum / count is transformers' loss
        return out + stats_loss(stats, self.cfg) * ((labels != -100).sum() if reduction == "sum" else 1)


# --- refinement: the router losses and recording the routers' logits ---


def router_stats(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                 attention_mask: torch.Tensor | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """What the router losses need from a forward's layers, each summed over all their rows.
    (2E + 2,) fp32 = [P (E): the router probabilities | picks (E): the top-k picks | rows |
    z: logsumexp(logits)²]. Only P and z carry gradients. Every entry is a sum over rows. So the
    statistics of two pieces of one forward add up to the whole's: pipeline stages, sequence shards.
    The softmax runs in the logits' dtype, as transformers' load_balancing_loss_func.
    attention_mask (B, S) of 0/1: padding rows count for nothing, in every layer. device: where
    the statistics of no layer are made (a pipeline stage of dense layers only)."""
    E = num_experts
    stats = torch.zeros(2 * E + 2, dtype=torch.float32,
                        device=router_logits[0].device if router_logits else device)
    for logits in router_logits:  # each (B·S, E)
        if attention_mask is not None and attention_mask.numel() != logits.shape[0]:
            raise ValueError(f"attention_mask has {attention_mask.numel()} tokens, the router saw "
                             f"{logits.shape[0]} (a sequence shard: give the mask of its tokens)")
        probs = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)  # (B·S, k)
        keep = (torch.ones(logits.shape[0], device=logits.device) if attention_mask is None
                else attention_mask.reshape(-1).to(device=logits.device, dtype=torch.float32))  # (B·S,)
        picks = torch.zeros(E, device=logits.device).scatter_add_(0, chosen.reshape(-1),
                                                                  keep.repeat_interleave(top_k))
        z = torch.logsumexp(logits.float(), dim=-1) ** 2  # (B·S,)
        stats = stats + torch.cat([(probs.float() * keep[:, None]).sum(0), picks,  # (2E + 2,)
                                   keep.sum()[None], (z * keep).sum()[None]])
    return stats


def balance_loss_of(stats: torch.Tensor) -> torch.Tensor:
    """Switch's E·Σ_i f_i·P_i from `router_stats`, as transformers. f_i (the picks) and P_i are over
    the rows of all layers together. So Σ f_i = k, and a perfectly balanced router scores k. The
    picks and the row count are constants: the gradient flows through P only."""
    E = (stats.numel() - 2) // 2
    prob, picks, rows = stats[:E], stats[E:2 * E].detach(), stats[2 * E].detach()
    return E * torch.sum((picks / rows) * (prob / rows))


def z_loss_of(stats: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss from `router_stats`: the mean over all layers' rows of logsumexp(logits)²."""
    return stats[-1] / stats[-2].detach()


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch's auxiliary loss E·Σ_i f_i·P_i, as transformers' load_balancing_loss_func. f_i is
    the number of top-k picks of expert i, P_i the sum of its router probability. Both are summed
    over every layer's rows and divided by the rows of all layers together (`balance_loss_of`)."""
    return balance_loss_of(router_stats(router_logits, num_experts, top_k, attention_mask))


def router_z_loss(router_logits: Sequence[torch.Tensor],
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over all layers' rows of logsumexp(logits)², in fp32. It keeps
    the logits small, which the softmax's fp32 rounding and bf16 logits need."""
    E = router_logits[0].shape[-1]
    return z_loss_of(router_stats(router_logits, E, 1, attention_mask))


def stats_loss(stats: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """What the routers add to the training loss, from a whole forward's `router_stats`: the
    config's coefficients times the losses."""
    loss = cfg.aux_loss_coef * balance_loss_of(stats)
    return loss + cfg.z_loss_coef * z_loss_of(stats) if cfg.z_loss_coef else loss


def router_loss(router_logits: Sequence[torch.Tensor], cfg: MoEConfig,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """What the routers add to the training loss: the config's coefficients times the losses."""
    return stats_loss(router_stats(router_logits, cfg.num_experts, cfg.top_k, attention_mask), cfg)


@contextlib.contextmanager
def record_router_logits(model: nn.Module) -> Iterator[list[torch.Tensor | None]]:
    """Collect each router's logits of the forwards run inside, in module order. Each router has one
    slot, which its later calls overwrite. So activation checkpointing's recompute (a second
    forward of the layer, in backward) cannot count a router twice."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    slots: list[torch.Tensor | None] = [None] * len(routers)

    def keep(i: int):
        def hook(module: nn.Module, args: tuple, out: tuple) -> None:
            slots[i] = out[0]
        return hook

    handles = [r.register_forward_hook(keep(i)) for i, r in enumerate(routers)]
    try:
        yield slots
    finally:
        for h in handles:
            h.remove()


# ---- tensor parallelism: the experts whole on every tp rank
# tp.apply_tp asks a module for its own style (`tp_style`): MoE answers here.
# Choice: no expert tensor parallelism. A rank holds every expert of its stage.
# Expert parallelism (shard_experts) splits them over dp instead.
# Attention is tp-split as in a dense layer.
# Without sp the block's input is replicated: every tp rank routes all tokens.
# Each rank computes the same output, so its dL/dx is complete.
# So the block gets no f: an all-reduce would count dL/dx tp times.
# Its parameters get the same full gradient on every rank.
# (train.py counts a replicated parameter in the grad norm on tp rank 0 only.)
# That costs tp× the expert FLOPs.
# With sp each rank routes its own S/tp tokens.
# The post-attention norm does not gather: the block maps (B, S/tp, H) to (B, S/tp, H).
# The router's and experts' weights enter through f, by the `weight_fn` seams.
# So autograd sums their gradients over tp, as for a sequence-parallel norm's weight.
# The aux loss pools all tokens of the forward.
# tp sets the model's `token_sum_fn` to all-reduce the router statistics (g).
# g's backward passes each rank's copy of the loss gradient straight back to its own rows.
def _tp_style(self: MoE, layer: nn.Module, group: Group, sequence_parallel: bool) -> None:
    """tp.apply_tp's style of this block: the experts stay whole (the plan leaves them out).
    Under sp the block runs on the S/tp tokens this rank holds.
    Its norm then keeps them (no gather), and the router's and experts' weights enter through f."""
    if sequence_parallel:
        from functools import partial

        from tp import ReplicatedRMSNorm, copy_to_region  # apply_tp calls this: tp.py is loaded
        layer.post_attention_layernorm = ReplicatedRMSNorm(layer.post_attention_layernorm, group)
        self.gate.weight_fn = self.experts.weight_fn = partial(copy_to_region, group=group)


MoE.tp_style = _tp_style
