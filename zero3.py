"""ZeRO-3: shard the parameters too. Each decoder layer is a flat unit, gathered only while it runs.

What it does
    `apply_zero(model, stage, dp_group, cfg, dtype)` builds any ZeRO stage, 0 to 3.
    Stages 0-2 come from zero.apply_zero_0_to_2. Stage 3 is a Zero3Optimizer. train.py calls this one.
    Stage 3 holds 16Ψ/N bytes a rank between steps (docs/memory.md). A frozen base adds its bytes / N.
    `gathered()` holds every unit full (evaluation). `each_unit_gathered()` holds one (export.py).

The core idea
    A unit is the flat buffer of one forward site.
    The sites are [embedding], each decoder layer, [norm, head].
    Between uses a unit holds only this rank's shard. Its full flat has no storage.
    Module hooks gather a unit just before it runs and free it just after.
    Backward gathers it again. It is freed once its gradients are reduce-scattered.
    The optimizer is zero.py's ZeroOptimizer, with units for buckets.

Phase map (one micro-batch, then the step)
    gather        Zero3Optimizer._pre_forward, the site's forward pre-hook.
    free          Zero3Optimizer._post_forward, its forward hook. It hooks the output's gradient.
    gather again  Zero3Optimizer._pre_backward, when that gradient arrives. Never an embedding's.
    reduce, free  zero.ReduceScatterSync reduces every micro-batch. Zero3Optimizer._on_reduced frees,
                  once every backward begun on the unit is reduced. (zb runs a W after later forwards.)
    free frozen   Zero3Optimizer._post_backward, at the site's input gradient. A frozen unit is never reduced.
    step          zero.py's phases 1 and 2. Zero3Optimizer._publish writes the persistent shards.
    Refinement: the next `prefetch` sites gather asynchronously, ahead in forward, behind in backward.
    What stage 3 needs of a model, and its cross-feature notes: docs/zero.md#zero-3-units-gathered-only-while-they-run.

Reference
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".
    Zhao et al. 2023, "PyTorch FSDP": flat units, storage freeing, pre-backward gathers, prefetch.

Run
    torchrun --nproc_per_node 4 train.py --model tiny --zero 3 --ac --steps 20

Invariants
    - zero.py's invariants hold. Stage 3 always accumulates micro-batches in its grad shards.
      Test: tests/test_zero.py::test_zero_dp2_exactness_and_stage3_mechanics.
    - Forward gathers each unit once. Backward gathers it once more, not the embedding's. Test: the same.
    - Other models name their parts. An output without a gradient raises.
      Test: tests/test_foreign.py::test_dp_and_zero_stages_copied_alone.
    - The peak stays within the formula plus zero_memory.peak_extras. Test: tests/test_memory.py::test_zero_peaks_dp2.
    - `teardown()` removes every hook. Test: tests/test_zero.py::test_zero_teardown_leaves_nothing_alive.
    - Virtual pipeline stages share the head's end-of-site hook. It acts for the chunk holding the head.
      Test: tests/test_zero.py::test_zero3_virtual_stages_gather_each_unit_twice.
    - Another reduction group's parameters (zero.py's seam) form units reduced over it. Test: zero.py's seam banner.
    - A frozen unit: bytes / N a rank, never reduced. Test: tests/test_lora.py::test_memory_formula_with_a_frozen_base.
    - Built from meta, it reads its shard: never the whole base. Test: test_lora.py::test_build_peak_of_a_frozen_base.

Builds on: zero.py, dp.py, precision.py
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

import zero
from dp import Bucket, Group, layout, remove_handles
from precision import OptimConfig
from zero import DataParallelOptimizer, Named, Parts, ZeroOptimizer, _place, find_parts, launch, sites


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors of a forward's output. Itself, or inside a tuple, list or dict (a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


class Zero3Optimizer(ZeroOptimizer):
    """Stage 3: units = [embedding], each decoder layer, [final norm, lm_head], whichever exist.
    A pipeline stage may hold only some. A unit holding nothing but this rank's shard is "free".
    The hooks come first (the phase map), then frozen units. Then the step's seam. Then how the units are built.
    `prefetch`: how many sites ahead (forward) or behind (backward) gather asynchronously."""

    def __init__(self, model: nn.Module, named_params: Named, cfg: OptimConfig, dtype: torch.dtype,
                 group: Group, prefetch: int = 1, parts: Parts | None = None, **kw):
        self.model, self.prefetch = model, prefetch
        self.parts = find_parts(model) if parts is None else parts
        self.module_handles: list[torch.utils.hooks.RemovableHandle] = []
        self.grad_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._inflight: dict[int, object] = {}  # unit → pending all-gather work
        self._open: dict[int, int] = {}  # unit → backwards begun whose gradients are not reduced yet
        self._pinned = False  # inside gathered(): forwards keep everything gathered
        self._tail: dict[int, bool] = {}  # site → its last forward's input needs no gradient
        self._group_of = kw.get("group_of")  # the frozen units' groups too (zero.py's seam)
        super().__init__(named_params, cfg, dtype, group, stage=3, parts=self.parts, **kw)
        head = self.parts.head
        for s, site in enumerate(self.sites):
            # the head's site ends with the model's own forward: attotron's loss reads lm_head.weight
            # without calling lm_head (loss.linear_cross_entropy), so lm_head's hook would not run
            end = model if head is not None and site[-1] is head else site[-1]
            self.module_handles.append(site[0].register_forward_pre_hook(partial(self._pre_forward, s)))
            self.module_handles.append(end.register_forward_hook(partial(self._post_forward, s)))

    # ---- gather / free: the hooks of the phase map ------------------------------------------
    def _unit(self, u: int) -> tuple[torch.Tensor, torch.Tensor, tuple[Group, int, int]]:
        """Unit u's full flat, this rank's shard, and (group, N, r). Frozen units follow the trained."""
        T = len(self.buckets)
        if u < T:
            return self.flat_params[u], self.param_shards[u], self._group(u)
        return self.frozen_flats[u - T], self.frozen_shards[u - T], self.frozen_groups[u - T]

    def _gather(self, u: int, wait: bool = True) -> None:
        if not self._full[u]:
            full, shard, (group, N, _) = self._unit(u)
            full.untyped_storage().resize_(full.nbytes)
            self._inflight[u] = launch(dist.all_gather_single, full, shard, group, N)
            self._full[u] = True
        if wait:
            self._wait(u)

    def _wait(self, u: int) -> None:
        work = self._inflight.pop(u, None)
        if work is not None:
            work.wait()

    def _free(self, u: int) -> None:
        self._wait(u)  # never free under an in-flight gather
        self._unit(u)[0].untyped_storage().resize_(0)
        self._full[u] = False

    def _units(self, sites: Iterable[int]) -> list[int]:
        return [u for s in sites if 0 <= s < len(self.sites) for u in self.site_units[s]]

    def _pre_forward(self, s: int, module: nn.Module, args: tuple) -> None:
        for u in self.site_units[s]:  # gather: the site computes next, so wait for it
            self._gather(u)
        if not _in_backward():  # refinement, prefetch. A checkpoint recompute needs none
            for u in self._units(range(s + 1, s + 1 + self.prefetch)):
                self._gather(u, wait=False)  # the next sites' units, asynchronously
            if not self._pinned and torch.is_grad_enabled() and self._frozen_in(s):
                self._hook_input(s, [t for t in _tensors(args) if t.requires_grad])

    def _post_forward(self, s: int, module: nn.Module, args: tuple, out: object) -> None:
        if _in_backward() or self._pinned:
            return  # a recompute inside backward (backward frees the unit), or inside gathered()
        if module is not self.sites[s][-1] and getattr(module, "lm_head", None) is not self.sites[s][-1]:
            return  # a virtual-stage chunk without the head: it shares the model's hook dicts
        ahead = set(self._units(range(s + 1, s + 1 + self.prefetch)))
        for u in self.site_units[s]:
            if u not in ahead and not self._open.get(u):  # (zb: a W still to run needs it)
                self._free(u)
        # the site's backward starts at the first gradient of any of its outputs (a tensor, or in a
        # tuple or a ModelOutput: the layer's hidden states, the model's (logits, loss))
        outs, fired = [t for t in _tensors(out) if t.requires_grad], []
        if not outs and not self._frozen_only(s) and torch.is_grad_enabled():
            raise ValueError(f"ZeRO-3: {type(module).__name__}'s forward returned no tensor that requires "
                             "grad (in a tensor, tuple, list or dict), so its unit cannot be gathered for backward")
        tail = self._tail.pop(s, False)
        for t in outs:
            self.grad_handles.append(t.register_hook(partial(self._pre_backward_once, s, fired, tail)))

    def _pre_backward_once(self, s: int, fired: list, tail: bool, grad: torch.Tensor) -> None:
        if not fired:  # one output's gradient of this call is enough
            fired.append(True)
            self._pre_backward(s, grad)
            if tail:  # refinement, frozen units: this backward ends with the site
                torch.autograd.Variable._execution_engine.queue_callback(partial(self._post_backward, s))

    def _pre_backward(self, s: int, grad: torch.Tensor) -> None:
        for u in self.backward_units[s]:
            self._open[u] = self._open.get(u, 0) + 1
            self._gather(u)
        for t in range(s - 1, max(s - 1 - self.prefetch, -1), -1):
            for u in self.backward_units[t]:
                self._gather(u, wait=False)

    def _on_reduced(self, u: int) -> None:
        self._open[u] = max(self._open.get(u, 0) - 1, 0)
        if not self._open[u]:
            self._free(u)  # all of the unit's grads are in: no backward needs its parameters

    # ---- refinement: frozen units, gathered but never reduced (a frozen base: lora.py) -------
    # A parameter that needs no gradient has no master, no grad shard and no optimizer state.
    # Its site still shards it, gathers it and frees it, with the trained units' hooks.
    # Backward reads it on the way to the site's input. So that input's gradient frees it: every reader has run.
    # A site whose input needs none (layer 0 over a frozen embedding) is the last its backward reaches.
    # The backward's end frees it (an autograd engine callback).
    # The build fills only this rank's shard (_shard_frozen). A meta parameter reads it from `init`.
    def _frozen_in(self, s: int) -> bool:
        return any(u >= len(self.buckets) for u in self.backward_units[s])

    def _frozen_only(self, s: int) -> bool:
        return all(u >= len(self.buckets) for u in self.backward_units[s])  # its output may need no grad

    def _hook_input(self, s: int, inputs: list[torch.Tensor]) -> None:
        """Free the site's frozen units once its inputs' gradients are in, or at the backward's end."""
        self._tail[s] = not inputs
        if inputs:
            self.grad_handles.append(torch.autograd.graph.register_multi_grad_hook(
                inputs, lambda grads: self._post_backward(s)))

    def _post_backward(self, s: int) -> None:
        for u in self.backward_units[s]:
            if u >= len(self.buckets):
                self._on_reduced(u)  # a frozen unit is "reduced" once its site's backward is done

    # ---- the seam: the step writes the persistent shards ------------------------------------
    def _publish(self) -> None:
        for u in [u for u, full in enumerate(self._full) if full]:
            self._free(u)  # a gathered copy would be stale
        for u, shard in enumerate(self.param_shards):
            self._write_shard(u, shard)

    def finish(self) -> None:
        super().finish()
        remove_handles(self.grad_handles)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit full inside. A frozen unit has no master: its shard keeps what changed (lora.merge)."""
        for u in range(len(self._full)):
            self._gather(u)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for u in range(len(self._full)):
                if u >= len(self.buckets):
                    full, shard, (_, N, r) = self._unit(u)
                    shard.copy_(full.view(N, -1)[r])  # (N·S,) → (N, S): row r is this rank's
                self._free(u)

    def each_unit_gathered(self) -> Iterator[list[str]]:
        """One unit gathered at a time, a dp collective each.
        Yields its parameter names while they hold full values. Frees it before the next.
        So a streaming export holds one unit, not the model."""
        names = [[self.names[i] for i in b.index] for b in self.buckets] + \
            [[self.frozen_names[i] for i in b.index] for b in self.frozen_units]
        for u, unit in enumerate(names):
            self._gather(u)
            try:
                yield unit
            finally:
                self._free(u)

    def teardown(self) -> None:
        remove_handles(self.module_handles)
        remove_handles(self.grad_handles)
        for u in list(self._inflight):
            self._wait(u)
        super().teardown()

    # --- refinement: units built shard by shard, with the parameters outside the parts as units
    def _buckets(self) -> list[Bucket]:
        self.sites = sites(self.parts)
        where = {id(p): i for i, p in enumerate(self.params)}
        frozen = [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad and id(p) not in where]
        self.frozen_names, self.frozen_params = [n for n, _ in frozen], [p for _, p in frozen]
        fwhere = {id(p): i for i, p in enumerate(self.frozen_params)}
        # a parameter outside the parts (a learned position embedding) is a unit of its own, its site
        # the module holding it (placed after the embedding's: where position embeddings run)
        inside = {id(p) for site in self.sites for mod in site for p in mod.parameters()}
        holders = [mod for mod in self.model.modules() if any(
            (id(p) in where or id(p) in fwhere) and id(p) not in inside for p in mod.parameters(recurse=False))]
        first = int(self.parts.embed is not None)
        self.sites[first:first] = [[mod] for mod in holders]
        units: list[list[int]] = []
        owner: dict[int, int] = {}  # param position → unit (a tied weight belongs to its first site)
        self.frozen_units, self.frozen_groups, fowner, site_frozen = [], [], {}, []
        self.site_units: list[list[int]] = []
        for site in self.sites:  # a holder's site: its own parameters only (it may be the model)
            params = [p for mod in site for p in mod.parameters(recurse=all(mod is not h for h in holders))]
            mine = [where[id(p)] for p in params if id(p) in where]
            new = [i for i in dict.fromkeys(mine) if i not in owner]
            # the tied copy is a unit of its own. So is each other reduction group's part (zero.py's seam)
            for unit in [[i for i in new if i != self.tied and self.classes[i] == c]
                         for c in range(len(self.class_groups))] + [[i for i in new if i == self.tied]]:
                if unit:
                    owner.update({i: len(units) for i in unit})
                    units.append(unit)
            self.site_units.append(sorted({owner[i] for i in mine}))
            fmine = [fwhere[id(p)] for p in params if id(p) in fwhere]
            self._add_frozen([i for i in dict.fromkeys(fmine) if i not in fowner], fowner)
            site_frozen.append(sorted({fowner[i] for i in fmine}))
        # the frozen units are numbered after the trained ones
        self.site_units = [us + [len(units) + f for f in fs] for us, fs in zip(self.site_units, site_frozen)]
        # what each site's backward reads: an embedding's backward reads only the ids (a lookup's
        # gradient is scattered by index), so its unit is not gathered again for backward
        lookup = lambda site: site == [self.parts.embed] or (  # noqa: E731
            len(site) == 1 and isinstance(site[0], nn.Embedding))
        self.backward_units = [[] if lookup(site) else units for site, units in zip(self.sites, self.site_units)]
        self._full = [False] * (len(units) + len(self.frozen_units))
        return [layout(u, self.params, pad_to=self.class_groups[self.classes[u[0]]][1]) for u in units]

    def _add_frozen(self, new: list[int], owner: dict[int, int]) -> None:
        """A site's new frozen parameters as units. One per dtype (NF4's codes are uint8) and group."""
        kinds: dict[tuple, list[int]] = {}
        groups: dict[int, Group] = {}
        for i in new:
            placed = self._group_of(self.frozen_names[i]) if self._group_of else None
            group = self.group if placed is None else placed[0]
            groups[id(group)] = group
            kinds.setdefault((self.frozen_params[i].dtype, id(group)), []).append(i)
        for (_, g), unit in kinds.items():
            N = dist.get_world_size(groups[g]) if dist.is_initialized() else 1
            owner.update({i: len(self.frozen_units) for i in unit})
            self.frozen_groups.append((groups[g], N, dist.get_rank(groups[g]) if N > 1 else 0))
            self.frozen_units.append(layout(unit, self.frozen_params, pad_to=N))

    def _make_master(self) -> list[torch.Tensor]:
        """Shard by shard. For each unit, this rank's compute-dtype shard and fp32 master pieces
        are filled from only the elements it owns. The parameters become views of the unit's flat.
        That flat holds no memory until gathered. Never more than one fp32 parameter in full."""
        self.buckets = self._buckets()
        self.pieces = [None] * len(self.params)  # type: ignore[list-item]
        self.flat_params, self.param_shards = [], []
        master: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for b, bucket in enumerate(self.buckets):
            full = torch.empty(bucket.size, dtype=self.dtype, device=self.device)  # (size,)
            views = [full[off:off + self.params[i].numel()].view_as(self.params[i])
                     for i, off in zip(bucket.index, bucket.offsets)]
            full.untyped_storage().resize_(0)  # the parameters' views hold no memory until gathered
            shard = torch.zeros(bucket.size // self._group(b)[1], dtype=self.dtype, device=self.device)  # (S,)
            for k, (i, view) in enumerate(zip(bucket.index, views)):
                pc = self.pieces[i] = self._piece(b, k)
                master[i] = self._values(i, pc.start, pc.start + pc.n).clone() if pc.n else \
                    torch.zeros(0, device=self.device)  # (pc.n,): only the elements it owns are read
                shard[pc.shard_start:pc.shard_start + pc.n].copy_(master[i])
                _place(self.params[i], view)
            self.flat_params.append(full)
            self.param_shards.append(shard)
        self._shard_frozen()
        return master

    def _shard_frozen(self) -> None:
        """The frozen units: each rank fills only its shard. No master.
        A parameter on the meta device reads its shard's range from `init`, one parameter at a time.
        So the build holds the shards, plus one whole weight where the reader reads it whole.
        The unit's full flat is allocated only to cut the parameters' views, then freed at once."""
        self.frozen_flats, self.frozen_shards = [], []
        for bucket, (_, N, r) in zip(self.frozen_units, self.frozen_groups):
            ps = [self.frozen_params[i] for i in bucket.index]
            if self.init is None and any(p.is_meta for p in ps):
                raise ValueError("ZeRO-3 fills a frozen meta parameter from init= (weights.param_reader)")
            full = torch.empty(bucket.size, dtype=ps[0].dtype, device=self.device)  # (size,)
            views = [full[off:off + p.numel()].view_as(p) for p, off in zip(ps, bucket.offsets)]
            full.untyped_storage().resize_(0)  # the parameters' views hold no memory until gathered
            S = bucket.size // N
            shard = torch.zeros(S, dtype=full.dtype, device=self.device)  # (S,) row r of (N, S)
            for i, off, view in zip(bucket.index, bucket.offsets, views):
                p = self.frozen_params[i]
                a, b = max(off, r * S), min(off + p.numel(), (r + 1) * S)  # my part of p, in the flat
                if a < b:
                    shard[a - r * S:b - r * S] = self._frozen_values(i, a - off, b - off)
                _place(p, view)  # after the read: a materialized p gives its values first
            self.frozen_shards.append(shard)
            self.frozen_flats.append(full)

    def _frozen_values(self, i: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of frozen parameter i, flattened, in its dtype.
        From `init` on the meta device (QLoRA's reader gives NF4 codes too). Else its own."""
        p = self.frozen_params[i]
        if p.is_meta:
            return self.init(self.frozen_names[i], start, stop).to(self.device, p.dtype)
        return p.detach().reshape(-1)[start:stop]


def apply_zero(model: nn.Module, stage: int, dp_group: Group, cfg: OptimConfig,
               dtype: torch.dtype = torch.float32, *, prefetch: int = 1, **kw) -> DataParallelOptimizer:
    """The step object for ZeRO `stage` 0-3 over `dp_group`.
    Stages 0-2 come from zero.apply_zero_0_to_2, with the same keywords `kw`.
    Stage 3 is a Zero3Optimizer, checked the same way.
    On the meta device it reads only this rank's shard.
    prefetch: the units gathered ahead (stage 3).
    reduce_every_micro_batch is stage 2's. Stage 3 always reduces each micro-batch."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if stage < 3:
        return zero.apply_zero_0_to_2(model, stage, dp_group, cfg, dtype, **kw)
    kw.pop("reduce_every_micro_batch", None)
    parts = find_parts(model, *(kw.pop(k, None) for k in ("embed", "layers", "norm", "head")))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Zero3Optimizer(model, named, cfg, dtype, dp_group, prefetch, parts=parts, **kw)
