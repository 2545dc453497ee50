"""Muon for the hidden matrices, AdamW for the rest: the update rule, one process to ZeRO-3 and tp.

What it does
    `MuonRule(cfg)` is an update rule (precision.UpdateRule) for the mixed-precision optimizer.
    Hidden 2-D matrices (q, k, v, o, gate, up, down) step by Muon. 3-D experts: each expert's matrices.
    The embedding, the head, the norms and the biases step by AdamW, as before.
    Both keep fp32 state beside the fp32 masters. Newton–Schulz computes in bf16, as torch's does.
    train.py: `--optimizer muon --muon-lr 0.02`. The AdamW flags (--lr, --weight-decay) stay AdamW's.

The core idea
    Muon keeps a momentum of each matrix's gradient (elementwise).
    Its update is that momentum made orthogonal: U·Vᵀ of its SVD, by five Newton–Schulz iterations.
    Orthogonalization needs the whole matrix. ZeRO and tp hold pieces of it.
    So each matrix gets one owner rank in its ZeRO group. The pieces go there (one all-to-all).
    Under tp the owner first gathers the tp shards (tp ranks share owners). It orthogonalizes.
    The new values go back to the pieces' holders (a second all-to-all).
    Everything else is elementwise, so it runs on the pieces where they lie, as AdamW does.

Reference
    Jordan et al. 2024, "Muon: an optimizer for hidden layers" (kellerjordan.github.io/posts/muon).
    torch.optim.Muon (torch 2.13): the same ops, the same bf16 Newton–Schulz, the same coefficients.
    We follow its adjust_lr_fn="original": lr · sqrt(max(1, A/B)) for an A×B matrix.
    Liu et al. 2025, "Muon is Scalable for LLM Training"; nanochat's DistMuon (owners, ZeRO).

Run
    torchrun --nproc_per_node 4 train.py --optimizer muon --muon-lr 0.02 --zero 2

Invariants
    - One process, fp32: the parameters after 3 steps equal torch.optim.Muon + torch.optim.AdamW's,
      bit for bit. Test: tests/test_muon.py::test_one_process_equals_torch_muon.
    - The exchange (ZeRO's pieces to owners, the tp gather, back) equals torch.optim.Muon bit for bit
      when fed the same gradients. Test: tests/test_muon.py::test_owners_and_tp_gather_equal_torch_muon.
    - tp, pp, ZeRO-1/2/3 and ep through train.py equal one process, up to bf16 Newton–Schulz's
      amplified rounding (docs/muon.md). Test: tests/test_muon.py::test_layouts_equal_one_process.
    - The state is a piece per master, as AdamW's: checkpoints stay layout-free.
      Test: tests/test_muon.py::test_resume_across_layouts.
    - Each matrix is orthogonalized once per step, on its owner. Owners balance the Newton–Schulz work.
      Test: tests/test_muon.py::test_owners_balance_work.

Builds on: precision.py (the UpdateRule seam); zero.py's pieces, when it runs under ZeRO.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import precision

Group = Any  # a torch.distributed.ProcessGroup, or None for the default group
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's)


@dataclass
class MuonConfig:
    lr: float = 0.02  # the peak; the schedule scales it as it scales AdamW's
    weight_decay: float = 0.0  # decoupled: the master shrinks by lr · weight_decay per step
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    eps: float = 1e-7


def hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Muon's parameters: 2-D matrices and 3-D stacks of experts' matrices.
    Not the embedding or the head: their rows are tokens, not a hidden map."""
    return param.ndim in (2, 3) and not any(k in name for k in ("embed", "lm_head", "wte", "wpe"))


# ---- the core: Newton–Schulz and the step, on whole matrices --------------------------------
def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's _zeropower_via_newtonschulz, op for op. (A, B) in, bf16 (A, B) out.
    A quintic iteration pushes every singular value towards 1 (to about 0.7-1.2)."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    if g.size(0) > g.size(1):
        x = x.T  # (B, A): the Gram matrix is the smaller side
    x.div_(x.norm().clamp(min=eps))  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T  # (m, m), m = min(A, B)
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·G + c·G²
        x = torch.addmm(x, gram_update, x, beta=a)  # a·X + (b·G + c·G²)·X
    return x.T if g.size(0) > g.size(1) else x


def orthogonalize(g: torch.Tensor, steps: int, eps: float, blocks: int = 1) -> torch.Tensor:
    """A matrix (A, B), or each expert's of a stack (E, A, B), one at a time, as on its own.
    blocks > 1: the rows stack that many matrices (an expert's gate and up): each on its own too."""
    if g.ndim == 3:
        return torch.stack([orthogonalize(e, steps, eps, blocks) for e in g])  # (E, A, B)
    if blocks > 1:
        return torch.cat([newton_schulz(b, steps, eps) for b in g.chunk(blocks, 0)])  # (A, B)
    return newton_schulz(g, steps, eps)


def fused_blocks(name: str, param: torch.Tensor) -> int:
    """How many matrices a parameter's rows stack. An expert stack's gate_up_proj (E, 2I, H) holds
    two per expert, gate and up, as a dense MLP's two matrices: Muon steps them apart."""
    return 2 if name.endswith("gate_up_proj") and param.ndim == 3 else 1


def adjusted_lr(lr: float, shape: tuple[int, ...]) -> float:
    """adjust_lr_fn="original": an A×B matrix's update has RMS about sqrt(1/B) when A <= B.
    Scaling by sqrt(max(1, A/B)) gives tall matrices the same per-element size."""
    A, B = shape[-2:]
    return lr * math.sqrt(max(1, A / B))


class MuonRule:
    """precision.UpdateRule: Muon for the parameters `is_muon` picks, AdamW for the others.
    AdamW takes the optimizer's OptimConfig, Muon this MuonConfig.
    tp_group, tp_dim: under tp, each sharded matrix's shard dim by name (tp.Shard.dim).
    A matrix absent from tp_dim is whole on every tp rank."""
    elementwise = False  # Newton–Schulz reads whole matrices: one step call over every master

    def __init__(self, cfg: MuonConfig | None = None,
                 is_muon: Callable[[str, torch.Tensor], bool] = hidden_matrix,
                 tp_group: Group = None, tp_dim: dict[str, int] | None = None,
                 blocks: Callable[[str, torch.Tensor], int] = fused_blocks):
        self.cfg, self.is_muon, self.blocks = cfg or MuonConfig(), is_muon, blocks
        self.tp_group, self.tp_dim = tp_group, tp_dim or {}

    def build(self, opt: Any) -> "MuonAdamW":
        return MuonAdamW(opt, self.cfg, self.is_muon, self.tp_group, self.tp_dim, self.blocks)


class MuonAdamW:
    """The optimizer MuonRule builds: a torch.optim.AdamW over the other masters, and Muon.
    One `state` (the AdamW's): each master's {"step", exp_avg, exp_avg_sq} or {"step", momentum_buffer}.
    `param_groups`: AdamW's two, then Muon's. precision sets every group's "lr" to AdamW's schedule.
    Muon's lr follows it: muon lr · (lr / peak lr)."""

    def __init__(self, opt: Any, cfg: MuonConfig, is_muon: Callable[[str, torch.Tensor], bool],
                 tp_group: Group, tp_dim: dict[str, int], blocks: Callable[[str, torch.Tensor], int]):
        self.opt, self.cfg, self.tp_group = opt, cfg, tp_group
        self.muon = [i for i, (n, p) in enumerate(zip(opt.names, opt.params)) if is_muon(n, p)]
        self.blocks = {i: blocks(opt.names[i], opt.params[i]) for i in self.muon}
        others = [i for i in range(len(opt.master)) if i not in self.blocks]
        decay = [opt.master[i] for i in others if opt.params[i].ndim >= 2]
        rest = [opt.master[i] for i in others if opt.params[i].ndim < 2]
        fused = bool(opt.master) and precision.use_fused_adamw(opt.master[0])  # CUDA: one kernel
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt.cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=opt.cfg.lr, betas=(opt.cfg.beta1, opt.cfg.beta2), eps=opt.cfg.eps, fused=fused or None)
        self.state, self.defaults = self.adamw.state, self.adamw.defaults
        self.param_groups = self.adamw.param_groups + [{"params": [opt.master[i] for i in self.muon],
                                                         "lr": opt.cfg.lr}]
        self.tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
        self.tp_dim = {i: tp_dim[opt.names[i]] for i in self.muon if opt.names[i] in tp_dim and self.tp > 1}
        for i in self.tp_dim:
            if opt.params[i].ndim != 2:
                raise ValueError(f"muon: {opt.names[i]} is a tp-sharded stack; only 2-D matrices may be")
        self.shape = {i: self._global_shape(i) for i in self.muon}  # the whole matrices Newton–Schulz sees
        self.sharded = getattr(opt, "pieces", None) is not None  # ZeRO 1-3: masters are flat pieces
        self.device = opt.master[0].device if opt.master else torch.device("cpu")
        self.owner, self.extent = self._assign_owners() if self.sharded else ({}, {})

    def _global_shape(self, i: int) -> tuple[int, ...]:
        """One matrix's shape (A, B), or (E, A, B) for a stack; A counts one block's rows."""
        shape = list(self.opt.params[i].shape)
        if i in self.tp_dim:
            shape[self.tp_dim[i]] *= self.tp
        shape[-2] //= self.blocks[i]
        return tuple(shape)

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on its masters, then Muon on the matrices' masters that have a .grad.
        Every rank of a ZeRO group has the same such matrices (a gradient bucket is reduced or not)."""
        self.adamw.step()
        cfg, master = self.cfg, self.opt.master
        todo = [i for i in self.muon if master[i].grad is not None]
        peak = self.opt.cfg.lr
        lr = cfg.lr * (self.param_groups[-1]["lr"] / peak) if peak else 0.0
        updates = {}
        for i in todo:
            g, state = master[i].grad, self.state[master[i]]
            if not state:
                state.update(step=torch.tensor(0.0), momentum_buffer=torch.zeros_like(g))
            elif "momentum_buffer" not in state:
                raise ValueError(f"muon: {self.opt.names[i]}'s optimizer state has no momentum_buffer "
                                 f"(a checkpoint of another optimizer?): {sorted(state)}")
            state["step"] += 1
            buf = state["momentum_buffer"]
            buf.lerp_(g, 1 - cfg.momentum)  # torch.optim.Muon's two lerps
            update = g.lerp(buf, cfg.momentum) if cfg.nesterov else buf
            updates[i] = update.bfloat16()  # Newton–Schulz's first op: so pieces travel in bf16
        for i, o in self._orthogonalized(updates).items():
            master[i].mul_(1 - lr * cfg.weight_decay)
            master[i].add_(o.view_as(master[i]), alpha=-adjusted_lr(lr, self.shape[i]))

    def _orthogonalized(self, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each matrix's orthogonalized update, in the layout of this rank's master of it."""
        whole = self._to_owners(updates) if self.sharded else updates  # this rank's local matrices
        local = {i: u.view(self.opt.params[i].shape) for i, u in whole.items()}
        full = self._tp_gather(local)
        done = {i: orthogonalize(g, self.cfg.ns_steps, self.cfg.eps, self.blocks[i]) for i, g in full.items()}
        done = {i: self._tp_slice(i, o) for i, o in done.items()}
        return self._from_owners(done, updates) if self.sharded else done

    # ---- refinement: tp, the owners' shards made whole over the tp group --------------------
    # Newton–Schulz of a shard is not a shard of Newton–Schulz: the Gram matrix mixes rows.
    # So every tp rank gathers the whole matrix and orthogonalizes it, then keeps its rows.
    # tp ranks hold the same local shapes, hence the same owners: they gather the same matrices.
    # A fused weight (tp.Fused: q, k, v stacked) gathers its rows permuted, rank-major.
    # Newton–Schulz commutes with row permutations, so the slice back is this rank's rows of the result.
    def _tp_gather(self, local: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        ids = [i for i in local if i in self.tp_dim]
        if not ids:
            return local
        flat = torch.cat([local[i].reshape(-1) for i in ids])  # (Σ local numel,)
        parts = [torch.empty_like(flat) for _ in range(self.tp)]
        dist.all_gather(parts, flat, group=self.tp_group)
        out, off = dict(local), 0
        for i in ids:
            n, shape = local[i].numel(), local[i].shape
            out[i] = torch.cat([p[off:off + n].view(shape) for p in parts], self.tp_dim[i])  # global shape
            off += n
        return out

    def _tp_slice(self, i: int, o: torch.Tensor) -> torch.Tensor:
        if i not in self.tp_dim:
            return o
        return o.chunk(self.tp, self.tp_dim[i])[dist.get_rank(self.tp_group)]  # this rank's rows

    # ---- refinement: ZeRO, each matrix made whole on one owner ------------------------------
    # A master is a flat piece [start, start + n) of its parameter; the ranks' pieces tile it.
    # One all-to-all per ZeRO group sends every piece to its matrix's owner.
    # The owner orthogonalizes. A second all-to-all sends each holder its piece of the result.
    def _assign_owners(self) -> tuple[dict[int, int], dict[int, list[tuple[int, int]]]]:
        """assign_owners: the costliest matrix first, to the least-loaded rank (longest processing time).
        Round-robin by size leaves one rank a whole extra large matrix when counts do not divide.
        This keeps the largest load within 4/3 of the best. The cost is Newton–Schulz's flops.
        Also every rank's (start, n) of each matrix: `_extents`."""
        owner = {}
        for group, ids in self._by_group().items():
            cost = [self.blocks[i] * ns_flops(self.shape[i], self.cfg.ns_steps) for i in ids]
            owner.update(zip(ids, assign_owners(cost, self._size(group))))
        return owner, self._extents()

    def _extents(self) -> dict[int, list[tuple[int, int]]]:
        """Every rank's (start, n) of each matrix, from ZeRO's layout (zero.py's core idea).
        A bucket's parameters lie back to back in one flat buffer, padded to N·S; rank r owns slice r.
        Computed, not exchanged: no collective, and no host read of a device value."""
        extent = {}
        for bucket in self.opt.buckets:
            N = self.opt.class_groups[self.opt.classes[bucket.index[0]]][1]
            S = bucket.size // N
            for i, off in zip(bucket.index, bucket.offsets):
                if i not in self.blocks:
                    continue
                n = self.opt.params[i].numel()
                cut = [(max(off, r * S), min(off + n, (r + 1) * S)) for r in range(N)]  # [a, z) of the flat
                extent[i] = [(a - off, z - a) if z > a else (0, 0) for a, z in cut]
                mine = extent[i][self._rank(self.opt.reduce_groups[i])]
                if mine[1] != self.opt.pieces[i].n or (mine[1] and mine[0] != self.opt.pieces[i].start):
                    raise ValueError(f"muon: {self.opt.names[i]}'s ZeRO piece {self.opt.pieces[i]} is not "
                                     f"slice r of its bucket, the layout muon.py reads")
        return extent

    def _by_group(self) -> dict[Group, list[int]]:
        """The matrices by their ZeRO group (the dp group, or an expert's replica group)."""
        groups = getattr(self.opt, "reduce_groups", [getattr(self.opt, "group", None)] * len(self.opt.params))
        out: dict[Group, list[int]] = defaultdict(list)
        for i in self.muon:
            out[groups[i]].append(i)
        return out

    def _size(self, group: Group) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    def _rank(self, group: Group) -> int:
        return dist.get_rank(group) if self._size(group) > 1 else 0

    def _to_owners(self, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Phase 1: the pieces to their owners. Returns the owned matrices, flat and whole."""
        whole = {}
        for group, ids in self._by_group().items():
            ids = [i for i in ids if i in updates]  # the same on every rank of the group
            if not ids:
                continue
            N, me = self._size(group), self._rank(group)
            mine = [i for i in ids if self.owner[i] == me]
            send = [[updates[i].reshape(-1) for i in ids if self.owner[i] == r] for r in range(N)]
            sizes = [[self.extent[i][r][1] for i in mine] for r in range(N)]  # rank r's pieces of mine
            got = _all_to_all(send, sizes, group, N, self.device)
            for k, i in enumerate(mine):  # the ranks' pieces, in rank order, tile the matrix
                whole[i] = torch.cat([got[r][k] for r in range(N)])  # (numel,)
        return whole

    def _from_owners(self, done: dict[int, torch.Tensor],
                     updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Phase 3: each holder gets its piece of every orthogonalized matrix."""
        out = {}
        for group, ids in self._by_group().items():
            ids = [i for i in ids if i in updates]  # the same on every rank of the group
            if not ids:
                continue
            N, me = self._size(group), self._rank(group)
            mine = [i for i in ids if self.owner[i] == me]
            send = [[done[i].reshape(-1).narrow(0, *self.extent[i][r]) for i in mine] for r in range(N)]
            theirs = [[i for i in ids if self.owner[i] == r] for r in range(N)]
            got = _all_to_all(send, [[self.extent[i][me][1] for i in t] for t in theirs], group, N, self.device)
            for r in range(N):
                out.update(zip(theirs[r], got[r]))
        return out


def assign_owners(cost: list[float], N: int) -> list[int]:
    """Each item's owner among N ranks: the costliest first, to the least-loaded rank (ties: the lowest).
    A pure function of (cost, N): every rank computes the same owners without a collective."""
    owner, load = [0] * len(cost), [0.0] * N
    for k in sorted(range(len(cost)), key=lambda k: (-cost[k], k)):
        owner[k] = min(range(N), key=lambda r: (load[r], r))
        load[owner[k]] += cost[k]
    return owner


def ns_flops(shape: tuple[int, ...], steps: int) -> float:
    """Newton–Schulz's matmul flops for a matrix (A, B), or a stack (E, A, B): m = min, n = max.
    Per step X·Xᵀ is 2m²n, G·G is 2m³, (bG + cG²)·X is 2m²n."""
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * steps * (4 * m * m * n + 2 * m ** 3)


def _all_to_all(send: list[list[torch.Tensor]], sizes: list[list[int]], group: Group, N: int,
                device: torch.device) -> list[list[torch.Tensor]]:
    """One uneven all-to-all of flat bf16 pieces. send[r]: the pieces for rank r, in order.
    sizes[r]: the sizes of the pieces rank r sends here. Returns them, per rank, cut as sent.
    Degree 1: no collective, the pieces are returned as they are."""
    if N == 1:
        return [list(send[0])]
    pieces = [t for part in send for t in part]
    flat = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.bfloat16, device=device)  # (Σ,)
    out = torch.empty(sum(map(sum, sizes)), dtype=torch.bfloat16, device=device)
    dist.all_to_all_single(out, flat, output_split_sizes=[sum(s) for s in sizes],
                           input_split_sizes=[sum(t.numel() for t in part) for part in send], group=group)
    chunks = out.split([sum(s) for s in sizes])
    return [list(c.split(s)) if s else [] for c, s in zip(chunks, sizes)]
