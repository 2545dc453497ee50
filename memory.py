"""Peak memory per phase of training: exact live bytes at the allocator, on CPU as on CUDA.

What it does
    `PeakMeter(device)` splits a rank's run into named phases and records, for each, the most bytes
    that were live at once (the peak that decides an out-of-memory error), not the state between
    steps and not the process's lifetime maximum:
        meter = PeakMeter(device)
        meter.phase("setup"); model, opt = build(...)
        meter.watch(model)              # each forward marks "forward", what follows it "backward"
        for step ...:
            meter.phase("data"); batch = ...
            loss(...).backward(); opt.finish()
            meter.settle()              # nothing in flight here: fold the peaks so far
            meter.phase("step"); opt.step(lr)
        meter.peak("forward", "backward", "step")   # Peak(allocated, reserved): the training peak
    A phase may be entered many times (each micro-batch's forward); its peak is the maximum over
    all of them. `phase(None)` pauses the meter. On CPU the peaks reach `peaks` (and `peak()`) at
    `settle()`, called where no collective is in flight (train.py: after the gradient reduction).

    CUDA: the caching allocator's own counters — at each phase switch `max_memory_allocated` and
    `max_memory_reserved` are read for the phase that ends, and `reset_peak_memory_stats` starts the
    next. Host-side counters: no synchronization.

    CPU (why it is exact): c10's CPU allocator (`DefaultCPUAllocator`) reports every block it hands
    out or takes back to `ProfiledCPUMemoryReporter`. With c10's flag `caffe2_report_cpu_memory_usage`
    set (the first CPU meter sets it, through ctypes in libc10: a mutex and a hash-table entry per
    CPU allocation from then on; a CUDA run, whose meter reads the caching allocator, never sets it;
    make the meter early: train.py does, before data) the reporter keeps a table
    pointer → size and a running total of live bytes under a mutex, for blocks allocated and freed on
    ANY thread. The meter runs PyTorch's own profiler with memory events only (no operator or
    user-scope events: see _CPUSession); every allocation on a thread carrying the profiler's state
    (the training thread, autograd's, gloo's workers while they run a collective) emits an event
    holding that running total. A phase switch allocates a one-byte marker inside the running
    session (no profiler start or stop: gloo's workers may be running a collective under it), so
    the events between two markers are the phase's; live bytes only rise at allocations, so the
    largest total among them is exactly its peak, the marker's own event giving the live bytes the
    phase began with (the markers themselves are left out). `settle()` ends the session and starts
    another: the only call that must come where no collective is in flight.
    Without the flag the profiler alone would miss every free that happens on a thread it does not
    follow — a buffer whose last reference gloo's worker drops after a collective completes — and
    over-count forever; the flag makes those frees count (tests/test_memory.py shows both).

    What it does not see (CPU): blocks allocated before the flag was set (neither their allocation
    nor their free is counted: live bytes are "allocated since the first CPU meter was made"; c10
    warns, once per 1000 such frees), memory that is
    not a tensor block of c10's CPU allocator (Python objects, gloo/MKL internal buffers, numpy and
    memmapped data), and the allocator's overhead (malloc headers, fragmentation: RSS is larger). A
    rise on a thread without the profiler state shows at the next event. If the flag cannot be set
    (libc10 not found: another platform) or another profiler is running, allocated bytes read None.

Reference
    c10/core/CPUAllocator.cpp (ProfiledCPUMemoryReporter); torch.cuda memory statistics.

Run
    python train.py          # the log line's "peak mem" is the training peak, setup excluded
    torchrun --nproc_per_node 4 train.py --model small --zero 3    # the last line: every phase

Invariants
    - Measuring changes nothing it measures: the probe is freed at once, events carry no tensors.
    - One meter at a time per process (the profiler is process-wide); `close()` stops it.
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
    """Turn on c10's per-block accounting of CPU memory (all threads); False where libc10 or its
    flag cannot be found. Blocks allocated before this call stay outside the count."""
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
    """One profiler session recording CPU allocation events only, across any number of phases:
    a phase switch inside it allocates a 1-byte marker (kept alive until the session ends, so its
    address is unique and its allocation is the last one there). `close()` returns each phase's peak.
    No RecordFunction is recorded (the one scope asked for, the lite interpreter's, never runs here;
    an empty set would mean every scope): a record started under one session and ended after it
    closed — a gloo collective or a pipeline send waited after a settle (c10d records each as a
    user scope) — would write its end into the closed session's freed events (heap corruption)."""
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
        while stack:  # (a hot loop: thousands of events a step) every event is a CPU allocation
            e = stack.pop()  # (any other kind holding some is walked into)
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
    """A profiler still running when the interpreter exits crashes it (a run that fails on bad
    flags exits from inside a phase): close what is open."""
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
        # the CPU meter needs c10's accounting and the profiler to itself; kineto prints two lines
        # per profiler session unless told otherwise (read when the profiler first starts)
        self.available = self.cuda or (exact_cpu_accounting() and not _profiler_enabled())
        if not self.cuda:
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")

    def phase(self, name: str | None) -> None:
        """End the current phase and start `name` (None: pause). On CPU this only marks the running
        profiler session, so it is safe anywhere, even with collectives in flight; the peaks reach
        `peaks` at the next `settle()`."""
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
        """Fold what was measured so far into `peaks` (the running phase goes on). On CPU this stops
        and restarts the profiler: call it only where no asynchronous collective is in flight —
        gloo's worker threads carry the profiler's state while they run one, and stopping the
        profiler under them crashes the process (train.py settles right after opt.finish())."""
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
        """Mark phases from the model's own calls: each forward with grad enabled is "forward" and
        what follows it (its backward, the gradient reduction) "backward". Recomputation under
        activation checkpointing calls layers, not the model, and changes nothing."""
        def forward(*_) -> None:
            if torch.is_grad_enabled():
                self.phase("forward")

        def backward(*_) -> None:
            if torch.is_grad_enabled():
                self.phase("backward")
        self.handles += [model.register_forward_pre_hook(forward), model.register_forward_hook(backward)]

    def peak(self, *names: str) -> Peak | None:
        """The peak over the named phases (all when none are named) folded by the last `settle()`
        (on CUDA: by the last phase switch); None if none of them ran or bytes cannot be measured."""
        found = [p for n, p in self.peaks.items() if not names or n in names]
        if not found or not self.available:
            return None
        out = found[0]
        for p in found[1:]:
            out = out | p
        return out

    def close(self) -> None:
        """Stop measuring (a last settle: call it where nothing is in flight) and remove the hooks
        (they hold this object)."""
        self.phase(None)
        self.settle()
        for h in self.handles:
            h.remove()
        self.handles.clear()
