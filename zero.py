"""ZeRO stages 0-2: shard the optimizer state, then the gradients over dp (zero3.py: the parameters too).

What it does
    `apply_zero(model, stage, dp_group, optim_cfg, dtype)` returns the training step object for one
    of these memory layouts (bytes per parameter, bf16 params/grads, fp32 master + Adam m, v; N = dp):
      stage 0  plain DP: everything replicated, grads all-reduced (dp.GradSync)    16Ψ
      stage 1  fp32 master + Adam state sharded; grads reduce-scattered           2Ψ + 2Ψ + 12Ψ/N
      stage 2  + gradients: each bucket is reduce-scattered the moment its grads
               are ready and the full-size grads are dropped right there           2Ψ + 14Ψ/N
      stage 3  + parameters, one flat unit per decoder layer (zero3.py)            16Ψ/N
    All stages share one call shape, so the trainer has one code path:
        opt = apply_zero(model, stage, dp_group, cfg, torch.bfloat16)
        for k, micro in enumerate(micro_batches):
            with opt.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
                normalized_loss(model(x, labels=y, reduction="sum"), step_targets).backward()
        grad_norm = opt.step(lr)  # finish(), sum a tied copy (pp), clip, AdamW, publish, zero_grad
        ...; opt.teardown()       # removes every hook (see "Invariants")
    Stage 3 lives in zero3.py, which builds on this file (its Zero3Optimizer is a ZeroOptimizer
    whose buckets are per-layer units, gathered and freed by module hooks). This apply_zero builds
    stages 0-2; zero3.apply_zero takes the same arguments plus `prefetch` and builds all four (0-2
    through this one). A trainer offering every stage calls that one (train.py); ZeRO-1/2 alone
    needs this file only (with dp.py and precision.py).

    Sharding is 1-D: the parameters of a bucket (~bucket_mb MB in reverse order, as in dp.py;
    stage 3: a unit) lie back to back in one flat buffer padded to a multiple of N; dp rank r
    owns elements [r·S, (r+1)·S), S = size/N. The fp32 master of parameter i is the piece of i in
    that range (maybe empty), so AdamW still sees one tensor per parameter: weight-decay groups
    survive, and AdamW being elementwise the update is bit-identical to the unsharded one. Updated
    masters are cast to the compute dtype and all-gathered during the next forward (below).

Overlapped parameter all-gather (stages 1-2; Megatron's distributed optimizer, overlap_param_gather)
    step() writes each updated master piece, cast, into this rank's slice of its bucket's flat; the
    all-gathers that complete the flats in place (NCCL detects the in-place form: no shard buffer)
    then run in a fixed order: the order in which a forward first reads the buckets (the
    embedding's first, the head's last; `sites`). A forward pre-hook on each site (embedding, each
    decoder layer, the final norm for norm + head; `find_parts`: attotron's Llama, transformers'
    layout, or the dotted paths a user names) launches them in that order up to the last
    bucket it reads, waits for those, and keeps the next `inflight` in flight: the all-gather of
    layer k+1 runs while layer k computes, and only the first bucket's is exposed. They start at
    the first pre-hook, not in step(): on a GPU the host gets there long before the device is
    through the optimizer's kernels, so nothing is lost, and no collective is left running under
    the host's logging, checkpoint or evaluation code (nor under memory.PeakMeter's phase switch on
    CPU: its profiler session must not close while a gloo collective started under it runs).
    Whichever hook asks, gathers are launched in the one order, so dp ranks post the same
    collectives in the same order and cannot deadlock. Between step() and the next forward the
    parameters are NOT complete: `finish_gathers()` completes them (train.py calls it before a
    checkpoint save, an evaluation, the export and at the end of the run; gathered() and export.py
    call it too). Without a model (ZeroOptimizer(model=None)) step() completes them itself.
    The gradient side has no such remedy: the embedding's gradient is ready last in backward, so
    its reduction (the largest bucket: V·h) has no compute left to hide behind; the optimizer
    cannot start before it lands (the clipping norm and the non-finite check need every
    gradient). That cost is measured, not removed (README, "ZeRO: exposed communication").

    Building: on a meta-device model (`model.build`, cut by pp/tp) with `init=weights.param_reader(
    ...)`, stages 1-2 fill their flats and masters parameter by parameter, never holding more than
    one parameter in fp32 (zero3.py reads only the elements of its own shard: no rank ever holds
    the model in full). A built model is accepted too (init=None: the values are read from the
    parameters).

Peak memory (what decides an out-of-memory error; memory.PeakMeter measures it, tests/test_memory.py
checks it per phase at dp = 2 and 4). The table holds between steps. At its peak a rank holds the
table, the activations (all that grows with a micro-batch's tokens, the loss's block of fp32 logits
included: loss.linear_cross_entropy never makes (T, V)) and at most these extras, B being the
largest bucket (stage 3: unit) in the reduce dtype (zero3.peak_extras, in bytes, for every stage):
    - backward: (inflight + 2)·B of gradient buffers — `inflight` (default 2, dp.py) reductions in
      flight, one bucket being packed, one being filled — and the shards they reduce into; a
      bucket's full-size flat is freed as soon as its reduction lands, only this rank's shard stays
      (when every micro-batch reduces, the last `inflight` ones land during the next forward);
    - stage 3: its gathered units (zero3.py, "Peak memory");
    - the step: one chunk of fp32 gradients (precision.STEP_CHUNK_BYTES, at least one master piece)
      and AdamW's temporaries (torch's per-parameter loop: up to three of one piece, measured); the
      stage 1-2 parameter all-gathers, in flight during the next forward, are in place (nothing
      extra on NCCL);
    - on gloo (CPU) every collective in flight also stages through a buffer of its full size (the
      stage 1-2 all-gathers too: `inflight` buckets in the forward);
    - Adam's step counters and a few scalars (the table leaves them out: 8 bytes a parameter).
    Setup (from `init`): stages 1-2 hold their flats and masters plus one parameter (zero3.py: 6Ψ/N).
    Micro-batches. Stage 1 accumulates in the full .grad and reduces once per step (no_sync). Stage 2
    reduces once per step too (the default): under no_sync its full-size .grad accumulates — 2Ψ,
    stage 1's backward peak — and the last backward reduce-scatters it bucket by bucket and drops it,
    so the step itself runs at 2Ψ + 14Ψ/N. That is Megatron's distributed optimizer: with pipeline
    micro-batches (m ≥ 2p) reducing each one would multiply the dp traffic by m, on links the
    pipeline's own sends already use. `reduce_every_micro_batch=True` reduce-scatters every
    micro-batch instead (DeepSpeed's ZeRO-2): m reduce-scatters per step, and the peak is one
    micro-batch's, 2Ψ + 14Ψ/N plus the extras above (stage 3 always does: zero3.py).

Reference
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".

Run
    torchrun --nproc_per_node 4 train.py --model tiny --zero 2 --steps 20

Invariants
    - Gradients are dp-SUMMED (losses are normalised by the global target count; see dp.py).
    - The grad norm sums squares over each rank's owned pieces, all-reduced over dp (plus the caller's
      tp/pp `norm_groups`, with `counted(name)` for replicas); at N = 1 the pieces are the whole
      parameters in the same order, so every stage is bit-identical to MixedPrecisionOptimizer.
    - vs stage 0 at dp=2 (fp32) stages 1-2 are bit-identical unless clipping is active (the norm is
      summed in another order: last-bit different coefficient) or the grad shards accumulate
      micro-batches (stage 2 with reduce_every_micro_batch: (a1+b1)+(a2+b2) vs (a1+a2)+(b1+b2)).
      At 4+ ranks gloo's sums depend on the buffer layout.
    - Stage 1 keeps the full .grad as accumulation buffer and honours no_sync; after finish() only
      the owned slice of each .grad holds the dp sum (the rest is this rank's local sum). Stage 2
      honours no_sync as well unless reduce_every_micro_batch; then, like stage 3, it reduce-scatters
      at every backward (no_sync is a no-op) and accumulates in the grad shard, in fp32 with
      reduce_dtype=torch.float32. With bf16 compute and reduce_dtype=torch.float32 the stages that
      reduce once per step accumulate in fp32 too: dp.GradSync's full-size fp32 main buffers (4Ψ
      instead of the 2Ψ bf16 .grad, as Megatron's main_grad); stage 0 steps from those fp32 sums
      (its .grad stays None: no rounded bf16 copy), stages 1-2 keep only their reduce-scattered
      fp32 shard.
    - Every hook handle (post-accumulate-grad, module forward) is kept and `teardown()` removes
      them: hook closure → this object → params → hook (held in C++) is a cycle gc cannot see (the
      seed's leak).
    - Tied embeddings with pp > 1 (`tied=pp.tied_copy(model)`, Megatron's embedding group): the
      first stage's embedding and the last stage's copy each lie ALONE in a bucket (zero3.py: a
      unit) of the same size and padding, so dp rank r owns the same elements of both.
      step() all-reduces that dp-summed piece (stage 0: the whole .grad) over the 2-rank embedding
      group: both copies take bit-identical steps.

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

from dp import Bucket, GradSync, Group, Piece, ReduceScatterSync, layout, make_buckets, remove_handles
from precision import MixedPrecisionOptimizer, OptimConfig

Named = Iterable[tuple[str, nn.Parameter]]
Init = Callable[[str, int, int], torch.Tensor]  # (name, start, stop) → fp32 flat elements [start, stop)


def _place(p: nn.Parameter, value: torch.Tensor) -> None:
    """Make p hold `value` while staying the same Parameter object (hooks, optimizer groups, the
    caller's references and ties stay valid). A meta parameter cannot take a real tensor as .data:
    it first swaps contents with an empty one. `.data =` keeps p's own version counter, so the
    all-gathers writing into a stage-3 flat never look like in-place edits of tensors autograd saved."""
    if p.is_meta:
        empty = torch.empty(0, dtype=value.dtype, device=value.device)
        torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))
    p.data = value


class DataParallel(MixedPrecisionOptimizer):
    """Stage 0: MixedPrecisionOptimizer + dp.GradSync (all-reduce). Base of the ZeRO stages: the
    trainer-facing methods (no_sync, finish, step, gathered, teardown) are the same for all."""
    stage = 0

    def __init__(self, named_params: Named, cfg: OptimConfig, dtype: torch.dtype, group: Group, *,
                 bucket_mb: float = 25.0, reduce_dtype: torch.dtype | None = None,
                 norm_groups: Iterable[dist.ProcessGroup] = (),
                 counted: Callable[[str], bool] = lambda name: True,
                 tied: nn.Parameter | None = None, embed_group: Group = None, inflight: int = 2,
                 init: Init | None = None, device: torch.device | str | None = None):
        self.group, self.bucket_mb, self.reduce_dtype = group, bucket_mb, reduce_dtype
        self.inflight, self.init = inflight, init
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if self.world > 1 else 0
        named = list(named_params)
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

    def _values(self, i: int, start: int, stop: int) -> torch.Tensor:
        """fp32 elements [start, stop) of parameter i's flattened initial values, on this device:
        from `init` (only what is asked for is read) or from the parameter itself (maybe a view)."""
        if self.init is not None:
            return self.init(self.names[i], start, stop).to(self.device, torch.float32)
        return self.params[i].detach().reshape(-1)[start:stop].float()

    def _make_master(self) -> list[torch.Tensor]:
        if self.init is not None:  # one parameter at a time: stage 0 holds the whole model anyway
            for i, p in enumerate(self.params):
                _place(p, self._values(i, 0, p.numel()).clone().view(p.shape))
        return super()._make_master()

    def _make_sync(self) -> GradSync:
        # with fp32 main grads the step reads them (_master_grads): no bf16 .grad copy of the sums
        return GradSync(self.params, self.group, self.bucket_mb, self.reduce_dtype, inflight=self.inflight,
                        round_into_grad=False)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Wrap every accumulation micro-step's backward except the last."""
        return self.sync.no_sync()

    def finish(self) -> None:
        """Wait for the gradient reductions of this step (step() calls it; idempotent)."""
        self.sync.finish()

    def step(self, lr: float) -> float:
        self.finish()
        return super().step(lr)

    def _master_grads(self) -> list[torch.Tensor | None]:
        if self.sync.wide:  # the fp32 sums (micro-steps and dp), not the bf16-rounded .grad
            return self._sum_tied([self.sync.main_grad(i) for i in range(len(self.params))])
        return self._sum_tied(super()._master_grads())

    def _sum_tied(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Sum this rank's piece of the tied copy's gradient with the same piece on the other stage
        (the embedding group), in fp32: both copies get the same gradient, hence the same step."""
        if self.tied is not None and grads[self.tied] is not None:  # None on both: no backward ran
            grads[self.tied] = grads[self.tied].float()
            dist.all_reduce(grads[self.tied], group=self.embed_group)
        return grads

    def zero_grad(self) -> None:
        super().zero_grad()
        self.sync.clear()

    def finish_gathers(self) -> None:
        """Complete the parameter all-gathers the last step started (stages 1-2): from here on every
        parameter holds its full updated value. The end of a run, checkpoint save, export and
        evaluation call it; a training forward needs not (its pre-hooks wait bucket by bucket).
        Stage 0 has none; stage 3's parameters are shards between uses (see gathered())."""

    def gathered(self) -> contextlib.AbstractContextManager:
        """Full parameters inside the context (for export/eval); only stage 3 needs to gather."""
        self.finish_gathers()
        return contextlib.nullcontext()

    def teardown(self) -> None:
        self.sync.remove()


class ZeroOptimizer(DataParallel):
    """Stages 1 and 2 through precision.py's seam: sharded masters, sharded grads, all-gather.
    model: the module holding the parameters (pp.split_stage's stage); given, the step's parameter
    all-gathers overlap the next forward (see "Overlapped parameter all-gather"), else step() waits
    for them."""

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
        if model is not None and self.world > 1:
            for s, site in enumerate(sites(self.parts)):
                first = model if site[0] is self.parts.head else site[0]  # maybe not called: see sites()
                self.module_handles.append(first.register_forward_pre_hook(partial(self._wait_site, s)))

    def _gather_order(self, model: nn.Module | None) -> tuple[list[int], list[int]]:
        """The buckets in the order a forward first reads them, and per site the position in that
        order through which its parameters are complete. Buckets holding a parameter outside every
        site come first (every site waits for them); without a model: reverse bucket order (buckets
        hold the parameters in reverse). Reversed, the order backward completes them in."""
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

    def _buckets(self) -> list[Bucket]:
        itemsize = (self.reduce_dtype or self.dtype).itemsize
        buckets = make_buckets(self.params, int(self.bucket_mb * 2**20), itemsize, pad_to=self.world)
        # the tied copy gets a bucket of its own: the same size and padding on both stages
        rest = [[i for i in b.index if i != self.tied] for b in buckets]
        tied = [] if self.tied is None else [[self.tied]]
        return [layout(index, self.params, self.world) for index in rest + tied if index]

    def _piece(self, b: int, k: int) -> Piece:
        """This rank's part of the k-th parameter of bucket b (maybe empty)."""
        bucket = self.buckets[b]
        S = bucket.size // self.world
        lo, off, n = self.rank * S, bucket.offsets[k], self.params[bucket.index[k]].numel()
        a, z = max(off, lo), min(off + n, lo + S)
        return Piece(b, a - off, a - lo, z - a) if z > a else Piece(b, 0, 0, 0)

    def _make_master(self) -> list[torch.Tensor]:
        """Lay every bucket out flat in the compute dtype (the parameters become views into it, so
        the all-gather writes them in place), one parameter at a time, and cut this rank's fp32
        piece of each. Peak: the flats and pieces so far plus one parameter in fp32."""
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
                                 order=self._order[::-1])

    def _on_reduced(self, b: int) -> None:
        pass

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.per_micro_batch else self.sync.no_sync()

    def _master_grads(self) -> list[torch.Tensor | None]:
        grads: list[torch.Tensor | None] = []  # this rank's pieces, dp-summed, in the reduce dtype
        for p, pc in zip(self.params, self.pieces):
            if self.stage == 1 and not self.sync.wide:
                g = None if p.grad is None else p.grad.view(-1)[pc.start:pc.start + pc.n]
            else:
                shard = self.sync.grad_shards[pc.bucket]
                g = None if shard is None else shard[pc.shard_start:pc.shard_start + pc.n]
            grads.append(g)
        return self._sum_tied(grads)

    def _write_shard(self, b: int, shard: torch.Tensor) -> None:
        """Write the master pieces of bucket b, cast to the compute dtype, into its shard (one
        foreach launch for the bucket, not a copy kernel per parameter)."""
        index = [i for i in self.buckets[b].index if self.pieces[i].n]
        if not index:  # this rank owns only padding of a tiny bucket
            return
        with torch.no_grad():
            torch._foreach_copy_([shard[self.pieces[i].shard_start:self.pieces[i].shard_start + self.pieces[i].n]
                                  for i in index], [self.master[i] for i in index])

    def _publish(self) -> None:
        """Write each updated master piece, cast to the compute dtype, into this rank's slice of its
        bucket's flat (the padding stays zero); the all-gathers that complete the flats in place
        are due: the next forward's pre-hooks launch and wait for them (or finish_gathers())."""
        self.finish_gathers()  # the last step's, if a bucket was never needed since
        for b, full in enumerate(self.flat_params):
            S = full.numel() // self.world
            self._write_shard(b, full[self.rank * S:(self.rank + 1) * S])  # (S,) a view: in place
        self._launched = self._landed = 0
        if not self.module_handles:  # no forward hook would ask for them: complete them now
            self.finish_gathers()

    def _gather_through(self, k: int) -> None:
        """Wait for the all-gathers of self._order[0..k] (launching, in order, any not yet started),
        then keep the next ones launched, at most `inflight` in flight. The launch order is fixed,
        whichever hook asks: every dp rank posts the same collectives in the same order (NCCL pairs
        them by call order), so ranks whose hooks fire in different orders cannot deadlock."""
        while self._landed <= k:
            if self._landed == self._launched:
                self._launch_gather()
            _, work = self._gathers.popleft()
            if work is not None:
                work.wait()  # NCCL: the compute stream waits, not the host
            self._landed += 1
        while self._launched < min(self._landed + self.inflight, len(self._order)):
            self._launch_gather()

    def _launch_gather(self) -> None:
        b = self._order[self._launched]
        full = self.flat_params[b]
        S = full.numel() // self.world
        work = dist.all_gather_single(full, full[self.rank * S:(self.rank + 1) * S], group=self.group,
                                      async_op=True) if self.world > 1 else None  # N = 1: complete
        self._gathers.append((b, work))
        self._launched += 1

    def _wait_site(self, s: int, module: nn.Module, args: tuple) -> None:
        if self._landed < len(self._order):  # else: complete (later micro-batches, recomputes)
            self._gather_through(self._site_pos[s])

    def finish_gathers(self) -> None:
        self._gather_through(len(self._order) - 1)

    def teardown(self) -> None:
        remove_handles(self.module_handles)
        self.finish_gathers()
        super().teardown()


@dataclass
class Parts:
    """The modules ZeRO's hooks follow: embedding, decoder layers, final norm, head (None or empty
    where a pipeline stage holds none)."""
    embed: nn.Module | None
    layers: list[nn.Module]
    norm: nn.Module | None
    head: nn.Module | None


def find_parts(model: nn.Module, embed: str | None = None, layers: str | None = None,
               norm: str | None = None, head: str | None = None) -> Parts:
    """The parts of attotron's Llama or of transformers' layout (model.model.embed_tokens, .layers,
    .norm, model.lm_head), found by themselves; of any other model, from dotted paths (`layers`
    required, e.g. embed="transformer.wte", layers="transformer.h", norm="transformer.ln_f",
    head="lm_head"; a part not named is absent)."""
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
    """The modules whose forward first reads each group of parameters, in forward order: [embedding],
    each decoder layer, [final norm, head] — whichever this pipeline stage holds. The head's site
    starts at the norm: attotron's loss reads lm_head.weight chunk by chunk without calling lm_head."""
    out = ([[parts.embed]] if parts.embed is not None else []) + [[layer] for layer in parts.layers]
    head = [mod for mod in (parts.norm, parts.head) if mod is not None]
    return out + ([head] if head else [])


def apply_zero(model: nn.Module, stage: int, dp_group: Group, cfg: OptimConfig,
               dtype: torch.dtype = torch.float32, *, bucket_mb: float = 25.0,
               reduce_dtype: torch.dtype | None = None, inflight: int = 2,
               reduce_every_micro_batch: bool = False,
               norm_groups: Iterable[dist.ProcessGroup] = (),
               counted: Callable[[str], bool] = lambda name: True,
               tied: nn.Parameter | None = None, embed_group: Group = None,
               init: Init | None = None, device: torch.device | str | None = None,
               embed: str | None = None, layers: str | None = None, norm: str | None = None,
               head: str | None = None) -> DataParallel:
    """The step object for ZeRO `stage` 0-2 (0 = plain DP) over `dp_group`, built on a model whose
    parameters hold their fp32 values (after materialize, tp, ac) — or on a meta-device model with
    `init` (weights.param_reader: fp32 elements [start, stop) of a parameter's flattened local values)
    and `device`, which every stage fills one parameter at a time. Stage 3: zero3.apply_zero, the
    same call for every stage.
    norm_groups/counted: the tp/pp groups and replica predicate of the grad norm (the dp group is
    added when grads are sharded). bucket_mb: gradient bucket size; inflight: gradient reductions
    (and stage 1-2 all-gathers) in flight at once; reduce_every_micro_batch: stage 2 reduce-scatters
    each micro-batch instead of once per step.
    tied: this pipeline stage's copy of an embedding tied across the first and last stage (None
    elsewhere; pp.tied_copy(model) gives it): step() sums its gradient over `embed_group`.
    embed, layers, norm, head: the parts of a model that is neither attotron's Llama nor in
    transformers' layout (find_parts); stages 1-2 hook them to overlap the parameter all-gathers.
    The forward may return anything (a tensor, a ModelOutput, a tuple)."""
    if stage not in (0, 1, 2):
        raise ValueError(f"ZeRO stage must be 0, 1 or 2 here (stage 3: zero3.apply_zero), got {stage}")
    named = trainable(model, bucket_mb, inflight, tied, embed_group)
    kw = dict(bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, norm_groups=norm_groups, counted=counted,
              tied=tied, embed_group=embed_group, inflight=inflight, init=init, device=device)
    parts = find_parts(model, embed, layers, norm, head)
    if stage == 0:
        return DataParallel(named, cfg, dtype, dp_group, **kw)
    return ZeroOptimizer(named, cfg, dtype, dp_group, stage, reduce_every_micro_batch, model, parts=parts, **kw)


def trainable(model: nn.Module, bucket_mb: float, inflight: int, tied: nn.Parameter | None,
              embed_group: Group) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters, once the arguments every stage's apply_zero shares are
    checked (zero3.apply_zero's too)."""
    if bucket_mb <= 0 or inflight < 1:
        raise ValueError(f"bucket_mb must be > 0 and inflight >= 1, got {bucket_mb} and {inflight}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if tied is not None and (embed_group is None or all(p is not tied for _, p in named)):
        raise ValueError("tied must be a trainable parameter of the model and comes with the "
                         "embedding group of the first and last stage (pp.tied_embedding_ranks)")
    return named
