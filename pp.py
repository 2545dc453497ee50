"""Pipeline parallelism: cut the model into stages, run a schedule of micro-batches through them.

What it does
    `run_pipeline` executes this rank's action list from pp_schedules.py on its stage.
    `partition` cuts the layers into p·v consecutive ranges (virtual stages).
    `split_stage` keeps what rank s owns and deletes the rest, before materialize.
    `stage_chunks` gives its v chunks (virtual stages s, s+p, ...) as modules.

The core idea
    Each rank holds consecutive layers. A micro-batch's activation travels forward, rank to rank.
    Its gradient travels back. The schedule fixes the order; the executor only follows it.
    F runs a chunk and keeps its output. B backpropagates the gradient that came back.
    A Comm posts sends and receives to one neighbour. Gradients accumulate in .grad.

The stage contract: a stage is any nn.Module, called as stage(x, labels=None, reduction="sum", **kw)
    x        stage 0: token ids (B, S). Any other stage: the previous one's hidden states (B, S, H).
    kw       the micro-batch's other keys (position_ids, ...), the same on every stage.
    returns  hidden states (B, S, H). The last stage gets labels and returns its SUM of token losses.
    H        run_pipeline's `hidden_size`. A receiving stage must know a message's shape beforehand.
    side_tensors  an optional attribute, {keyword: (shape, dtype)}: tensors sent beside the hidden
             states. The stage then returns (h, *values), and the next one takes them as keywords.
    Nothing else is read from a stage. attotron's Llama is its own stage.
    `split_stage` makes a `Stage` of transformers' decoders and of models described by `Parts`.

Run
    python pp.py --show zb --pp 4 --micro-batches 8        # draw a schedule (pp_schedules.show)
    torchrun --nproc_per_node 4 train.py --pp 4 --schedule interleaved --virtual-stages 2

Reference
    GPipe: Huang et al. 2019. 1F1B: PipeDream-Flush, Narayanan et al. 2021.
    Interleaved 1F1B, the tied-embedding group: Narayanan et al. 2021 (Megatron-LM).
    The B/W split (zb): Qi et al. 2023, "Zero Bubble Pipeline Parallelism".

Invariants
    - Loss and gradients equal the single process, every schedule (tests/test_pp.py::test_pp2).
    - The schedules differ in order only: the same gradient bits (the same test).
    - B + W cost one backward (tests/test_pp.py::test_bw_split_costs_one_backward).
    - Checkpoints ignore pp and v (tests/test_pp_cli.py::test_interleaved_checkpoint_is_layout_free).
    - A bare nn.Module stage runs every schedule from a folder of pp.py and pp_schedules.py alone
      (tests/test_pp_contract.py). A Stage equals transformers' model (tests/test_foreign_tp_pp.py).
    - Peers given different micro-batches all raise; none hangs (tests/test_pp.py::test_pp2).

Builds on: pp_schedules.py (actions, schedules, simulator). More: docs/pp.md, docs/pipeline-nccl.md.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from pp_schedules import (B, F, SCHEDULES, W, Action, Comm, Msg, Step, bubble_formula,  # noqa: F401
                          connections_problem, forward_only, gpipe, interleaved, one_f_one_b, simulate,
                          zero_bubble)


# ----------------------------------------------------------------------------------------- the executor
Group = dist.ProcessGroup | None  # None: the default group, as in torch.distributed


def run_pipeline(model: nn.Module | Sequence[nn.Module], actions: Sequence[Step], microbatches: Sequence[dict],
                 pp_group: Group, step_targets: int | torch.Tensor, *, hidden_size: int | None = None,
                 no_sync: Callable[[], ContextManager] | None = None, seq_shards: int = 1,
                 timer: Callable[[Action], ContextManager] | None = None, check_group: Group = None,
                 peer_groups: Mapping[int, dist.ProcessGroup] | None = None) -> torch.Tensor:
    """Run this rank's `actions` over `microbatches`, accumulating gradients in .grad.
    Returns this dp rank's share of the step loss (token losses / step_targets) on every pp peer.

    model: the stage (the contract above), or its chunks (stage_chunks) under virtual stages.
    microbatches: dicts of (B, S) input_ids, labels and the stage's keywords; the same on every peer.
    step_targets: the step's target tokens over all dp ranks. A tensor stays on its device.
    hidden_size: H of the (B, S, H) activations, needed with more than one stage.
    no_sync: dp/ZeRO's context that defers their reduction (_deferred).
    seq_shards: tp's sequence parallelism. Stages then exchange (B, S/seq_shards, H) shards.
    timer: a context manager around each computation (bench_theory.py).
    check_group, peer_groups: see _check_inputs."""
    chunks = [model] if isinstance(model, nn.Module) else list(model)
    _check_inputs(chunks, actions, microbatches, pp_group, hidden_size, seq_shards, check_group, peer_groups)
    split = any(isinstance(a, Action) and a.kind == W for a in actions)
    run = (_ZeroBubbleRun if split else _Run)(chunks, actions, microbatches, pp_group, step_targets, hidden_size,
                                             seq_shards, no_sync, timer, peer_groups)
    for k, a in enumerate(actions):
        if isinstance(a, Comm):
            run.post(a)  # one batch of sends and receives with one peer
        elif a.kind == F:
            run.forward(a)
        elif a.kind == B:
            run.backward(a, k)
        else:
            run.weight_grad(a, k)  # zb only
    return run.finish()


class _Run:
    """One rank's state during run_pipeline (its arguments): what one action makes, for a later one.
    Keys are (micro-batch, chunk). A message is a tuple: the activation, then any side tensors."""
    grad_kind = B  # the action that accumulates into .grad

    def __init__(self, chunks, actions, microbatches, pp_group, step_targets, hidden_size, seq_shards, no_sync,
                 timer, peer_groups):
        self.chunks, self.microbatches, self.pp_group = chunks, microbatches, pp_group
        self.stage, self.n = _stage_of(pp_group)
        self.route = _routes(pp_group, peer_groups, self.n)  # peer stage → (its group, its rank there)
        self.timed = timer or (lambda a: contextlib.nullcontext())
        param = next(chunks[0].parameters())
        self.device = param.device
        self.denominator = step_targets.clamp(min=1) if torch.is_tensor(step_targets) else max(int(step_targets), 1)
        rows, seq = microbatches[0]["input_ids"].shape
        self.side = side_tensors(chunks[0])  # {keyword: (shape, dtype)}
        self.shapes = [((rows, seq // seq_shards, hidden_size), param.dtype), *self.side.values()]  # a message
        self.deferred = _deferred(no_sync, actions, self.grad_kind)  # k → dp/ZeRO's no_sync, or not (below)
        self.inputs: dict[tuple, tuple] = {}    # received input leaves, until B
        self.outputs: dict[tuple, tuple] = {}   # the chunk's outputs, until B
        self.in_grads: dict[tuple, list] = {}   # the gradients of the inputs, to send back
        self.recvs: dict[tuple, list] = {}      # (payload, mb, chunk) → [(work to wait for, tensor)]
        self.sends: list = []                   # works of posted sends (each keeps its tensor alive)
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)

    def first(self, chunk: int) -> bool:
        return chunk * self.n + self.stage == 0  # virtual stage 0: token ids in

    def last(self, chunk: int) -> bool:
        return chunk * self.n + self.stage == self.n * len(self.chunks) - 1  # the last one: the loss out

    def post(self, a: Comm) -> None:
        """Post one batch_isend_irecv. A send is never waited on here: its work keeps the tensor alive."""
        self.sends = [w for w in self.sends if not w.is_completed()]  # drop finished sends
        group, peer = self.route[a.peer]
        ops, msgs = [], []
        for msg in a.msgs:
            key = (msg.microbatch, msg.chunk)
            if not msg.send:
                ts = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.shapes]
            else:  # F: our outputs; B: the gradients of our inputs
                ts = [t.detach().contiguous() for t in (self.outputs[key] if msg.payload == F
                                                        else self.in_grads.pop(key))]
            ops += [dist.P2POp(dist.isend if msg.send else dist.irecv, t, group=group, group_peer=peer) for t in ts]
            msgs += [msg] * len(ts)
        works = dist.batch_isend_irecv(ops)
        for msg, op, w in zip(msgs, ops, works if len(works) == len(ops) else works * len(ops)):  # NCCL: 1 work
            if msg.send:
                self.sends.append(w)
            else:
                self.recvs.setdefault((msg.payload, msg.microbatch, msg.chunk), []).append((w, op.tensor))

    def received(self, payload: str, key: tuple) -> list[torch.Tensor]:
        """A receive is waited on right before the computation that reads it."""
        works_and_tensors = self.recvs.pop((payload, *key))
        for w, _ in works_and_tensors:
            w.wait()
        return [t for _, t in works_and_tensors]

    def forward(self, a: Action) -> None:
        """F: run the chunk; the last virtual stage adds its loss share to the step's loss."""
        key, mb = (a.microbatch, a.chunk), self.microbatches[a.microbatch]
        kwargs = {name: t for name, t in mb.items() if name not in ("input_ids", "labels")}
        if self.first(a.chunk):
            x = mb["input_ids"]  # (B, S) token ids
        else:
            x, *side = self.inputs[key] = tuple(t.requires_grad_() for t in self.received(F, key))
            kwargs.update(zip(self.side, side))  # the side tensors, by keyword
        with self.timed(a):
            if self.last(a.chunk):
                out = self.chunks[a.chunk](x, labels=mb["labels"], reduction="sum", **kwargs) / self.denominator
                self.loss += out.detach()
            else:
                out = self.chunks[a.chunk](x, **kwargs)  # (B, S, H), or (B, S, H) and the side tensors
        self.outputs[key] = out if isinstance(out, tuple) else (out,)

    def backward(self, a: Action, k: int) -> None:
        """B: backpropagate the received gradients; keep the inputs' gradients to send back."""
        key = (a.microbatch, a.chunk)
        grad = None if self.last(a.chunk) else self.received(B, key)
        with self.deferred(k), self.timed(a):
            dx = self.input_grad(key, grad)
        if not self.first(a.chunk):
            self.in_grads[key] = dx

    def input_grad(self, key: tuple, grad: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """The whole backward: the inputs' and the parameters' gradients."""
        outs, grads = _with_grad(self.outputs.pop(key), grad)
        torch.autograd.backward(outs, grad_tensors=grads)
        return None if self.first(key[1]) else _grads_of(self.inputs.pop(key))

    def finish(self) -> torch.Tensor:
        """Wait for the sends still in flight; broadcast the loss from the last stage."""
        for w in self.sends:
            w.wait()
        if self.n > 1:
            dist.broadcast(self.loss, group=self.pp_group, group_src=self.n - 1)
        return self.loss


def _grads_of(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs' gradients to send back; zeros where an input reached nothing differentiable."""
    return [torch.zeros_like(t) if t.grad is None else t.grad for t in inputs]


def _stage_of(group: Group) -> tuple[int, int]:
    """(this rank's stage, the number of stages) in the pp group; (0, 1) without torch.distributed."""
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


# --- refinement: side tensors. What a stage sends on besides its hidden states, declared up front.
# A receive needs each tensor's shape and dtype before it arrives: so the stage declares them.
# A loss of every stage's layers (moe.py's load-balancing loss) carries its statistics this way.
# Their gradients come back with the activation's, so autograd does the rest.
def side_tensors(stage: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The stage's declared side tensors, {keyword: (shape, dtype)}; none by default."""
    return getattr(stage, "side_tensors", {})


def _with_grad(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None) -> tuple[list, list | None]:
    """The outputs that carry a gradient, with theirs (none on the last stage: the loss is the root).
    A side tensor may be a constant: it gets no gradient."""
    keep = [j for j, t in enumerate(outs) if t.requires_grad]
    return [outs[j] for j in keep], None if grads is None else [grads[j] for j in keep]


# --- refinement: dp/ZeRO's deferred reduction. Their hooks reduce a parameter after its last gradient.
def _deferred(no_sync: Callable[[], ContextManager] | None, actions: Sequence[Step],
              kind: str) -> Callable[[int], ContextManager]:
    """Action k → no_sync, but for each chunk's last action of `kind`: the one that accumulates into .grad."""
    computes = [(k, a) for k, a in enumerate(actions) if isinstance(a, Action)]
    last = {max((k for k, a in computes if a.kind == kind and a.chunk == c), default=-1)
            for c in {a.chunk for _, a in computes}}
    return lambda k: no_sync() if no_sync is not None and k not in last else contextlib.nullcontext()


# --- refinement: one group per neighbour pair. NCCL runs one group's P2P on one stream per rank.
# A rank's send to one neighbour then waits behind its send to the other. Rings of virtual stages
# deadlock (docs/pipeline-nccl.md). A 2-rank group per pair gives each pair its own stream.
def _routes(pp_group: Group, peer_groups: Mapping[int, dist.ProcessGroup] | None, n: int) -> dict[int, tuple]:
    """{peer stage: (the group a message goes on, the peer's rank in it)}."""
    if peer_groups is None:
        return {s: (pp_group, s) for s in range(n)}
    return {s: (g, 1 - dist.get_rank(g)) for s, g in peer_groups.items()}  # in a pair: the other one


def serialized_p2p(device: torch.device) -> bool:
    """Whether one process group's P2P on `device` runs on one stream per rank, in posting order.
    NCCL (CUDA) does (docs/pipeline-nccl.md); gloo (CPU) does not."""
    return device.type == "cuda"


def neighbour_pairs(pipelines: Sequence[Sequence[int]]) -> list[list[int]]:
    """Global ranks of the 2-rank group of each neighbour pair: stages (s, s+1).
    With 3 or more stages also (p-1, 0): virtual stages go round the ranks.
    pipelines: each pipeline's global ranks, by stage.
    Every rank must call dist.new_group for every returned list, in this order.
    It passes its own to run_pipeline as peer_groups, {the other one's stage: group}.
    grid.make_grid does both."""
    return [sorted([ranks[s], ranks[(s + 1) % len(ranks)]]) for ranks in pipelines
            for s in range(len(ranks) if len(ranks) > 2 else len(ranks) - 1)]


def peer_groups(pipelines: Sequence[Sequence[int]]) -> dict[int, dist.ProcessGroup]:
    """run_pipeline's peer_groups for this rank: {the other stage: the pair's group}.
    Every rank calls it with the same pipelines (each pipeline's global ranks, by stage)."""
    me, out = dist.get_rank(), {}
    stage = {r: s for ranks in pipelines for s, r in enumerate(ranks)}
    for pair in neighbour_pairs(pipelines):
        group = dist.new_group(pair)  # every rank, every pair, the same order
        if me in pair:
            out.update({stage[r]: group for r in pair if r != me})
    return out


# --- refinement: the B/W split (zero bubble). B computes only the input's gradient; W the rest, later.
# B = torch.autograd.backward(out, grad, inputs=[x]): autograd runs only the nodes between out and x.
# Each node computes only the outputs towards x: a linear's backward makes dX = dY·W, not dW.
# A node pre-hook keeps the gradient dY flowing into each parameter's branch.
# W reruns those nodes from dY, for the parameters only. B + W cost one backward (docs/pp.md).
# Virtual stage 0 takes token ids: no input gradient. There W runs the whole backward.
class _ZeroBubbleRun(_Run):
    """run_pipeline's state for a schedule with W actions (zb)."""
    grad_kind = W

    def __init__(self, chunks: list[nn.Module], *args: Any):
        super().__init__(chunks, *args)
        self.params = [[p for p in ch.parameters() if p.requires_grad] for ch in chunks]
        self.pending: dict[tuple, Callable[[], None]] = {}  # (micro-batch, chunk) → its W

    def input_grad(self, key: tuple, grad: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        outs, grads = _with_grad(self.outputs.pop(key), grad)
        if self.first(key[1]):  # token ids in: no input gradient, so W runs the whole backward
            self.pending[key] = functools.partial(torch.autograd.backward, outs, grads)
            return None
        dx, work = backward_input(outs, grads, self.inputs.pop(key), self.params[key[1]])
        self.pending[key] = functools.partial(backward_weight, work)
        return dx

    def weight_grad(self, a: Action, k: int) -> None:
        """W: the parameters' gradients, from what B kept."""
        with self.deferred(k), self.timed(a):
            self.pending.pop((a.microbatch, a.chunk))()


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node of the backward graph under `roots` → the nodes whose next_functions hold it."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    todo, seen = list(roots), set(roots)
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is not None:
                parents[child].append(node)
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
    return parents


def _up(starts: list[Node], parents: dict, stop: set[Node] = frozenset()) -> tuple[set[Node], dict]:
    """Nodes reached from `starts` towards the root, not entering `stop`; and the `stop` nodes met.
    Those are a dict, an ordered set: every rank lists them in the same order."""
    seen, met, todo = set(starts), {}, list(starts)
    while todo:
        for par in parents.get(todo.pop(), []):
            if par in stop:
                met[par] = None
            elif par not in seen:
                seen.add(par)
                todo.append(par)
    return seen, met


def backward_input(out: torch.Tensor | Sequence[torch.Tensor], grad: torch.Tensor | Sequence[torch.Tensor] | None,
                   inp: torch.Tensor | Sequence[torch.Tensor],
                   params: Sequence[nn.Parameter]) -> tuple[torch.Tensor | list[torch.Tensor], list]:
    """B: the gradient of `inp` (a leaf, or several) only. Returns it (them), and W's groups for
    backward_weight. A group is (params, [(node, the gradients flowing into it)]): the banner above
    says why. out, grad: a tensor, or several (a stage's activation and its side tensors)."""
    one = isinstance(inp, torch.Tensor)
    outs, inps = ([out], [inp]) if one else (list(out), list(inp))
    grads = grad if grad is None or not isinstance(grad, torch.Tensor) else [grad]
    parents = _parents([o.grad_fn for o in outs])
    path, _ = _up([get_gradient_edge(i).node for i in inps], parents)  # nodes between the outputs and inputs
    groups: list[tuple[set[int], dict]] = []  # (ids of parameters, nodes where they join the path)
    for p in params:
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # not used by this chunk's graph
        ids, nodes = {id(p)}, _up([node], parents, stop=path)[1]
        for g in [g for g in groups if g[0] & ids or g[1].keys() & nodes]:
            groups.remove(g)
            ids, nodes = ids | g[0], {**g[1], **nodes}
        groups.append((ids, nodes))
    for _, nodes in groups:  # a parameter joining the path at two depths would get dY twice in W
        if len(nodes) > 1 and any(n in _up([m], parents)[0] for n in nodes for m in nodes if m is not n):
            raise ValueError("a parameter is used at several depths of one chunk: the B/W split "
                             "would count its gradient twice (use a schedule without W)")
    saved: dict[Node, tuple] = {}
    hooks = [n.register_prehook(lambda grads, n=n: saved.__setitem__(n, grads))
             for _, nodes in groups for n in nodes]
    try:
        torch.autograd.backward(outs, grads, inputs=inps, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    dx = inp.grad if one else _grads_of(inps)
    return dx, [([p for p in params if id(p) in ids], [(n, saved[n]) for n in nodes]) for ids, nodes in groups]


def backward_weight(work: list) -> None:
    """W: run each group's nodes again with the saved gradients, for its parameters only.
    They accumulate into .grad: AccumulateGrad and its hooks fire once per parameter.
    The groups run last parameters first, the order of a plain backward.
    dp/ZeRO launch their buckets in that order."""
    for ps, nodes in reversed(work):
        roots = [GradientEdge(n, k) for n, gs in nodes for k, g in enumerate(gs) if g is not None]
        torch.autograd.backward(roots, [g for _, gs in nodes for g in gs if g is not None], inputs=ps)


# --- refinement: input checks. A wrong input raises the same error on every stage, never a hang.
KEYS_CHECKED = ("input_ids", "labels", "position_ids")  # (B, S) tensors; other keys pass through


def _check_inputs(chunks: list[nn.Module], actions: Sequence[Step], microbatches: Sequence[dict], pp_group: Group,
                  hidden_size: int | None, seq_shards: int, check_group: Group,
                  peer_groups: Mapping[int, dist.ProcessGroup] | None) -> None:
    """run_pipeline's checks, before any message.
    check_group: a gloo group of pp_group's ranks (grid.pp_check): the check runs on the host.
    None: over pp_group, on the parameters' device (on CUDA, a device→host read every step).
    peer_groups: {neighbour stage: the pair's 2-rank group} (grid.pp_peers, neighbour_pairs).
    None puts every message on pp_group: refused where NCCL would deadlock."""
    (stage, n), v, param = _stage_of(pp_group), len(chunks), next(chunks[0].parameters())
    peers = {a.peer for a in actions if isinstance(a, Comm)}
    if peer_groups is None and v > 1 and n > 2 and serialized_p2p(param.device):
        raise ValueError(f"{n} stages with {v} virtual stages on one NCCL group deadlock (its P2P runs on one "
                         f"stream per rank): pass peer_groups, a 2-rank group per neighbour pair (grid.pp_peers)")
    problem = "run_pipeline needs hidden_size (H of the (B, S, H) activations)" if n > 1 and hidden_size is None \
        else "" if peer_groups is None or peers <= set(peer_groups) \
        else f"it talks to stages {sorted(peers)}, peer_groups has {sorted(peer_groups)}"
    _check_step(microbatches, actions, pp_group if check_group is None else check_group, stage, n, v,
                param.device if check_group is None else torch.device("cpu"), seq_shards, problem)


def _check_step(microbatches: Sequence[dict], actions: Sequence[Step], group: Group,
                stage: int, n: int, v: int, device: torch.device, seq_shards: int, extra: str = "") -> None:
    """Local checks, then one tiny all_gather: every pp peer raises the same error.
    Otherwise some would wait forever for a message of another shape.
    The header holds host values only. Over a gloo group (device cpu) it never waits for the GPU."""
    m = len(microbatches)
    shape = tuple(microbatches[0]["input_ids"].shape) if m else ()
    shapes = [tuple(mb[k].shape) for mb in microbatches for k in KEYS_CHECKED if mb.get(k) is not None]
    problem = ""
    if m == 0:
        problem = "no micro-batches"
    elif len(shape) != 2:
        problem = f"input_ids must be (B, S) token ids, got shape {shape}"
    elif any(s != shape for s in shapes):
        problem = f"every micro-batch's {'/'.join(KEYS_CHECKED)} must have the shape {shape} of the first, got {shapes}"
    elif shape[1] % seq_shards:
        problem = f"sequence length {shape[1]} does not split into {seq_shards} sequence shards"
    for a in actions:
        pieces = [a] if isinstance(a, Action) else a.msgs
        bad_peer = isinstance(a, Comm) and not (0 <= a.peer < n and a.peer != stage)
        if not problem and (bad_peer or any(not (0 <= x.microbatch < m and 0 <= x.chunk < v) for x in pieces)):
            problem = f"action {a} does not fit {m} micro-batches and {v} chunk(s) on stage {stage} of {n}"
    problem = problem or extra
    bs = shape if len(shape) == 2 else (0, 0)
    header = [m, *bs, int(not problem)]
    rows = [header]
    if n > 1:
        gathered = torch.empty(n * 4, dtype=torch.int64, device=device)
        dist.all_gather_single(gathered, torch.tensor(header, device=device), group=group)  # flat (n * 4,)
        rows = gathered.view(n, 4).tolist()  # per stage: [M, B, S, ok]
    if problem:
        raise ValueError(f"pipeline stage {stage}: {problem}")
    if any(r != rows[0] for r in rows) or not all(r[3] for r in rows):
        raise ValueError("pipeline peers disagree on the step (per stage: [micro-batches, B, S, ok]): "
                         f"{rows}; all pp peers must be given the same micro-batches")



# ----------------------------------------------------------------------------------------- the stages
def head_cost(cfg, seq_len: int) -> float:
    """lm_head + loss in decoder-layer equivalents, from FLOPs per token (forward + backward).
    A layer: its matmuls 6·(its weights), plus attention 12·q·S (PaLM's count).
    The head: 6·h·V, plus the fp32 cross-entropy (~8 FLOPs per logit).
    Norms and the embedding lookup count zero.
    On a GPU the vocab-sized loss is memory-bound, slower than its FLOPs say: --pp-layers overrides."""
    h, i, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = 6 * (2 * h * q + 2 * h * kv + 3 * h * i) + 12 * q * seq_len
    return (6 * h * vocab + 8 * vocab) / layer


def partition(num_layers: int, num_stages: int, layers: Sequence[int] | None = None,
              head: float = 0.0) -> list[range]:
    """Consecutive layer ranges, one per (virtual) stage. Or user-given counts such as [3, 3, 2].
    By default balanced: every stage starts with one layer.
    Each further layer goes to the cheapest stage (the earliest on a tie).
    The last stage also carries `head` layer-equivalents (head_cost).
    head = 0 is uniform, with the remainder on the earliest stages."""
    if num_stages < 1:
        raise ValueError(f"pipeline needs at least 1 stage, got {num_stages}")
    if layers is None:
        if num_layers < num_stages:
            raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages (every "
                             f"stage needs a layer; virtual stages count: pp × v)")
        counts = [1] * num_stages
        for _ in range(num_layers - num_stages):
            cost = [c + head * (s == num_stages - 1) for s, c in enumerate(counts)]
            counts[cost.index(min(cost))] += 1
    else:
        counts = list(layers)
        if len(counts) != num_stages:
            raise ValueError(f"--pp-layers {counts} has {len(counts)} entries for {num_stages} (virtual) stages")
        if min(counts) < 1:
            raise ValueError(f"--pp-layers {counts}: stage {counts.index(min(counts))} would have "
                             f"{min(counts)} layers (every stage needs at least 1)")
        if sum(counts) != num_layers:
            raise ValueError(f"--pp-layers {counts} sums to {sum(counts)}, the model has {num_layers} layers")
    starts = [sum(counts[:s]) for s in range(num_stages)]
    return [range(a, a + c) for a, c in zip(starts, counts)]


def default_microbatches(schedule: str, pp: int, rows: int) -> int:
    """Micro-batches per step when --micro-batches is not given.
    4·pp for gpipe/1f1b; 2·pp for interleaved/zb (simulated bubble <= 15.8% at pp=2 and 4).
    1 without pipeline. Then the largest divisor of this dp rank's `rows` not above that."""
    want = 1 if pp == 1 else (4 if schedule in ("gpipe", "1f1b") else 2) * pp
    return max(k for k in range(1, min(want, rows) + 1) if rows % k == 0)


@dataclass
class Parts:
    """Where a model keeps its parts, as dotted attribute paths, for split_stage.
    The first stage runs embed, plus positions: a learned table of position ids (GPT's wpe).
    Every stage runs its layers: an nn.ModuleList, each called as layer(h).
    The last stage runs norm and head."""
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    norm: str | None = "model.norm"
    head: str = "lm_head"
    positions: str | None = None


def _get(root: nn.Module, path: str | None, missing: Any = AttributeError) -> Any:
    """The attribute at a dotted path; None where the path (or a part of it) is None.
    A path that does not exist raises, unless `missing` is given: then that is returned."""
    obj = root
    for name in (path.split(".") if path else [None]):
        if obj is not None and name is not None and not hasattr(obj, name):
            if missing is AttributeError:
                raise AttributeError(f"{type(root).__name__} has no {path!r} ({name!r} missing)")
            return missing
        obj = None if obj is None or name is None else getattr(obj, name)
    return obj


def _set(root: nn.Module, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent) if parent else root, name, value)


def split_stage(model: nn.Module, stage: int, num_stages: int, layer_ranges: Sequence[range],
                parts: Parts | None = None, loss_fn: Callable[..., torch.Tensor] | None = None) -> nn.Module:
    """Keep only what rank `stage` owns, in place, and return the stage ("The stage" above).
    attotron's Llama, META-built (before apply_tp/materialize): the model itself.
    It takes p·v layer ranges: virtual stages stage, stage + p, ... (v chunks).
    transformers' decoders (parts None) and models described by `parts`: a `Stage`.
    They may be meta or materialized, with one range per stage (v = 1).
    loss_fn(logits, labels, reduction): the last stage's loss (default `token_loss`)."""
    if parts is None and isinstance(_get(model, "model.layers", None), nn.ModuleDict):
        return _split_llama(model, stage, num_stages, layer_ranges)
    hf = parts is None
    if hf and not (isinstance(_get(model, "model.layers", None), nn.ModuleList) and hasattr(model, "lm_head")):
        raise ValueError(f"split_stage: {type(model).__name__} is neither attotron's Llama nor a transformers "
                         f"decoder (model.model.layers, lm_head); pass parts=pp.Parts(embed=..., layers=..., "
                         f"norm=..., head=..., positions=...) and loss_fn")
    if hf:
        _check_splittable(model, num_stages)
    parts = parts or Parts()
    layers = _get(model, parts.layers)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"split_stage: {parts.layers} must be an nn.ModuleList, got {type(layers).__name__}")
    if not 0 <= stage < num_stages or len(layer_ranges) != num_stages:
        raise ValueError(f"stage {stage} of {num_stages} with {len(layer_ranges)} layer ranges (virtual stages, "
                         f"v > 1, need attotron's Llama)")
    if [i for r in layer_ranges for i in r] != list(range(len(layers))):
        raise ValueError(f"layer ranges {list(layer_ranges)} do not cover the model's {len(layers)} layers in order")
    first, last = stage == 0, stage == num_stages - 1
    embed, head = _get(model, parts.embed), _get(model, parts.head)
    tied = head.weight is embed.weight
    owned = {str(i): layers[i] for i in layer_ranges[stage]}
    _set(model, parts.layers, OwnedLayers(owned))
    if hf and getattr(model.config, "layer_types", None):
        # transformers' forward picks each layer's mask by its index among the layers it runs
        base = _get(model, parts.layers.rpartition(".")[0])
        base.config = copy.copy(base.config)
        base.config.layer_types = [model.config.layer_types[int(i)] for i in owned]
    if last and not first and tied:  # the last stage's own copy of the embedding (tied_copy)
        head.weight = nn.Parameter(head.weight.detach().clone())
    if not first:
        _set(model, parts.embed, None)
        if parts.positions:
            _set(model, parts.positions, None)
    if not last:
        _set(model, parts.head, None)
        if parts.norm:  # transformers' forward calls its norm: make it the identity
            _set(model, parts.norm, nn.Identity() if hf else None)
    return Stage(model, parts, first, last, loss_fn or token_loss, tied, hf)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """A Stage's default loss: fp32 token cross-entropy, -100 ignored.
    The labels are aligned with the logits, already shifted: labels[t] is the token after input[t]."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100,
                                             reduction=reduction)  # (F is the forward action here)


class OwnedLayers(nn.ModuleList):
    """A stage's layers under their global indices: names stay the model's (`model.layers.5.…`).
    It iterates and slices as a ModuleList, so transformers' own forward runs it."""

    def __init__(self, layers: dict[str, nn.Module] | Sequence[nn.Module] = ()):
        super().__init__()
        for i, layer in (layers.items() if isinstance(layers, dict) else enumerate(layers)):
            self.add_module(str(i), layer)


class Stage(nn.Module):
    """One pipeline stage of a model attotron did not write. It runs this stage's share of it.
    It holds the model's own top-level modules: parameter names and objects are the model's.
    Without labels, the last stage returns logits (B, S, V)."""

    def __init__(self, model: nn.Module, parts: Parts, first: bool, last: bool,
                 loss_fn: Callable[..., torch.Tensor], tied: bool, hf: bool):
        super().__init__()
        self._modules.update(model._modules)  # the same modules under the same names
        self.config = getattr(model, "config", None)
        self.parts, self.first, self.last = parts, first, last
        self.loss_fn, self.tied, self.hf = loss_fn, tied, hf

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "sum",
                position_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        p = self.parts
        if self.hf:  # transformers' own forward: masks, rotary embeddings, keyword calls
            base = _get(self, p.layers.rpartition(".")[0])
            inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
            h = base(**inputs, position_ids=position_ids, use_cache=False, **kwargs).last_hidden_state
        else:
            if kwargs:
                raise TypeError(f"Stage.forward: {sorted(kwargs)} are not inputs of a described model")
            h = x
            if self.first:
                h = _get(self, p.embed)(x)  # (B, S, H)
                if p.positions:
                    pos = torch.arange(x.shape[1], device=x.device) if position_ids is None else position_ids
                    h = h + _get(self, p.positions)(pos)  # learned positions, (S, H) or (B, S, H)
            for layer in _get(self, p.layers):
                h = layer(h)  # (B, S, H)
            if self.last and p.norm:
                h = _get(self, p.norm)(h)
        if not self.last:
            return h  # (B, S, H)
        logits = _get(self, p.head)(h)  # (B, S, V)
        return logits if labels is None else self.loss_fn(logits, labels, reduction)


def _split_llama(model: nn.Module, stage: int, num_stages: int, layer_ranges: Sequence[range]) -> nn.Module:
    """split_stage for attotron's Llama."""
    layers = model.model.layers  # nn.ModuleDict keyed by global layer index
    if not 0 <= stage < num_stages or len(layer_ranges) % num_stages:
        raise ValueError(f"stage {stage} of {num_stages} with {len(layer_ranges)} layer ranges")
    if [str(i) for r in layer_ranges for i in r] != list(layers.keys()):
        raise ValueError(f"layer ranges {list(layer_ranges)} do not cover the model's layers "
                         f"{list(layers.keys())} in order")
    own = {str(i) for r in layer_ranges[stage::num_stages] for i in r}
    for key in [k for k in layers.keys() if k not in own]:
        del layers[key]
    first, last = stage == 0, stage == num_stages - 1
    if last and not first and model.config.tie_word_embeddings:
        # lm_head.weight IS the embedding Parameter. The last stage gets its own copy.
        # materialize fills it from `model.embed_tokens.weight` (init or checkpoint).
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = None
        model.lm_head = None
    return model


# --- refinement: virtual stages. Rank s holds chunks s, s+p, ...: the interleaved and zb schedules' v > 1.
def stage_chunks(model: nn.Module, layer_ranges: Sequence[range], stage: int, num_stages: int) -> list[nn.Module]:
    """This rank's chunks for run_pipeline: chunk c is virtual stage c·p + stage. v = 1: [model].
    Else each is a shallow copy of the (split, tp'd, materialized, checkpointed) model.
    Its own module table holds only its layers.
    The embedding is only on virtual stage 0, norm + head only on the last.
    The modules, parameters and hooks are the model's own, and Llama.forward runs it."""
    v = len(layer_ranges) // num_stages
    if v == 1:
        return [model]
    chunks = []
    for c in range(v):
        vs = c * num_stages + stage
        chunk, body = copy.copy(model), copy.copy(model.model)
        chunk._modules, body._modules = dict(model._modules), dict(model.model._modules)
        body.layers = nn.ModuleDict({str(i): model.model.layers[str(i)] for i in layer_ranges[vs]})
        if vs != 0:
            body.embed_tokens = None
        if vs != len(layer_ranges) - 1:
            body.norm, chunk.lm_head = None, None
        chunk.model = body
        chunks.append(chunk)
    return chunks


# --- refinement: an embedding tied to the head. The first and the last stage each hold a copy.
def tied_copy(model: nn.Module) -> nn.Parameter | None:
    """This stage's copy of an embedding tied across the first and last stage.
    That is the embedding on the first stage, `lm_head.weight` on the last.
    None when untied, at pp == 1 or on a middle stage."""
    if isinstance(model, Stage):
        emb, head, tied = _get(model, model.parts.embed), _get(model, model.parts.head), model.tied
    else:
        emb, head, tied = model.model.embed_tokens, model.lm_head, model.config.tie_word_embeddings
    if not tied or (emb is None) == (head is None):
        return None
    return emb.weight if emb is not None else head.weight


def norm_counted(model: nn.Module) -> Callable[[str], bool]:
    """`counted` for MixedPrecisionOptimizer: count the tied embedding's gradient once.
    After sync_tied_grads the last stage's copy (`lm_head.weight`) holds the first stage's gradient."""
    head = model.parts.head if isinstance(model, Stage) else "lm_head"
    skip = f"{head}.weight" if tied_copy(model) is not None and _get(model, head) is not None else None
    return lambda name: name != skip


def tied_embedding_ranks(world_size: int, num_stages: int) -> list[list[int]]:
    """Global ranks of each embedding group, for the grid tp innermost, then dp, then pp.
    A group is the first and the last stage's rank at the same (dp, tp) coordinates.
    Every rank must call dist.new_group for every returned list, in this order:
        for r in tied_embedding_ranks(W, pp): g = dist.new_group(r) ..."""
    if num_stages == 1:
        return []
    stride = world_size // num_stages  # ranks per stage (tp * dp)
    return [[i, (num_stages - 1) * stride + i] for i in range(stride)]


def sync_tied_grads(model: nn.Module, embed_group: dist.ProcessGroup | None) -> None:
    """Sum the two tied copies' gradients (first and last stage), so both take the same step.
    A no-op on other stages. Summing is linear: it may run before or after a dp all-reduce.
    But it needs the FULL .grad: call it after run_pipeline (and plain dp's finish()), before the step.
    ZeRO 1-3 keep only a shard of it. There `zero3.apply_zero(..., tied=tied_copy(model), embed_group=...)`
    sums the owned pieces inside its step instead (for plain dp too).
    embed_group: the 2 ranks holding the copies (tied_embedding_ranks).
    None is the default group, as in torch.distributed."""
    w = tied_copy(model)
    if w is None:
        return
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    dist.all_reduce(w.grad, group=embed_group)


# --- refinement: models a Stage cannot split.
def _check_splittable(model: nn.Module, num_stages: int) -> None:
    """Refuse a transformers model whose loss pools every stage's layers: a Stage returns only its own loss.
    transformers' MoE load-balancing loss (output_router_logits) is one. moe.py gives attotron's own model
    that loss through side tensors."""
    if getattr(model.config, "output_router_logits", False) and num_stages > 1:
        raise ValueError(f"split_stage: {type(model).__name__} has output_router_logits: its load-balancing "
                         f"loss pools every stage's routers, which a Stage cannot; attotron's own MoE "
                         f"model (model.py) can")


if __name__ == "__main__":
    import pp_schedules
    pp_schedules.main()
