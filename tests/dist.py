"""Multi-rank test harness: run a function on N gloo ranks on this CPU and collect the results.

    results = run_ranks(fn, world_size=4, *args)   # fn(rank, world_size, *args) -> picklable
    result = run_alone([folder], "module", "fn", *args)  # as if only `folder` were importable
    reinit()                                       # inside fn: a fresh default group, no new port

Ranks are forked from the already-imported test process (about 3x cheaper than spawning fresh
interpreters on a 2-core machine) and pinned to one intra-op thread each, so 8 ranks fit on 2 cores.
The default process group is initialised before `fn` runs and destroyed after. A rank that raises
makes the whole call raise with every failing rank's traceback; a call that outlives `timeout`
kills all ranks and names the ones that never answered — a test never hangs.
With `cpu_clock=True` the timeout counts the busiest rank's CPU seconds, not wall seconds, and a
call fails as hung when no rank used any CPU for STALL wall seconds: ranks blocked in a collective
use none, while a loaded machine still gives every runnable rank some. Load cannot trip it.
"""
from __future__ import annotations

import importlib
import os
import pickle
import queue
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_HELD: dict[str, Any] = {}  # in a forked rank: the store client, the rank, the world, groups made


def reinit(**kwargs: Any) -> None:
    """Form the default group (again) inside a forked rank, after train.main destroyed it, on the
    store rank 0 opened: each group under its own key prefix, with no new port to find."""
    _HELD["made"] += 1
    dist.init_process_group("gloo", store=dist.PrefixStore(f"group{_HELD['made']}/", _HELD["store"]),
                            rank=_HELD["rank"], world_size=_HELD["world"], **kwargs)


def _worker(fn: Callable, rank: int, world: int, port: Any, ready: Any, q: Any, args: tuple,
            kwargs: dict) -> None:
    try:
        torch.set_num_threads(1)
        # Rank 0 serves the store on a port the OS picks as it binds, and hands it over in shared
        # memory. A port picked first and bound later can be taken in between by any gloo connection
        # (EADDRINUSE). The parent serves nothing: a child forked beside a server thread can inherit
        # a libc lock that thread held (seen: a rank stuck in the resolver's lock, forever).
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
            port.value = store.port
            ready.set()
        else:
            if not ready.wait(timeout=120):
                raise TimeoutError("rank 0 opened no store within 120 s")
            store = dist.TCPStore("127.0.0.1", port.value, world, is_master=False)
        _HELD.update(store=store, rank=rank, world=world, made=0)
        reinit()
        result = fn(rank, world, *args, **kwargs)
        # plain pickle copies tensor data; the queue's own pickler would pass shared-memory
        # handles that die with this process at os._exit
        q.put((rank, True, pickle.dumps(result)))
        if dist.is_initialized():  # fn may have torn the group down itself (train.main does)
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()  # flush the queue's feeder thread before the hard exit
        os._exit(0)  # skip atexit/pytest teardown inherited through fork


GRACE = 10.0  # seconds a failed rank's peers get to finish before they are killed
STALL = 60.0  # wall seconds without any rank's CPU use that mean a hang (cpu_clock=True)


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a process, all its threads (Linux's /proc; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class _CpuClock:
    """Waits on the result queue in short polls; raises queue.Empty when the busiest rank has used
    `budget` CPU seconds, or when no rank used any for STALL wall seconds."""
    def __init__(self, procs: list, budget: float) -> None:
        self.procs, self.budget = procs, budget
        self.used = [0.0] * len(procs)
        self.last_busy = time.monotonic()

    def get(self, q: Any) -> Any:
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                now = [max(u, _cpu_seconds(p.pid)) for u, p in zip(self.used, self.procs)]
                if now != self.used:
                    self.used, self.last_busy = now, time.monotonic()
                if max(self.used) > self.budget or time.monotonic() - self.last_busy > STALL:
                    raise


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, cpu_clock: bool = False,
              **kwargs: Any) -> list:
    """Run fn(rank, world_size, *args, **kwargs) on world_size forked gloo ranks; return the results
    ordered by rank. `timeout` is in wall seconds, or the busiest rank's CPU seconds with cpu_clock."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port, ready = ctx.Value("i", 0), ctx.Event()  # rank 0's store port, set once it listens
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, ready, q, args, kwargs), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    clock = _CpuClock(procs, timeout) if cpu_clock else None
    try:
        for _ in range(world_size):
            # after a rank's error its peers get a short grace: a peer that fails too (rank 0 printing
            # the run's one error message) finishes; one blocked in a collective is killed below
            if clock and not errors:
                rank, ok, value = clock.get(q)
            else:
                rank, ok, value = q.get(timeout=GRACE if errors else timeout)
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    except queue.Empty:
        if not errors:
            missing = sorted(set(range(world_size)) - set(results) - set(errors))
            within = (f"{timeout:.0f} CPU seconds (or used none for {STALL:.0f}s)" if clock
                      else f"{timeout:.0f}s")
            raise TimeoutError(f"ranks {missing} did not finish within {within}") from None
    finally:
        for p in procs:
            p.join(timeout=0 if errors or len(results) < world_size else 5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world_size)]


def _alone(dirs: list[str], module: str, fn: str, q: Any, args: tuple) -> None:
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        inside = lambda path: (os.path.abspath(path or ".") + os.sep).startswith(repo + os.sep)  # noqa: E731
        for name, mod in list(sys.modules.items()):  # forget every module this repository gave
            if inside(getattr(mod, "__file__", None) or "/"):
                del sys.modules[name]
        sys.path[:] = list(dirs) + [p for p in sys.path if not inside(p)]
        importlib.invalidate_caches()
        os.chdir(dirs[0])
        q.put((True, pickle.dumps(getattr(importlib.import_module(module), fn)(*args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        q.put((False, traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()
        os._exit(0)


def run_alone(dirs: list[str], module: str, fn: str, *args: Any, timeout: float = 300.0) -> Any:
    """Call `module`.`fn`(*args) in a forked process that has forgotten every module this repository
    gave the test process and imports only from `dirs` (and site-packages): what a fresh interpreter
    in a project holding only those folders would see, without its start-up (torch, transformers
    and the rest stay imported). The copy-one-file tests run there."""
    q = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=_alone, args=(dirs, module, fn, q, args))  # may fork ranks
    proc.start()
    try:
        ok, value = q.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"{module}.{fn} did not finish within {timeout:.0f}s") from None
    finally:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise RuntimeError(f"{module}.{fn} in {dirs}:\n{value}")
    return pickle.loads(value)
