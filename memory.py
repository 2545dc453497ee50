"""Peak memory per phase of training: exact live bytes at the allocator, on CPU as on CUDA.

What it does
    `PeakMeter(device)` splits a rank's run into named phases.
    For each it records the most bytes live at once: the peak that decides an out-of-memory error.
    That is neither the state between steps nor the process's lifetime maximum.
        meter = PeakMeter(device)
        meter.phase("setup"); model, opt = build(...)
        meter.watch(model)              # each forward marks "forward", what follows it "backward"
        for step ...:
            meter.phase("data"); batch = ...
            loss(...).backward(); opt.finish()
            meter.settle()              # nothing in flight here: fold the peaks so far
            meter.phase("step"); opt.step(lr)
        meter.peak("forward", "backward", "step")   # Peak(allocated, reserved): the training peak
    A phase may be entered many times (each micro-batch's forward). Its peak is the maximum over all.
    `phase(None)` pauses the meter.
    On CPU the peaks reach `peaks` (and `peak()`) at `settle()`.
    Call it where no collective is in flight (train.py: after the gradient reduction).

    CUDA: the caching allocator's own counters, read on the host (no synchronization).
    A phase switch reads `max_memory_allocated` and `max_memory_reserved` for the phase that ends.
    Then `reset_peak_memory_stats` starts the next.

    CPU: c10's allocator reports every block it hands out or takes back, on any thread.
    The first CPU meter sets c10's flag `caffe2_report_cpu_memory_usage` (through ctypes).
    Then a reporter keeps a running total of live bytes. It costs a mutex per CPU allocation.
    PyTorch's profiler, with memory events only, emits an event holding that total per allocation.
    A phase switch allocates a one-byte marker: the events between two markers are that phase's.
    Live bytes only rise at allocations, so the largest total among them is exactly the phase's peak.
    Without the flag, frees on threads the profiler does not follow would be missed.
    Gloo's workers drop buffers that way. The meter would over-count (tests/test_memory.py shows both).
    How and why in full: docs/memory.md#how-the-peak-is-measured-memorypeakmeter.

    What it does not see (CPU): blocks allocated before the flag was set. So make the meter early.
    Nor memory outside c10's CPU allocator: Python objects, gloo or MKL buffers, numpy, memmaps.
    Nor malloc's overhead: RSS is larger.
    Without libc10's flag, or under another profiler, allocated bytes read None.

Reference
    c10/core/CPUAllocator.cpp (ProfiledCPUMemoryReporter); torch.cuda memory statistics.

Run
    python train.py          # the log line's "peak mem" is the training peak, setup excluded
    torchrun --nproc_per_node 4 train.py --model small --zero 3    # the last line: every phase

Invariants
    - Measuring changes nothing it measures: the probe is freed at once, events carry no tensors.
    - One meter at a time per process (the profiler is process-wide). `close()` stops it.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
from torch._C._profiler import (ProfilerActivity, ProfilerConfig, ProfilerState, RecordScope,
                                _EventType, _ExperimentalConfig)
from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler, _profiler_enabled

TRAINING = ("forward", "backward", "step")  # the phases of the training peak


@dataclass(frozen=True)
class Peak:
    """Most bytes live at once: allocated (tensor blocks) and, on CUDA, reserved by the cache."""
    allocated: int
    reserved: int | None = None

    def __or__(self, other: "Peak | None") -> "Peak":
        if other is None:
            return self
        res = None if self.reserved is None else max(self.reserved, other.reserved or 0)
        return Peak(max(self.allocated, other.allocated), res)


_FLAG: list[bool] = []  # set once per process: [True] if c10 now tracks every CPU block


def exact_cpu_accounting() -> bool:
    """Turn on c10's per-block accounting of CPU memory, on all threads.
    False where libc10 or its flag cannot be found.
    Blocks allocated before this call stay outside the count."""
    if not _FLAG:
        ok = False
        for path in glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*")):
            try:
                ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage").value = True
                ok = True
                break
            except (OSError, ValueError):
                continue
        _FLAG.append(ok)
    return _FLAG[0]


class _CPUSession:
    """One profiler session recording CPU allocation events only, across any number of phases.
    A phase switch inside it allocates a 1-byte marker. The marker lives until the session ends.
    So its address is unique, and its allocation is the last one there.
    `close()` returns each phase's peak.
    No RecordFunction is recorded. The one scope asked for, the lite interpreter's, never runs here.
    (An empty set would mean every scope.)
    The c10d layer records a gloo collective or a pipeline send as a user scope.
    One waited after a settle ends after its session closed.
    Its end would be written into the closed session's freed events: heap corruption."""
    CONFIG = dict(activities={ProfilerActivity.CPU}, scopes={RecordScope.LITE_INTERPRETER})

    def __init__(self, phase: str | None) -> None:
        # kineto, no shapes, profile_memory=True, no stacks / flops / modules
        cfg = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False,
                             _ExperimentalConfig(), "")
        _prepare_profiler(cfg, self.CONFIG["activities"])
        _enable_profiler(cfg, self.CONFIG["activities"], self.CONFIG["scopes"])
        self.marks: list[torch.Tensor] = []  # one per phase switch; their events hold the live total
        self.phases: list[str | None] = []
        _OPEN.append(self)
        self.mark(phase)

    def mark(self, phase: str | None) -> None:
        self.marks.append(torch.empty(1, dtype=torch.uint8))
        self.phases.append(phase)

    def close(self) -> dict[str, int]:
        _OPEN.remove(self)
        stack, events, alloc = list(_disable_profiler().experimental_event_tree()), [], _EventType.Allocation
        while stack:  # a hot loop: thousands of events a step. Keep the CPU allocations
            e = stack.pop()  # any other kind holding some is walked into
            if e.tag != alloc:
                stack.extend(e.children)
            elif e.extra_fields.alloc_size > 0:  # live bytes only rise at allocations
                events.append(e)
        events.sort(key=lambda e: e.start_time_ns)
        last = {e.extra_fields.ptr: k for k, e in enumerate(events)}  # a marker's own allocation
        starts = {last[t.data_ptr()]: i for i, t in enumerate(self.marks) if t.data_ptr() in last}
        peaks: dict[str, int] = {}
        phase, seen = None, 0  # the running phase; markers allocated so far (left out of the totals)
        for k, e in enumerate(events):
            if k in starts:
                phase, seen = self.phases[starts[k]], starts[k] + 1
            if phase is not None:  # a phase's peak includes the live bytes it started with
                peaks[phase] = max(peaks.get(phase, 0), e.extra_fields.total_allocated - seen)
        self.marks.clear()
        return peaks


_OPEN: list[_CPUSession] = []


@atexit.register
def _close_open_sessions() -> None:
    """A profiler still running when the interpreter exits crashes it. Close what is open.
    (A run that fails on bad flags exits from inside a phase.)"""
    for session in list(_OPEN):
        session.close()


class PeakMeter:
    """Peak live bytes per named phase on one rank (module docstring)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peaks: dict[str, Peak] = {}
        self.current: str | None = None
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self._session: _CPUSession | None = None
        # the CPU meter needs c10's accounting and the profiler to itself.
        # Kineto prints two lines per profiler session unless told otherwise (read at its first start)
        self.available = self.cuda or (exact_cpu_accounting() and not _profiler_enabled())
        if not self.cuda:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    def phase(self, name: str | None) -> None:
        """End the current phase and start `name` (None: pause).
        On CPU this only marks the running profiler session.
        So it is safe anywhere, even with collectives in flight.
        The peaks reach `peaks` at the next `settle()`."""
        if self.cuda:
            if self.current is not None:
                self._fold({self.current: Peak(torch.cuda.max_memory_allocated(self.device),
                                               torch.cuda.max_memory_reserved(self.device))})
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.available:
            if self._session is None:
                self._session = _CPUSession(name)
            else:
                self._session.mark(name)
        self.current = name

    def settle(self) -> None:
        """Fold what was measured so far into `peaks`. The running phase goes on.
        On CPU this stops and restarts the profiler.
        Call it only where no asynchronous collective is in flight.
        Gloo's worker threads carry the profiler's state while they run one.
        Stopping the profiler under them crashes the process.
        (train.py settles right after opt.finish().)"""
        if self.cuda:
            self.phase(self.current)
        elif self._session is not None:
            session, self._session = self._session, None
            self._fold({name: Peak(b) for name, b in session.close().items()})
            if self.current is not None:
                self._session = _CPUSession(self.current)

    def _fold(self, peaks: dict[str, Peak]) -> None:
        for name, p in peaks.items():
            self.peaks[name] = p | self.peaks.get(name)

    @contextlib.contextmanager
    def during(self, name: str) -> Iterator[None]:
        """Measure a block as phase `name`, then return to the phase that was running."""
        previous = self.current
        self.phase(name)
        try:
            yield
        finally:
            self.phase(previous)

    def watch(self, model: nn.Module) -> None:
        """Mark phases from the model's own calls. Each forward with grad enabled is "forward".
        What follows it (its backward, the gradient reduction) is "backward".
        Recomputation under activation checkpointing calls layers, not the model: no change."""
        def forward(*_) -> None:
            if torch.is_grad_enabled():
                self.phase("forward")

        def backward(*_) -> None:
            if torch.is_grad_enabled():
                self.phase("backward")
        self.handles += [model.register_forward_pre_hook(forward), model.register_forward_hook(backward)]

    def peak(self, *names: str) -> Peak | None:
        """The peak over the named phases (all when none are named).
        It covers what the last `settle()` folded (on CUDA: the last phase switch).
        None if none of them ran, or if bytes cannot be measured."""
        found = [p for n, p in self.peaks.items() if not names or n in names]
        if not found or not self.available:
            return None
        out = found[0]
        for p in found[1:]:
            out = out | p
        return out

    def close(self) -> None:
        """Stop measuring and remove the hooks (they hold this object).
        It settles a last time: call it where nothing is in flight."""
        self.phase(None)
        self.settle()
        for h in self.handles:
            h.remove()
        self.handles.clear()
