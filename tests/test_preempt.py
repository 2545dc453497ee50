"""Preemption and the save folder's lock, end to end (preempt.py, train.py).

Signals are real: a rank sends SIGTERM / SIGUSR1 to itself at a chosen moment (in a step, inside a
save), or the test sends SIGTERM to a real `torchrun --nproc_per_node 2` (gloo), which forwards it.
References: the uninterrupted run of the same flags and layout (the resumed curve equals it bit for
bit), the files on disk, the exit status of every rank and of torchrun, and the lock file's bytes.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import checkpoint as CK
import feed
import preempt as PR
from dist import run_ranks
from test_faults import _run, dirs  # noqa: F401 - train.main's exit status on a rank; the tiny model, data

ROOT = Path(__file__).resolve().parents[1]
STEPS = 6


def argv(d: Path, metrics: str, *extra: str) -> list[str]:
    return ["--init-from", str(d / "init"), "--data", str(d / "data"), "--steps", str(STEPS), "--seq-len",
            "32", "--batch-size", "4", "--lr", "3e-3", "--warmup", "1", "--metrics", str(d / metrics),
            "--log-every", "100", *extra]


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def newest(ck: Path) -> list[str]:
    return [p.name for _, p in CK.complete_checkpoints(ck)]


def signal_at_step(n: int, signum: int = signal.SIGTERM, ranks=(0,)):
    """A patch: this rank sends itself `signum` as its step n starts (the batch is taken)."""
    def patch(rank: int) -> None:
        if rank not in ranks:
            return
        real, calls = feed.Prefetcher.next, [0]

        def next_(self):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signum)
            return real(self)
        feed.Prefetcher.next = next_
    return patch


LAYOUTS = {"one": (1, ()), "dp2": (2, ()), "pp2": (2, ("--pp", "2"))}  # name: (world, flags)


@pytest.fixture(scope="module")
def straight(dirs):
    """The uninterrupted curves of each layout."""
    out = {}
    for name, (world, flags) in LAYOUTS.items():
        assert run_ranks(_run, world, argv(dirs, f"ref_{name}.jsonl", *flags)) == [0] * world
        out[name] = losses(dirs / f"ref_{name}.jsonl")
    return out


@pytest.mark.parametrize("layout,signum,ranks", [("one", signal.SIGTERM, (0,)), ("dp2", signal.SIGUSR1, (1,)),
                                                 ("pp2", signal.SIGTERM, (0,)),
                                                 ("dp2", signal.SIGINT, (0, 1))])  # torchrun forwards Ctrl-C
def test_signal_mid_run_saves_the_step_reached_and_resume_is_bit_exact(dirs, straight, capfd, layout,
                                                                       signum, ranks):
    """The signal arrives during step 3 (dp 2: on rank 1 only; pp 2: on the first stage only). Every
    rank agrees to stop after step 4 (the agreement is one step late), saves step 4, exits 128 +
    signum; --resume auto then ends on the uninterrupted curve of the same layout, bit for bit."""
    (world, flags), ck, m = LAYOUTS[layout], dirs / f"ck_sig_{layout}_{signum}", f"sig_{layout}_{signum}.jsonl"
    got = run_ranks(_run, world, argv(dirs, m, "--save", str(ck), *flags), signal_at_step(3, signum, ranks))
    assert got == [128 + signum] * world
    assert newest(ck) == ["step_00000004"] and not (ck / "LOCK.json").exists()
    assert f"stopped by {signal.Signals(signum).name} after step 4" in capfd.readouterr().out
    assert [s for s, _ in losses(dirs / m)] == [1, 2, 3, 4]  # flushed before the save
    assert run_ranks(_run, world, argv(dirs, m, "--save", str(ck), "--resume", "auto", *flags)) == [0] * world
    assert losses(dirs / m) == straight[layout]


CTRL_C = """import os, signal, sys
sys.path[:0] = [{root!r}]
import feed
real, calls = feed.Prefetcher.next, [0]
def next_(self):
    calls[0] += 1
    if calls[0] in {at!r}:
        os.kill(os.getpid(), signal.SIGINT)
    return real(self)
feed.Prefetcher.next = next_
sys.argv = ["train.py", *{argv!r}]
import runpy
runpy.run_path({train!r}, run_name="__main__")
"""


def test_ctrl_c_saves_and_a_second_aborts_without_a_traceback(dirs):
    """`python train.py` as a terminal runs it, Ctrl-C as step 3 starts: the run says what it does,
    saves step 4 (its step, path and seconds), says how to continue and exits 130. Ctrl-C again
    during step 4: it aborts at once, exit 130, nothing saved. Neither prints a traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = {}
    for name, at in (("once", (3,)), ("twice", (3, 4))):
        ck = dirs / f"ck_ctrl_c_{name}"
        code = CTRL_C.format(root=str(ROOT), at=at, train=str(ROOT / "train.py"),
                             argv=argv(dirs, f"ctrl_c_{name}.jsonl", "--save", str(ck), "--steps", "100"))
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        out[name] = (run.returncode, run.stdout, run.stderr, newest(ck) if ck.exists() else [])
    rc, stdout, stderr, saved = out["once"]
    assert rc == 130 and saved == ["step_00000004"], (rc, stdout, stderr)
    assert "interrupt: stopping after the next step (saving it if --save is set)" in stderr
    assert re.search(rf"saved step 4 to {re.escape(str(dirs))}/ck_ctrl_c_once/step_00000004 in \d+\.\d s", stdout)
    assert "stopped by SIGINT after step 4: saved" in stdout and "run the same command with --resume auto" in stdout
    rc, stdout, stderr, saved = out["twice"]
    assert rc == 130 and saved == [] and "second interrupt: aborting now" in stderr, (rc, stdout, stderr)
    assert "stopped by" not in stdout
    for _, stdout, stderr, _ in out.values():
        assert "Traceback" not in stdout + stderr


def _polls(rank: int, world: int) -> tuple[list[int], bool]:
    import torch.distributed as dist
    before = signal.getsignal(signal.SIGTERM)
    stop = PR.StopSignal()
    got = [stop.poll(None)]
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    got += [stop.poll(None), stop.poll(None)]
    if rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)  # a larger signal elsewhere, later: the MAX takes it
    got += [stop.poll(None), stop.poll(None), stop.wait()]
    dist.barrier()
    stop.close()
    return got, signal.getsignal(signal.SIGTERM) is before


def test_ranks_agree_one_boundary_late():
    """Rank 1 alone gets SIGUSR1 after boundary 1: both ranks read it at boundary 3 (the
    reduction started at boundary 2); rank 0's SIGTERM after boundary 3 makes the MAX 15 at
    boundary 5. close() restores the handlers."""
    assert run_ranks(_polls, 2) == [([0, 0, 10, 10, 15, 15], True)] * 2


def test_signals_during_a_save_corrupt_nothing(dirs, capfd):
    """Two SIGTERMs while step 2's checkpoint is written: that save completes, step 1's survives, and
    the run stops after step 3 with its checkpoint: each loads, crc32 checked."""
    ck = dirs / "ck_during"
    real = CK.write_safetensors

    def patch(rank):
        def write(path, *a, **k):
            if Path(path).parent.name == "step_00000002.tmp":
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)
            return real(path, *a, **k)
        CK.write_safetensors = write
    got = run_ranks(_run, 1, argv(dirs, "during.jsonl", "--save", str(ck), "--save-every", "1"), patch)
    assert got == [143]
    assert newest(ck) == ["step_00000001", "step_00000002", "step_00000003"]
    assert sorted(p.name for p in ck.iterdir()) == newest(ck)  # no .tmp debris, no lock left
    for step in (1, 2, 3):
        assert run_ranks(_run, 1, argv(dirs, "during_r.jsonl", "--resume", str(ck / f"step_{step:08d}"),
                                       "--steps", str(step + 1))) == [0]
    assert "stopped by SIGTERM after step 3" in capfd.readouterr().out


def test_without_save_says_so_and_exits(dirs, capfd):
    assert run_ranks(_run, 1, argv(dirs, "nosave.jsonl"), signal_at_step(1)) == [143]
    assert "stopped by SIGTERM after step 2: no --save, nothing saved" in capfd.readouterr().out


def _lock(folder: Path, **over) -> Path:
    info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "heartbeat": time.time(), "job": None, "attempt": None, "token": "other"} | over
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "LOCK.tmp").write_text(json.dumps(info))  # whole, as SaveLock writes it: a reader never
    os.replace(folder / "LOCK.tmp", folder / "LOCK.json")  # sees half a file
    return folder / "LOCK.json"


def test_lock_stale_takeover_refusal_and_reading_a_locked_folder(dirs, tmp_path, capfd):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that is gone on this host
    cases = {"old heartbeat": ({"host": "elsewhere", "heartbeat": time.time() - 2 * PR.STALE_S}, True),
             "pid gone": ({"pid": dead.pid}, True),
             "earlier attempt": ({"host": "elsewhere", "job": "slurm:7", "attempt": "0.0"}, True),
             "live, this host": ({}, False),
             "live, elsewhere": ({"host": "elsewhere"}, False),
             "same attempt": ({"host": "elsewhere", "job": "slurm:7", "attempt": "1.0"}, False)}
    for name, (over, stale) in cases.items():
        path = _lock(tmp_path / name.replace(" ", "_").replace(",", ""), **over)
        before = path.read_bytes()
        lock = PR.SaveLock(path.parent, job="slurm:7", attempt="1.0")
        if stale:
            assert "took over the stale lock" in lock.acquire(), name
            assert json.loads(path.read_text())["pid"] == os.getpid() and lock.check() is None
            lock.release()
            assert sorted(p.name for p in path.parent.iterdir()) == [], name  # no stale copy left
        else:
            with pytest.raises(PR.LockedError, match=f"in use by another run \\(host {json.loads(before)['host']} "
                                                     f"pid {json.loads(before)['pid']}"):
                lock.acquire()
            assert path.read_bytes() == before, name
            with pytest.raises(OSError, match="no longer holds"):
                lock.check()

    # end to end: a stale lock is taken over with a note; a live one refuses the run (exit 2, the
    # holder named on rank 0); a run that only --resumes from the locked folder needs no lock
    ck = tmp_path / "ck"
    _lock(ck, pid=dead.pid)
    assert run_ranks(_run, 1, argv(dirs, "lock.jsonl", "--save", str(ck), "--steps", "2")) == [0]
    assert "note: took over the stale lock" in capfd.readouterr().out
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000002"]
    live = _lock(ck).read_bytes()
    assert run_ranks(_run, 2, argv(dirs, "lock.jsonl", "--save", str(ck), "--resume", "auto")) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("is in use by another run") == 1 and f"pid {os.getpid()}" in err
    assert run_ranks(_run, 1, argv(dirs, "lock2.jsonl", "--resume", str(ck / "step_00000002"), "--steps", "3",
                                   "--save", str(tmp_path / "other"))) == [0]
    assert (ck / "LOCK.json").read_bytes() == live and newest(tmp_path / "other") == ["step_00000003"]


def test_heartbeat_and_a_lost_lock_stops_the_save(dirs, tmp_path, capfd, monkeypatch):
    """The thread refreshes the heartbeat; a run whose lock was taken from it (here: overwritten
    after step 1) refuses its next save on every rank and leaves the other holder's lock alone."""
    monkeypatch.setattr(PR, "BEAT_S", 0.05)
    lock = PR.SaveLock(tmp_path / "beat")
    lock.acquire()
    first = json.loads(lock.path.read_text())["heartbeat"]
    _wait_for(lambda: json.loads(lock.path.read_text())["heartbeat"] > first, "a heartbeat", timeout=10)
    lock.release()
    assert not lock.path.exists()

    ck = tmp_path / "ck"

    def steal(rank):
        if rank:  # one thief: two ranks rewriting one file at once would garble it
            return
        real = feed.Prefetcher.next

        def next_(self):
            if (ck / "step_00000001").exists():
                _lock(ck, token="thief")
            return real(self)
        feed.Prefetcher.next = next_
    assert run_ranks(_run, 2, argv(dirs, "lost.jsonl", "--save", str(ck), "--save-every", "1"), steal) == [2, 2]
    assert "this run no longer holds the save folder's lock" in capfd.readouterr().err
    assert newest(ck) == ["step_00000001"] and json.loads((ck / "LOCK.json").read_text())["token"] == "thief"


def _wait_for(cond, what: str, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while not cond():
        assert time.time() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_torchrun_restart_forwarding_and_a_refused_second_launch(dirs, capfd):
    """A real `torchrun --nproc_per_node 2 --max-restarts 1` (gloo) trains with --save-every 1
    --resume auto. A second launch on its folder is refused, naming torchrun's rank 0, and leaves
    the lock and the checkpoints as they were; the first keeps training. SIGTERM to worker 1 alone:
    both workers stop at one step, save it and exit 143, which torchrun counts as a failure and
    restarts; the new workers resume from that step. SIGTERM to torchrun: it forwards it, the
    workers save the step reached and torchrun exits 1 (torch 2.13 re-raises the signal)."""
    ck, m = dirs / "ck_torchrun", dirs / "torchrun.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", str(ROOT / "train.py"),
           *argv(dirs, "torchrun.jsonl", "--save", str(ck), "--save-every", "1", "--steps", "100000",
                 "--keep", "2", "--resume", "auto")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    count = lambda: len(m.read_text().splitlines()) if m.exists() else 0  # noqa: E731
    try:
        _wait_for(lambda: count() >= 2, "two steps of the first run")
        lock = (ck / "LOCK.json").read_bytes()
        done = {p.name: (p / "meta.json").read_bytes() for _, p in CK.complete_checkpoints(ck)}
        capfd.readouterr()
        assert run_ranks(_run, 1, argv(dirs, "second.jsonl", "--save", str(ck), "--resume", "auto")) == [2]
        holder = json.loads(lock)
        assert f"in use by another run (host {holder['host']} pid {holder['pid']}" in capfd.readouterr().err
        assert (ck / "LOCK.json").read_bytes() == lock and not (dirs / "second.jsonl").exists()
        for name, meta in done.items():  # the first run may prune them (--keep 2) at any moment, nobody else
            try:  # (no exists() first: the prune may land between the check and the read)
                assert (ck / name / "meta.json").read_bytes() == meta
            except FileNotFoundError:
                pass
        seen = count()
        _wait_for(lambda: count() > seen, "the first run to keep training")
        workers = _children(run.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGTERM)
        _wait_for(lambda: not set(workers) & set(_children(run.pid)) and len(_children(run.pid)) == 2,
                  "torchrun to restart its workers")
        seen = newest(ck)[-1]
        _wait_for(lambda: newest(ck)[-1] > seen, "the restarted workers to train and save")
        run.send_signal(signal.SIGTERM)
        out, _ = run.communicate(timeout=60)
    finally:
        run.kill()
    first = re.search(r"stopped by SIGTERM after step (\d+)", out).group(1)
    assert re.search(r"failed \(exitcode: 143\) local_rank: [01]", out)  # torchrun's log of the restart
    assert f"resumed from {ck}/step_{int(first):08d} at step {first}" in out
    steps = [s for s, _ in losses(m)]
    assert steps == list(range(1, len(steps) + 1))  # the resumed run redid nothing, lost nothing
    assert newest(ck)[-1] == f"step_{steps[-1]:08d}"  # the step reached is saved
    assert out.count("stopped by SIGTERM") == 2
    assert run.returncode == 1 and not (ck / "LOCK.json").exists()
