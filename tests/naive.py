"""Textbook versions of the core algorithms, a few lines each, for reading beside the production code.
tests/test_naive.py asserts each equal to the production path.

one_f_one_b: the 1F1B order of one pipeline rank as the papers draw it — warm-up forwards, then one
forward and one backward at a time (steady state), then the remaining backwards (cool-down).
pp_schedules.one_f_one_b builds the same order from its general function (_one_f_one_b_order, which
also covers interleaved chunks and the zero-bubble split) and adds the messages.
Reference: Narayanan et al. 2021 (1F1B as PipeDream-Flush), Fig. 4.
"""
from __future__ import annotations


def one_f_one_b(m: int, s: int, p: int) -> list[tuple[str, int]]:
    """[("F" | "B", micro-batch), ...] of rank s of p, for m micro-batches."""
    warmup = min(m, p - 1 - s)  # forwards in flight before the first backward comes back
    order = [("F", i) for i in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]  # cool-down: drain the backwards
    return order
