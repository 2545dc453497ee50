"""ZeRO stages 0-2: shard the optimizer state over dp, then the gradients (zero3.py: the parameters).

What it does
    `apply_zero_0_to_2(model, stage, dp_group, cfg, dtype)` returns one stage's step object.
    Stage 0 is plain DP: the gradients are all-reduced (dp.GradSync).
    Stage 1 shards the fp32 master and Adam's m and v over the N dp ranks.
    Stage 2 shards the gradients too.
    zero3.apply_zero builds every stage, 3 included. train.py calls that one.
    What each stage holds, and its peak: docs/memory.md (zero_memory.py computes both).

The core idea
    A bucket's parameters lie back to back in one flat buffer. Dp rank r owns slice r of it.
    Rank r's fp32 master of a parameter is that parameter's piece in slice r.
    AdamW is elementwise. So stepping every piece equals stepping the whole.
    `zero1_step` is the textbook step: the three phases on one flat buffer, in 15 lines.

Phase map (one step of stages 1-2), in reading order
    1. reduce-scatter  ReduceScatterSync._launch, in backward, bucket by bucket.
                       DataParallelOptimizer.step waits for the last ones (finish).
    2. step            ZeroOptimizer._master_grads gives this rank's pieces to
                       precision.MixedPrecisionOptimizer.step. It clips, then runs AdamW.
    3. all-gather      ZeroOptimizer._publish writes the new pieces into this rank's slice.
                       ZeroOptimizer._launch_gather completes each flat in place.
    Refinements follow under banners: the flat layout, the overlapped all-gather, the parameter groups.

Reference
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
    Megatron-LM's distributed optimizer: the overlapped parameter all-gather.

Run
    torchrun --nproc_per_node 4 train.py --model tiny --zero 2 --steps 20

Invariants (all of them: docs/zero.md#invariants-and-their-tests)
    - At dp = 1 every stage is bit-identical to MixedPrecisionOptimizer.
    - At dp = 2 (fp32, no clipping) stages 1-2 are bit-identical to stage 0.
      Both: tests/test_zero.py::test_zero_dp2_exactness_and_stage3_mechanics.
    - `zero1_step` gives the same parameters as stage 1, bit for bit.
      Test: tests/test_naive.py::test_textbook_tp_pair_and_zero1_step_equal_production.
    - Dp ranks launch the all-gathers in one order, whichever hook asks first.
      Test: tests/test_zero.py::test_zero12_parameter_gather_overlaps_the_next_forward.
    - A tied embedding's two pipeline copies take bit-identical steps.
      Test: tests/test_zero.py::test_zero_tied_embeddings_pp2_dp2.
    - `teardown()` removes every hook. Test: tests/test_zero.py::test_zero_teardown_leaves_nothing_alive.
    - A parameter that `group_of` places in a subgroup of dp is reduced and sharded there.
      The grad norm still counts each element once.
      Test: tests/test_moe_ep.py::test_ep_layouts_resume_and_export_equal_single_process.

Builds on: precision.py, dp.py
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dp import TWICE, Bucket, GradSync, Group, group_classes, layout, make_buckets, remove_handles
from precision import MixedPrecisionOptimizer, OptimConfig, UpdateRule

Named = Iterable[tuple[str, nn.Parameter]]
Init = Callable[[str, int, int], torch.Tensor]  # (name, start, stop) → fp32 flat elements [start, stop)
GroupOf = Callable[[str], "tuple[Group, Group] | None"]  # the parameter → group seam (its banner below)


# ---- the textbook step: the three phases on one flat buffer -------------------------------
def zero1_step(params: list[torch.Tensor], master: torch.Tensor, opt: torch.optim.Optimizer,
               group: Group = None) -> None:
    """One ZeRO-1 step. The params hold this rank's local gradients.
    `master` is this rank's slice (S,) of the flat fp32 parameters, padded to N·S.
    `opt` is an AdamW over [master]. Production adds buckets, overlap, clipping and decay groups."""
    n = dist.get_world_size(group)
    grads = torch.cat([p.grad.reshape(-1) for p in params])  # (Ψ,)
    grads = F.pad(grads, (0, master.numel() * n - grads.numel()))  # (n·S,)
    master.grad = torch.empty_like(master)
    dist.reduce_scatter_tensor(master.grad, grads, group=group)  # 1. the dp sum of my slice only
    opt.step()  # 2. AdamW on my slice only
    full = master.new_empty(master.numel() * n)  # (n·S,) on master's device
    dist.all_gather_into_tensor(full, master.detach(), group=group)  # 3. every rank's updated slice
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(full[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


# ---- phase 1 in production: each bucket is reduce-scattered as backward completes it -------
@dataclass(frozen=True)
class Piece:
    """The part of one parameter this rank owns. n may be 0.
    Its flat elements [start, start+n) are elements [shard_start, shard_start+n) of this rank's
    shard of bucket `bucket`."""
    bucket: int
    start: int
    shard_start: int
    n: int


def launch(collective: Callable, out: torch.Tensor, inp: torch.Tensor, group: Group, world: int):
    """Start `collective` on flat buffers, asynchronously: dist.reduce_scatter_single (a SUM) or
    dist.all_gather_single. With N = 1 it is a plain copy, and there is no work to wait for (None)."""
    if world == 1:
        out.copy_(inp)
        return None
    return collective(out, inp, group=group, async_op=True)


class ReduceScatterSync(GradSync):
    """dp.GradSync whose buckets are reduce-scattered. N, r and S are the bucket group's.
    Rank r receives the dp sum of elements [r·S, (r+1)·S) of the bucket's flat buffer.
    With keep_full (stage 1) they go into the owned slices of .grad, the accumulation buffer.
    Else (stages 2-3) they go into `grad_shards`. Then .grad is dropped once packed.
    per_micro_batch (stage 3, stage 2 on request): every backward reduces, and the shards accumulate.
    Each bucket then launches as it completes (docs/zero.md#dppy-the-gradient-buckets).
    Else no_sync is honoured and each bucket is reduced once per step, in `order`.
    `on_reduced(b)` runs after each launch. `on_landed(b)` runs once its sum is in place."""

    def __init__(self, params: list[nn.Parameter], group: Group, buckets: list[Bucket],
                 pieces: list[Piece], reduce_dtype: torch.dtype | None, keep_full: bool,
                 per_micro_batch: bool, on_reduced: Callable[[int], None],
                 on_landed: Callable[[int], None], inflight: int = 2,
                 order: list[int] | None = None, groups: list[Group] | None = None):
        self.pieces, self.keep_full = pieces, keep_full
        self.on_reduced, self.on_landed = on_reduced, on_landed
        self.per_micro_batch = per_micro_batch
        self.grad_shards: list[torch.Tensor | None] = [None] * len(buckets)
        super().__init__(params, group, reduce_dtype=reduce_dtype, buckets=buckets, inflight=inflight,
                         order=order, groups=groups)
        self.in_order = not per_micro_batch  # each micro-batch: as completed (see the class docstring)
        self.fp32_grads &= not per_micro_batch  # those accumulate in fp32 grad shards already
        self._alias = not keep_full  # stage 1 keeps .grad, and a reduce-scatter may scribble in its input

    def hooked(self) -> bool:
        return True  # N = 1 runs the same path. The collectives become copies

    def _launch(self, b: int) -> None:
        if not self.per_micro_batch and b in self._launched:
            raise RuntimeError(TWICE.format(b))
        if b in self._pending:
            self._land_bucket(b)  # an earlier micro-step's sum: accumulate it first
        self._launched.add(b)
        self._bound()
        flat = self._pack(b)  # (N·S,)
        if not self.keep_full:
            for i in self.buckets[b].index:
                self.params[i].grad = None  # stages 2-3: no full-size gradient survives backward
        out = torch.empty(flat.numel() // self.worlds[b], dtype=flat.dtype, device=flat.device)  # (S,)
        self._pending[b] = (launch(dist.reduce_scatter_single, out, flat, self.groups[b], self.worlds[b]),
                            out, flat)
        self.on_reduced(b)

    def _land(self, b: int, out: torch.Tensor, flat: torch.Tensor) -> None:
        if self.keep_full and not self.fp32_grads:
            for i in self.buckets[b].index:
                pc = self.pieces[i]
                self.params[i].grad.view(-1)[pc.start:pc.start + pc.n].copy_(
                    out[pc.shard_start:pc.shard_start + pc.n])
        elif self.grad_shards[b] is None:
            self.grad_shards[b] = out
            self.main[b] = None  # fp32 accumulation, once per step: the reduced shard is all it keeps
        else:
            self.grad_shards[b] += out
        self.on_landed(b)

    def clear(self) -> None:
        super().clear()
        self.grad_shards = [None] * len(self.buckets)


# ---- the step objects: stage 0, then phases 2 and 3 of stages 1-2 ---------------------------
class DataParallelOptimizer(MixedPrecisionOptimizer):
    """The step object of stage 0: MixedPrecisionOptimizer + dp.GradSync (all-reduce).
    It is the base of the ZeRO stages. Their no_sync, finish, step, gathered and teardown are its own.
    bucket_mb, reduce_dtype, inflight: the gradient buckets (dp.GradSync).
    norm_groups, counted: the grad norm's groups and replicas (precision.py).
    Banners below explain the rest. tied, embed_group: a tied embedding's pipeline copy.
    init, device: the meta device. group_of: the parameter → group seam.
    rule: the update-rule seam (precision.UpdateRule), AdamW by default."""
    stage = 0

    def __init__(self, named_params: Named, cfg: OptimConfig, dtype: torch.dtype, group: Group, *,
                 bucket_mb: float = 25.0, reduce_dtype: torch.dtype | None = None,
                 norm_groups: Iterable[dist.ProcessGroup] = (),
                 counted: Callable[[str], bool] = lambda name: True,
                 tied: nn.Parameter | None = None, embed_group: Group = None, inflight: int = 2,
                 init: Init | None = None, device: torch.device | str | None = None,
                 group_of: GroupOf | None = None, rule: UpdateRule | None = None):
        if bucket_mb <= 0 or inflight < 1:
            raise ValueError(f"bucket_mb must be > 0 and inflight >= 1, got {bucket_mb} and {inflight}")
        named = list(named_params)
        if tied is not None and (embed_group is None or all(p is not tied for _, p in named)):
            raise ValueError("tied must be a trainable parameter of the model and comes with the "
                             "embedding group of the first and last stage (pp.tied_embedding_ranks)")
        self.group, self.bucket_mb, self.reduce_dtype = group, bucket_mb, reduce_dtype
        self.inflight, self.init = inflight, init
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._place_groups([n for n, _ in named], group_of)
        self.device = self._build_device(named, device)
        self.tied = next((i for i, (_, p) in enumerate(named) if p is tied), None)  # its position
        self.embed_group = embed_group
        groups = ([group] if self.stage and self.world > 1 else []) + \
            [g for g in norm_groups if dist.get_world_size(g) > 1]  # no collective on a group of one
        super().__init__(named, cfg, dtype, groups, counted, rule)
        self.sync = self._make_sync()

    def step(self, lr: float) -> float:
        """One optimizer step; returns the grad norm before clipping. Stages 1-2: the phase map."""
        self.finish()  # 1. the reductions launched in backward land (stages 1-3: the reduce-scatters)
        return super().step(lr)  # 2. clip + AdamW on _master_grads; 3. _publish (stages 1-2: all-gather)

    def finish(self) -> None:
        """Wait for the gradient reductions of this step (step() calls it; idempotent)."""
        self.sync.finish()

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Wrap every accumulation micro-step's backward except the last."""
        return self.sync.no_sync()

    def _master_grads(self) -> list[torch.Tensor | None]:
        if self.sync.fp32_grads:  # the fp32 sums (micro-steps and dp), not the bf16-rounded .grad
            return self._sum_tied([self.sync.main_grad(i) for i in range(len(self.params))])
        return self._sum_tied(super()._master_grads())

    def zero_grad(self) -> None:
        super().zero_grad()
        self.sync.clear()

    def _make_sync(self) -> GradSync:
        # with fp32 main grads the step reads them (_master_grads). No bf16 .grad copy of the sums
        return GradSync(self.params, self.group, self.bucket_mb, self.reduce_dtype, inflight=self.inflight,
                        round_into_grad=False, groups=self.reduce_groups)

    def finish_gathers(self) -> None:
        """Complete the parameter all-gathers the last step started (stages 1-2).
        From here on every parameter holds its full updated value.
        The end of a run, a checkpoint save, the export and an evaluation call it.
        A training forward needs not: its pre-hooks wait bucket by bucket.
        Stage 0 has none. Stage 3's parameters are shards between uses (see gathered())."""

    def gathered(self) -> contextlib.AbstractContextManager:
        """Full parameters inside the context (for export/eval); only stage 3 needs to gather."""
        self.finish_gathers()
        return contextlib.nullcontext()

    def teardown(self) -> None:
        self.sync.remove()

    # ---- refinement: a tied embedding's two pipeline copies step together --------------------
    def _sum_tied(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Sum this rank's piece of the tied copy's gradient over the embedding group, in fp32.
        The other stage holds the same piece. Both copies get the same gradient, hence the same step."""
        if self.tied is not None and grads[self.tied] is not None:  # None on both: no backward ran
            grads[self.tied] = grads[self.tied].float()
            dist.all_reduce(grads[self.tied], group=self.embed_group)
        return grads

    # ---- refinement: building from the meta device, one parameter at a time -----------------
    def _build_device(self, named: list[tuple[str, nn.Parameter]],
                      device: torch.device | str | None) -> torch.device:
        real = [p.device for _, p in named if not p.is_meta]
        if device is None and not real and named:
            raise ValueError("a meta-device model needs the device to build on (device=...)")
        if self.init is None and len(real) < len(named):
            raise ValueError("a meta-device model needs init= (weights.param_reader) to fill it")
        return torch.device(device) if device is not None else (real[0] if real else torch.device("cpu"))

    def _values(self, i: int, start: int, stop: int) -> torch.Tensor:
        """fp32 elements [start, stop) of parameter i's flattened initial values, on this device.
        They come from `init`, which reads only what is asked for. Or from the parameter itself."""
        if self.init is not None:
            return self.init(self.names[i], start, stop).to(self.device, torch.float32)
        return self.params[i].detach().reshape(-1)[start:stop].float()

    def _make_master(self) -> list[torch.Tensor]:
        if self.init is not None:  # one parameter at a time: stage 0 holds the whole model anyway
            for i, p in enumerate(self.params):
                _place(p, self._values(i, 0, p.numel()).clone().view(p.shape))
        return super()._make_master()

    # ---- refinement: the parameter → group seam ----------------------------------------------
    # `group_of(name)` says where a parameter's data parallelism runs. None means the dp group.
    # Else it is a pair (group, across) of subgroups of dp, with group × across = dp:
    #   group   the ranks holding this same parameter. They sum its gradient. ZeRO shards its state there.
    #   across  the ranks holding other parameters in its place (None: no such ranks).
    # Expert parallelism uses it (moe.grad_reduce_plan).
    # Why a function of the name: the caller knows its layout, and ZeRO stays one code path.
    # Test: tests/test_moe_ep.py::test_ep_layouts_resume_and_export_equal_single_process.
    def _place_groups(self, names: list[str], group_of: GroupOf | None) -> None:
        """Each parameter's reduction group. The parameters of one group form a class.
        Classes never share a bucket. Each holds (group, N, this rank's index r in it)."""
        placed = [None if group_of is None else group_of(n) for n in names]
        self.reduce_groups = [self.group if p is None else p[0] for p in placed]
        self.classes, groups = group_classes(self.reduce_groups)
        size = lambda g: dist.get_world_size(g) if dist.is_initialized() else 1  # noqa: E731
        self.class_groups = [(g, size(g), dist.get_rank(g) if size(g) > 1 else 0) for g in groups]
        # each class's `across` group: the first one its parameters name
        self.across = [next((p[1] for p, k in zip(placed, self.classes) if k == c and p), None)
                       for c in range(len(groups))]

    def _group(self, b: int) -> tuple[Group, int, int]:
        """Bucket b's reduction group, its size N and this rank's index r in it."""
        return self.class_groups[self.classes[self.buckets[b].index[0]]]

    def replica_rank(self, i: int) -> int | None:
        """Parameter i's rank in its reduction group. None when that is the dp group.
        (checkpoint.py: at stage 0 rank 0 of that group writes the parameter.)"""
        group, _, r = self.class_groups[self.classes[i]]
        return None if group is self.group else r

    def grad_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """precision's global norm, each element counted once. Each class sums its squares apart.
        At stage 0 a class's ranks hold the same values, so a class sums over `across` only.
        At stages 1-3 each rank holds distinct pieces of every class.
        The dp all-reduce in norm_groups sums them all, as group × across = dp."""
        if len(self.class_groups) == 1:
            return super().grad_norm(grads)
        for c, across in enumerate(self.across):
            part = self._square_sum(grads, [n and k == c for n, k in zip(self.counted, self.classes)])
            if not self.stage and across is not None and dist.get_world_size(across) > 1:
                dist.all_reduce(part, group=across)
            sq = part if c == 0 else sq + part
        for group in self.norm_groups:
            dist.all_reduce(sq, group=group)
        return sq.sqrt()


class ZeroOptimizer(DataParallelOptimizer):
    """Stages 1 and 2 through precision.py's seam: sharded masters, sharded grads, all-gather.
    The phases come first, then the flat layout, then the overlapped all-gather.
    `model` is the module holding the parameters (pp.split_stage's stage).
    Given, the step's all-gathers overlap the next forward (refinement below).
    Else step() waits for them."""

    def __init__(self, named_params: Named, cfg: OptimConfig, dtype: torch.dtype, group: Group,
                 stage: int, reduce_every_micro_batch: bool = False, model: nn.Module | None = None,
                 parts: Parts | None = None, **kw):
        self.stage = stage
        self.parts = find_parts(model) if parts is None and model is not None else parts
        self.per_micro_batch = stage == 3 or (stage == 2 and reduce_every_micro_batch)
        self.module_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._gathers: collections.deque = collections.deque()  # (bucket, work) launched, not yet waited
        self._model = model
        super().__init__(named_params, cfg, dtype, group, **kw)
        self._launched = self._landed = len(self._order)  # in self._order; the flats are complete now
        if model is not None and max((N for _, N, _ in self.class_groups), default=1) > 1:
            for s, site in enumerate(sites(self.parts)):
                first = model if site[0] is self.parts.head else site[0]  # maybe not called: see sites()
                self.module_handles.append(first.register_forward_pre_hook(partial(self._wait_site, s)))

    # ---- the phases (module docstring: the phase map) ----------------------------------------
    def _make_sync(self) -> GradSync:
        """Phase 1: reduce-scatter each bucket in backward (ReduceScatterSync, above).
        The buckets go in the order backward completes them: the gathers' order, reversed."""
        self._order, self._site_pos = self._gather_order(self._model)
        return ReduceScatterSync(self.params, self.group, self.buckets, self.pieces, self.reduce_dtype,
                                 keep_full=self.stage == 1, per_micro_batch=self.per_micro_batch,
                                 on_reduced=self._on_reduced, on_landed=self._on_landed,
                                 inflight=self.inflight, order=self._order[::-1], groups=self.reduce_groups)

    def _master_grads(self) -> list[torch.Tensor | None]:
        """Phase 2's input: this rank's piece of each gradient, dp-summed by phase 1."""
        return self._sum_tied([self._grad_piece(i) for i in range(len(self.params))])

    def _grad_piece(self, i: int) -> torch.Tensor | None:
        """This rank's piece of parameter i's gradient, in the reduce dtype. None before a backward."""
        pc = self.pieces[i]
        if self.stage == 1 and not self.sync.fp32_grads:  # stage 1 keeps the full .grad
            g = self.params[i].grad
            return None if g is None else g.view(-1)[pc.start:pc.start + pc.n]
        shard = self.sync.grad_shards[pc.bucket]
        return None if shard is None else shard[pc.shard_start:pc.shard_start + pc.n]

    def _publish(self) -> None:
        """Phase 3: write each updated master piece, cast, into this rank's slice of its bucket's flat.
        The padding stays zero. The all-gathers that complete the flats in place are then due.
        The next forward's pre-hooks launch them (refinement below), or finish_gathers() does."""
        self.finish_gathers()  # the last step's, if a bucket was never needed since
        for b, full in enumerate(self.flat_params):
            self._write_shard(b, self._slice(b, full))
        self._launched = self._landed = 0  # every bucket's all-gather is due
        if not self.module_handles:  # no forward hook would ask for them: complete them now
            self.finish_gathers()

    def _write_shard(self, b: int, shard: torch.Tensor) -> None:
        """Write the master pieces of bucket b, cast to the compute dtype, into its shard.
        One foreach launch for the bucket, not a copy kernel per parameter."""
        index = [i for i in self.buckets[b].index if self.pieces[i].n]
        if not index:  # this rank owns only padding of a tiny bucket
            return
        with torch.no_grad():
            torch._foreach_copy_([shard[self.pieces[i].shard_start:self.pieces[i].shard_start + self.pieces[i].n]
                                  for i in index], [self.master[i] for i in index])

    def _launch_gather(self) -> None:
        """Phase 3's collective: all-gather the next bucket of self._order into its own flat."""
        b = self._order[self._launched]
        (group, N, _), full = self._group(b), self.flat_params[b]
        work = dist.all_gather_single(full, self._slice(b, full), group=group,
                                      async_op=True) if N > 1 else None  # N = 1: complete
        self._gathers.append((b, work))
        self._launched += 1

    def _slice(self, b: int, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice (S,) of bucket b's flat (N·S,): elements [r·S, (r+1)·S)."""
        _, N, r = self._group(b)
        S = flat.numel() // N
        return flat[r * S:(r + 1) * S]

    # ---- the flat layout: one flat buffer per bucket, rank r owns slice r ---------------------
    def _buckets(self) -> list[Bucket]:
        itemsize = (self.reduce_dtype or self.dtype).itemsize
        buckets = make_buckets(self.params, int(self.bucket_mb * 2**20), itemsize,
                               pad_to=[N for _, N, _ in self.class_groups], classes=self.classes)
        # the tied copy gets a bucket of its own. It has the same size and padding on both stages
        rest = [[i for i in b.index if i != self.tied] for b in buckets]
        tied = [] if self.tied is None else [[self.tied]]
        return [layout(index, self.params, self.class_groups[self.classes[index[0]]][1])
                for index in rest + tied if index]

    def _piece(self, b: int, k: int) -> Piece:
        """This rank's part of the k-th parameter of bucket b (maybe empty)."""
        bucket, (_, N, r) = self.buckets[b], self._group(b)
        S = bucket.size // N
        lo, off, n = r * S, bucket.offsets[k], self.params[bucket.index[k]].numel()
        a, z = max(off, lo), min(off + n, lo + S)
        return Piece(b, a - off, a - lo, z - a) if z > a else Piece(b, 0, 0, 0)

    def _make_master(self) -> list[torch.Tensor]:
        """Lay every bucket out flat in the compute dtype, one parameter at a time.
        The parameters become views into it. So the all-gather writes them in place.
        Cut this rank's fp32 piece of each. Peak: the flats and pieces so far, and one fp32 parameter."""
        self.buckets = self._buckets()
        self.pieces: list[Piece] = [None] * len(self.params)  # type: ignore[list-item]
        self.flat_params: list[torch.Tensor] = []
        master: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for b, bucket in enumerate(self.buckets):
            full = torch.zeros(bucket.size, dtype=self.dtype, device=self.device)  # (size,)
            for k, (i, off) in enumerate(zip(bucket.index, bucket.offsets)):
                p, n, pc = self.params[i], self.params[i].numel(), self._piece(b, k)
                self.pieces[i] = pc
                values = self._values(i, 0, n)  # (n,) fp32
                master[i] = values[pc.start:pc.start + pc.n].clone()
                full[off:off + n].copy_(values)
                _place(p, full[off:off + n].view_as(p))
            self.flat_params.append(full)
        return master

    def _on_reduced(self, b: int) -> None:
        pass  # zero3.py frees a unit here

    def _on_landed(self, b: int) -> None:
        """Bucket b's dp sum is in its pieces (_grad_piece), in the compute stream's order.
        A subclass may read them here, during backward, not at the step. Stage 1-2 need nothing."""

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.per_micro_batch else self.sync.no_sync()

    # ---- refinement: the all-gathers overlap the next forward (Megatron's overlap_param_gather)
    # A forward pre-hook per site waits for the buckets it reads and keeps `inflight` more in flight.
    # Why they start in the forward, not in step(): docs/zero.md#refinement-the-overlapped-parameter-all-gather-stages-1-2.
    def _gather_order(self, model: nn.Module | None) -> tuple[list[int], list[int]]:
        """The buckets in the order a forward first reads them. And per site, the position in that
        order through which its parameters are complete. Buckets holding a parameter outside every
        site come first: every site waits for them. Without a model: reverse bucket order.
        (Buckets hold the parameters in reverse.) Reversed, this is the order backward completes them in."""
        if model is None:
            return list(reversed(range(len(self.buckets)))), []
        bucket_of = {id(self.params[i]): b for b, bk in enumerate(self.buckets) for i in bk.index}
        need = [[bucket_of[id(p)] for mod in site for p in mod.parameters() if id(p) in bucket_of]
                for site in sites(self.parts)]
        order = [b for b in range(len(self.buckets)) if not any(b in n for n in need)]
        stray = len(order)
        for n in need:
            order += [b for b in dict.fromkeys(n) if b not in order]
        return order, [max([stray - 1] + [order.index(b) for b in n]) for n in need]

    def _wait_site(self, s: int, module: nn.Module, args: tuple) -> None:
        if self._landed < len(self._order):  # else: complete (later micro-batches, recomputes)
            self._gather_through(self._site_pos[s])

    def _gather_through(self, k: int) -> None:
        """Wait for the all-gathers of self._order[0..k]. Launch, in order, any not yet started.
        Then keep the next ones launched, at most `inflight` in flight.
        The launch order is fixed, whichever hook asks. So every dp rank posts the same collectives
        in the same order. NCCL pairs them by call order: ranks cannot deadlock."""
        while self._landed <= k:
            if self._landed == self._launched:
                self._launch_gather()
            _, work = self._gathers.popleft()
            if work is not None:
                work.wait()  # NCCL: the compute stream waits, not the host
            self._landed += 1
        while self._launched < min(self._landed + self.inflight, len(self._order)):
            self._launch_gather()

    def finish_gathers(self) -> None:
        self._gather_through(len(self._order) - 1)

    def teardown(self) -> None:
        remove_handles(self.module_handles)
        self.finish_gathers()
        super().teardown()



def _place(p: nn.Parameter, value: torch.Tensor) -> None:
    """Make p hold `value` while staying the same Parameter object.
    So hooks, optimizer groups, the caller's references and ties stay valid.
    A meta parameter cannot take a real tensor as .data. It first swaps contents with an empty one.
    `.data =` keeps p's own version counter. So the all-gathers into a stage-3 flat never look like
    in-place edits of tensors autograd saved."""
    if p.is_meta:
        empty = torch.empty(0, dtype=value.dtype, device=value.device)
        torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
    p.data = value


@dataclass
class Parts:
    """The modules ZeRO's hooks follow: embedding, decoder layers, final norm, head.
    Each is None or empty where a pipeline stage holds none."""
    embed: nn.Module | None
    layers: list[nn.Module]
    norm: nn.Module | None
    head: nn.Module | None


def find_parts(model: nn.Module, embed: str | None = None, layers: str | None = None,
               norm: str | None = None, head: str | None = None) -> Parts:
    """The parts of a model. attotron's Llama and transformers' layout are found by themselves.
    That is model.model.embed_tokens, .layers and .norm, and model.lm_head.
    Any other model names them by dotted paths, `layers` at least.
    For example embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f", head="lm_head".
    A part not named is absent."""
    if layers is None:
        if (embed, norm, head) != (None, None, None):
            raise ValueError("a described model names its decoder layers too (layers=...)")
        inner = getattr(model, "model", None)
        found = getattr(inner, "layers", None)
        if not isinstance(found, (nn.ModuleDict, nn.ModuleList)):
            raise ValueError(f"{type(model).__name__} is neither attotron's Llama nor transformers' "
                             "layout (model.model.layers): name its parts, e.g. embed='transformer.wte', "
                             "layers='transformer.h', norm='transformer.ln_f', head='lm_head'")
        listed = found.values() if isinstance(found, nn.ModuleDict) else found
        return Parts(getattr(inner, "embed_tokens", None), list(listed), getattr(inner, "norm", None),
                     getattr(model, "lm_head", None))
    get = lambda path: None if path is None else model.get_submodule(path)  # noqa: E731
    found = get(layers)
    if not isinstance(found, (nn.ModuleDict, nn.ModuleList)):
        raise ValueError(f"layers={layers!r} is a {type(found).__name__}, not an nn.ModuleList or nn.ModuleDict")
    listed = found.values() if isinstance(found, nn.ModuleDict) else found
    return Parts(get(embed), list(listed), get(norm), get(head))


def sites(parts: Parts) -> list[list[nn.Module]]:
    """The modules whose forward first reads each group of parameters, in forward order.
    They are [embedding], each decoder layer, [final norm, head], whichever this pipeline stage holds.
    The head's site starts at the norm. attotron's loss reads lm_head.weight without calling lm_head."""
    out = ([[parts.embed]] if parts.embed is not None else []) + [[layer] for layer in parts.layers]
    head = [mod for mod in (parts.norm, parts.head) if mod is not None]
    return out + ([head] if head else [])


def apply_zero_0_to_2(model: nn.Module, stage: int, dp_group: Group, cfg: OptimConfig,
                      dtype: torch.dtype = torch.float32, *, reduce_every_micro_batch: bool = False,
                      embed: str | None = None, layers: str | None = None, norm: str | None = None,
                      head: str | None = None, **kw) -> DataParallelOptimizer:
    """The step object for ZeRO `stage` 0-2 over `dp_group`. Stage 0 is plain DP.
    The model's parameters hold their fp32 values (after materialize, tp, ac).
    Or the model is on the meta device: then pass `init` (weights.param_reader) and `device`.
    Each stage then fills itself one parameter at a time.
    Stage 3: zero3.apply_zero, the same call for every stage.
    embed, layers, norm, head: a described model's parts (find_parts).
    kw: DataParallelOptimizer's keywords, bucket_mb to group_of.
    The arguments, one by one: docs/zero.md#two-entry-points-and-where-the-accounting-lives."""
    if stage not in (0, 1, 2):
        raise ValueError(f"ZeRO stage must be 0, 1 or 2 here (stage 3: zero3.apply_zero), got {stage}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    parts = find_parts(model, embed, layers, norm, head)
    if stage == 0:
        return DataParallelOptimizer(named, cfg, dtype, dp_group, **kw)
    return ZeroOptimizer(named, cfg, dtype, dp_group, stage, reduce_every_micro_batch, model, parts=parts, **kw)
