"""pp_schedules.py: every schedule through the simulator (no deadlock under NCCL's pair-stream
semantics, each F/B/W once, activations in flight, the bubble against its closed form), the
simulator's own error reports, the text timeline, and the bubble targets of issues 14 and 17.

All checks are exact (Fractions): the closed forms are derived in pp_schedules' docstring, and the
counts of F/B/W per micro-batch and chunk are recomputed here independently of the simulator."""
from __future__ import annotations

import itertools
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

import model as M
import pp
from pp_schedules import (SCHEDULES, Action, B, Comm, F, Msg, W, bubble_formula, forward_only, gpipe,
                          interleaved, one_f_one_b, one_group, pair_groups, rounds, show, simulate,
                          zero_bubble)

ROOT = Path(__file__).resolve().parents[1]
VS = {"gpipe": [1], "1f1b": [1], "interleaved": [2, 3], "zb": [1, 2, 3]}
COSTS = {"gpipe": [(1, 1, 0), (1, 2, 0), (2, 3, 0)], "1f1b": [(1, 1, 0), (1, 2, 0), (2, 3, 0)],
         "interleaved": [(1, 1, 0), (1, 2, 0), (2, 3, 0)], "zb": [(1, 1, 1), (2, 2, 1), (1, 2, 1)]}


def strs(steps) -> list[str]:
    return [str(a) for a in steps]


def test_schedules_read_as_expected():
    assert strs(one_f_one_b(3, 0, 2)) == ["F0", "SEND_F(0)@1", "F1", "SEND_F(1)+RECV_B(0)@1", "B0", "F2",
                                          "SEND_F(2)+RECV_B(1)@1", "B1", "RECV_B(2)@1", "B2"]
    assert strs(one_f_one_b(3, 1, 2)) == ["RECV_F(0)@0", "F0", "B0", "RECV_F(1)@0", "SEND_B(0)@0", "F1", "B1",
                                          "RECV_F(2)@0", "SEND_B(1)@0", "F2", "B2", "SEND_B(2)@0"]
    assert strs(gpipe(2, 1, 3)) == ["RECV_F(0)@0", "F0", "SEND_F(0)@2", "RECV_F(1)@0", "F1",
                                    "SEND_F(1)+RECV_B(0)@2", "B0", "SEND_B(0)@0", "RECV_B(1)@2", "B1", "SEND_B(1)@0"]
    # zb: rank 1 defers each W by one backward; rank 0 runs them at once
    assert [str(a) for a in zero_bubble(3, 0, 2) if isinstance(a, Action)] == \
        ["F0", "F1", "B0", "W0", "F2", "B1", "W1", "B2", "W2"]
    assert [str(a) for a in zero_bubble(3, 1, 2) if isinstance(a, Action)] == \
        ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"]
    # interleaved: chunk 1 (') of a round after its chunk 0; backwards last chunk first
    assert [str(a) for a in interleaved(2, 0, 2) if isinstance(a, Action)] == \
        ["F0", "F1", "F0'", "F1'", "B0'", "B1'", "B0", "B1"]
    assert rounds(8, 4) == [range(0, 4), range(4, 8)] and rounds(7, 2) == [range(0, 3), range(3, 5), range(5, 7)]
    assert rounds(3, 4) == [range(0, 3)]
    with pytest.raises(ValueError, match="interleaved needs >= 2 virtual stages"):
        interleaved(4, 0, 2, 1)
    with pytest.raises(ValueError, match="virtual stages > 1 with >= 2 stages"):
        zero_bubble(4, 0, 1, 2)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_simulated_schedules(name):
    for p, v, m in itertools.product(range(1, 6), VS[name], range(1, 11)):
        if v > 1 and p == 1:
            continue
        scheds = [SCHEDULES[name](m, s, p, v) for s in range(p)]
        for sched in scheds:  # independent of the simulator's own check: each F/B (/W) once per chunk
            acts = [a for a in sched if isinstance(a, Action)]
            for kind in (F, B, W) if name == "zb" else (F, B):
                assert sorted((a.chunk, a.microbatch) for a in acts if a.kind == kind) == \
                    [(c, i) for c in range(v) for i in range(m)], (name, p, v, m, kind)
        for f, b, w in COSTS[name]:
            r = simulate(scheds, f, b, w)  # raises on deadlock, a mismatched message, a missing action
            if m >= p or name in ("gpipe", "1f1b"):
                assert r.bubble == bubble_formula(name, m, p, v, f, b, w), (name, p, v, m, f, b, w, r.bubble)
            assert r.busy == [v * m * (f + b + w)] * p
        # activations in flight (F done, last backward action not yet), in chunk units
        g = len(rounds(m, p)[0])
        want = {"gpipe": [m] * p, "1f1b": [min(m, p - s) for s in range(p)],
                "interleaved": [min(v * m, (v - 1) * g + 2 * (p - 1 - s) + 1) for s in range(p)],
                "zb": [min(v * m, (v - 1) * g + p) for s in range(p)]}[name]
        if m >= p or name != "zb":
            assert r.peak_in_flight == want, (name, p, v, m, r.peak_in_flight)
        # communication time only adds idle time, and never deadlocks
        assert simulate(scheds, 1, 2, 1, comm_cost=Fraction(1, 2)).bubble >= r.bubble or p == 1


def test_bubble_targets():
    """Issue 17: interleaved p=4, m=8, v=2 <= 16% (1F1B 27.3%); ZB-H1 at p=4, m=8: one third of
    1F1B's idle time (F=B=W=1 against F=1, B=2: the same work per micro-batch)."""
    sim = lambda name, v, f, b, w: simulate([SCHEDULES[name](8, s, 4, v) for s in range(4)], f, b, w)  # noqa: E731
    ofob, inter, zb, zb2 = sim("1f1b", 1, 1, 2, 0), sim("interleaved", 2, 1, 2, 0), sim("zb", 1, 1, 1, 1), \
        sim("zb", 2, 1, 1, 1)
    assert ofob.bubble == Fraction(3, 11) and inter.bubble == Fraction(3, 19) <= Fraction(16, 100)
    assert zb.idle == [i / 3 for i in ofob.idle] == [3] * 4  # a third of the idle time...
    assert zb.bubble == Fraction(1, 9)  # ...which is 11.1% of the shorter step (1F1B: 27.3%)
    assert zb2.bubble == Fraction(3, 51) <= ofob.bubble / 3  # with v = 2 chunks: 5.9%


def test_default_microbatches_bubble():
    """Issue 14: the default --micro-batches keeps the simulated bubble <= 20% at pp=2 and pp=4 for
    every schedule (F=1, B=2; zb F=B=W=1), with train.py's default batch (16 rows per dp rank)."""
    for name, p in itertools.product(SCHEDULES, (2, 4)):
        v = 2 if name == "interleaved" else 1
        m = pp.default_microbatches(name, p, 16)
        r = simulate([SCHEDULES[name](m, s, p, v) for s in range(p)], 1, 1 if name == "zb" else 2, 1)
        assert r.bubble <= Fraction(1, 5), (name, p, m, float(r.bubble))
    assert pp.default_microbatches("1f1b", 4, 16) == 16 and pp.default_microbatches("zb", 4, 16) == 8
    assert pp.default_microbatches("1f1b", 4, 12) == 12 and pp.default_microbatches("1f1b", 8, 12) == 12
    assert pp.default_microbatches("1f1b", 4, 6) == 6 and pp.default_microbatches("1f1b", 1, 16) == 1
    assert pp.default_microbatches("1f1b", 4, 18) == 9  # the largest divisor of the rows below 4·pp


def test_default_partition_balances_the_1b_preset():
    """Issue 14: with the head counted (FLOPs), the 1b preset's stages cost within 10% of each other
    at pp=2 and pp=4 (uniform layers: the last stage 1.5-2x the others)."""
    cfg = M.PRESETS["1b"]
    for seq in (256, 2048):
        head = pp.head_cost(cfg, seq)
        assert 3.5 < head < 4.5, head  # 6hV against 6·(12.3h²+...) per layer: about four layers
        for p in (2, 4):
            ranges = pp.partition(cfg.num_hidden_layers, p, head=head)
            cost = [len(r) + head * (s == p - 1) for s, r in enumerate(ranges)]
            assert max(cost) / min(cost) - 1 <= 0.10, (seq, p, [len(r) for r in ranges], cost)
            uniform = [len(r) + head * (s == p - 1) for s, r in enumerate(pp.partition(cfg.num_hidden_layers, p))]
            assert max(uniform) / min(uniform) > 1.4
    assert [len(r) for r in pp.partition(16, 2, head=pp.head_cost(cfg, 256))] == [10, 6]
    assert [len(r) for r in pp.partition(16, 4, head=pp.head_cost(cfg, 256))] == [5, 5, 5, 1]


def _nccl_deadlock() -> list[list]:
    """Both ranks send first and receive later, in separate batches: each pair stream's head is a
    send whose receive waits behind the peer's own send."""
    s = lambda kind, i: Msg(True, kind, i, 0)  # noqa: E731
    r = lambda kind, i: Msg(False, kind, i, 0)  # noqa: E731
    a = lambda kind, i: Action(kind, i)  # noqa: E731
    return [[a(F, 0), Comm(1, (s(F, 0),)), a(F, 1), Comm(1, (s(F, 1),)), Comm(1, (r(B, 0),)), a(B, 0),
             Comm(1, (r(B, 1),)), a(B, 1)],
            [Comm(0, (r(F, 0),)), a(F, 0), a(B, 0), Comm(0, (s(B, 0),)), Comm(0, (r(F, 1),)), a(F, 1), a(B, 1),
             Comm(0, (s(B, 1),))]]


def test_simulator_reports_errors():
    with pytest.raises(RuntimeError, match=r"deadlock: stage 0 waits at #5 B0; stage 1 waits at #5 F1"):
        simulate(_nccl_deadlock())
    swapped = [[Action(F, 0), Action(F, 1), Comm(1, (Msg(True, F, 0, 0), Msg(True, F, 1, 0))),
                Comm(1, (Msg(False, B, 0, 0),)), Action(B, 0), Comm(1, (Msg(False, B, 1, 0),)), Action(B, 1)],
               [Comm(0, (Msg(False, F, 1, 0),)), Comm(0, (Msg(False, F, 0, 0),)), Action(F, 0), Action(F, 1),
                Action(B, 0), Action(B, 1), Comm(0, (Msg(True, B, 0, 0), Msg(True, B, 1, 0)))]]
    with pytest.raises(ValueError, match=r"stage 0 sends SEND_F\(0\) to stage 1, which receives RECV_F\(1\)"):
        simulate(swapped)
    with pytest.raises(ValueError, match=r"stage 0 action #0 B0: backward before forward"):
        simulate([[Action(B, 0), Action(F, 0)]])
    with pytest.raises(ValueError, match=r"#1 F0: computed twice"):
        simulate([[Action(F, 0), Action(F, 0)]])
    with pytest.raises(ValueError, match=r"missing \['B0'\]"):
        simulate([[Action(F, 0)]])
    with pytest.raises(ValueError, match=r"#1 W0: weight gradient before backward|missing"):
        simulate([[Action(F, 0), Action(W, 0), Action(B, 0)]])
    with pytest.raises(ValueError, match=r"stage 1 action #0 F0: input activation not received"):
        simulate([[Action(F, 0), Comm(1, (Msg(True, F, 0, 0),)), Comm(1, (Msg(False, B, 0, 0),)), Action(B, 0)],
                  [Action(F, 0), Action(B, 0), Comm(0, (Msg(True, B, 0, 0),))]])
    with pytest.raises(ValueError, match="no stage 2 to talk to"):
        simulate([[Comm(2, (Msg(False, F, 0, 0),))], []])
    twice = Comm(0, (Msg(True, B, 0, 0),))
    with pytest.raises(RuntimeError, match=r"messages never received: stage 1: SEND_B\(0\)@0"):
        simulate([[Action(F, 0), Comm(1, (Msg(True, F, 0, 0),)), Comm(1, (Msg(False, B, 0, 0),)), Action(B, 0)],
                  [Comm(0, (Msg(False, F, 0, 0),)), Action(F, 0), Action(B, 0), twice, twice]])


def test_show_draws_the_timeline():
    text = show("zb", 4, 2)
    assert text.splitlines()[1:] == ["rank 0 |F0 F1 .. B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
                                     "rank 1 |.. F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"]
    assert "simulated bubble 7.7% (formula 7.7%)" in text
    r = subprocess.run([sys.executable, "pp.py", "--show", "interleaved", "--pp", "4", "--micro-batches", "8"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "simulated bubble 15.8% (formula 15.8%)" in lines[0] and len(lines) == 5
    assert lines[1].startswith("rank 0 |F0  F1  F2  F3  F0' F1' F2' F3' F4 ")


def test_no_deadlock_on_nccl_streams():
    """Issue 22: NCCL as torch 2.13 drives it runs a rank's batches of one communicator on one
    stream, in posting order. Every schedule the CLI accepts (p <= 8, v <= 3, m from 1 to 2p, and
    4p: the defaults are 4p for gpipe/1f1b, 2p for the others) and its forward-only schedule run
    without deadlock on pp.run_pipeline's communicators: one 2-rank group per neighbour pair. On
    the one pp group (the executor before issue 22) exactly interleaved and zb with v >= 2 at p >= 3
    deadlock (checked at the default m = 2p)."""
    accepted = [(name, p, v) for name in SCHEDULES for p in range(1, 9) for v in VS[name] if v == 1 or p > 1]
    for name, p, v in accepted:
        for m in [*range(1, 2 * p + 1), *[4 * p] * (v == 1)]:  # each schedule's default m included
            sched = [SCHEDULES[name](m, s, p, v) for s in range(p)]
            for steps, bwd in ((sched, True), ([forward_only(st) for st in sched], False)):
                simulate(steps, communicator=pair_groups, backward=bwd)  # raises on deadlock
                if m == 2 * p:
                    try:
                        simulate(steps, communicator=one_group, backward=bwd)
                        dead = False
                    except RuntimeError as e:
                        dead = str(e).startswith("deadlock")
                    assert dead == (name in ("interleaved", "zb") and v >= 2 and p >= 3), (name, p, v, m)
    assert pp.default_microbatches("interleaved", 4, 16) == pp.default_microbatches("zb", 4, 16) == 8  # 2p


def test_hardware_queues_pin_the_connections_needed():
    """CUDA_DEVICE_MAX_CONNECTIONS in the simulator (hardware_queues): with one queue a rank's two
    pair groups share a FIFO, and exactly one_group's deadlocks return (interleaved and zb, v >= 2,
    p >= 3, at m = 2p, training and forward-only). With 2 queues or more none deadlocks.
    connections_problem refuses fewer than 3 (the compute stream's queue too) there, and only there."""
    from pp_schedules import connections_problem, hardware_queues
    for name, p, v in [(n, p, v) for n in SCHEDULES for p in range(2, 7) for v in VS[n]]:
        sched = [SCHEDULES[name](2 * p, s, p, v) for s in range(p)]
        for steps, bwd in ((sched, True), ([forward_only(st) for st in sched], False)):
            for q in (1, 2, 3):
                try:
                    simulate(steps, communicator=hardware_queues(q), backward=bwd)
                    dead = False
                except RuntimeError as e:
                    dead = str(e).startswith("deadlock")
                assert dead == (q == 1 and name in ("interleaved", "zb") and v >= 2 and p >= 3), (name, p, v, q)
        for n in ("1", "2", "3", "8"):
            refused = connections_problem(p, v, {"CUDA_DEVICE_MAX_CONNECTIONS": n}) is not None
            assert refused == (int(n) < 3 and p >= 3 and v >= 2), (name, p, v, n)
    assert connections_problem(4, 2, {}) is None and "not a number" in connections_problem(4, 2, {
        "CUDA_DEVICE_MAX_CONNECTIONS": "x"})
