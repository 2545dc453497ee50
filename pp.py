"""Pipeline parallelism: split the layers into stages, schedule micro-batches, simulate, execute.

What it does
    `partition` + `split_stage` cut a meta-built Llama into `pp` stages of consecutive layers; the
    first stage keeps the embedding, the last the final norm, lm_head and loss. `gpipe` and
    `one_f_one_b` are pure functions returning each stage's list of actions (compute and
    point-to-point communication); `simulate` runs all stages' lists against a virtual clock (this is
    how schedules are tested, and what bench.py prints beside measured times); `run_pipeline`
    executes one stage's list with batched isend/irecv on the pp group.

Reference
    GPipe: Huang et al. 2019. 1F1B (PipeDream-Flush): Narayanan et al. 2021, "Efficient Large-Scale
    Language Model Training on GPU Clusters Using Megatron-LM" (also the tied-embedding group).

Run
    torchrun --nproc_per_node 4 train.py --pp 4 --schedule 1f1b --micro-batches 8

Invariants
    - Modules a stage does not own are deleted before materialize: never allocated, never read from a
      checkpoint. Layer names stay HF's (`model.layers.<global index>`).
    - The gradient equals the single-process one: every stage sees the same micro-batches, the last
      stage divides each micro-batch's token-loss SUM by the target count of the whole step (the
      rule of precision.normalized_loss), and gradients accumulate over micro-batches in .grad.
      No gradient is reduced here: hook-based dp/ZeRO pass their `no_sync`, so they reduce once, in
      this stage's last backward.
    - Tied embeddings with pp > 1: the last stage holds its own copy as `lm_head.weight`; the two
      copies' gradients are summed over a 2-rank group before the step, so they stay identical.
    - A disagreement between pp peers (micro-batch count or shape, target count) raises on every
      stage instead of hanging: a small header is all-gathered before any point-to-point message.

Bubble and micro-batches (M = micro-batches per step, p = stages)
    With balanced stages and free communication, both schedules idle (p-1)/(M+p-1) of the time
    (whatever the forward/backward cost ratio): the last stage starts only after a micro-batch
    crossed p-1 stages, and the first stage idles as long at the end while the backwards drain.
    1F1B does not shrink this bubble; it caps memory. Stage s runs min(p-1-s, M) warm-up forwards,
    then alternates one forward and one backward, so at most min(M, p-s) micro-batches hold
    activations (GPipe: all M). M >= 1 always works, but with M < p the early stages run all their
    forwards before any backward (1F1B saves nothing there) and the bubble is at least
    (p-1)/(2p-2) = 1/2. Only M >> p makes it small (M = 4p: under 20%), and 1F1B keeps the memory
    of p micro-batches however large M grows.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn


# ----------------------------------------------------------------------------------------- partition
def partition(num_layers: int, num_stages: int, layers: Sequence[int] | None = None) -> list[range]:
    """Consecutive layer ranges, one per stage. Uniform by default, the remainder going to the
    earliest stages (the last one also carries norm, lm_head and the vocab-sized loss); or
    user-given counts such as [3, 3, 2]."""
    if num_stages < 1:
        raise ValueError(f"pipeline needs at least 1 stage, got pp={num_stages}")
    if layers is None:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot fill pp={num_stages} stages (need layers >= pp)")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (s < extra) for s in range(num_stages)]
    else:
        counts = list(layers)
        if len(counts) != num_stages:
            raise ValueError(f"--pp-layers {counts} has {len(counts)} entries for pp={num_stages} stages")
        if min(counts) < 1:
            raise ValueError(f"--pp-layers {counts}: stage {counts.index(min(counts))} would have "
                             f"{min(counts)} layers (every stage needs at least 1)")
        if sum(counts) != num_layers:
            raise ValueError(f"--pp-layers {counts} sums to {sum(counts)}, the model has {num_layers} layers")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


def split_stage(model: nn.Module, stage: int, num_stages: int, layer_ranges: Sequence[range]) -> nn.Module:
    """Keep only what `stage` owns, in place, on a META-built model (before apply_tp/materialize)."""
    layers = model.model.layers  # nn.ModuleDict keyed by global layer index
    if len(layer_ranges) != num_stages or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages} with {len(layer_ranges)} layer ranges")
    if [str(i) for r in layer_ranges for i in r] != list(layers.keys()):
        raise ValueError(f"layer ranges {list(layer_ranges)} do not cover the model's layers "
                         f"{list(layers.keys())} in order")
    own = {str(i) for i in layer_ranges[stage]}
    for key in [k for k in layers.keys() if k not in own]:
        del layers[key]
    first, last = stage == 0, stage == num_stages - 1
    if last and not first and model.config.tie_word_embeddings:
        # lm_head.weight IS the embedding Parameter; the last stage gets its own copy, which
        # materialize fills from `model.embed_tokens.weight` (init or checkpoint).
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = None
        model.lm_head = None
    return model


def tied_copy(model: nn.Module) -> nn.Parameter | None:
    """This stage's copy of an embedding tied across the first and last stage (the embedding on the
    first stage, `lm_head.weight` on the last); None when untied, pp == 1 or a middle stage."""
    emb, head = model.model.embed_tokens, model.lm_head
    if not model.config.tie_word_embeddings or (emb is None) == (head is None):
        return None
    return emb.weight if emb is not None else head.weight


def norm_counted(model: nn.Module) -> Callable[[str], bool]:
    """`counted` for MixedPrecisionOptimizer: the last stage's tied copy (`lm_head.weight`) holds the
    same gradient as the first stage's embedding after sync_tied_grads; count it once, there."""
    skip = "lm_head.weight" if tied_copy(model) is not None and model.lm_head is not None else None
    return lambda name: name != skip


def tied_embedding_ranks(world_size: int, num_stages: int) -> list[list[int]]:
    """Global ranks of each embedding group for the grid tp innermost, then dp, then pp: the first and
    last stage rank at the same (dp, tp) coordinates. Every rank must call dist.new_group for every
    returned list, in this order:  for r in tied_embedding_ranks(W, pp): g = dist.new_group(r) ..."""
    if num_stages == 1:
        return []
    stride = world_size // num_stages  # ranks per stage (tp * dp)
    return [[i, (num_stages - 1) * stride + i] for i in range(stride)]


def sync_tied_grads(model: nn.Module, embed_group: dist.ProcessGroup | None) -> None:
    """Sum the two tied copies' gradients (first and last stage) so both take the same step; a no-op
    on other stages. Summing is linear, so it may run before or after a dp all-reduce, but it needs
    the FULL .grad: call it after run_pipeline (and plain dp's finish()), before the step. ZeRO 1-3
    keep only a shard of it: there, `zero.apply_zero(..., tied=tied_copy(model), embed_group=...)`
    sums the owned pieces inside its step instead (and does so for plain dp too)."""
    w = tied_copy(model)
    if w is None:
        return
    if embed_group is None:
        raise ValueError("tied embeddings with pp > 1 need the embedding group (tied_embedding_ranks)")
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    dist.all_reduce(w.grad, group=embed_group)


# ----------------------------------------------------------------------------------------- schedules
F, B = "F", "B"                    # forward / backward of one micro-batch on this stage
SEND_F, RECV_F = "SEND_F", "RECV_F"  # activations: to the next stage / from the previous one
SEND_B, RECV_B = "SEND_B", "RECV_B"  # gradients: to the previous stage / from the next one
# Posted together in one batch: two neighbours that each first sent and then received would both
# wait in their send (NCCL's rendezvous) — a deadlock in 1F1B's steady phase.
SEND_F_RECV_B, SEND_B_RECV_F = "SEND_F_RECV_B", "SEND_B_RECV_F"


@dataclass(frozen=True)
class Action:
    kind: str
    microbatch: int  # the micro-batch computed, sent or received
    recv_microbatch: int | None = None  # combined actions: the micro-batch received

    def __str__(self) -> str:
        extra = "" if self.recv_microbatch is None else f",{self.recv_microbatch}"
        return f"{self.kind}({self.microbatch}{extra})"


def _forward(mb: int, first: bool, last: bool) -> list[Action]:
    return [Action(RECV_F, mb)] * (not first) + [Action(F, mb)] + [Action(SEND_F, mb)] * (not last)


def _backward(mb: int, first: bool, last: bool) -> list[Action]:
    return [Action(RECV_B, mb)] * (not last) + [Action(B, mb)] + [Action(SEND_B, mb)] * (not first)


def gpipe(num_microbatches: int, stage: int, num_stages: int) -> list[Action]:
    """All forwards, then all backwards (in the same order, so gradients accumulate exactly as in
    1F1B). Every micro-batch's activations are alive at the turn: M in flight."""
    first, last = stage == 0, stage == num_stages - 1
    fwd = [a for mb in range(num_microbatches) for a in _forward(mb, first, last)]
    return fwd + [a for mb in range(num_microbatches) for a in _backward(mb, first, last)]


def one_f_one_b(num_microbatches: int, stage: int, num_stages: int) -> list[Action]:
    """1F1B: warm-up forwards fill the pipe, the steady phase alternates forward(k + warmup) and
    backward(k), the cool-down drains the remaining backwards. At most min(M, p - stage) in flight."""
    m, first, last = num_microbatches, stage == 0, stage == num_stages - 1
    warmup = min(num_stages - 1 - stage, m)
    steady = m - warmup
    acts = [a for mb in range(warmup) for a in _forward(mb, first, last)]  # warm-up
    for k in range(steady):  # steady: the sends and receives of neighbours are posted pairwise
        f = warmup + k
        if k == 0 and not first:
            acts.append(Action(RECV_F, f))  # later inputs arrive with the previous SEND_B_RECV_F
        acts.append(Action(F, f))
        if not last:
            acts.append(Action(SEND_F_RECV_B, f, k))
        acts.append(Action(B, k))
        if not first:
            acts.append(Action(SEND_B, k) if k == steady - 1 else Action(SEND_B_RECV_F, k, f + 1))
    acts += [a for mb in range(steady, m) for a in _backward(mb, first, last)]  # cool-down
    return acts


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def p2p_ops(a: Action, stage: int) -> list[tuple[bool, int, str, int]]:
    """A communication action as its pieces (is_send, peer stage, payload "F"|"B", micro-batch)."""
    mb, rmb, nxt, prv = a.microbatch, a.recv_microbatch, stage + 1, stage - 1
    return {SEND_F: [(True, nxt, F, mb)], RECV_F: [(False, prv, F, mb)],
            SEND_B: [(True, prv, B, mb)], RECV_B: [(False, nxt, B, mb)],
            SEND_F_RECV_B: [(True, nxt, F, mb), (False, nxt, B, rmb)],
            SEND_B_RECV_F: [(True, prv, B, mb), (False, prv, F, rmb)]}[a.kind]


# ----------------------------------------------------------------------------------------- simulator
@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # per stage: time spent in F and B
    idle: list[float]  # per stage: makespan - busy
    peak_in_flight: list[int]  # per stage: most micro-batches forwarded but not yet backwarded
    bubble: Fraction  # idle share of p * makespan (exact for integer costs)
    timeline: list[list[tuple[float, float, Action]]]  # per stage: (start, end, F/B action)


def simulate(schedules: Sequence[Sequence[Action]], f_cost: float = 1, b_cost: float = 2,
             comm_cost: float = 0) -> SimResult:
    """Run every stage's actions together. Compute takes f_cost/b_cost; a communication action is
    posted whole (like one batch_isend_irecv) and each piece completes when the peer has posted the
    matching piece (a rendezvous, the strictest send semantics), comm_cost later. Raises ValueError
    on a dependency violation (F without its input, B before F, twice the same F...) and
    RuntimeError naming every stage's stuck action on deadlock."""
    p = len(schedules)
    pc, clock = [0] * p, [0] * p
    matched: list[dict] = [{} for _ in range(p)]  # pieces of the current action matched -> time
    got = [set() for _ in range(p)]  # (payload, mb) received
    done = [set() for _ in range(p)]  # (F|B, mb) computed
    in_flight, peak = [0] * p, [0] * p
    timeline: list[list] = [[] for _ in range(p)]

    def need(ok: bool, s: int, a: Action, why: str) -> None:
        if not ok:
            raise ValueError(f"stage {s} action #{pc[s]} {a}: {why}")

    def current_ops(s: int) -> list:
        a = schedules[s][pc[s]] if pc[s] < len(schedules[s]) else None
        return [] if a is None or a.kind in (F, B) else p2p_ops(a, s)

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(schedules[s]):
                a = schedules[s][pc[s]]
                mb = a.microbatch
                if a.kind in (F, B):
                    need((a.kind, mb) not in done[s], s, a, "computed twice")
                    if a.kind == F:
                        need(s == 0 or (F, mb) in got[s], s, a, "input activation not received")
                    else:
                        need((F, mb) in done[s], s, a, "backward before forward")
                        need(s == p - 1 or (B, mb) in got[s], s, a, "output gradient not received")
                    cost = f_cost if a.kind == F else b_cost
                    timeline[s].append((clock[s], clock[s] + cost, a))
                    clock[s] += cost
                    done[s].add((a.kind, mb))
                    in_flight[s] += 1 if a.kind == F else -1
                    peak[s] = max(peak[s], in_flight[s])
                else:
                    ops = p2p_ops(a, s)
                    for piece in ops:
                        is_send, peer, what, j = piece
                        need(0 <= peer < p, s, a, f"no stage {peer} to talk to")
                        need(not is_send or (what, j) in done[s], s, a, f"sends {what}{j} before it exists")
                        mate = (not is_send, s, what, j)  # the same piece seen from the peer
                        free = piece not in matched[s] and mate not in matched[peer]
                        if free and mate in current_ops(peer):
                            t = max(clock[s], clock[peer]) + comm_cost
                            matched[s][piece] = matched[peer][mate] = t
                    if len(matched[s]) < len(ops):
                        break  # blocked: wait for the peers
                    clock[s] = max(matched[s].values())
                    got[s] |= {(what, j) for is_send, _, what, j in ops if not is_send}
                    matched[s] = {}
                pc[s] += 1
                progress = True
    if any(pc[s] < len(schedules[s]) for s in range(p)):
        stuck = "; ".join(f"stage {s} waits at #{pc[s]} {schedules[s][pc[s]]}"
                          for s in range(p) if pc[s] < len(schedules[s]))
        raise RuntimeError(f"deadlock: {stuck}")
    m = 1 + max((a.microbatch for sch in schedules for a in sch), default=-1)
    want = {(k, i) for k in (F, B) for i in range(m)}
    for s in range(p):
        if done[s] != want:
            raise ValueError(f"stage {s}: missing {sorted(want - done[s])} (each micro-batch needs F and B)")
    makespan = max(clock, default=0)
    busy = [sum(end - start for start, end, _ in timeline[s]) for s in range(p)]
    idle = [makespan - b for b in busy]
    bubble = Fraction(sum(idle)) / Fraction(p * makespan) if makespan else Fraction(0)
    return SimResult(makespan, busy, idle, peak, bubble, timeline)


# ----------------------------------------------------------------------------------------- executor
def _check_step(microbatches: Sequence[dict], actions: Sequence[Action], step_targets: int,
                group: dist.ProcessGroup | None, stage: int, n: int, device: torch.device,
                seq_shards: int) -> None:
    """Local checks, then one tiny all_gather so that every pp peer raises the same error rather
    than some of them waiting forever for a message of another shape."""
    m = len(microbatches)
    shape = tuple(microbatches[0]["input_ids"].shape) if m else ()
    shapes = [tuple(mb[k].shape) for mb in microbatches for k in ("input_ids", "labels", "position_ids")
              if mb.get(k) is not None]
    problem = ""
    if m == 0:
        problem = "no micro-batches"
    elif len(shape) != 2:
        problem = f"input_ids must be (B, S) token ids, got shape {shape}"
    elif any(s != shape for s in shapes):
        problem = f"every micro-batch tensor must have the shape {shape} of the first, got {shapes}"
    elif shape[1] % seq_shards:
        problem = f"sequence length {shape[1]} does not split into {seq_shards} sequence shards"
    for a in actions:
        pieces = [] if a.kind in (F, B) else p2p_ops(a, stage)
        ids = [a.microbatch] + [q[3] for q in pieces]
        if not problem and (any(not 0 <= i < m for i in ids) or any(not 0 <= q[1] < n for q in pieces)):
            problem = f"action {a} does not fit {m} micro-batches on stage {stage} of {n}"
    bs = shape if len(shape) == 2 else (0, 0)
    header = torch.tensor([m, *bs, step_targets, int(not problem)], dtype=torch.int64, device=device)
    if n > 1:
        rows = torch.empty(n * 5, dtype=torch.int64, device=device)
        dist.all_gather_single(rows, header, group=group)  # rows: flat (n * 5,)
        rows = rows.view(n, 5).tolist()  # per stage: [M, B, S, step targets, ok]
    else:
        rows = [header.tolist()]
    if problem:
        raise ValueError(f"pipeline stage {stage}: {problem}")
    if any(r != rows[0] for r in rows) or not all(r[4] for r in rows):
        raise ValueError("pipeline peers disagree on the step (per stage: [micro-batches, B, S, targets, "
                         f"ok]): {rows}; all pp peers must be given the same micro-batches")


def run_pipeline(model: nn.Module, actions: Sequence[Action], microbatches: Sequence[dict],
                 pp_group: dist.ProcessGroup | None, step_targets: int | torch.Tensor,
                 no_sync: Callable[[], ContextManager] | None = None,
                 seq_shards: int = 1) -> torch.Tensor:
    """Run this stage's `actions` over `microbatches` (dicts of (B, S) tensors: input_ids, labels,
    optional position_ids; identical on every pp peer), accumulating gradients in .grad. Every
    other key (e.g. `docs`, the document boundaries) is passed to the model as a keyword argument.

    step_targets: target tokens of the whole optimizer step (all micro-batches, all dp ranks).
    no_sync: the dp/ZeRO object's context that defers its gradient reduction (hook-based dp such as
    dp.GradSync reduces during backward); every backward but this stage's last runs inside it.
    seq_shards: tp under sequence parallelism (tp.py): stages exchange (B, S/seq_shards, H) shards.
    Returns this dp rank's share of the step loss (sum of token losses / step_targets), broadcast
    from the last stage to every pp peer; sum it over dp for the global loss.
    pp_group None (or of size 1) runs the whole model locally without communication."""
    stage = dist.get_rank(pp_group) if pp_group is not None else 0
    n = dist.get_world_size(pp_group) if pp_group is not None else 1
    first, last = stage == 0, stage == n - 1
    param = next(model.parameters())
    targets = int(step_targets)
    _check_step(microbatches, actions, targets, pp_group, stage, n, param.device, seq_shards)
    rows, seq = microbatches[0]["input_ids"].shape  # (not B, S: B names the backward action here)
    act_shape = (rows, seq // seq_shards, model.config.hidden_size)  # (B, S/seq_shards, H)

    inputs: dict[int, torch.Tensor] = {}   # received activations: leaves that collect the input grad
    outputs: dict[int, torch.Tensor] = {}  # this stage's outputs (hidden states, or the loss) until B
    grads: dict[int, torch.Tensor] = {}    # received gradients of this stage's outputs
    loss = torch.zeros((), dtype=torch.float32, device=param.device)
    last_backward = max((k for k, a in enumerate(actions) if a.kind == B), default=-1)
    for k, a in enumerate(actions):
        i = a.microbatch
        if a.kind == F:
            mb = microbatches[i]
            x = mb["input_ids"] if first else inputs[i]
            extra = {k: v for k, v in mb.items() if k not in ("input_ids", "labels")}  # position_ids, docs
            if last:
                out = model(x, labels=mb["labels"], reduction="sum", **extra) / max(targets, 1)
                loss += out.detach()
            else:
                out = model(x, **extra)  # (B, S, H)
            outputs[i] = out
        elif a.kind == B:
            defer = no_sync is not None and k != last_backward
            with no_sync() if defer else contextlib.nullcontext():
                torch.autograd.backward(outputs.pop(i), grad_tensors=None if last else grads.pop(i))
        else:
            ops, received = [], []
            for is_send, peer, what, j in p2p_ops(a, stage):
                if is_send:  # F: our output activation; B: the gradient of our received input
                    t = (outputs[j].detach() if what == F else inputs.pop(j).grad).contiguous()
                else:
                    t = torch.empty(act_shape, dtype=param.dtype, device=param.device)  # (B, S, H)
                    received.append((what, j, t))
                ops.append(dist.P2POp(dist.isend if is_send else dist.irecv, t, group=pp_group,
                                      group_peer=peer))
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            for what, j, t in received:
                if what == F:
                    inputs[j] = t.requires_grad_()
                else:
                    grads[j] = t
    if n > 1:
        dist.broadcast(loss, group=pp_group, group_src=n - 1)
    return loss
