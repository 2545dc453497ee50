"""The multi-rank harness itself: results by rank, errors with tracebacks, timeouts that never hang."""
import time

import pytest
import torch
import torch.distributed as dist

import dist as harness
from dist import run_ranks


def _sum_ranks(rank: int, world: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def _fail_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank one says no")
    return rank


def _sleep_on_zero(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(60)
    return rank


def test_eight_ranks_all_reduce():
    assert run_ranks(_sum_ranks, 8) == [(r, 28.0) for r in range(8)]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1.*ValueError: rank one says no"):
        run_ranks(_fail_on_one, 2, timeout=30)


def test_timeout_names_the_silent_rank():
    t = time.time()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
        run_ranks(_sleep_on_zero, 2, timeout=2)
    assert time.time() - t < 15


def _spin_on_zero(rank: int, world: int) -> int:
    t = time.process_time()
    while rank == 0 and time.process_time() - t < 60:
        pass
    return rank


def test_cpu_clock_counts_cpu_seconds_and_stalls(monkeypatch):
    """cpu_clock: a spinning rank trips the CPU budget; ranks that all wait trip the stall bound;
    a nap longer than the budget in wall seconds does not. No wall-clock bound here: load would trip
    it, and a broken clock fails anyway (the spin and the sleep return after 60 s, raising nothing)."""
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 2 CPU seconds"):
        run_ranks(_spin_on_zero, 2, timeout=2, cpu_clock=True)
    monkeypatch.setattr(harness, "STALL", 5.0)
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish"):
        run_ranks(_sleep_on_zero, 2, timeout=100, cpu_clock=True)
    assert run_ranks(_nap_on_zero, 2, timeout=2, cpu_clock=True) == [0, 1]


def _nap_on_zero(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(3.5)  # more wall seconds than the CPU budget below, fewer than STALL
    dist.barrier()
    return rank


def _tensor_result(rank: int, world: int) -> dict:
    return {"t": torch.full((3,), float(rank)), "n": rank}


def test_tensors_come_back_by_value():
    out = run_ranks(_tensor_result, 2)
    assert [torch.equal(o["t"], torch.full((3,), float(r))) for r, o in enumerate(out)] == [True, True]
