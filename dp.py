"""Data parallelism: the bucketed, overlapped gradient all-reduce, and the dp-rank sampler.

What it does
    Each dp rank trains on its own slice of the global batch.
    `GradSync` sums the gradients over the dp group, as DDP does.
    After `finish()` every rank holds the same summed gradient.
    zero.ReduceScatterSync reduce-scatters the same buckets instead: ZeRO's gradient side.
    `DPSampler` gives each dp rank its slice of every global batch.
    `global_count` sums the step's target tokens over dp.

The core idea
    Parameters go into flat buckets of about `bucket_mb` MB, in reverse order.
    Backward makes the last layers' gradients first, so buckets complete in that order.
    A post-accumulate-grad hook counts each bucket's ready gradients (`GradSync._on_grad`).
    A complete bucket is packed into one flat buffer and all-reduced asynchronously (`_launch`).
    Backward goes on with earlier layers meanwhile.
    `finish()` waits for the rest and writes the sums back, before the optimizer step.
    Two refinements follow the core, each under its banner.
    One keeps at most `inflight` reductions in flight. One keeps fp32 main gradients.
    Their reasons, and the launch order: docs/zero.md#dppy-the-gradient-buckets.

Reference
    Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB).

Run
    torchrun --nproc_per_node 4 train.py --model tiny --steps 20      # dp = world / (tp·pp) = 4

Invariants
    - Gradients are summed over dp, never averaged: each rank divides its loss sum by the global
      target count (precision.normalized_loss). Test: test_dp.py::test_dp_matches_single_process_and_bucketing.
    - dp = 1 is an exact no-op: no hooks, no buffers. Only fp32 accumulation hooks in there.
      Tests: the same, and test_zero.py::test_fp32_accumulation_of_bf16_grads.
    - A bucket is reduced once per step. A second synced backward raises. Test: the same.
    - A missing gradient raises in `finish()`. It never hangs. Test: the same.
    - `remove()` drops every hook. Their cycle is invisible to gc.
      Test: test_zero.py::test_zero_teardown_leaves_nothing_alive.
    - Step k trains on the same sequences at any dp size.
      Test: test_dp.py::test_sampler_epoch_coverage_and_layout_free_batches.
    - Parameters of different `groups` never share a bucket.
      With one group for all, the buckets are the plain sync's. Test: zero.py's parameter → group seam.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

Group = dist.ProcessGroup | None
TWICE = ("bucket {} was reduced twice before finish(): run every accumulation micro-step but the "
         "last under no_sync() and call finish() once per step")


# ------------------------------------------------------------------------------------------ grad sync
class GradSync:
    """Sum `.grad` over the dp group in flat buckets, overlapped with backward.

        sync = GradSync(params, dp_group, bucket_mb=25)
        for k, micro in enumerate(micro_batches):
            with sync.no_sync() if k < len(micro_batches) - 1 else contextlib.nullcontext():
                loss(micro).backward()        # the last backward launches the bucket all-reduces
        sync.finish()                         # wait, copy the sums into .grad
        optimizer.step(); ...; sync.remove()  # at teardown

    reduce_dtype: the flat buffers' dtype (None: the grads' dtype). torch.float32 with bf16 grads
    turns on fp32 main grads (refinement below). Subclasses (zero.ReduceScatterSync) replace
    `_launch` and `_land` to reduce-scatter.
    groups: one group per parameter, to sum some over a subgroup of `group` (zero.py's parameter →
    group seam). A bucket holds one group's parameters only."""

    def __init__(self, params: Sequence[nn.Parameter], group: Group = None, bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None, buckets: list[Bucket] | None = None,
                 inflight: int = 2, order: Sequence[int] | None = None, round_into_grad: bool = True,
                 groups: Sequence[Group] | None = None):
        if inflight < 1:
            raise ValueError(f"inflight must be >= 1 (reductions in flight at once), got {inflight}")
        self.params = list(params)
        self.group, self.inflight = group, inflight
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1
        self.reduce_dtype, self.round_into_grad = reduce_dtype, round_into_grad
        classes, distinct = group_classes([group] * len(self.params) if groups is None else groups)
        if buckets is None:
            itemsize = (reduce_dtype or self.params[0].dtype).itemsize if self.params else 4
            buckets = make_buckets(self.params, int(bucket_mb * 2**20), itemsize, classes=classes)
        self.buckets = buckets
        # each bucket's group and its size (all `group` unless `groups` says otherwise)
        self.groups = [distinct[classes[b.index[0]]] for b in buckets]
        self.worlds = [dist.get_world_size(g) if dist.is_initialized() else 1 for g in self.groups]
        # fp32 main grads: accumulate in reduce_dtype flat buffers, one per bucket, made lazily
        self.fp32_grads = bool(self.params) and reduce_dtype is not None and \
            reduce_dtype.itemsize > self.params[0].dtype.itemsize
        self.main: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._where = {i: (b, off) for b, bk in enumerate(self.buckets)
                       for i, off in zip(bk.index, bk.offsets)}  # param → (bucket, offset)
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._sync = True
        self._ready = [0] * len(self.buckets)  # grads accumulated so far in this backward, per bucket
        # the launch order. Buckets are reduced in it, whatever order their grads complete in
        self.in_order = True
        self.order = list(range(len(self.buckets))) if order is None else list(order)
        self._complete = [False] * len(self.buckets)  # all grads in, launch not yet due
        self._next = 0  # position in self.order of the next bucket to launch
        self._pending: dict[int, tuple] = {}  # bucket → (work, buffers it reads/writes), launch order
        self._launched: set[int] = set()  # buckets reduced since the last finish()
        self._alias = True  # may a one-gradient bucket be reduced in the .grad itself (_pack)
        if self.hooked():
            for b, bucket in enumerate(self.buckets):
                for i in bucket.index:
                    hook = partial(self._on_grad, b, i)
                    self.handles.append(self.params[i].register_post_accumulate_grad_hook(hook))

    def hooked(self) -> bool:
        """dp = 1 needs no communication at all: no hooks (unless accumulating in fp32)."""
        return max(self.worlds, default=1) > 1 or self.fp32_grads

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this context only accumulates into .grad (accumulation micro-steps)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _on_grad(self, b: int, i: int, param: nn.Parameter) -> None:
        if self.fp32_grads:  # every micro-step: .grad → the bucket's fp32 buffer, so autograd never adds in bf16
            self.main_grad(i, create=True).add_(param.grad)
            param.grad = None
        if not self._sync:
            return
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b].index):
            self._ready[b] = 0
            if not self.in_order:
                self._launch(b)
                return
            self._complete[b] = True
            while self._complete[self.order[self._next]]:  # launch in self.order, never out of it
                self._complete[self.order[self._next]] = False
                self._launch(self.order[self._next])
                self._next = (self._next + 1) % len(self.order)  # a whole round: the next backward
                if self._next == 0:
                    break

    def _launch(self, b: int) -> None:
        if b in self._launched:
            raise RuntimeError(TWICE.format(b))
        self._launched.add(b)
        self._bound()
        flat = self._pack(b)
        work = dist.all_reduce(flat, group=self.groups[b], async_op=True) if self.worlds[b] > 1 else None
        self._pending[b] = (work, flat)

    def _pack(self, b: int) -> torch.Tensor:
        """The bucket's grads in one flat buffer (reduce dtype), zero padding at the end: (size,).
        A bucket may be one whole gradient (a large parameter: the embedding).
        Then it is that gradient itself, reduced in place. No copy of the largest tensors."""
        if self.fp32_grads:
            return self.main[b]  # already flat: reduced in place
        bucket = self.buckets[b]
        first = self.params[bucket.index[0]].grad
        dtype = self.reduce_dtype or first.dtype
        if self._alias and len(bucket.index) == 1 and bucket.size == bucket.numel and \
                first.dtype == dtype and first.is_contiguous():
            return first.view(-1)
        flat = torch.empty(bucket.size, dtype=dtype, device=first.device)
        flat[bucket.numel:].zero_()
        for i, off in zip(bucket.index, bucket.offsets):
            g = self.params[i].grad
            flat[off:off + g.numel()].copy_(g.reshape(-1))
        return flat

    def finish(self) -> None:
        """Wait for every launched reduction and write the results back. Idempotent."""
        partial_ = [b for b, n in enumerate(self._ready) if n]
        if partial_:
            names = [i for b in partial_ for i in self.buckets[b].index if self.params[i].grad is None]
            raise RuntimeError(f"buckets {partial_} got only some of their gradients in the synced "
                               f"backward (no grad for parameters at positions {names[:8]}): every "
                               f"rank must use every parameter, or freeze the unused ones")
        if self._next or any(self._complete):  # a round begun and not finished
            blocked = self.order[self._next:]
            raise RuntimeError(f"bucket {blocked[0]} got no gradient in the synced backward, so buckets "
                               f"{[b for b in blocked if self._complete[b]]} behind it in the fixed launch "
                               f"order were not reduced: every rank must use every parameter")
        for b in list(self._pending):
            self._land_bucket(b)
        self._launched.clear()

    def _land_bucket(self, b: int) -> None:
        work, *buffers = self._pending.pop(b)
        if work is not None:  # None: a dp=1 "collective" that was a plain copy
            work.wait()
        self._land(b, *buffers)

    def _land(self, b: int, flat: torch.Tensor) -> None:
        bucket = self.buckets[b]
        for i, off in zip(bucket.index, bucket.offsets):
            p = self.params[i]
            if self.fp32_grads:  # the fp32 sum stays in main. .grad gets it rounded once, for any optimizer
                if self.round_into_grad:
                    p.grad = flat[off:off + p.numel()].view_as(p).to(p.dtype)
            elif p.grad.data_ptr() != flat.data_ptr():  # else reduced in place
                p.grad.copy_(flat[off:off + p.numel()].view_as(p))

    def remove(self) -> None:
        """Teardown: drop every hook (breaking the hook → self → params → hook cycle) and buffers."""
        remove_handles(self.handles)
        for work, *_ in self._pending.values():
            if work is not None:
                work.wait()
        self._pending.clear()
        self._launched.clear()
        self._ready = [0] * len(self.buckets)
        self._complete, self._next = [False] * len(self.buckets), 0
        self.clear()

    # --- refinement: at most `inflight` reductions in flight (a bounded backward peak)
    def _bound(self) -> None:
        """Before packing one more bucket, land the oldest until fewer than `inflight` are pending."""
        while len(self._pending) >= self.inflight:
            self._land_bucket(next(iter(self._pending)))

    # --- refinement: fp32 main gradients (Megatron's main_grad): accumulate and sum in fp32
    def main_grad(self, i: int, create: bool = False) -> torch.Tensor | None:
        """Parameter i's fp32 gradient sum in its bucket's main buffer (None before any backward)."""
        b, off = self._where[i]
        p = self.params[i]
        if self.main[b] is None and create:
            self.main[b] = torch.zeros(self.buckets[b].size, dtype=self.reduce_dtype, device=p.device)
        return None if self.main[b] is None else self.main[b][off:off + p.numel()].view_as(p)

    def clear(self) -> None:
        """Drop the main buffers (the optimizer's zero_grad): the next step accumulates from zero."""
        self.main = [None] * len(self.buckets)


# ------------------------------------------------------------------------------------------ buckets
@dataclass
class Bucket:
    """Some parameters laid out back to back in one flat buffer.
    Parameter `index[k]` of the owner's list occupies [offsets[k], offsets[k] + numel).
    `size` is `numel` padded to a multiple of the dp size when the bucket is sharded (ZeRO).
    The padding is zero."""
    index: list[int]
    offsets: list[int]
    numel: int
    size: int


def layout(index: list[int], params: Sequence[torch.Tensor], pad_to: int = 1) -> Bucket:
    offsets, n = [], 0
    for i in index:
        offsets.append(n)
        n += params[i].numel()
    return Bucket(index, offsets, n, -(-n // pad_to) * pad_to)


def make_buckets(params: Sequence[torch.Tensor], bucket_bytes: int, itemsize: int,
                 pad_to: int | Sequence[int] = 1, classes: Sequence[int] | None = None) -> list[Bucket]:
    """Group parameters in REVERSE order into buckets of at most `bucket_bytes`.
    Backward produces the last layers' grads first. A larger parameter gets a bucket of its own.
    classes: parameters of different classes (reduced over different groups) never share a bucket.
    Each class fills its own, padded to pad_to[c] for class c.
    The buckets are listed in the order they are opened. With one class, that is one list's order."""
    classes = [0] * len(params) if classes is None else list(classes)
    pads = [pad_to] * (max(classes, default=0) + 1) if isinstance(pad_to, int) else list(pad_to)
    groups: list[list[int]] = []
    open_: dict[int, tuple[int, int]] = {}  # class → (its open group, bytes in it)
    for i in reversed(range(len(params))):
        c, nbytes = classes[i], params[i].numel() * itemsize
        if c in open_ and open_[c][1] + nbytes > bucket_bytes:
            del open_[c]
        if c not in open_:
            open_[c] = (len(groups), 0)
            groups.append([])
        g, size = open_[c]
        groups[g].append(i)
        open_[c] = (g, size + nbytes)
    return [layout(g, params, pads[classes[g[0]]]) for g in groups]


def group_classes(groups: Sequence[Group]) -> tuple[list[int], list[Group]]:
    """Each parameter's reduction group → (its class, the distinct groups by class).
    Parameters whose groups are the same object share a class.
    So a subgroup that is the dp group itself changes nothing."""
    distinct: list[Group] = []
    for g in groups:
        if all(d is not g for d in distinct):
            distinct.append(g)
    return [next(c for c, d in enumerate(distinct) if d is g) for g in groups], distinct


# ------------------------------------------------------------------------------------------ the data side
class DPSampler:
    """This dp rank's sample indices, one optimizer step at a time.

    All ranks derive one global order of the dataset from (seed, epoch).
    Each uses its own `torch.Generator`. G is the global batch.
    Optimizer step k consumes entries [k·G, (k+1)·G) of that order.
    Dp rank r takes its contiguous slice of G/dp of them.
    So step k trains on the same sequences at any dp size or micro-batch split.
    TP/PP peers of a dp rank pass the same dp rank. They see identical rows.

    remainder "drop": an epoch's tail that does not fill a global batch is skipped (pretraining).
    remainder "wrap": the epoch's last global batch is filled up from the permutation's start.
    (Small SFT sets: every sample is seen at least once per epoch.)"""

    def __init__(self, num_samples: int, global_batch: int, dp_rank: int, dp_size: int, seed: int,
                 remainder: str = "drop"):
        if remainder not in ("drop", "wrap"):
            raise ValueError(f"remainder must be 'drop' or 'wrap', got {remainder!r}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if global_batch < 1 or global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not a positive multiple of dp size "
                             f"{dp_size}: every dp rank must get the same number of sequences")
        if num_samples < 1 or (remainder == "drop" and num_samples < global_batch):
            raise ValueError(f"{num_samples} samples cannot fill one global batch of {global_batch} "
                             f"with remainder='drop' (use remainder='wrap' or a smaller batch)")
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.dp_rank, self.dp_size, self.remainder = dp_rank, dp_size, remainder
        self.epoch, self.offset = 0, 0  # offset: entries of this epoch's global order consumed
        self._order: tuple[int, torch.Tensor] | None = None

    @property
    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full + (1 if rest and self.remainder == "wrap" else 0)

    def order(self, epoch: int) -> torch.Tensor:
        """The global permutation of epoch `epoch`: the same on every rank, never global RNG."""
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.num_samples, generator=g))
        return self._order[1]

    def next_batch(self) -> list[int]:
        """This rank's indices for the next optimizer step (global_batch // dp_size of them)."""
        per_rank = self.global_batch // self.dp_size
        start = self.offset + self.dp_rank * per_rank
        positions = torch.arange(start, start + per_rank) % self.num_samples  # "wrap" pads from the start
        batch = self.order(self.epoch)[positions].tolist()
        self.offset += self.global_batch
        if self.offset >= self.steps_per_epoch * self.global_batch:
            self.epoch, self.offset = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "global_batch": self.global_batch, "num_samples": self.num_samples,
                "remainder": self.remainder, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict) -> None:
        """Resume the exact global sequence. The position is an offset in the global order.
        So a different dp size resumes exactly. A different data or batch definition raises."""
        bad = [f"{k}: saved {state[k]!r}, now {getattr(self, k)!r}"
               for k in ("seed", "global_batch", "num_samples", "remainder") if state[k] != getattr(self, k)]
        if bad:
            raise ValueError("sampler state does not match this run (the global order or batch would "
                             "change): " + "; ".join(bad))
        offset = state["offset"]
        if offset % self.global_batch or not 0 <= offset < self.steps_per_epoch * self.global_batch:
            raise ValueError(f"sampler offset {offset} is not a step boundary of this epoch "
                             f"(global batch {self.global_batch}, {self.steps_per_epoch} steps per epoch)")
        self.epoch, self.offset = int(state["epoch"]), int(offset)


def global_count(local: torch.Tensor | int, group: Group = None) -> torch.Tensor:
    """Sum of a count over the dp group, e.g. the step's target tokens.
    Pass the tensor from `precision.count_targets`. It lives on the data device, which NCCL needs.
    Returns a 0-dim int64 tensor on that device. It is never read on the host here.
    (precision.normalized_loss divides by it there.) So on CUDA the step goes on without waiting.
    int() it where a number is needed."""
    t = local.detach().to(torch.int64).clone() if isinstance(local, torch.Tensor) else torch.tensor(local)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def remove_handles(handles: list[torch.utils.hooks.RemovableHandle]) -> None:
    for h in handles:
        h.remove()
    handles.clear()
