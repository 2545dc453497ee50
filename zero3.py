"""ZeRO-3: shard the parameters too — each decoder layer is a flat unit, gathered only while it runs.

What it does
    Stage 3 of zero.py's table: 16Ψ/N bytes a rank between steps (bf16 params and grads, fp32
    master + Adam m, v; N = dp). `Zero3Optimizer` is zero.py's ZeroOptimizer (sharded fp32 masters,
    Adam state and reduce-scattered gradients) whose buckets are flat units, one per forward site:
    [embedding], each decoder layer, [final norm, lm_head] — whichever this pipeline stage holds.
    Between uses a unit holds only this rank's compute-dtype shard (the parameters are views of its
    flat, whose storage is freed). Module hooks move it:
      - the forward pre-hook of the site's first module gathers it (waits) and starts the
        all-gathers of the next `prefetch` sites' units;
      - the forward post-hook of its last module frees it (unless a prefetched site shares it)
        and hooks the output's gradient;
      - that gradient hook (the site's backward comes next) gathers it again and starts the
        previous `prefetch` sites' — except the embedding's: a lookup's backward reads only the ids;
      - once the gradients of every backward begun on it are reduce-scattered (dp.ReduceScatterSync's
        on_reduced) it is freed; until then no forward frees it (zb runs a W after later forwards).
    step() writes the updated masters, cast, into the persistent shards (gathered when next used).
    gathered() holds every unit full (evaluation); each_unit_gathered() one at a time (export.py).

    `apply_zero(model, stage, dp_group, optim_cfg, dtype, ...)` here picks the stage: zero.py's call
    and arguments plus `prefetch`, for every stage 0-3 (0-2 are built by zero.apply_zero). It lives
    here, not in zero.py, so that ZeRO-1/2 copied alone needs no ZeRO-3 code and the import graph
    stays a tree; a trainer offering every stage calls this one (train.py). For the same reason
    persistent_bytes, formula_bytes and peak_extras live here: the memory account of every stage
    (zero.py's table and extras in bytes; what tests/test_memory.py and bench_theory.py check).

    What ZeRO-3 needs of the model. Its parts: attotron's Llama and transformers' layout are found
    by themselves, any other model names them (embed=, layers=, norm=, head=: dotted paths). Each
    part is called as a module (hooks gather and free it); a parameter outside the parts (a learned
    position embedding) is a unit of its own, read only inside its module's forward. The outputs of
    a layer and of the model hold the tensors backward starts from: a tensor, or a tuple, list or
    dict of them (a ModelOutput, the GPT's (logits, loss)); the first of their gradients gathers the
    unit for backward. An output without one (under grad) raises. tests/test_foreign.py.

    Building: on a meta-device model with `init=weights.param_reader(...)`, each unit's shard and
    fp32 master pieces are filled from only the elements this rank owns (from safetensors only the
    rows that hold them): no rank ever holds the model in full.

Peak memory (adds to zero.py's "Peak memory", B being the largest unit): prefetch + 1 gathered
units in forward, prefetch + 2 in backward (the unit whose grads are being reduced, this one, the
ones prefetched); a tied embedding stays gathered from the head's backward to the embedding's.
Under zb a unit stays gathered from a micro-batch's B to its W (W unpacks the saved views of its
weights), so a chunk with Ws pending keeps its units gathered through the forwards in between.
The embedding's own unit is not gathered for backward: a lookup's backward reads only the ids, so
an untied embedding (or pipeline stage 0's copy) costs no all-gather of V·h per micro-batch there.
Setup (from `init`): 6Ψ/N (fp32 master + compute shard; Adam's m, v appear at the first step) plus
one parameter in fp32 (a seeded init draws the whole tensor) or, for an instant, one unit's flat in
the compute dtype. Stage 3 always reduces every micro-batch: its parameters are gathered only while
a micro-batch uses them, and a full-size gradient kept between micro-batches would cost the 2Ψ that
stage 3 exists to avoid.

Reference
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models";
    Zhao et al. 2023, "PyTorch FSDP" (flat units, storage freeing, pre-backward gathers, prefetch).

Run
    torchrun --nproc_per_node 4 train.py --model tiny --zero 3 --ac --steps 20

Invariants
    - zero.py's hold (dp-summed gradients, the grad norm over owned pieces, the tied copy's step).
      vs stage 0 at dp=2 (fp32) bit-identical unless clipping is active or the grad shards
      accumulate micro-batches, which they always do here: (a1+b1)+(a2+b2) vs (a1+a2)+(b1+b2).
    - It reduce-scatters at every backward (no_sync is a no-op) and accumulates in the grad shard,
      in fp32 with reduce_dtype=torch.float32.
    - Every hook handle (post-accumulate-grad, module forward, output-grad) is kept and `teardown()`
      removes them (zero.py). After teardown the model's parameters are released (unusable).
    - Several micro-batches in flight (pipelining): each forward frees its units and each backward
      re-gathers them, so autograd's saved views of a unit stay valid. Forward hooks run inside
      backward (a checkpoint recompute) gather but never free. A tied embedding stays gathered from
      the head's backward to the embedding's. The head's unit is freed by a hook on the model
      itself: the loss reads lm_head.weight chunk by chunk without calling lm_head. With virtual
      pipeline stages (pp.stage_chunks) every chunk shares that hook; it acts for the chunk holding
      the head only (tests/test_zero.py::test_zero3_virtual_stages_gather_each_unit_twice).
    - Tied embeddings with pp > 1: the tied copy is a unit of its own, of the same size and
      padding on both stages (zero.py's "Invariants").

Builds on: zero.py, dp.py, precision.py
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

import precision as P
import zero
from dp import Bucket, Group, launch, layout, remove_handles
from precision import OptimConfig
from zero import DataParallel, Init, Named, Parts, ZeroOptimizer, _place, find_parts, sites


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(out: object) -> list[torch.Tensor]:
    """The tensors of a forward's output: itself, or inside a tuple, list or dict (a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


class Zero3Optimizer(ZeroOptimizer):
    """Stage 3: units = [embedding], each decoder layer, [final norm, lm_head] (whichever exist — a
    pipeline stage may hold only some). A unit holding nothing but this rank's shard is "free"; it is
    gathered by the forward pre-hook of its site and freed by the forward post-hook, gathered again
    by a hook on the site's output gradient (not the embedding's: its backward reads only the ids)
    and freed once all its grads are reduce-scattered.
    `prefetch` = how many sites ahead (forward) / behind (backward) are gathered asynchronously."""

    def __init__(self, model: nn.Module, named_params: Named, cfg: OptimConfig, dtype: torch.dtype,
                 group: Group, prefetch: int = 1, parts: Parts | None = None, **kw):
        self.model, self.prefetch = model, prefetch
        self.parts = find_parts(model) if parts is None else parts
        self.module_handles: list[torch.utils.hooks.RemovableHandle] = []
        self.grad_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._inflight: dict[int, object] = {}  # unit → pending all-gather work
        self._open: dict[int, int] = {}  # unit → backwards begun whose gradients are not reduced yet
        self._pinned = False  # inside gathered(): forwards keep everything gathered
        super().__init__(named_params, cfg, dtype, group, stage=3, parts=self.parts, **kw)
        head = self.parts.head
        for s, site in enumerate(self.sites):
            # the head's site ends with the model's own forward: attotron's loss reads lm_head.weight
            # without calling lm_head (loss.linear_cross_entropy), so lm_head's hook would not run
            end = model if head is not None and site[-1] is head else site[-1]
            self.module_handles.append(site[0].register_forward_pre_hook(partial(self._pre_forward, s)))
            self.module_handles.append(end.register_forward_hook(partial(self._post_forward, s)))

    def _buckets(self) -> list[Bucket]:
        self.sites = sites(self.parts)
        where = {id(p): i for i, p in enumerate(self.params)}
        # a parameter outside the parts (a learned position embedding) is a unit of its own, its site
        # the module holding it (placed after the embedding's: where position embeddings run)
        inside = {id(p) for site in self.sites for mod in site for p in mod.parameters()}
        holders = [mod for mod in self.model.modules()
                   if any(id(p) in where and id(p) not in inside for p in mod.parameters(recurse=False))]
        first = int(self.parts.embed is not None)
        self.sites[first:first] = [[mod] for mod in holders]
        units: list[list[int]] = []
        owner: dict[int, int] = {}  # param position → unit (a tied weight belongs to its first site)
        self.site_units: list[list[int]] = []
        for site in self.sites:  # a holder's site: its own parameters only (it may be the model)
            mine = [where[id(p)] for mod in site
                    for p in mod.parameters(recurse=all(mod is not h for h in holders)) if id(p) in where]
            new = [i for i in dict.fromkeys(mine) if i not in owner]
            for unit in ([i for i in new if i != self.tied], [i for i in new if i == self.tied]):
                if unit:  # the tied copy is a unit of its own
                    owner.update({i: len(units) for i in unit})
                    units.append(unit)
            self.site_units.append(sorted({owner[i] for i in mine}))
        # what each site's backward reads: an embedding's backward reads only the ids (a lookup's
        # gradient is scattered by index), so its unit is not gathered again for backward
        lookup = lambda site: site == [self.parts.embed] or (  # noqa: E731
            len(site) == 1 and isinstance(site[0], nn.Embedding))
        self.backward_units = [[] if lookup(site) else units for site, units in zip(self.sites, self.site_units)]
        self._full = [False] * len(units)
        return [layout(u, self.params, pad_to=self.world) for u in units]

    def _make_master(self) -> list[torch.Tensor]:
        """Shard by shard: for each unit, this rank's compute-dtype shard and fp32 master pieces are
        filled from only the elements it owns; the parameters become views of the unit's flat,
        which holds no memory until gathered. Never more than one parameter (fp32) in full."""
        self.buckets = self._buckets()
        self.pieces = [None] * len(self.params)  # type: ignore[list-item]
        self.flat_params, self.param_shards = [], []
        master: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for b, bucket in enumerate(self.buckets):
            full = torch.empty(bucket.size, dtype=self.dtype, device=self.device)  # (size,)
            views = [full[off:off + self.params[i].numel()].view_as(self.params[i])
                     for i, off in zip(bucket.index, bucket.offsets)]
            full.untyped_storage().resize_(0)  # the parameters' views hold no memory until gathered
            shard = torch.zeros(bucket.size // self.world, dtype=self.dtype, device=self.device)  # (S,)
            for k, (i, view) in enumerate(zip(bucket.index, views)):
                pc = self.pieces[i] = self._piece(b, k)
                master[i] = self._values(i, pc.start, pc.start + pc.n).clone() if pc.n else \
                    torch.zeros(0, device=self.device)  # (pc.n,): only the elements it owns are read
                shard[pc.shard_start:pc.shard_start + pc.n].copy_(master[i])
                _place(self.params[i], view)
            self.flat_params.append(full)
            self.param_shards.append(shard)
        return master

    # ---- gather / free -------------------------------------------------------------------------
    def _gather(self, u: int, wait: bool = True) -> None:
        if not self._full[u]:
            full, shard = self.flat_params[u], self.param_shards[u]
            full.untyped_storage().resize_(full.nbytes)
            self._inflight[u] = launch(dist.all_gather_single, full, shard, self.group, self.world)
            self._full[u] = True
        if wait:
            self._wait(u)

    def _wait(self, u: int) -> None:
        work = self._inflight.pop(u, None)
        if work is not None:
            work.wait()

    def _free(self, u: int) -> None:
        self._wait(u)  # never free under an in-flight gather
        self.flat_params[u].untyped_storage().resize_(0)
        self._full[u] = False

    def _units(self, sites: Iterable[int]) -> list[int]:
        return [u for s in sites if 0 <= s < len(self.sites) for u in self.site_units[s]]

    def _pre_forward(self, s: int, module: nn.Module, args: tuple) -> None:
        for u in self.site_units[s]:
            self._gather(u)
        if not _in_backward():  # an activation-checkpoint recompute needs no prefetch
            for u in self._units(range(s + 1, s + 1 + self.prefetch)):
                self._gather(u, wait=False)

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
        if not outs and self.backward_units[s] and torch.is_grad_enabled():
            raise ValueError(f"ZeRO-3: {type(module).__name__}'s forward returned no tensor that requires "
                             "grad (in a tensor, tuple, list or dict), so its unit cannot be gathered for backward")
        for t in outs:
            self.grad_handles.append(t.register_hook(partial(self._pre_backward_once, s, fired)))

    def _pre_backward_once(self, s: int, fired: list, grad: torch.Tensor) -> None:
        if not fired:  # one output's gradient of this call is enough
            fired.append(True)
            self._pre_backward(s, grad)

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

    # ---- the seam ----------------------------------------------------------------------------------
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
        for u in range(len(self.buckets)):
            self._gather(u)
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False
            for u in range(len(self.buckets)):
                self._free(u)

    def each_unit_gathered(self) -> Iterator[list[str]]:
        """One unit gathered at a time (a dp collective each): yields its parameter names while they
        hold full values, frees it before the next (a streaming export holds one unit, not the model)."""
        for u in range(len(self.buckets)):
            self._gather(u)
            try:
                yield [self.names[i] for i in self.buckets[u].index]
            finally:
                self._free(u)

    def teardown(self) -> None:
        remove_handles(self.module_handles)
        remove_handles(self.grad_handles)
        for u in list(self._inflight):
            self._wait(u)
        super().teardown()


def apply_zero(model: nn.Module, stage: int, dp_group: Group, cfg: OptimConfig,
               dtype: torch.dtype = torch.float32, *, bucket_mb: float = 25.0,
               reduce_dtype: torch.dtype | None = None, prefetch: int = 1, inflight: int = 2,
               reduce_every_micro_batch: bool = False,
               norm_groups: Iterable[dist.ProcessGroup] = (),
               counted: Callable[[str], bool] = lambda name: True,
               tied: nn.Parameter | None = None, embed_group: Group = None,
               init: Init | None = None, device: torch.device | str | None = None,
               embed: str | None = None, layers: str | None = None, norm: str | None = None,
               head: str | None = None) -> DataParallel:
    """The step object for ZeRO `stage` 0-3 over `dp_group`: stages 0-2 from zero.apply_zero (the
    same arguments, documented there), stage 3 a Zero3Optimizer, checked the same way and built on
    the meta device reading only this rank's shard. prefetch: units gathered ahead (stage 3);
    reduce_every_micro_batch is stage 2's (stage 3 always reduces each micro-batch). embed,
    layers, norm, head: a model's parts when it is neither attotron's Llama nor in transformers'
    layout (zero.find_parts)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    kw = dict(bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, norm_groups=norm_groups, counted=counted,
              tied=tied, embed_group=embed_group, inflight=inflight, init=init, device=device)
    described = dict(embed=embed, layers=layers, norm=norm, head=head)
    if stage < 3:
        return zero.apply_zero(model, stage, dp_group, cfg, dtype,
                               reduce_every_micro_batch=reduce_every_micro_batch, **kw, **described)
    parts = find_parts(model, **described)
    named = zero.trainable(model, bucket_mb, inflight, tied, embed_group)
    return Zero3Optimizer(model, named, cfg, dtype, dp_group, prefetch, parts=parts, **kw)


def persistent_bytes(opt: DataParallel) -> dict[str, int]:
    """Bytes this rank holds for params, grads, fp32 master, Adam m and v, from the tensors: each
    storage once, in the first category holding it (an fp32 master that IS the param counts as
    params); a freed stage-3 unit counts 0. Call between finish() and step() to see the grads."""
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor | None]) -> int:
        storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors if t is not None)}
        new = {ptr: n for ptr, n in storages.items() if n and ptr not in seen}
        seen.update(new)
        return sum(new.values())

    state = [opt.optimizer.state.get(m, {}) for m in opt.master]
    return {"params": total([*opt.params, *getattr(opt, "param_shards", [])]),
            "grads": total([p.grad for p in opt.params] + getattr(opt.sync, "grad_shards", [])
                           + opt.sync.main),
            "master": total(opt.master),
            "adam_m": total(s.get("exp_avg") for s in state),
            "adam_v": total(s.get("exp_avg_sq") for s in state)}


def formula_bytes(stage: int, psi: int, n: int) -> float:
    """zero.py's table (its module docstring): bytes per rank between steps for Ψ parameters over N = n
    ranks, bf16 params and grads, fp32 master + Adam m, v."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def peak_extras(opt: DataParallel) -> dict[str, int]:
    """The extras of zero.py's "Peak memory" (and this module's, stage 3), in bytes, from this rank's
    own buckets (or units) and master pieces: the most a phase ("forward", "backward", "step") may
    hold beyond the table's state and the activations. What a test or benchmark checks a measured
    peak against."""
    c, r = opt.dtype.itemsize, (opt.reduce_dtype or opt.dtype).itemsize
    k, n, stage3 = opt.inflight, opt.world, isinstance(opt, Zero3Optimizer)
    bucket = max((b.size for b in opt.sync.buckets), default=0)  # elements; a unit at stage 3
    piece = max((m.numel() for m in opt.master), default=0)
    gloo = opt.device.type == "cpu"  # gloo stages every collective through a full-size buffer
    small = 8 * len(opt.master) + 1024  # Adam's step counters, scalars
    units = (opt.prefetch + 1) * bucket * c + gloo * opt.prefetch * bucket * c if stage3 else 0
    grads = (k + 2) * bucket * r + k * (bucket // max(n, 1)) * r + gloo * k * bucket * r
    chunk = 4 * max(P.STEP_CHUNK_BYTES // 4, piece) + 12 * piece  # fp32 grads, AdamW's temporaries
    gathers = gloo * k * bucket * c if opt.stage in (1, 2) else 0  # in place: gloo's staging only
    pending = grads - 2 * bucket * r if getattr(opt, "per_micro_batch", False) else 0  # in flight still
    return {"forward": small + units + pending + gathers,
            "backward": small + units + bucket * c * stage3 + grads, "step": small + chunk}
