"""ZeRO-Offload: the fp32 master, Adam's m and v and the step live on the host; the GPU keeps bf16.

What it does
    `apply_offload(model, stage, dp_group, cfg, dtype)` builds ZeRO-1 or -2 as zero.py does.
    Each rank's fp32 master pieces, and so AdamW's m and v, are made on the host.
    The step reads the reduced gradient pieces from the host and runs AdamW there.
    The updated pieces go back as bf16 into the rank's slice of each bucket.
    zero.py's all-gather then completes the buckets, as without offload.

The core idea (Ren et al. 2021, "ZeRO-Offload")
    Memory-bound work moves to the host, whose memory is ten times larger.
    The GPU keeps what compute needs: bf16 params and grads, 4Ψ at dp 1 instead of 16Ψ.
    The host holds 16Ψ/N: master, m, v and the fp32 gradient pieces.
    The AdamW is the same torch.optim.AdamW on the same fp32 values: the run without offload on CPU.

Copies
    On CUDA the host buffers are pinned, and every copy is non_blocking on a side stream.
    Device → host: a bucket's pieces, as soon as its reduce-scatter lands (zero.py's _on_landed).
    Most land during backward, the last `inflight` at finish(). So the copies overlap backward.
    The side stream waits for the compute stream, which waited for the reduce-scatter.
    The step waits for a bucket's copy event before it reads that bucket's host pieces.
    Stage 2 per micro-batch lands a bucket each micro-batch. Its running sum goes each time.
    The last copy holds the step's sum. The sync cannot tell which micro-batch is the last.
    Summing on the host instead would make each add wait for its copy.
    The next sum adds in place. So its launch makes the compute stream wait for the last copy.
    A tied embedding's piece is summed at the step (zero.py's _sum_tied). It goes then.
    Host → device: each bucket's bf16 shard. Its all-gather waits for that copy only.
    So the copies of later buckets overlap the next forward's first layers.
    On a CPU-only run the same code runs, with the CPU as the device: the copies are plain copies.

Run
    torchrun --nproc_per_node 2 train.py --zero 2 --offload

Invariants
    - In fp32 on CPU, --offload equals the run without it, bit for bit, at dp 1 and 2, ZeRO-1 and -2.
      Test: tests/test_offload.py::test_offload_equals_the_run_without.
    - The gradient pieces leave during backward, none at the step, every micro-batch's sums too.
      Test: tests/test_offload.py::test_gradients_leave_during_backward.
    - Host buffers are pinned and contiguous, so no copy blocks the host (the contract's rule).
      Test: tests/test_offload.py::test_offload_copies_under_the_contract.

Builds on: zero.py (its ZeroOptimizer and the precision.py seam it implements), dp.py, precision.py
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dp import Group
from precision import OptimConfig
from zero import ZeroOptimizer, find_parts

HOST = torch.device("cpu")


class OffloadOptimizer(ZeroOptimizer):
    """ZeRO-1/2 whose masters and step are on the host.
    Overrides the precision.py seam and zero.py's landing hooks only."""

    def _make_master(self) -> list[torch.Tensor]:
        device_master = super()._make_master()  # this rank's fp32 pieces, made on the device
        self.pin = self.device.type != "cpu"  # a non_blocking copy is async only from pinned memory
        self.side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        master = [self._host(m) for m in device_master]
        self.host_grads = [self._host(torch.zeros_like(m)) for m in device_master]
        # one bf16 staging buffer per bucket, laid out as this rank's slice; its padding stays zero
        self.staging = [self._host(torch.zeros_like(self._slice(b, full))) for b, full in enumerate(self.flat_params)]
        self.d2h: dict[int, torch.cuda.Event] = {}  # bucket → its last device → host copy
        self.h2d: dict[int, torch.cuda.Event] = {}  # bucket → its host → device copy
        return master

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        h = t.detach().to(HOST).contiguous()
        return h.pin_memory() if self.pin else h

    def _on_landed(self, b: int) -> None:
        """Bucket b's dp sum is in place, during backward: its pieces leave for the host now.
        The tied copy's piece is not final yet: _master_grads sends it."""
        self._to_host(b, {i: self._grad_piece(i) for i in self.buckets[b].index if i != self.tied})

    def _on_reduced(self, b: int) -> None:
        """A new sum of bucket b will add into its pieces in place (stage 2, every micro-batch).
        So the compute stream first waits for the last sum's copy, usually done a backward ago."""
        if b in self.d2h:
            torch.cuda.current_stream(self.device).wait_event(self.d2h.pop(b))

    def _to_host(self, b: int, grads: dict[int, torch.Tensor]) -> None:
        """Copy bucket b's pieces into their pinned fp32 host buffers. One event marks them done."""
        with self._on_side():
            for i, g in grads.items():
                if g.numel():  # a rank may own nothing of a parameter
                    self.host_grads[i].copy_(g, non_blocking=self.pin)
            if self.side is not None:
                self.d2h[b] = self.side.record_event()

    def _master_grads(self) -> list[torch.Tensor | None]:
        """The host buffers the landings filled. The norm reads the device's pieces."""
        self._device_grads = super()._master_grads()  # the tied copy's piece is summed here
        t = self.tied
        if t is not None and self._device_grads[t] is not None:
            self._to_host(self.pieces[t].bucket, {t: self._device_grads[t]})
        return [None if g is None else h for h, g in zip(self.host_grads, self._device_grads)]

    def grad_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        return super().grad_norm(self._device_grads)  # the norm's all-reduces need device tensors

    def _step_chunk(self, chunk: list[int], grads: list[torch.Tensor | None],
                    coef: torch.Tensor | None) -> None:
        self._wait_copies({self.pieces[i].bucket for i in chunk})  # the host reads these pieces next
        super()._step_chunk(chunk, grads, None if coef is None else coef.to(HOST))

    def zero_grad(self) -> None:
        self._wait_copies(set(self.d2h))  # a skipped step's copies: their device pieces are freed next
        super().zero_grad()

    def _wait_copies(self, buckets: set[int]) -> None:
        """The host waits until these buckets' pieces are in its buffers."""
        for b in buckets & self.d2h.keys():
            self.d2h.pop(b).synchronize()

    def _write_shard(self, b: int, shard: torch.Tensor) -> None:
        """Cast bucket b's pieces into its host staging buffer, then one copy to the device."""
        index = [i for i in self.buckets[b].index if self.pieces[i].n]
        if not index:  # this rank owns only padding of a tiny bucket
            return
        stage = self.staging[b]
        with torch.no_grad():
            torch._foreach_copy_([stage[self.pieces[i].shard_start:self.pieces[i].shard_start + self.pieces[i].n]
                                  for i in index], [self.master[i] for i in index])
            with self._on_side():
                shard.copy_(stage, non_blocking=self.pin)
                if self.side is not None:
                    self.h2d[b] = self.side.record_event()

    def _launch_gather(self) -> None:
        b = self._order[self._launched]
        if b in self.h2d:  # the gather reads the shard: wait for its copy, not for the others
            torch.cuda.current_stream(self.device).wait_event(self.h2d.pop(b))
        super()._launch_gather()

    def _on_side(self):
        if self.side is None:
            return torch.no_grad()  # no stream on CPU (or on the contract's stand-in device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))  # the data it copies is ready
        return torch.cuda.stream(self.side)


def apply_offload(model: nn.Module, stage: int, dp_group: Group, cfg: OptimConfig,
                  dtype: torch.dtype = torch.float32, *, prefetch: int = 1, **kw) -> OffloadOptimizer:
    """zero.apply_zero_0_to_2 for stage 1 or 2, with the master and step on the host.
    prefetch is ZeRO-3's (zero3.apply_zero's signature): unused here, as at stages 1-2 there."""
    if stage not in (1, 2):
        raise ValueError(f"offload goes with ZeRO stage 1 or 2, got {stage}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    parts = find_parts(model, *(kw.pop(k, None) for k in ("embed", "layers", "norm", "head")))
    return OffloadOptimizer(named, cfg, dtype, dp_group, stage, kw.pop("reduce_every_micro_batch", False),
                            model, parts=parts, **kw)
