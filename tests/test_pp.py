"""pp.py: partition, split and chunks, the B/W split, and the executor of every schedule on gloo
ranks against the single-process model (same seed → same full weights, same global batch). The
schedules themselves are checked through the simulator in test_pp_schedules.py.

Tolerances: fp32 throughout. Pipelined gradients are compared with the single process that runs the
same micro-batches one after the other: the stages run exactly the same ops on the same values and
accumulate .grad in the same order, so they must be BIT-identical (untied models; with tied
embeddings the two copies' sums are added in another order, and with dp the gloo all_reduce adds
ranks in its own order). Against the full-batch single process (one forward of the whole batch,
the independent reference) the summation order differs: <= 1e-5 relative, per tensor, as
max|a - b| / max|b|. After 5 AdamW steps (clipping active) the loss curve is held to 1e-5 against
the full-batch run and loss, grad norm and weights (per tensor ||a - b|| / ||b||) to 1e-5 against
the micro-batch loop; measured errors are ~1e-7 (see curve_errors for why not bit-identical).
Interleaved and zb run the same ops on the same values as the loop (zb's W computes dW from the
same dY and X that one backward would), so they are held to the same bit-identity.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import weakref

import pytest
import torch
import torch.distributed as dist

from dist import run_ranks
from model import LlamaConfig, build
from weights import materialize
from pp import (SCHEDULES, backward_input, backward_weight, gpipe, norm_counted, one_f_one_b, partition,
                run_pipeline, split_stage, stage_chunks, sync_tied_grads, tied_copy, tied_embedding_ranks,
                zero_bubble)
from precision import MixedPrecisionOptimizer, OptimConfig, count_targets, normalized_loss

CFG = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
TIED = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
OPT = OptimConfig(clip=0.05)  # below every grad norm (~1.3): the pp-wide norm must be right
TOL = 1e-5
LR = 3e-3  # stable for this model; at 1e-2 its grad norm grows and AdamW turns rounding into drift


# ----------------------------------------------------------------------------------------- helpers
def batches(m: int, seed: int, B: int = 2, S: int = 8, packed: bool = False) -> list[dict]:
    """m micro-batches, each with its own storage; labels masked at a different rate per micro-batch
    (uneven target counts: a mean of means would be wrong); packed rows restart positions."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        ids = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
        labels = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
        labels[torch.rand(B, S, generator=g) < 0.15 * i] = -100
        mb = {"input_ids": ids, "labels": labels}
        if packed:
            docs = torch.cat([torch.arange(S // 2 + 1), torch.arange(S - S // 2 - 1)])  # two documents
            mb["position_ids"] = docs.repeat(B, 1)  # (B, S)
        out.append(mb)
    return out


def full_model(cfg: LlamaConfig) -> torch.nn.Module:
    return materialize(build(cfg), "cpu", seed=3)


def stage_model(cfg: LlamaConfig, stage: int, n: int, layers=None, v: int = 1) -> torch.nn.Module:
    model = split_stage(build(cfg), stage, n, partition(cfg.num_hidden_layers, n * v, layers))
    return materialize(model, "cpu", seed=3)


def targets(mbs: list[dict]) -> int:
    return int(sum(count_targets(mb["labels"]) for mb in mbs))


def ref_backward(model, mbs: list[dict], full: bool) -> float:
    """Single process: one forward/backward of the whole batch (full: the independent reference), or
    the same micro-batches one after the other (what the pipeline computes, op for op)."""
    n = targets(mbs)
    parts = [{k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}] if full else mbs
    loss = torch.zeros(())
    for mb in parts:
        loss_sum = model(mb["input_ids"], mb.get("position_ids"), mb["labels"], reduction="sum")
        part = normalized_loss(loss_sum, n)
        part.backward()
        loss += part.detach()
    return float(loss)


def reference(cfg: LlamaConfig, mbs: list[dict], full: bool) -> tuple[float, dict]:
    model = full_model(cfg)
    loss = ref_backward(model, mbs, full)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def train_ref(cfg: LlamaConfig, steps: list[list[dict]], full: bool) -> tuple[list, list, dict]:
    """(losses, grad norms, final weights) of AdamW steps in one process."""
    model = full_model(cfg)
    opt = MixedPrecisionOptimizer(model.named_parameters(), OPT)
    losses, norms = [], []
    for mbs in steps:
        losses.append(ref_backward(model, mbs, full))
        norms.append(opt.step(LR))
    return losses, norms, dict(model.named_parameters())


def train_pp(model, schedule: str, steps: list[list[dict]], pp, emb=None, dp=None, v: int = 1
             ) -> tuple[list, list, dict]:
    """The same steps pipelined; with dp, each dp rank takes its slice of every global batch and the
    gradients are all-reduced (summed) once per step, after the last backward."""
    dp_rank, dp_size = (dist.get_rank(dp), dist.get_world_size(dp)) if dp is not None else (0, 1)
    opt = MixedPrecisionOptimizer(model.named_parameters(), OPT, norm_groups=[pp],
                                  counted=norm_counted(model))
    losses, norms = [], []
    for glob in steps:
        k = len(glob) // dp_size
        loss = torch.tensor(pipeline_step(model, schedule, glob[k * dp_rank: k * dp_rank + k], pp, emb,
                                          step_targets=targets(glob), v=v))
        if dp is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp)
            dist.all_reduce(loss, group=dp)  # each dp rank holds its share of the global mean
        losses.append(float(loss))
        norms.append(opt.step(LR))
    return losses, norms, {ref_name(model, n): p for n, p in model.named_parameters()}


def curve_errors(cfg: LlamaConfig, steps: list[list[dict]], got: tuple[list, list, dict]) -> dict:
    """The loss curve against the full-batch run, and loss, grad norm and weights against the
    single-process micro-batch loop (the grad norm's sum of squares is split over stages, so the run
    is not bit-identical). Measured: the two single-process runs themselves agree to ~1e-6 at LR;
    at lr 1e-2 (unstable here) AdamW amplifies rounding to 8e-5 in the norm by step 5."""
    losses, norms, params = got
    full, acc = train_ref(cfg, steps, True), train_ref(cfg, steps, False)
    errs = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))  # noqa: E731
    return {"loss_vs_full": errs(losses, full[0]), "loss_vs_loop": errs(losses, acc[0]),
            "norm_vs_loop": errs(norms, acc[1]),
            "weights_vs_loop": max(float((p - acc[2][n]).norm() / acc[2][n].norm())
                                   for n, p in params.items())}


def ref_name(model: torch.nn.Module, name: str) -> str:
    """The single-process name of a stage parameter (the tied copy is the embedding)."""
    return "model.embed_tokens.weight" if name == "lm_head.weight" and tied_copy(model) is not None else name


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(model, loss: float, ref: tuple[float, dict]) -> tuple[float, float]:
    """(loss relative error, worst gradient relative error) of this stage against a reference."""
    ref_loss, ref_grads = ref
    errs = [rel(p.grad, ref_grads[ref_name(model, n)]) for n, p in model.named_parameters()]
    return abs(loss - ref_loss) / abs(ref_loss), max(errs)


def bitwise(model, ref: tuple[float, dict]) -> bool:
    return all(torch.equal(p.grad, ref[1][ref_name(model, n)]) for n, p in model.named_parameters())


def pipeline_step(model, schedule: str, mbs, pp_group, embed_group=None, step_targets=None, v: int = 1,
                  layers=None):
    """One step of `schedule` over v chunks per rank (the model from stage_model(..., v=v))."""
    stage, n = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    acts = SCHEDULES[schedule](len(mbs), stage, n, v)
    chunks = stage_chunks(model, partition(model.config.num_hidden_layers, n * v, layers), stage, n)
    loss = run_pipeline(chunks, acts, mbs, pp_group, targets(mbs) if step_targets is None else step_targets,
                        hidden_size=model.config.hidden_size)
    sync_tied_grads(model, embed_group)
    return float(loss)


class WaitLog:
    """pp.py's `dist` in a test: logs each posted send/receive, each wait on one, each computation."""
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        return getattr(dist, name)

    def batch_isend_irecv(self, ops: list) -> list:
        works = dist.batch_isend_irecv(ops)
        kinds = ["send" if op.op is dist.isend else "recv" for op in ops]
        self.events += [("post", k) for k in kinds]
        return [self.Logged(w, k, self.events) for w, k in zip(works, kinds)]

    class Logged:
        def __init__(self, work, kind: str, events: list):
            self.work, self.kind, self.events = work, kind, events

        def wait(self):
            self.events.append(("wait", self.kind))
            return self.work.wait()

        def is_completed(self) -> bool:
            return self.work.is_completed()

    @contextlib.contextmanager
    def compute(self, action):
        self.events.append(("compute", action.kind))
        yield


def group_of(rank: int, lists: list[list[int]]):
    """new_group for every list (same order on all ranks); return this rank's group or None."""
    mine = None
    for ranks in lists:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


class SavedBytes:
    """Live bytes of tensors autograd saved for backward: unique storages, parameters and buffers
    excluded; each storage is released when the last graph node holding it is freed. The box holds
    a detached alias: a saved output boxed as itself would hold its own grad_fn, a cycle through
    C++ that would keep a retained (zb) graph alive after the step."""

    class _Box:
        def __init__(self, t: torch.Tensor):
            self.t = t

    def __init__(self, model: torch.nn.Module):
        state = itertools.chain(model.parameters(), model.buffers())
        self.skip = {t.untyped_storage().data_ptr() for t in state}
        self.refs: dict[int, int] = {}
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip:
            return t
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.now += t.untyped_storage().nbytes()
            self.peak = max(self.peak, self.now)
        self.refs[ptr] += 1
        box = self._Box(t.detach())  # a saved output would otherwise hold its own grad_fn: a cycle
        weakref.finalize(box, self._release, ptr, t.untyped_storage().nbytes())
        return box

    def _release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.now -= nbytes

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, SavedBytes._Box) else x


# ----------------------------------------------------------------------------------------- pure tests
def test_partition():
    assert partition(8, 2) == [range(0, 4), range(4, 8)]
    assert partition(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]  # last lightest
    assert partition(4, 2, [3, 1]) == [range(0, 3), range(3, 4)]
    assert partition(4, 1) == [range(0, 4)]
    # the head counted: 2.5 layer-equivalents on the last stage
    assert [len(r) for r in partition(12, 3, head=2.5)] == [5, 5, 2]  # costs 5, 5, 4.5
    assert [len(r) for r in partition(8, 4, head=10)] == [3, 2, 2, 1]  # at least one layer each
    with pytest.raises(ValueError, match=r"3 layers cannot fill 4 pipeline stages"):
        partition(3, 4)
    with pytest.raises(ValueError, match=r"\[3, 2\] sums to 5, the model has 4 layers"):
        partition(4, 2, [3, 2])
    with pytest.raises(ValueError, match=r"stage 1 would have 0 layers"):
        partition(4, 3, [4, 0, 0])
    with pytest.raises(ValueError, match=r"has 2 entries for 3 \(virtual\) stages"):
        partition(4, 3, [2, 2])


def test_split_stage_and_chunks():
    ranges = partition(4, 3, [2, 1, 1])
    kinds = []
    for s in range(3):
        m = split_stage(build(TIED), s, 3, ranges)
        names = [n for n, _ in m.named_parameters()]
        layers = sorted({n.split(".")[2] for n in names if n.startswith("model.layers.")})
        assert layers == [str(i) for i in ranges[s]]
        kinds.append((m.model.embed_tokens is not None, m.model.norm is not None, m.lm_head is not None))
        if s == 2:  # the tied copy: its own Parameter, filled from the embedding by materialize
            assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names
            assert not norm_counted(m)("lm_head.weight") and norm_counted(m)("model.norm.weight")
            w = materialize(m, "cpu", seed=3).lm_head.weight
            assert torch.equal(w, full_model(TIED).model.embed_tokens.weight)
        assert norm_counted(m)("model.embed_tokens.weight")
    assert kinds == [(True, False, False), (False, False, False), (False, True, True)]
    whole = split_stage(build(TIED), 0, 1, partition(4, 1))  # pp=1: untouched, still one tied Parameter
    assert whole.lm_head.weight is whole.model.embed_tokens.weight and tied_copy(whole) is None
    with pytest.raises(ValueError, match="do not cover the model's layers"):
        split_stage(build(CFG), 0, 2, [range(0, 2), range(2, 3)])
    assert tied_embedding_ranks(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tied_embedding_ranks(8, 4) == [[0, 6], [1, 7]] and tied_embedding_ranks(2, 1) == []
    # v = 2 chunks on 2 ranks: rank 0 holds layers 0 and 2 (virtual stages 0, 2), rank 1 layers 1 and 3
    ranges = partition(4, 4)
    for s, own in ((0, ["0", "2"]), (1, ["1", "3"])):
        m = materialize(split_stage(build(TIED), s, 2, ranges), "cpu", seed=3)
        assert list(m.model.layers) == own and tied_copy(m) is not None  # names stay HF's, global index
        chunks = stage_chunks(m, ranges, s, 2)
        assert [list(c.model.layers) for c in chunks] == [[own[0]], [own[1]]]
        assert [(c.model.embed_tokens is not None, c.lm_head is not None) for c in chunks] == \
            ([(True, False), (False, False)] if s == 0 else [(False, False), (False, True)])
        shared = {id(p) for c in chunks for p in c.parameters()}
        assert shared == {id(p) for p in m.parameters()}  # views: the model's own parameters
        assert list(m.model.layers) == own and (m.model.embed_tokens is not None) == (s == 0)  # untouched
    assert stage_chunks(m, partition(4, 2), 1, 2) == [m]


def test_pp1_is_the_plain_model():
    """pp_group None: no communication, bit-identical to the micro-batch loop of the plain model,
    with one backward per micro-batch (1f1b) or B and W apart (zb; also with a tied embedding)."""
    mbs = batches(3, seed=1)
    for cfg, schedule in ((CFG, one_f_one_b), (CFG, zero_bubble), (TIED, zero_bubble)):
        model = full_model(cfg)
        loss = run_pipeline(model, schedule(3, 0, 1), mbs, None, targets(mbs))
        ref = reference(cfg, mbs, full=False)
        assert float(loss) == ref[0] and bitwise(model, ref), (cfg.tie_word_embeddings, schedule)
    # no_sync: every backward but the last defers the dp reduction (seen from a grad hook); under zb
    # the gradients land in W, and the last W reduces
    for schedule in (one_f_one_b, zero_bubble):
        deferring, seen = [False], []

        @contextlib.contextmanager
        def no_sync():
            deferring[0] = True
            yield
            deferring[0] = False
        model = full_model(CFG)
        model.model.norm.weight.register_post_accumulate_grad_hook(lambda p: seen.append(deferring[0]))
        run_pipeline(model, schedule(3, 0, 1), mbs, None, targets(mbs), no_sync=no_sync)
        assert seen == [True, True, False], schedule
    with pytest.raises(ValueError, match=r"shape \(2, 8\) of the first, got .*\(2, 4\)"):
        run_pipeline(model, gpipe(2, 0, 1), [mbs[0], batches(1, 2, S=4)[0]], None, 1)


def test_bw_split_costs_one_backward():
    """B + W = one backward: the same FLOPs (B computes dX, W dW: each matmul's backward once) but
    one head matmul (the chunked loss recomputes its logits blocks in each pass), the same gradients
    bit for bit, and each parameter's AccumulateGrad (dp/ZeRO's hook) fires once."""
    from torch.utils.flop_counter import FlopCounterMode
    mbs = batches(1, seed=4)
    x = torch.randn(2, 8, CFG.hidden_size)
    ref, model = (split_stage(full_model(CFG), 0, 1, partition(4, 1)) for _ in range(2))
    for m in (ref, model):
        m.model.embed_tokens = None  # a middle/last stage: hidden states in
    leaf = x.clone().requires_grad_()
    loss = ref(leaf, labels=mbs[0]["labels"], reduction="sum")
    with FlopCounterMode(display=False) as full:
        loss.backward()
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
    inp = x.clone().requires_grad_()
    out = model(inp, labels=mbs[0]["labels"], reduction="sum")
    with FlopCounterMode(display=False) as b:
        dx, work = backward_input(out, None, inp, list(model.parameters()))
    assert fired == [] and all(p.grad is None for p in model.parameters())  # B touches no parameter
    # W's inputs held from B to W: dY of every parameterised op (pp.py's docstring), fp32 here: per
    # layer and token q + 2 kv + 4 h + 2 i values, the final norm h, the chunked loss's 1 (the loss
    # gradient: W recomputes the logits blocks from it, no (T, V) gradient is held)
    c = CFG
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_token = c.num_hidden_layers * (q + 2 * kv + 4 * c.hidden_size + 2 * c.intermediate_size) + \
        c.hidden_size + 1
    held = sum(g.nbytes for _, nodes in work for _, gs in nodes for g in gs if g is not None)
    assert held == 4 * x.shape[0] * x.shape[1] * per_token
    with FlopCounterMode(display=False) as w:
        backward_weight(work)
    assert b.get_total_flops() > 0 and w.get_total_flops() > 0
    head = 2 * x.shape[0] * x.shape[1] * c.hidden_size * c.vocab_size  # one (T, H) x (H, V) matmul
    assert b.get_total_flops() + w.get_total_flops() == full.get_total_flops() + head
    assert torch.equal(dx, leaf.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert sorted(fired) == sorted(id(p) for p in model.parameters())  # once each


# ----------------------------------------------------------------------------------------- multi-rank
LAYOUTS = [("uniform", CFG, None, True), ("uneven31", CFG, [3, 1], False), ("tied", TIED, None, False)]
RUNS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1), ("zb", 2)]  # (schedule, chunks per rank)


def _pp2(rank: int, world: int) -> dict:
    pp = group_of(rank, [[0, 1]])
    emb = group_of(rank, tied_embedding_ranks(world, 2))
    out, grads = {}, {}
    # loss and every gradient vs the single process, every schedule, three layouts
    for (schedule, v), (label, cfg, layers, packed) in itertools.product(RUNS, LAYOUTS):
        if layers and v > 1:
            continue  # [3, 1] is a 2-stage split
        mbs = batches(4, seed=10, packed=packed)
        model = stage_model(cfg, rank, 2, layers, v)
        loss = pipeline_step(model, schedule, mbs, pp, emb, v=v, layers=layers)
        grads[schedule, v, label] = {n: p.grad for n, p in model.named_parameters()}
        out[schedule, v, label] = (*compare(model, loss, reference(cfg, mbs, full=True)),
                                   bitwise(model, reference(cfg, mbs, full=False)))
    for (schedule, v, label), g in grads.items():  # the schedules differ in order only: same bits
        g1 = grads["1f1b", 1, label]  # (with v = 2 a rank holds other layers: compare the common ones)
        out["same", schedule, v, label] = all(torch.equal(t, g1[n]) for n, t in g.items() if n in g1)
    # 5 AdamW steps (clipped: OPT.clip < grad norm), a new batch each step
    steps = [batches(4, seed=100 + i) for i in range(5)]
    for schedule, v, cfg in [("gpipe", 1, CFG), ("1f1b", 1, TIED), ("interleaved", 2, CFG), ("zb", 1, CFG),
                             ("zb", 2, TIED)]:
        model = stage_model(cfg, rank, 2, v=v)
        got = train_pp(model, schedule, steps, pp, emb, v=v)
        out["adamw", schedule, v, cfg.tie_word_embeddings] = curve_errors(cfg, steps, got)
        if cfg.tie_word_embeddings:
            copies = [torch.empty_like(tied_copy(model)) for _ in range(2)]
            dist.all_gather(copies, tied_copy(model).detach(), group=emb)
            out["tied copies equal", schedule] = torch.equal(*copies)  # same summed grads: same bits
    # saved activations per stage: 1F1B holds min(m, p - stage) micro-batches, GPipe all m, zb p
    # (its graph lives from F to W)
    out["saved"] = {}
    for schedule, m in [("gpipe", 1), ("gpipe", 4), ("gpipe", 8), ("1f1b", 4), ("1f1b", 8), ("zb", 4), ("zb", 8)]:
        model = stage_model(CFG, rank, 2)
        meter = SavedBytes(model)
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            pipeline_step(model, schedule, batches(m, seed=5), pp)
        out["saved"][schedule, m] = (meter.peak, meter.now)
    # sends are never waited on while the stage still computes (only in the drain at the end)
    import pp as pp_module
    for schedule, v in (("1f1b", 1), ("zb", 2)):
        log = WaitLog()
        pp_module.dist = log
        try:
            model = stage_model(CFG, rank, 2, v=v)
            chunks = stage_chunks(model, partition(4, 2 * v), rank, 2)
            mbs = batches(4, seed=6)
            run_pipeline(chunks, SCHEDULES[schedule](4, rank, 2, v), mbs, pp, targets(mbs), timer=log.compute,
                         hidden_size=CFG.hidden_size)
        finally:
            pp_module.dist = dist
        out["waits", schedule] = log.events
    # peers given different shapes, and a micro-batch of another shape: every stage raises
    model = stage_model(CFG, rank, 2)
    for label, mbs in [("peers", batches(2, seed=1, S=8 if rank == 0 else 16)),
                       ("inside", batches(1, seed=1) + batches(1, seed=2, B=3))]:
        try:
            pipeline_step(model, "1f1b", mbs, pp)
            out["error", label] = None
        except ValueError as e:
            out["error", label] = str(e)
    return out


def assert_adamw(e: dict, key, rank) -> None:
    assert e["loss_vs_full"] <= TOL, (key, rank, e)
    assert max(e["loss_vs_loop"], e["norm_vs_loop"], e["weights_vs_loop"]) <= TOL, (key, rank, e)


def test_pp2():
    r0, r1 = run_ranks(_pp2, 2)
    for key in [k for k in r0 if len(k) == 3 and k[0] in SCHEDULES]:
        for stage, r in enumerate((r0, r1)):
            loss_err, grad_err, exact = r[key]
            assert loss_err <= TOL and grad_err <= TOL, (key, stage, loss_err, grad_err)
            # untied: the very same ops in the same order as the single-process micro-batch loop
            assert exact or key[2] == "tied", (key, stage)
            assert r["same", *key], (key, stage)  # every schedule: bit-identical gradients
    for key in [k for k in r0 if k[0] == "adamw"]:
        for stage, r in enumerate((r0, r1)):
            assert_adamw(r[key], key, stage)
    assert all(r["tied copies equal", s] for r in (r0, r1) for s in ("1f1b", "zb"))
    for r in (r0, r1):
        saved = r["saved"]
        assert all(now == 0 for _, now in saved.values())  # everything released after the step
        unit = saved["gpipe", 1][0]
        assert unit > 0
        assert saved["gpipe", 4][0] == 4 * unit and saved["gpipe", 8][0] == 8 * unit
        assert saved["zb", 4][0] == saved["zb", 8][0] == 2 * unit  # p micro-batches from F to W
    assert r0["saved"]["1f1b", 4][0] == r0["saved"]["1f1b", 8][0] == 2 * r0["saved"]["gpipe", 1][0]
    assert r1["saved"]["1f1b", 4][0] == r1["saved"]["1f1b", 8][0] == r1["saved"]["gpipe", 1][0]
    for r in (r0, r1):
        for schedule in ("1f1b", "zb"):
            events = r["waits", schedule]
            last_compute = max(i for i, e in enumerate(events) if e[0] == "compute")
            assert ("wait", "recv") in events and ("post", "send") in events
            assert all(i > last_compute for i, e in enumerate(events) if e == ("wait", "send")), events
        assert "pipeline peers disagree" in r["error", "peers"] and "[2, 2, 16," in r["error", "peers"]
        assert "shape (2, 8) of the first" in r["error", "inside"]


CFG8 = LlamaConfig(**{**CFG.__dict__, "num_hidden_layers": 8})


def _pp4_and_pp2dp2(rank: int, world: int) -> dict:
    out = {}
    pp4 = group_of(rank, [[0, 1, 2, 3]])
    for (schedule, v), m in itertools.product([("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1),
                                               ("zb", 2)], [3, 6]):  # m < p and m > p, not a multiple
        cfg = CFG8 if v > 1 else CFG
        mbs = batches(m, seed=20 + m, packed=True)
        model = stage_model(cfg, rank, 4, v=v)
        loss = pipeline_step(model, schedule, mbs, pp4, v=v)
        out[schedule, v, m] = (*compare(model, loss, reference(cfg, mbs, full=True)),
                               bitwise(model, reference(cfg, mbs, full=False)))
    steps = [batches(5, seed=200 + i) for i in range(5)]
    for schedule, v in [("1f1b", 1), ("interleaved", 2), ("zb", 1)]:
        cfg = CFG8 if v > 1 else CFG
        got = train_pp(stage_model(cfg, rank, 4, v=v), schedule, steps, pp4, v=v)
        out["adamw", schedule, v] = curve_errors(cfg, steps, got)
    # pp=2 x dp=2 (grid: dp inner, pp outer), tied embeddings, uneven layers, plain dp all-reduce
    pp = group_of(rank, [[0, 2], [1, 3]])
    dp = group_of(rank, [[0, 1], [2, 3]])
    emb = group_of(rank, tied_embedding_ranks(world, 2))
    steps = [batches(6, seed=300 + i) for i in range(5)]
    for schedule in ("1f1b", "zb"):
        got = train_pp(stage_model(TIED, rank // 2, 2, [3, 1]), schedule, steps, pp, emb, dp)
        out["dp", schedule] = curve_errors(TIED, steps, got)
    return out


def test_pp4_and_pp2_dp2():
    results = run_ranks(_pp4_and_pp2dp2, 4)
    for rank, r in enumerate(results):
        for key in [k for k in r if k[0] in SCHEDULES]:
            loss_err, grad_err, exact = r[key]
            assert loss_err <= TOL and grad_err <= TOL and exact, (rank, key, r[key])
        for key in [k for k in r if k[0] in ("adamw", "dp")]:
            assert_adamw(r[key], key, rank)


# ----------------------------------------------------------------------------------------- issue 22
GRID_LAYOUTS = [(2, 2, 1), (1, 4, 1), (1, 2, 2), (4, 1, 1), (1, 1, 1)]  # (tp, pp, cp) at 4 ranks


def _grid_and_pairs(rank: int, world: int) -> dict:
    """grid.make_grid at every layout with dist.new_group recorded; then interleaved and zb (v=2)
    at pp=4 on the neighbour-pair groups against the same steps on the one pp group."""
    import grid as G
    import pp as PP
    calls, new_group = [], dist.new_group

    def recorded(ranks=None, *args, **kw):
        calls.append((tuple(ranks) if ranks is not None else None, kw.get("backend"),
                      kw.get("use_local_synchronization", False)))
        return new_group(ranks, *args, **kw)

    out, grids = {}, {}
    dist.new_group = recorded
    try:
        for tp, p, cp in GRID_LAYOUTS:
            calls.clear()
            g = grids[tp, p, cp] = G.Grid(rank, world, torch.device("cpu"))
            G.make_grid(g, tp, p, cp=cp)
            sizes = {k: dist.get_world_size(getattr(g, k)) for k in ("tp_group", "dp_group", "pp_group",
                                                                     "cp_group", "pp_check")}
            peers = {s: dist.get_process_group_ranks(pg) for s, pg in g.pp_peers.items()}
            out["calls", tp, p, cp] = (list(calls), sizes, peers)
        calls.clear()  # a gloo family that does not cover the world: completed to a partition
        made = G.family([[0, 1]], world, datetime.timedelta(seconds=60), "gloo")
        out["family"] = (list(calls), len(made), dist.get_world_size(made[0]) if rank < 2 else None)
        try:
            G.family([[0, 1], [1, 2]], world, datetime.timedelta(seconds=60), "gloo")
        except ValueError as e:
            out["overlap"] = str(e)
    finally:
        dist.new_group = new_group
    g = grids[1, 4, 1]
    for schedule in ("interleaved", "zb"):
        mbs = batches(4, seed=40)
        runs = []
        for peer_groups in (None, g.pp_peers):
            model = stage_model(CFG8, rank, 4, v=2)
            chunks = stage_chunks(model, partition(8, 8), rank, 4)
            loss = run_pipeline(chunks, SCHEDULES[schedule](4, rank, 4, 2), mbs, g.pp_group, targets(mbs),
                                check_group=g.pp_check, peer_groups=peer_groups, hidden_size=CFG8.hidden_size)
            runs.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
        out["same", schedule] = runs[0][0] == runs[1][0] and all(torch.equal(a, runs[1][1][n])
                                                                 for n, a in runs[0][1].items())
    # pp.peer_groups, the library's own (the bench uses it): the same pairs as the grid's
    out["peer_groups"] = {s: dist.get_process_group_ranks(pg) for s, pg in PP.peer_groups([[0, 1, 2, 3]]).items()}
    serialized = PP.serialized_p2p
    PP.serialized_p2p = lambda device: True  # as on CUDA: the one pp group is refused
    try:
        run_pipeline(chunks, SCHEDULES["zb"](4, rank, 4, 2), mbs, g.pp_group, targets(mbs), hidden_size=CFG8.hidden_size)
    except ValueError as e:
        out["refused"] = str(e)
    finally:
        PP.serialized_p2p = serialized
    return out


def _splits(calls: list, rank: int) -> list:
    """The splits of the world's NCCL communicator each call costs this rank under eager init, by
    torch 2.13's rules (distributed_c10d.py: _new_group_with_tag returns at once for a
    use_local_synchronization non-member; _new_process_group_helper runs ncclCommSplit with a colour
    on an NCCL group's members and perform_nocolor_split on every non-member, gloo groups' too).
    Each is labelled by the NCCL call it belongs to, or "-" for a gloo group's no-colour split."""
    out = []
    for i, (ranks, backend, local) in enumerate(calls):
        member = ranks is None or rank in ranks
        if local:
            assert backend == "gloo" and member, "a members-only NCCL group would split the world alone"
        elif backend != "gloo":
            out.append(i)
        elif not member:
            out.append("-")
    return out


def test_grid_groups_and_neighbour_pairs():
    """Issue 22: make_grid, recorded at five layouts of 4 ranks. Every rank makes the same calls in
    the same order (the members-only solo group aside); no group of one rank on the default (NCCL)
    backend; under eager init every rank runs the same splits of the world communicator; the
    pipeline's neighbour pairs are made (a ring at pp=4); a gloo family that leaves ranks out is
    completed to a partition (one no-colour split on every rank) and overlapping lists are refused.
    Then pp=4 with v=2 on the pair groups is
    bit-identical to the one pp group (same ops, same values, only the communicator differs), and on
    CUDA the one pp group is refused instead of deadlocking."""
    results = run_ranks(_grid_and_pairs, 4)
    for tp, p, cp in GRID_LAYOUTS:
        shared = None
        for rank, r in enumerate(results):
            calls, sizes, peers = r["calls", tp, p, cp]
            assert not [c for c in calls if c[0] is not None and len(c[0]) == 1 and c[1] != "gloo"], calls
            assert all(c == ((rank,), "gloo", True) for c in calls if c[2]), calls  # solo only
            common = [c for c in calls if not c[2]]
            assert shared is None or common == shared, (tp, p, cp, rank)
            shared = common
            assert sizes == {"tp_group": tp, "dp_group": 4 // (tp * p), "pp_group": p, "cp_group": cp,
                             "pp_check": p}, (tp, p, cp, sizes)
            stage, stride = rank // (4 // p), 4 // p
            others = {(stage + 1) % p, (stage - 1) % p} - {stage}  # at pp=2 one neighbour, at pp=1 none
            assert peers == {o: sorted([rank, o * stride + rank % stride]) for o in others}, (tp, p, cp, peers)
        # the k-th split is the same call on every rank, or a no-colour split on every rank
        splits = [_splits(r["calls", tp, p, cp][0], k) for k, r in enumerate(results)]
        assert all(len(set(map(str, col))) == 1 for col in zip(*splits)), splits
        assert len({len(sp) for sp in splits}) == 1, splits
    for k, r in enumerate(results):
        calls, n, size = r["family"]
        assert calls == [((0, 1), "gloo", False), ((2, 3), "gloo", False)] and n == 1 and size == (2 if k < 2 else None)
        assert _splits(calls, k) == ["-"] and "must not overlap" in r["overlap"]  # one no-colour split each
    for r in results:
        assert r["peer_groups"] == r["calls", 1, 4, 1][2]
        assert r["same", "interleaved"] and r["same", "zb"]
        assert "pass peer_groups" in r["refused"]
