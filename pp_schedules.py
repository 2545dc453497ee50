"""Pipeline schedules as action lists, and the simulator that checks them (pure Python, no torch).

What it does
    A schedule says what each of p ranks does, in order.
    An `Action` computes F (forward), B (backward) or W (weight gradient) of one micro-batch.
    A `Comm` is one batch_isend_irecv with one peer.
    `add_comm` derives the Comms from the compute orders.
    `simulate` runs all ranks' lists against a virtual clock: it is how schedules are tested.
    `show` draws a schedule as text. pp.py executes one.

The core idea: 1F1B in three phases (`textbook_1f1b`)
    Warm-up: rank s runs p-1-s forwards, until the first gradient can come back.
    Steady state: one forward, then one backward, until the forwards run out.
    Cool-down: the remaining backwards.
    So rank s holds at most p-s micro-batches' activations. GPipe (all F, then all B) holds m.
    Both idle (p-1) / (m+p-1) of the step: the bubble.

Refinements (after the `# --- refinement:` banners)
    interleaved: v chunks per rank; chunk c of rank s is virtual stage c·p + s.
    The bubble shrinks to (p-1) / (v·m+p-1).
    zb (ZB-H1): each backward splits into B (input gradient) and W (weight gradient).
    Rank s runs each W s backwards late, so the Ws fill the drain bubble.
    messages: both ranks of a pair post theirs in one global order, so nothing deadlocks.

Run
    python pp.py --show 1f1b --pp 4 --micro-batches 8
    python pp.py --show zb --pp 4 --micro-batches 8 --virtual-stages 2

Reference
    GPipe: Huang et al. 2019. 1F1B: PipeDream-Flush, Narayanan et al. 2021.
    Interleaved 1F1B: Narayanan et al. 2021 (Megatron-LM). Zero bubble: Qi et al. 2023 (ZB-H1).

Invariants
    - textbook_1f1b is the general order at v = 1 (tests/test_naive.py::test_textbook_1f1b_equals_the_general_schedule).
    - Each simulated bubble equals `bubble_formula` (tests/test_pp_schedules.py::test_simulated_schedules).
    - Rank s holds at most p-s micro-batches under 1F1B (the same test).
      Under zb: (v-1)·g + p chunks, g the first round's size.
    - No schedule deadlocks on NCCL's streams (tests/test_pp_schedules.py::test_no_deadlock_on_nccl_streams).
    - The simulator names every wrong schedule (tests/test_pp_schedules.py::test_simulator_reports_errors).

More: docs/pp.md (rounds, warm-up sizes, the communication model), docs/pipeline-nccl.md.
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Hashable, Mapping, Sequence

F, B, W = "F", "B", "W"  # forward; backward (input gradient, or all of it without W); weight gradient


@dataclass(frozen=True)
class Action:
    """Compute `kind` of one micro-batch on one of this rank's chunks."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + "'" * self.chunk


@dataclass(frozen=True)
class Msg:
    """One tensor of this rank's `chunk`: the chunk that produced it (send) or will read it (receive).
    Payload F: an activation, to the next virtual stage. Payload B: a gradient, to the previous one."""
    send: bool
    payload: str
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{'SEND' if self.send else 'RECV'}_{self.payload}({self.microbatch}{chr(39) * self.chunk})"


@dataclass(frozen=True)
class Comm:
    """One batch of messages with one peer rank (one dist.batch_isend_irecv)."""
    peer: int
    msgs: tuple[Msg, ...]

    def __str__(self) -> str:
        return "+".join(map(str, self.msgs)) + f"@{self.peer}"


Step = Action | Comm


# ----------------------------------------------------------------------------------------- the core
def textbook_1f1b(m: int, s: int, p: int) -> list[Action]:
    """The 1F1B compute order of rank s of p, for m micro-batches."""
    warmup = min(m, p - 1 - s)  # forwards in flight before the first backward comes back
    order = [Action(F, i) for i in range(warmup)]  # warm-up
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [Action(F, warmup + i), Action(B, i)]
    order += [Action(B, i) for i in range(m - warmup, m)]  # cool-down: drain the backwards
    return order


def _gpipe_order(m: int, s: int, p: int, v: int) -> list[Action]:
    if v != 1:
        raise ValueError("gpipe runs one chunk per rank (virtual stages go with interleaved or zb)")
    return [Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)]


# --- refinement: virtual stages (interleaved 1F1B). docs/pp.md has the rounds and the warm-up sizes.
def rounds(m: int, p: int) -> list[range]:
    """m micro-batches in max(1, m // p) rounds of near-equal size, larger first.
    Each round has >= p micro-batches when m >= p."""
    n = max(1, m // p)
    base, extra = divmod(m, n)
    starts = [k * base + min(k, extra) for k in range(n + 1)]
    return [range(starts[k], starts[k + 1]) for k in range(n)]


def _one_f_one_b_order(m: int, s: int, p: int, v: int, split: bool) -> list[Action]:
    """The three phases of `textbook_1f1b` over v chunks per rank. `split`: the zb order."""
    rs = rounds(m, p)
    fwd = [(c, i) for r in rs for c in range(v) for i in r]  # a round's chunk 0, then chunk 1, ...
    bwd = [(c, i) for r in rs for c in reversed(range(v)) for i in r]  # backwards: last chunk first
    slack = 2 if v > 1 and not split else 1  # Megatron's interleaved warm-up (docs/pp.md)
    warmup = min(len(fwd), (v - 1) * len(rs[0]) + slack * (p - 1 - s))
    acts = [Action(F, i, c) for c, i in fwd[:warmup]]  # warm-up
    for (fc, fi), (bc, bi) in zip(fwd[warmup:], bwd):  # steady state: one forward, one backward
        acts += [Action(F, fi, fc), Action(B, bi, bc)]
    acts += [Action(B, i, c) for c, i in bwd[len(fwd) - warmup:]]  # cool-down
    return _with_weight_grads(acts, s) if split else acts


# --- refinement: zero bubble (ZB-H1). B waits for nobody's W, so W can wait.
def _with_weight_grads(acts: list[Action], s: int) -> list[Action]:
    """After the k-th B, the W of backward k - s; the last s Ws at the end.
    So rank s runs each W s backwards late: the deferred Ws fill the drain bubble."""
    bwd = [a for a in acts if a.kind == B]
    out: list[Action] = []
    k = 0  # backwards so far
    for a in acts:
        out.append(a)
        if a.kind == B:
            if k >= s:
                out.append(Action(W, bwd[k - s].microbatch, bwd[k - s].chunk))
            k += 1
    return out + [Action(W, a.microbatch, a.chunk) for a in bwd[max(0, len(bwd) - s):]]


# ----------------------------------------------------------------------------------------- messages
# Two ranks that each post a send first and a receive later wait for each other forever on NCCL.
# So add_comm puts all messages of the step in ONE global order: when a unit-cost run produces each.
# Both ranks of a pair post theirs in that order. A send goes right after the computation that made
# it. A receive goes right before the computation that reads it, or earlier if the order says so.
# A receive closes its batch: on NCCL a computation waits for its input's whole batch.
def _sources(a: Action, s: int, p: int, v: int) -> list[tuple[int, Msg]]:
    """(peer, receive) that compute action a on rank s waits for: its input activation or gradient."""
    vs, last = a.chunk * p + s, p * v - 1
    if a.kind == F and vs > 0:
        return [((vs - 1) % p, Msg(False, F, a.microbatch, a.chunk))]
    if a.kind == B and vs < last:
        return [((vs + 1) % p, Msg(False, B, a.microbatch, a.chunk))]
    return []


def _products(a: Action, s: int, p: int, v: int) -> list[tuple[int, Msg, int]]:
    """(peer, send, the peer's chunk that reads it) that compute action a on rank s produces."""
    vs, last = a.chunk * p + s, p * v - 1
    if a.kind == F and vs < last:
        return [((vs + 1) % p, Msg(True, F, a.microbatch, a.chunk), (vs + 1) // p)]
    if a.kind == B and vs > 0:
        return [((vs - 1) % p, Msg(True, B, a.microbatch, a.chunk), (vs - 1) // p)]
    return []


def add_comm(orders: Sequence[Sequence[Action]], v: int = 1) -> list[list[Step]]:
    """The per-rank compute orders with their messages inserted (the rule above)."""
    p = len(orders)
    if p == 1:
        return [list(orders[0])]
    run = simulate(orders, 1, 1, 1, free_messages=True)  # unit costs: when each message is produced
    produced = sorted(((end, s), peer, send, dst_chunk)  # (time, rank) is unique
                      for s, row in enumerate(run.timeline) for _, end, a in row
                      for peer, send, dst_chunk in _products(a, s, p, v))
    queues: dict[tuple[int, int], list[Msg]] = {}  # (rank, peer) → its messages, in the global order
    for (_, s), peer, send, dst_chunk in produced:
        queues.setdefault((s, peer), []).append(send)
        queues.setdefault((peer, s), []).append(Msg(False, send.payload, send.microbatch, dst_chunk))
    return [_with_messages(s, order, queues, p, v) for s, order in enumerate(orders)]


def _with_messages(s: int, order: Sequence[Action], queues: dict, p: int, v: int) -> list[Step]:
    """Rank s's compute order with its messages posted in the pair order of `queues`."""
    posted = {peer: 0 for (r, peer) in queues if r == s}  # messages posted so far, per peer
    where = {peer: {msg: k for k, msg in enumerate(queues[s, peer])} for peer in posted}  # msg → index
    done: set[Action] = set()
    steps: list[Step] = []
    batch: dict[int, list[Msg]] = {}  # peer → messages to post at this point

    def post_through(peer: int, msg: Msg) -> None:
        queue = queues[s, peer]
        while posted[peer] <= where[peer][msg]:  # and every message before it, in order
            nxt = queue[posted[peer]]
            if nxt.send and Action(nxt.payload, nxt.microbatch, nxt.chunk) not in done:
                raise ValueError(f"rank {s}: {nxt} is due before it is computed")
            batch.setdefault(peer, []).append(nxt)
            posted[peer] += 1

    def flush() -> None:  # a receive closes its batch: a computation waits for ONE message
        for peer, msgs in batch.items():
            cut = [0] + [k + 1 for k, msg in enumerate(msgs) if not msg.send]
            cut += [len(msgs)] * (cut[-1] < len(msgs))
            steps.extend(Comm(peer, tuple(msgs[a:z])) for a, z in zip(cut, cut[1:]))
        batch.clear()

    for a in order:
        for peer, recv in _sources(a, s, p, v):
            post_through(peer, recv)
        flush()
        steps.append(a)
        done.add(a)
        for peer, send, _ in _products(a, s, p, v):
            post_through(peer, send)
    flush()
    return steps


# ----------------------------------------------------------------------------------------- schedules
@functools.lru_cache(maxsize=64)
def _build(name: str, m: int, p: int, v: int) -> tuple[tuple[Step, ...], ...]:
    if m < 1 or p < 1 or v < 1 or (v > 1 and p < 2):
        raise ValueError(f"need micro-batches, stages and virtual stages >= 1 (virtual stages > 1 with "
                         f">= 2 stages), got m={m}, p={p}, v={v}")
    if name == "gpipe":
        orders = [_gpipe_order(m, s, p, v) for s in range(p)]
    elif name == "1f1b" and v == 1:
        orders = [textbook_1f1b(m, s, p) for s in range(p)]
    else:
        orders = [_one_f_one_b_order(m, s, p, v, split=name == "zb") for s in range(p)]
    return tuple(tuple(steps) for steps in add_comm(orders, v))


def gpipe(m: int, stage: int, p: int, v: int = 1) -> list[Step]:
    """All forwards, then all backwards (in the same order, so gradients accumulate as in 1F1B)."""
    return list(_build("gpipe", m, p, v)[stage])


def one_f_one_b(m: int, stage: int, p: int, v: int = 1) -> list[Step]:
    """1F1B (PipeDream-Flush); with v > 1 chunks per rank, interleaved 1F1B."""
    return list(_build("1f1b", m, p, v)[stage])


def interleaved(m: int, stage: int, p: int, v: int = 2) -> list[Step]:
    """Interleaved 1F1B: v >= 2 chunks per rank (v = 1 is plain 1F1B)."""
    if v < 2:
        raise ValueError(f"interleaved needs >= 2 virtual stages per rank, got {v} (v=1 is 1f1b)")
    return one_f_one_b(m, stage, p, v)


def zero_bubble(m: int, stage: int, p: int, v: int = 1) -> list[Step]:
    """ZB-H1: 1F1B (v = 1) or interleaved 1F1B (v > 1) with B and W apart, W deferred by `stage`."""
    return list(_build("zb", m, p, v)[stage])


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb": zero_bubble}


def forward_only(steps: Sequence[Step]) -> list[Step]:
    """A schedule's forwards and activation messages alone, in its order: evaluation under no_grad.
    It runs through the same chunks and peers. Each pair keeps its messages' order.
    Nothing waits for a backward any more, so it stays deadlock-free."""
    out: list[Step] = []
    for st in steps:
        if isinstance(st, Comm):
            msgs = tuple(msg for msg in st.msgs if msg.payload == F)
            out += [Comm(st.peer, msgs)] if msgs else []
        elif st.kind == F:
            out.append(st)
    return out


def bubble_formula(name: str, m: int, p: int, v: int = 1, f: float = 1, b: float = 2,
                   w: float = 1) -> Fraction:
    """The bubble of docs/pp.md: the idle share of p · step time (interleaved and zb: m >= p).
    f, b, w: the costs of one chunk's F, B and W. Without W, b is the whole backward."""
    if name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if name == "interleaved":
        return Fraction(p - 1, v * m + p - 1)
    idle, busy = (p - 1) * Fraction(f + b - w), v * m * Fraction(f + b + w)
    return idle / (idle + busy)


# ----------------------------------------------------------------------------------------- simulator
# NCCL as torch 2.13 drives it (docs/pipeline-nccl.md): a group's batched P2P runs on one stream per
# rank, in posting order. A send completes only once the peer posted the matching receive.
# The simulator keeps one stream per (rank, communicator). gloo never serializes: only this shows it.
def pair_groups(rank: int, peer: int) -> tuple[int, int]:
    """The communicator of a message under pp.run_pipeline: one 2-rank group per neighbour pair."""
    return min(rank, peer), max(rank, peer)


def one_group(rank: int, peer: int) -> str:
    """Every message on the one pp group: NCCL runs all of a rank's batches on one stream."""
    return "pp"


# ---- refinement: hardware queues (CUDA_DEVICE_MAX_CONNECTIONS)
def hardware_queues(q: int) -> Callable[[int, int], Hashable]:
    """pair_groups on a device with q hardware queues (CUDA_DEVICE_MAX_CONNECTIONS = q). CUDA maps a
    rank's streams onto its queues round-robin, in creation order. The compute stream comes first
    (queue 0). Then NCCL's streams: the predecessor's pair (s-1, s), then the successor's. Under
    v >= 2 the last stage feeds stage 0: rank 0's predecessor is p-1, and the last rank's successor 0.
    Streams on one queue run as one FIFO. So at q = 1 a rank's two pair groups share a queue:
    one_group's order, and its deadlocks, return. The compute stream's share of a queue is not
    modelled: a NCCL kernel waiting at a queue's head would stall it too."""
    def queue(rank: int, peer: int) -> Hashable:
        nccl = 0 if peer == rank - 1 or (rank == 0 and peer > 1) else 1  # predecessor's stream first
        return "queue", (1 + nccl) % q
    return queue


def connections_problem(p: int, v: int, env: Mapping[str, str]) -> str | None:
    """The refusal of a CUDA_DEVICE_MAX_CONNECTIONS too small for pp.run_pipeline's pair groups:
    at p >= 3 with v >= 2 (interleaved, zb) their two NCCL streams must not share a queue
    (hardware_queues(1) deadlocks: tests/test_pp_schedules.py), nor one with compute. So 3."""
    raw = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if raw is None or p < 3 or v < 2:
        return None
    try:
        n = int(raw)
    except ValueError:
        return f"CUDA_DEVICE_MAX_CONNECTIONS={raw!r} is not a number"
    if n >= 3:
        return None
    return (f"CUDA_DEVICE_MAX_CONNECTIONS={n} with --pp {p} and {v} virtual stages: a rank's two pipeline "
            f"groups and its compute stream need 3 hardware queues, or the schedule can deadlock "
            f"(docs/pipeline-nccl.md); unset it or set it to 3 or more for this run")


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # per rank: time spent computing
    idle: list[float]  # per rank: makespan - busy
    peak_in_flight: list[int]  # per rank: most (micro-batch, chunk)s between F and the last backward
    #                            action (W if the schedule has Ws, else B)
    bubble: Fraction | float  # idle share of p · makespan (exact for rational costs)
    timeline: list[list[tuple[float, float, Action]]]  # per rank: (start, end, compute action)


@dataclass(eq=False)
class _Posted:
    """A Comm in flight: its messages complete with the peer's matching ones."""
    rank: int
    comm: Comm
    post: float
    lane_pos: list[int]  # per message: its index among the messages from src to dst
    key: tuple = ()  # (rank, its stream): where it waits for the head
    times: dict = None  # message index → completion time
    start: float | None = None  # when it reached the head of its stream
    done: float | None = None


def simulate(schedules: Sequence[Sequence[Step]], f_cost: float = 1, b_cost: float = 2,
             w_cost: float = 1, comm_cost: float = 0,
             weights: Sequence[Sequence[float]] | None = None, free_messages: bool = False,
             communicator: Callable[[int, int], Hashable] = pair_groups, backward: bool = True) -> SimResult:
    """Run every rank's list together against a virtual clock, with NCCL's rules (above).
    A Comm is posted at once, on its rank's stream of communicator(rank, peer).
    On one stream, Comms complete in posting order.
    The n-th send from a to b meets the n-th receive posted by b.
    It completes comm_cost after both reach the heads of their streams.
    A computation waits for the Comm that brought its input.
    communicator: pair_groups (what pp.run_pipeline uses) or one_group (all on the pp group).
    F, B and W cost f/b/w_cost, times weights[rank][chunk].
    free_messages: compute orders without Comms; an input is there when its producer finished.
    backward=False: a forward_only schedule (only Fs are due).
    A wrong schedule raises ValueError: an input never received, B before F, an F twice,
    a message meeting another one, a missing action. A deadlock raises RuntimeError.
    It names every rank's stuck action."""
    p = len(schedules)
    acts = [a for sch in schedules for a in sch if isinstance(a, Action)]
    v, m = 1 + max((a.chunk for a in acts), default=0), 1 + max((a.microbatch for a in acts), default=-1)
    cost = {F: f_cost, B: b_cost, W: w_cost}  # (ints add exactly; the bubble is a Fraction)
    with_w = [any(isinstance(a, Action) and a.kind == W for a in sch) for sch in schedules]
    pc, clock, in_flight, peak = [0] * p, [0] * p, [0] * p, [0] * p
    done: list[dict[Action, float]] = [{} for _ in range(p)]
    arrives: list[dict[Msg, _Posted]] = [{} for _ in range(p)]  # posted receive → its Comm
    streams: dict[tuple, list[_Posted]] = {}  # (rank, communicator) → Comms in posting order
    heads: dict[tuple, int] = {}
    lanes: dict[tuple[int, int, bool], list[tuple[_Posted, int]]] = {}  # (src, dst, send?) → messages
    timeline: list[list] = [[] for _ in range(p)]

    def fail(s: int, a: Step, why: str) -> None:
        raise ValueError(f"stage {s} action #{pc[s]} {a}: {why}")

    def post(s: int, c: Comm) -> None:
        if not (0 <= c.peer < p and c.peer != s):
            fail(s, c, f"no stage {c.peer} to talk to")
        posted = _Posted(s, c, clock[s], [], (s, communicator(s, c.peer)), {})
        streams.setdefault(posted.key, []).append(posted)
        for k, msg in enumerate(c.msgs):
            if msg.send:
                if Action(msg.payload, msg.microbatch, msg.chunk) not in done[s]:
                    fail(s, c, f"sends {msg.payload}{msg.microbatch} before it exists")
            else:
                arrives[s][msg] = posted
            src, dst = (s, c.peer) if msg.send else (c.peer, s)
            mine, theirs = lanes.setdefault((src, dst, msg.send), []), lanes.get((src, dst, not msg.send), [])
            posted.lane_pos.append(len(mine))
            mine.append((posted, k))
            if len(theirs) >= len(mine):  # the n-th send from src to dst meets the n-th receive
                other = theirs[len(mine) - 1]
                sent, got = (msg, other[0].comm.msgs[other[1]])[::1 if msg.send else -1]
                vs = sent.chunk * p + src + (1 if sent.payload == F else -1)
                if (sent.payload, sent.microbatch, vs // p) != (got.payload, got.microbatch, got.chunk):
                    raise ValueError(f"stage {src} sends {sent} to stage {dst}, which receives {got} in its "
                                     f"place (messages between two stages must be posted in one order)")

    def head(key: tuple) -> _Posted | None:
        """The Comm at the head of a stream (with its start time), or None."""
        stream, i = streams.get(key, []), heads.setdefault(key, 0)
        if i >= len(stream):
            return None
        if stream[i].start is None:
            stream[i].start = max(stream[i].post, stream[i - 1].done if i else 0)
        return stream[i]

    def resolve() -> bool:
        """Complete the messages whose both ends are at the heads of their streams."""
        changed = True
        while changed:
            changed = False
            for key in list(streams):
                while (c := head(key)) is not None:
                    s, peer = c.rank, c.comm.peer
                    for k, msg in enumerate(c.comm.msgs):
                        src, dst = (s, peer) if msg.send else (peer, s)
                        theirs = lanes.get((src, dst, not msg.send), [])
                        if k in c.times or c.lane_pos[k] >= len(theirs):
                            continue
                        other, j = theirs[c.lane_pos[k]]
                        if head(other.key) is other:  # the peer's end heads its own stream
                            c.times[k] = other.times[j] = max(c.start, other.start) + comm_cost
                    if len(c.times) < len(c.comm.msgs):
                        break
                    c.done, heads[key] = max(c.times.values()), heads[key] + 1
                    changed = True

    def ready(s: int, a: Action) -> float | None:
        """When a's input is there (None: not known yet)."""
        if a in done[s]:
            fail(s, a, "computed twice")
        if a.kind != F and Action(B if a.kind == W else F, a.microbatch, a.chunk) not in done[s]:
            fail(s, a, "weight gradient before backward" if a.kind == W else "backward before forward")
        for peer, recv in _sources(a, s, p, v):  # (at most one)
            if free_messages:
                t = done[peer].get(Action(a.kind, a.microbatch, (a.chunk * p + s + (1 if a.kind == B else -1)) // p))
            else:
                if recv not in arrives[s]:
                    fail(s, a, f"{'input activation' if a.kind == F else 'output gradient'} not received")
                t = arrives[s][recv].done
            return None if t is None else max(clock[s], t)
        return clock[s]

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(schedules[s]):
                a = schedules[s][pc[s]]
                if isinstance(a, Comm):
                    post(s, a)
                elif (t := ready(s, a)) is None:
                    break
                else:
                    end = t + cost[a.kind] * (weights[s][a.chunk] if weights else 1)
                    timeline[s].append((t, end, a))
                    clock[s] = done[s][a] = end
                    in_flight[s] += (a.kind == F) - (a.kind == (W if with_w[s] else B))
                    peak[s] = max(peak[s], in_flight[s])
                pc[s] += 1
                progress = True
        before = sum(heads.values())
        resolve()
        progress = progress or sum(heads.values()) > before
    if any(pc[s] < len(schedules[s]) for s in range(p)):
        raise RuntimeError("deadlock: " + "; ".join(f"stage {s} waits at #{pc[s]} {schedules[s][pc[s]]}"
                                                    for s in range(p) if pc[s] < len(schedules[s])))
    unmatched = [f"stage {c.rank}: {c.comm}" for cs in streams.values() for c in cs if c.done is None]
    if unmatched:
        raise RuntimeError(f"messages never received: {'; '.join(unmatched)}")
    for s in range(p):
        kinds = (F, B, W) if with_w[s] else (F, B) if backward else (F,)
        want = {Action(k, i, c) for k in kinds for i in range(m) for c in range(v)}
        if set(done[s]) != want:
            raise ValueError(f"stage {s}: missing {sorted(map(str, want - set(done[s])))} (each micro-batch "
                             f"needs {'/'.join(kinds)} on each of the {v} chunk(s))")
    makespan = max(clock, default=0)
    busy = [sum((end - start for start, end, _ in timeline[s]), Fraction(0)) for s in range(p)]
    idle = [makespan - b for b in busy]
    bubble = sum(idle, Fraction(0)) / (p * makespan) if makespan else Fraction(0)
    return SimResult(makespan, busy, idle, peak, bubble, timeline)


# ----------------------------------------------------------------------------------------- show
def show(name: str, m: int, p: int, v: int = 1, f: int = 1, b: int | None = None, w: int = 1) -> str:
    """The simulated schedule as text: one row per rank, one column per time unit (integer costs).
    Chunk c is marked by c primes: F3'' is micro-batch 3's forward on the rank's chunk 2."""
    b = (1 if name == "zb" else 2) if b is None else b
    sim = simulate([SCHEDULES[name](m, s, p, v) for s in range(p)], f, b, w)
    width = max(len(str(a)) for row in sim.timeline for _, _, a in row) + 1
    rows = []
    for s, row in enumerate(sim.timeline):
        cells = ["." * (width - 1)] * int(sim.makespan)
        for start, end, a in row:
            cells[int(start)] = str(a)
            for t in range(int(start) + 1, int(end)):
                cells[t] = "-" * (width - 1)
        rows.append(f"rank {s} |" + " ".join(c.ljust(width - 1) for c in cells))
    costs = f"F={f} B={b}" + (f" W={w}" if name == "zb" else "")
    head = (f"{name}: {p} ranks x {v} chunk(s), {m} micro-batches, costs {costs} per chunk; "
            f"simulated bubble {float(sim.bubble):.1%} (formula {float(bubble_formula(name, m, p, v, f, b, w)):.1%}), "
            f"peak (micro-batch, chunk)s in flight per rank {sim.peak_in_flight}")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="draw a simulated pipeline schedule")
    ap.add_argument("--show", required=True, choices=sorted(SCHEDULES))
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=None, help="chunks per rank (default: 2 for "
                                                                     "interleaved, else 1)")
    args = ap.parse_args(argv)
    v = args.virtual_stages if args.virtual_stages is not None else 2 if args.show == "interleaved" else 1
    print(show(args.show, args.micro_batches, args.pp, v))


if __name__ == "__main__":
    main()
