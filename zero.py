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

Phase map (one step of stages 1-2)
    1. reduce-scatter  In backward, bucket by bucket: dp.ReduceScatterSync._launch.
                       DataParallelOptimizer.step waits for the last ones (finish).
    2. step            ZeroOptimizer._master_grads gives this rank's pieces to
                       precision.MixedPrecisionOptimizer.step. It clips, then runs AdamW.
    3. all-gather      ZeroOptimizer._publish writes the new pieces into this rank's slice.
                       ZeroOptimizer._launch_gather completes each flat in place.
    Refinement: the all-gathers overlap the next forward (ZeroOptimizer._gather_through).

Reference
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
    Megatron-LM's distributed optimizer: the overlapped parameter all-gather.

Run
    torchrun --nproc_per_node 4 train.py --model tiny --zero 2 --steps 20

Invariants (all of them: docs/zero.md#invariants-and-their-tests)
    - At dp = 1 every stage is bit-identical to MixedPrecisionOptimizer.
    - At dp = 2 (fp32, no clipping) stages 1-2 are bit-identical to stage 0.
      Both: tests/test_zero.py::test_zero_dp2_exactness_and_stage3_mechanics.
    - The textbook ZeRO-1 step gives the same parameters, bit for bit.
      Test: tests/test_naive.py::test_textbook_tp_pair_and_zero1_step_equal_production.
    - Dp ranks launch the all-gathers in one order, whichever hook asks first.
      Test: tests/test_zero.py::test_zero12_parameter_gather_overlaps_the_next_forward.
    - A tied embedding's two pipeline copies take bit-identical steps.
      Test: tests/test_zero.py::test_zero_tied_embeddings_pp2_dp2.
    - `teardown()` removes every hook. Test: tests/test_zero.py::test_zero_teardown_leaves_nothing_alive.
    - Expert parallelism (`expert`, `replica_group`, `ep_group`): the experts' gradients and state
      are reduced and sharded over the ranks holding the same experts, the rest over dp; the grad
      norm counts every expert element once. A replica group that is the dp group itself (ep = 1)
      changes nothing. Test: tests/test_moe_ep.py::test_ep_layouts_resume_and_export_equal_single_process.

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

from dp import (Bucket, GradSync, Group, Piece, ReduceScatterSync, group_classes, layout, make_buckets,
                remove_handles)
from precision import MixedPrecisionOptimizer, OptimConfig

Named = Iterable[tuple[str, nn.Parameter]]
Init = Callable[[str, int, int], torch.Tensor]  # (name, start, stop) → fp32 flat elements [start, stop)


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


class DataParallelOptimizer(MixedPrecisionOptimizer):
    """The step object of stage 0: MixedPrecisionOptimizer + dp.GradSync (all-reduce).
    It is the base of the ZeRO stages. Their no_sync, finish, step, gathered and teardown are its own."""
    stage = 0

    def __init__(self, named_params: Named, cfg: OptimConfig, dtype: torch.dtype, group: Group, *,
                 bucket_mb: float = 25.0, reduce_dtype: torch.dtype | None = None,
                 norm_groups: Iterable[dist.ProcessGroup] = (),
                 counted: Callable[[str], bool] = lambda name: True,
                 tied: nn.Parameter | None = None, embed_group: Group = None, inflight: int = 2,
                 init: Init | None = None, device: torch.device | str | None = None,
                 expert: Callable[[str], bool] | None = None, replica_group: Group = None,
                 ep_group: Group = None):
        self.group, self.bucket_mb, self.reduce_dtype = group, bucket_mb, reduce_dtype
        self.inflight, self.init = inflight, init
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        named = list(named_params)
        # expert parallelism: the experts' gradients and state over their replica group (a class of
        # their own, unless that group is the dp group itself: ep = 1, one class, nothing changes)
        self.reduce_groups = [replica_group if expert is not None and expert(n) else group for n, _ in named]
        self.classes, self.class_groups = group_classes(self.reduce_groups)
        self.class_worlds = [dist.get_world_size(g) if dist.is_initialized() else 1 for g in self.class_groups]
        self.class_ranks = [dist.get_rank(g) if w > 1 else 0 for g, w in zip(self.class_groups, self.class_worlds)]
        self.ep_group = ep_group
        real = [p.device for _, p in named if not p.is_meta]
        if device is None and not real and named:
            raise ValueError("a meta-device model needs the device to build on (device=...)")
        if init is None and len(real) < len(named):
            raise ValueError("a meta-device model needs init= (weights.param_reader) to fill it")
        self.device = torch.device(device) if device is not None else \
            (real[0] if real else torch.device("cpu"))
        self.tied = next((i for i, (_, p) in enumerate(named) if p is tied), None)  # its position
        self.embed_group = embed_group
        groups = ([group] if self.stage and self.world > 1 else []) + \
            [g for g in norm_groups if dist.get_world_size(g) > 1]  # no collective on a group of one
        super().__init__(named, cfg, dtype, groups, counted)
        self.sync = self._make_sync()

    def _bucket_class(self, b: int) -> int:
        return self.classes[self.buckets[b].index[0]]

    def replica_rank(self, i: int) -> int | None:
        """An expert's rank among the ranks holding the same experts (its reduction group); None for
        a parameter reduced over dp (checkpoint.py: at stage 0 that group's rank 0 writes it)."""
        c = self.classes[i]
        return None if self.class_groups[c] is self.group else self.class_ranks[c]

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

    def grad_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """precision's global norm; under expert parallelism each element still counts once. Stage
        0: the dense squares are the same on every dp rank (counted once, as without EP), the
        experts' are distinct across the ep group (summed there) and copies across their replica
        group (not summed). Stages 1-3: every rank holds distinct pieces of both, so the one dp
        all-reduce in norm_groups sums the experts over their replica shards and the ep group
        together (replica × ep = the dp·cp ranks)."""
        if len(self.class_groups) == 1:
            return super().grad_norm(grads)
        dense = [c and k == 0 for c, k in zip(self.counted, self.classes)]
        sq = self._square_sum(grads, dense)
        experts = self._square_sum(grads, [c and k > 0 for c, k in zip(self.counted, self.classes)])
        if not self.stage and dist.get_world_size(self.ep_group) > 1:
            dist.all_reduce(experts, group=self.ep_group)
        sq = sq + experts
        for group in self.norm_groups:
            dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def _master_grads(self) -> list[torch.Tensor | None]:
        if self.sync.fp32_grads:  # the fp32 sums (micro-steps and dp), not the bf16-rounded .grad
            return self._sum_tied([self.sync.main_grad(i) for i in range(len(self.params))])
        return self._sum_tied(super()._master_grads())

    def zero_grad(self) -> None:
        super().zero_grad()
        self.sync.clear()

    def _sum_tied(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Sum this rank's piece of the tied copy's gradient over the embedding group, in fp32.
        The other stage holds the same piece. Both copies get the same gradient, hence the same step."""
        if self.tied is not None and grads[self.tied] is not None:  # None on both: no backward ran
            grads[self.tied] = grads[self.tied].float()
            dist.all_reduce(grads[self.tied], group=self.embed_group)
        return grads

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


class ZeroOptimizer(DataParallelOptimizer):
    """Stages 1 and 2 through precision.py's seam: sharded masters, sharded grads, all-gather.
    The three phases come first, then the flat layout, then the overlapped all-gather.
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
        if model is not None and max(self.class_worlds, default=1) > 1:
            for s, site in enumerate(sites(self.parts)):
                first = model if site[0] is self.parts.head else site[0]  # maybe not called: see sites()
                self.module_handles.append(first.register_forward_pre_hook(partial(self._wait_site, s)))

    # ---- the three phases (module docstring: the phase map) ----------------------------------
    def _master_grads(self) -> list[torch.Tensor | None]:
        """Phase 2's input: this rank's piece of each gradient, dp-summed by phase 1."""
        grads: list[torch.Tensor | None] = []  # this rank's pieces, dp-summed, in the reduce dtype
        for p, pc in zip(self.params, self.pieces):
            if self.stage == 1 and not self.sync.fp32_grads:
                g = None if p.grad is None else p.grad.view(-1)[pc.start:pc.start + pc.n]
            else:
                shard = self.sync.grad_shards[pc.bucket]
                g = None if shard is None else shard[pc.shard_start:pc.shard_start + pc.n]
            grads.append(g)
        return self._sum_tied(grads)

    def _publish(self) -> None:
        """Phase 3: write each updated master piece, cast, into this rank's slice of its bucket's flat.
        The padding stays zero. The all-gathers that complete the flats in place are then due.
        The next forward's pre-hooks launch them (refinement below), or finish_gathers() does."""
        self.finish_gathers()  # the last step's, if a bucket was never needed since
        for b, full in enumerate(self.flat_params):
            c = self._bucket_class(b)
            S = full.numel() // self.class_worlds[c]
            self._write_shard(b, full[self.class_ranks[c] * S:(self.class_ranks[c] + 1) * S])  # (S,) in place
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
        full, c = self.flat_params[b], self._bucket_class(b)
        S, r = full.numel() // self.class_worlds[c], self.class_ranks[c]
        work = dist.all_gather_single(full, full[r * S:(r + 1) * S], group=self.class_groups[c],
                                      async_op=True) if self.class_worlds[c] > 1 else None  # N = 1: complete
        self._gathers.append((b, work))
        self._launched += 1

    # ---- the flat layout: one flat buffer per bucket, dp rank r owns slice r ------------------
    def _buckets(self) -> list[Bucket]:
        itemsize = (self.reduce_dtype or self.dtype).itemsize
        buckets = make_buckets(self.params, int(self.bucket_mb * 2**20), itemsize, pad_to=self.class_worlds,
                               classes=self.classes)
        # the tied copy gets a bucket of its own. It has the same size and padding on both stages
        rest = [[i for i in b.index if i != self.tied] for b in buckets]
        tied = [] if self.tied is None else [[self.tied]]
        return [layout(index, self.params, self.class_worlds[self.classes[index[0]]])
                for index in rest + tied if index]

    def _piece(self, b: int, k: int) -> Piece:
        """This rank's part of the k-th parameter of bucket b (maybe empty)."""
        bucket, c = self.buckets[b], self._bucket_class(b)
        S = bucket.size // self.class_worlds[c]
        lo, off, n = self.class_ranks[c] * S, bucket.offsets[k], self.params[bucket.index[k]].numel()
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

    def _make_sync(self) -> GradSync:
        # gradients are reduced in the order backward completes the buckets: the gathers' reversed
        self._order, self._site_pos = self._gather_order(self._model)
        return ReduceScatterSync(self.params, self.group, self.buckets, self.pieces, self.reduce_dtype,
                                 keep_full=self.stage == 1, per_micro_batch=self.per_micro_batch,
                                 on_reduced=self._on_reduced, inflight=self.inflight,
                                 order=self._order[::-1], groups=self.reduce_groups)

    def _on_reduced(self, b: int) -> None:
        pass

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.per_micro_batch else self.sync.no_sync()

    # --- refinement: the all-gathers overlap the next forward (Megatron's overlap_param_gather)
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
                      dtype: torch.dtype = torch.float32, *, bucket_mb: float = 25.0,
                      reduce_dtype: torch.dtype | None = None, inflight: int = 2,
                      reduce_every_micro_batch: bool = False,
                      norm_groups: Iterable[dist.ProcessGroup] = (),
                      counted: Callable[[str], bool] = lambda name: True,
                      tied: nn.Parameter | None = None, embed_group: Group = None,
                      init: Init | None = None, device: torch.device | str | None = None,
                      expert: Callable[[str], bool] | None = None, replica_group: Group = None,
                      ep_group: Group = None,
                      embed: str | None = None, layers: str | None = None, norm: str | None = None,
                      head: str | None = None) -> DataParallelOptimizer:
    """The step object for ZeRO `stage` 0-2 over `dp_group`. Stage 0 is plain DP.
    The model's parameters hold their fp32 values (after materialize, tp, ac).
    Or the model is on the meta device: then pass `init` (weights.param_reader) and `device`.
    Each stage then fills itself one parameter at a time.
    Stage 3: zero3.apply_zero, the same call for every stage.
    expert, replica_group, ep_group: expert parallelism (moe.py). The parameters `expert(name)`
    names sum their gradients and shard their state over replica_group; ep_group holds the
    other experts (the grad norm sums over it at stage 0). docs/moe.md#expert-parallelism-in-trainpy.
    The arguments, one by one: docs/zero.md#two-entry-points-and-where-the-accounting-lives."""
    if stage not in (0, 1, 2):
        raise ValueError(f"ZeRO stage must be 0, 1 or 2 here (stage 3: zero3.apply_zero), got {stage}")
    named = trainable(model, bucket_mb, inflight, tied, embed_group)
    kw = dict(bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, norm_groups=norm_groups, counted=counted,
              tied=tied, embed_group=embed_group, inflight=inflight, init=init, device=device,
              expert=expert, replica_group=replica_group, ep_group=ep_group)
    parts = find_parts(model, embed, layers, norm, head)
    if stage == 0:
        return DataParallelOptimizer(named, cfg, dtype, dp_group, **kw)
    return ZeroOptimizer(named, cfg, dtype, dp_group, stage, reduce_every_micro_batch, model, parts=parts, **kw)


def trainable(model: nn.Module, bucket_mb: float, inflight: int, tied: nn.Parameter | None,
              embed_group: Group) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters. First it checks the arguments every stage shares."""
    if bucket_mb <= 0 or inflight < 1:
        raise ValueError(f"bucket_mb must be > 0 and inflight >= 1, got {bucket_mb} and {inflight}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if tied is not None and (embed_group is None or all(p is not tied for _, p in named)):
        raise ValueError("tied must be a trainable parameter of the model and comes with the "
                         "embedding group of the first and last stage (pp.tied_embedding_ranks)")
    return named
