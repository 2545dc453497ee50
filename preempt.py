"""Cluster-proof runs: save on a preemption signal, and one writer per save folder.

What it does
    StopSignal   records SIGTERM / SIGUSR1 (Slurm's preemption and its `--signal` warning) and
                 SIGINT (Ctrl-C). torchrun forwards the ones it handles. Every rank agrees at a
                 step boundary to stop. train.py then saves that step, flushes the metrics and
                 exits (`exit_status`). A second SIGINT aborts at once, saving nothing.
    SaveLock     the lock file `<save>/LOCK.json` (host, pid, start time, heartbeat, job). The run
                 that writes to the folder takes it before any heavy work. A thread refreshes it.
                 Each save verifies it. The run removes it at the end.
    holder_note  one readable line naming a lock's holder
    job_of       a launcher's job id and attempt

Core idea
    A signal reaches ranks at different moments. So each rank only sets a flag in its handler.
    Nothing is interrupted, so a second signal during a save corrupts nothing. At each step
    boundary every rank starts an asynchronous MAX all-reduce of its flag, on a gloo group. It
    runs on the CPU with no host sync, and completes while the next step computes. Each rank then
    reads the one it started at the previous boundary. So all ranks learn the same answer at the
    same boundary, one step after the signal. Nobody waits in a collective while another rank
    saves; the save's own waits are on the same gloo group. A group of one runs no collective.
    The answer lags one step there too.

Reference
    Megatron-LM's --exit-signal-handler: a flag set by the handler, an all-gather of it each step.
    torchrun's agent: torch/distributed/elastic/agent/server/api.py, `_shutdown(e.sigval,
    timeout=self._shutdown_timeout)`. docs/cluster.md has the launcher and Slurm side.

Run
    torchrun --nproc_per_node 2 --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
        train.py --save ckpt --resume auto       # kill -TERM <torchrun pid>: saves, exits 143

Invariants
    - Every rank stops at the same step, the one after the signal's. In test_preempt, a signal
      on one rank alone stops both.
    - The exit status is 128 + the signal number on every rank: 143 for SIGTERM, 138 for SIGUSR1,
      130 for Ctrl-C; a second Ctrl-C exits 130 at once. No traceback from either (test_preempt).
    - A lock whose holder is alive is never taken: the second launch is refused, naming the
      holder. A stale lock is taken over with a note (test_preempt). Stale means a heartbeat older
      than STALE_S, the holder's pid gone on this host, or an earlier attempt of the same job.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
BEAT_S = 30.0  # heartbeat period of the lock's thread
STALE_S = 600.0  # a heartbeat older than this is a dead holder's (20 beats: room for clock skew)


# ------------------------------------------------------------------------------------------ stop
class StopSignal:
    """The handler of SIGNALS and the ranks' agreement to stop (module docstring). Main thread only
    (Python's rule for signal handlers)."""

    def __init__(self, signals: tuple[int, ...] = SIGNALS, speaks: bool = True):
        self.received = 0  # the first signal's number (0: none)
        self.speaks = speaks  # says what Ctrl-C does (rank 0 only: one line per run)
        self._pending: tuple[torch.Tensor, dist.Work | None] | None = None
        self._old = {s: signal.signal(s, self._record) for s in signals}

    def _record(self, signum: int, frame) -> None:
        if signum == signal.SIGINT:
            self._interrupt()
        self.received = self.received or signum  # only a flag: the step or the save goes on

    def _interrupt(self) -> None:
        """Ctrl-C. The first is a stop like SIGTERM's; a second one after any signal aborts. os.write,
        not print: a handler may run inside a print, and print is not reentrant."""
        if self.received:
            if self.speaks:
                os.write(2, b"\nsecond interrupt: aborting now, nothing more is saved\n")
            os._exit(exit_status(signal.SIGINT))  # no traceback, no cleanup that could hang on a peer
        if self.speaks:
            os.write(2, b"\ninterrupt: stopping after the next step (saving it if --save is set); "
                        b"press Ctrl-C again to abort at once\n")

    def poll(self, group: dist.ProcessGroup | None) -> int:
        """At a step boundary, on every rank of `group` (a gloo group). Returns the largest signal
        number any rank had received by the previous boundary (0: go on). Every rank gets the same."""
        agreed = self.wait()
        flag = torch.tensor([self.received], dtype=torch.int32)  # gloo: host memory
        work = None
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._pending = (flag, work)
        return agreed

    def wait(self) -> int:
        """Complete the agreement in flight (before the group goes): its answer, 0 when none."""
        if self._pending is None:
            return 0
        flag, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        return int(flag)

    def close(self) -> None:
        """Restore the previous handlers. train.py does it last, once the lock is released: torchrun
        sends SIGTERM to the ranks still running when one exits first."""
        for s, old in self._old.items():
            signal.signal(s, old)


def exit_status(signum: int) -> int:
    """128 + the signal: what a shell reports for a process the signal ended (docs/cluster.md)."""
    return 128 + signum


# ------------------------------------------------------------------------------------------ lock
class LockedError(RuntimeError):
    """The save folder is locked by a live run."""


def holder_note(info: dict) -> str:
    age = time.time() - info.get("heartbeat", 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    job = f", job {info['job']}" if info.get("job") else ""
    return f"host {info.get('host')} pid {info.get('pid')}{job}, started {started}, heartbeat {age:.0f} s ago"


def _stale(info: dict, job: str | None, attempt: str | None) -> str | None:
    """Why the holder is gone (None: it may be alive)."""
    if time.time() - info.get("heartbeat", 0) > STALE_S:
        return f"its heartbeat is older than {STALE_S:.0f} s"
    if info.get("host") == socket.gethostname():
        try:
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            return "its pid is gone on this host"
        except (PermissionError, KeyError, ValueError, TypeError):
            pass  # alive (another user's), or unreadable: not proven dead
    if job and info.get("job") == job and info.get("attempt") != attempt:
        return f"it is an earlier attempt ({info.get('attempt')}) of this job"
    return None


def job_of(env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(job, attempt) from a launcher's environment, with its restart count. Slurm gives its job
    id, which --requeue keeps. torchrun gives its rendezvous id; its 'none' default names no job."""
    slurm, run = env.get("SLURM_JOB_ID"), env.get("TORCHELASTIC_RUN_ID")
    job = f"slurm:{slurm}" if slurm else f"torchrun:{run}" if run and run != "none" else None
    attempt = f"{env.get('SLURM_RESTART_COUNT', '0')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return job, attempt if job else None


class SaveLock:
    """`<folder>/LOCK.json`, held by one run (its rank 0). It is created by a hard link of a complete
    temporary file. That is atomic, also on NFS: a reader never sees half a lock. job / attempt are
    the scheduler's job id and restart count (job_of). So a restart of the same job takes over its
    own lock at once, even on another host."""

    def __init__(self, folder: str | os.PathLike, job: str | None = None, attempt: str | None = None):
        self.path = Path(folder) / "LOCK.json"
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                     "heartbeat": time.time(), "job": job, "attempt": attempt,
                     "token": f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"}
        self.job, self.attempt = job, attempt
        self.lost: str | None = None  # set by the heartbeat thread when the file is no longer ours
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> str | None:
        """Take the lock or raise LockedError naming the live holder. Returns a note when a stale
        lock was taken over (None otherwise)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(3):  # a holder may release or a peer take over between our steps
            tmp = self.path.with_name(f"LOCK.{self.info['token'].replace(':', '.')}.tmp")
            tmp.write_text(json.dumps(self.info))
            try:
                os.link(tmp, self.path)  # fails if any lock exists: never two holders
                break
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            try:
                info = json.loads(self.path.read_text())
            except FileNotFoundError:
                continue  # released meanwhile: try again
            except (OSError, ValueError) as e:
                raise LockedError(f"{self.path} exists but is unreadable ({e}): another run may be "
                                  f"writing it; remove it if you know no run uses this folder") from None
            why = _stale(info, self.job, self.attempt)
            if why is None:
                raise LockedError(f"{self.path.parent} is in use by another run ({holder_note(info)}): "
                                  f"wait for it to end or use another --save; a lock whose heartbeat "
                                  f"is older than {STALE_S:.0f} s is taken over")
            # rename, not unlink: of two runs taking over at once only one moves the stale file
            try:
                os.replace(self.path, self.path.with_name(f"LOCK.stale.{self.info['token'].replace(':', '.')}"))
            except FileNotFoundError:
                continue
            note = f"took over the stale lock {self.path} ({holder_note(info)}): {why}"
        else:
            raise LockedError(f"{self.path}: could not take the lock (other runs keep taking it)")
        for old in self.path.parent.glob("LOCK.stale.*"):
            old.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._beat, name="save-lock heartbeat", daemon=True)
        self._thread.start()
        return note

    def check(self) -> None:
        """Raise OSError unless this run still holds the lock (called before each save)."""
        if self.lost is None:
            try:
                if json.loads(self.path.read_text()).get("token") != self.info["token"]:
                    self.lost = "another run holds it now"
            except (OSError, ValueError) as e:
                self.lost = f"it cannot be read ({e})"
        if self.lost:
            raise OSError(f"{self.path}: this run no longer holds the save folder's lock ({self.lost}); "
                          f"not writing a checkpoint into a folder another run may write")

    def _beat(self) -> None:
        """A thread beats, not each step. A long save, evaluation or first compile must not make a
        live run look dead. And the step never waits for a shared filesystem's metadata write."""
        while not self._stop.wait(BEAT_S):
            try:
                self.check()
                self.info["heartbeat"] = time.time()
                tmp = self.path.with_name(f"LOCK.{self.info['token'].replace(':', '.')}.tmp")
                tmp.write_text(json.dumps(self.info))
                os.replace(tmp, self.path)
            except OSError:
                return  # lost: `check` raises at the next save

    def release(self) -> None:
        """Stop the heartbeat; remove the file if it is still ours. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            try:
                if json.loads(self.path.read_text()).get("token") == self.info["token"]:
                    self.path.unlink()
            except (OSError, ValueError):
                pass
