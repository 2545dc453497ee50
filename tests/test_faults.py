"""Faults around checkpoints and the metrics log, end to end through train.main on forked gloo ranks:
skipped steps that must not save or prune, a kill between a step's record and its checkpoint, a
crash while the metrics log is rewritten, resuming with other flags, a full disk during a save, a
corrupt file only one rank reads, and checkpoint waits longer than --timeout.

References: the straight run of the same flags (same layout: resumed curves are bit-identical), the
files on disk, and the exit status and the one message of every rank (grid.fail)."""
import json
import os
import time
from pathlib import Path

import pytest

import checkpoint as CK
import data
import model as M
import train
import weights as W
from dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
CFG = M.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    W.save_hf(dict(W.materialize(M.build(CFG), "cpu", seed=5).named_parameters()), CFG, d / "init")
    (d / "corpus.txt").write_text("".join(p.read_text() for p in sorted(ROOT.glob("*.py")))[:30_000])
    data.prepare(d / "corpus.txt", d / "data")
    return d


def argv(d: Path, *extra: str, metrics: str = "m.jsonl") -> list[str]:
    return ["--init-from", str(d / "init"), "--data", str(d / "data"), "--steps", "4", "--seq-len", "32",
            "--batch-size", "4", "--lr", "3e-3", "--warmup", "1", "--metrics", str(d / metrics), *extra]


def _run(rank: int, world: int, argv: list[str], patch=None) -> int:
    """train.main's exit status on this rank (0, or grid.fail's 2); `patch(rank)` runs first."""
    if patch is not None:
        patch(rank)
    try:
        train.main(argv)
        return 0
    except SystemExit as e:
        return e.code


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_in(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir())


class Killed(BaseException):
    """A kill -9 stand-in: no handler catches it."""


def _nan_loss(rank: int) -> None:
    plain = M.linear_cross_entropy
    M.linear_cross_entropy = lambda *a, **k: plain(*a, **k) * float("nan")


def test_skipped_steps_never_save_nor_prune_good_checkpoints(dirs, capfd):
    """Resumed into a state whose every step is non-finite, with --save-every 1 --keep 3: the
    skipped steps save nothing, so the three good checkpoints survive the abort."""
    ck = dirs / "ck_nan"
    assert run_ranks(_run, 1, argv(dirs, "--steps", "3", "--save", str(ck), "--save-every", "1",
                                   metrics="nan.jsonl")) == [0]
    assert steps_in(ck) == ["step_00000001", "step_00000002", "step_00000003"]
    got = run_ranks(_run, 1, argv(dirs, "--steps", "8", "--save", str(ck), "--save-every", "1", "--resume",
                                  "auto", "--max-bad-steps", "3", metrics="nan.jsonl"), _nan_loss)
    assert got == [2] and "3 consecutive non-finite steps" in capfd.readouterr().err
    assert steps_in(ck) == ["step_00000001", "step_00000002", "step_00000003"]
    assert [r["step"] for r in records(dirs / "nan.jsonl")] == [1, 2, 3]  # nothing logged as trained


def _die_saving_step_2(rank: int) -> None:
    real = CK.save_checkpoint

    def save(ckpt_dir, step, *a, **k):
        if step == 2:
            raise Killed("killed while saving step 2")
        return real(ckpt_dir, step, *a, **k)
    CK.save_checkpoint = save


def test_metrics_record_is_written_before_its_checkpoint(dirs):
    """A kill while step 2 saves: its record is already in the log; the resumed run redoes step 2
    and the log equals the straight run's, bit for bit."""
    ck = dirs / "ck_kill"
    flags = ("--save", str(ck), "--save-every", "1")
    with pytest.raises(RuntimeError, match="killed while saving step 2"):
        run_ranks(_run, 1, argv(dirs, *flags, metrics="kill.jsonl"), _die_saving_step_2)
    assert [r["step"] for r in records(dirs / "kill.jsonl")] == [1, 2]
    assert steps_in(ck) == ["step_00000001"]
    assert run_ranks(_run, 1, argv(dirs, *flags, "--resume", "auto", metrics="kill.jsonl")) == [0]
    assert run_ranks(_run, 1, argv(dirs, metrics="straight.jsonl")) == [0]
    want = [(r["step"], r["loss"]) for r in records(dirs / "straight.jsonl")]
    assert [(r["step"], r["loss"]) for r in records(dirs / "kill.jsonl")] == want


def _open_then(path: Path, start: int, die) -> int:
    """open_metrics in a forked child that dies (os._exit: no flush, no close) where `die` says."""
    pid = os.fork()
    if pid == 0:
        if die == "before rename":
            os.replace = lambda *a: os._exit(0)
        train.open_metrics(str(path), start)
        os._exit(0)
    return os.waitpid(pid, 0)[1]


def test_metrics_rewrite_survives_a_crash(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)]
    path.write_text("".join(lines))
    _open_then(path, 3, "before rename")  # killed between writing the new file and renaming it
    assert path.read_text() == "".join(lines)
    _open_then(path, 3, "right after")  # killed before the first step: the kept lines are on disk
    assert path.read_text() == "".join(lines[:3])
    path.write_text("".join(lines[:3]) + '{"step": 4, "lo')  # a kill mid-line
    train.open_metrics(str(path), 5).close()
    assert path.read_text() == "".join(lines[:3])
    assert "1 unreadable line(s) dropped" in capsys.readouterr().out
    train.open_metrics(str(path), 0).close()  # a fresh run starts an empty log
    assert path.read_text() == ""


def test_resume_with_other_flags(dirs, capfd):
    ck = dirs / "ck_flags"
    assert run_ranks(_run, 1, argv(dirs, "--steps", "2", "--save", str(ck), metrics="f.jsonl")) == [0]
    saved = str(ck / "step_00000002")
    capfd.readouterr()
    # today's silent no-op: --steps below the checkpoint's step trained nothing and exited 0
    assert run_ranks(_run, 1, argv(dirs, "--resume", saved, "--steps", "1", metrics="f.jsonl")) == [2]
    err = capfd.readouterr().err
    assert "--steps 1 is below the checkpoint's step 2: nothing would be trained" in err
    assert err.count("error:") == 1
    assert run_ranks(_run, 1, argv(dirs, "--resume", saved, "--seq-len", "16", "--seed", "1",
                                   metrics="f.jsonl")) == [2]
    err = capfd.readouterr().err
    assert "--seed 1 (checkpoint: 0): the data order changes" in err
    assert "--seq-len 16 (checkpoint: 32): the rows change" in err
    # legitimate changes: notes, and the run goes on
    assert run_ranks(_run, 1, argv(dirs, "--resume", saved, "--lr", "1e-3", "--micro-batches", "2",
                                   metrics="f.jsonl")) == [0]
    out = capfd.readouterr().out
    for note in ("note: resuming", "--lr 0.001 (checkpoint: 0.003)", "--micro-batches 2 (checkpoint: 1)",
                 "--steps 4 (checkpoint's run: 2): the cosine decay now ends at step 4",
                 "the lr of step 3 is"):
        assert note in out, out
    assert [r["step"] for r in records(dirs / "f.jsonl")] == [1, 2, 3, 4]


def _full_disk_at_step_2(rank: int) -> None:
    """Rank 1's tensor file of step 2 is /dev/full: the kernel's own ENOSPC, after the header."""
    if rank != 1:
        return
    real = CK.write_safetensors

    def write(path, *a, **k):
        if "step_00000002" in str(path):
            os.symlink("/dev/full", path)
        return real(path, *a, **k)
    CK.write_safetensors = write


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_full_disk_during_save_is_named_and_cleaned(dirs, capfd):
    ck = dirs / "ck_full"
    got = run_ranks(_run, 2, argv(dirs, "--zero", "1", "--save", str(ck), "--save-every", "1",
                                  metrics="full.jsonl"), _full_disk_at_step_2)
    assert got == [2, 2]  # both ranks stop, neither waits for the other
    err = capfd.readouterr().err
    assert err.count("error:") == 1, err
    assert f"rank 1: {ck}/step_00000002.tmp/rank00001.safetensors: no space left on device" in err
    assert "the partial step_00000002.tmp was removed" in err
    assert steps_in(ck) == ["step_00000001"]  # no debris; the previous checkpoint intact


def test_corrupt_file_read_by_one_rank_stops_every_rank(dirs, capfd):
    """tp2: tp rank 1 alone reads rank00001.safetensors' tp-sharded tensors. A flipped bit there
    (same size, valid header) is found by its checksum, and rank 0 stops too instead of waiting."""
    ck = dirs / "ck_flip"
    assert run_ranks(_run, 2, argv(dirs, "--tp", "2", "--steps", "1", "--save", str(ck),
                                   metrics="flip.jsonl")) == [0, 0]
    f = ck / "step_00000001" / "rank00001.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0x10  # an exponent bit of the last float: it would load as a wild value
    f.write_bytes(bytes(raw))
    capfd.readouterr()
    got = run_ranks(_run, 2, argv(dirs, "--tp", "2", "--resume", str(ck / "step_00000001"),
                                  metrics="flip.jsonl"), timeout=60)
    assert got == [2, 2]
    err = capfd.readouterr().err
    assert f"rank 1: {f}: checksum mismatch" in err and err.count("error:") == 1, err


def _slow_io(rank: int) -> None:
    """Rank 1 writes its first file 5 s late; rank 0 prunes 5 s late: both beyond --timeout 3."""
    name = "write_safetensors" if rank == 1 else "prune"
    real = getattr(CK, name)

    def late_once(*a, **k):
        setattr(CK, name, real)
        time.sleep(5)
        return real(*a, **k)
    setattr(CK, name, late_once)


def test_checkpoint_waits_outlast_the_collective_timeout(dirs):
    """Checkpoint I/O waits in the io group (--io-timeout), and pruning happens inside it: a slow
    writer and a slow prune do not trip --timeout, which still guards every training collective."""
    ck = dirs / "ck_slow"
    flags = ("--zero", "1", "--steps", "2", "--save", str(ck), "--save-every", "1", "--keep", "1",
             "--timeout", "3")
    got = run_ranks(_run, 2, argv(dirs, *flags, metrics="slow.jsonl"), _slow_io, timeout=90)
    assert got == [0, 0] and steps_in(ck) == ["step_00000002"]
