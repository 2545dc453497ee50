"""zero.py, zero3.py: every ZeRO stage against plain DP and the single process, memory, hooks, composition.

Tolerances (fp32 unless stated), and why:
- dp=1 (a group of one rank): every stage bit-identical to MixedPrecisionOptimizer, clipping and
  accumulation included (the owned pieces are then whole parameters, summed in the same order).
- dp=2 vs stage 0 (fp32 and bf16): bit-identical parameters and losses without clipping (2-rank
  sums are a+b in any layout; AdamW is elementwise); ZeRO-3 under activation checkpointing and with
  two micro-batches' forwards in flight is bit-identical to ZeRO-3 without. Not bitwise when
  clipping is active (the norm's squares are summed per shard, then over dp: last-bit different
  coefficient) nor for stages 2-3 under accumulation ((a1+b1)+(a2+b2) vs (a1+a2)+(b1+b2)): 1e-6,
  parameters relative to the largest parameter.
- dp=4 and tp×dp: 1e-5 relative, against stage 0 and the single process (gloo's 4-rank sums depend on
  buffer layout; tp adds its own all-reduces).
- Tied embeddings, pp=2 × dp=2 (× tp=2), every stage: 1e-5 relative against the single process on
  the whole global batch (loss, grad norm, final weights; measured <= 5e-7); the two copies
  bitwise equal after every step (the same summed pieces, the same norm, elementwise AdamW).
"""
from __future__ import annotations

import contextlib
import gc
import time
import weakref

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
import torch.distributed as dist
import torch.utils.checkpoint as ckpt

import ac as AC
import dp
import model as M
import precision as P
import tp as TP
import weights as W
import zero as Z
import zero3 as Z3
import zero_memory as ZM
from dist import run_ranks
from pp import (norm_counted, one_f_one_b, partition, run_pipeline, split_stage, tied_copy,
                tied_embedding_ranks)
from test_dp import CFG, G, LR, N_ROWS, dataset, make_model, reference, rel, train
from test_pp import LR as PP_LR, OPT as PP_OPT, TIED, batches, group_of, ref_name, targets, train_ref

FP32, BF16 = torch.float32, torch.bfloat16


def run(stage: int, group, *, clip: float = 0.0, micro: int = 1, dtype=FP32, tie: bool = False,
        steps: int = 5, bucket_mb: float = 0.01, model=None, **kw):
    """Train `steps` steps under `stage`; returns (losses, grad norms, full fp32 params)."""
    m = model if model is not None else make_model(tie_word_embeddings=tie)
    opt = Z3.apply_zero(m, stage, group, P.OptimConfig(lr=LR, clip=clip), dtype, bucket_mb=bucket_mb, **kw)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    losses, norms = train(m, opt, dp.DPSampler(N_ROWS, G, rank, size, seed=7), micro, group,
                          opt.no_sync, opt.finish, steps)
    with opt.gathered():
        params = [p.detach().float().clone() for p in m.parameters()]
    opt.teardown()
    return losses, norms, params


def same(a, b) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


def reld(a, b) -> float:
    """Largest relative difference of the loss curves, and largest parameter difference relative to
    the largest parameter (per-tensor scaling would blow up Adam's last-bit noise on tiny weights)."""
    scale = max(y.abs().max().item() for y in b[2])
    return max(rel(a[0], b[0]), max((x - y).abs().max().item() for x, y in zip(a[2], b[2])) / scale)


def plain(clip: float, micro: int, dtype) -> tuple:
    m = make_model()
    opt = P.MixedPrecisionOptimizer(m.named_parameters(), P.OptimConfig(lr=LR, clip=clip), dtype)
    losses, norms = train(m, opt, dp.DPSampler(N_ROWS, G, 0, 1, seed=7), micro)
    return losses, norms, [p.detach().float().clone() for p in m.parameters()]


def gathered_counts(rank: int) -> dict:
    """ZeRO-3 at dp=2: how many units are gathered at each layer's forward and backward, and which
    units backward gathers (untied and tied embeddings)."""
    out = {}
    for prefetch, tie in ((0, False), (1, False), (2, False), (1, True)):
        m = make_model(tie_word_embeddings=tie)
        opt = Z3.apply_zero(m, 3, dist.group.WORLD, P.OptimConfig(lr=LR), prefetch=prefetch)
        fwd, bwd, launched, real = [], [], [], opt._gather

        def counted(u: int, wait: bool = True) -> None:
            if not opt._full[u] and torch._C._current_graph_task_id() != -1:
                launched.append(u)  # an all-gather launched in backward
            real(u, wait)
        opt._gather = counted
        def on_output(mod, args, out) -> None:
            out.register_hook(lambda g: bwd.append(sum(opt._full)))

        for layer in m.model.layers.values():  # registered after ZeRO's hooks, so they run after
            layer.register_forward_pre_hook(lambda *_: fwd.append(sum(opt._full)))
            layer.register_forward_hook(on_output)
        x, y = dataset()
        loss = m(x[:2], labels=y[:2], reduction="sum")
        after_forward = sum(opt._full)
        loss.backward()
        out[prefetch, tie] = (max(fwd), after_forward, bwd, sum(opt._full),
                              all(p.grad is None for p in m.parameters()), launched, len(opt.flat_params))
        opt.teardown()
    return out


class Checkpointed(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return ckpt.checkpoint(self.inner, *args, use_reentrant=False)


def pipeline_like(rank: int, stage: int, interleave: bool, ac: bool) -> tuple:
    """A last pipeline stage (no embedding, layer "1" only, norm + head), two micro-batches whose
    forwards may both run before either backward, optionally with activation checkpointing."""
    m = make_model()
    m.model.embed_tokens = None
    del m.model.layers["0"]
    opt = Z3.apply_zero(m, stage, dist.group.WORLD, P.OptimConfig(lr=LR), bucket_mb=0.001)
    if ac:  # checkpoint the hooked layer: its forward hooks run again inside backward
        m.model.layers["1"] = Checkpointed(m.model.layers["1"])
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        hs = [torch.randn(2, 8, CFG.hidden_size, generator=g, requires_grad=True) for _ in range(2)]
        ys = [torch.randint(0, CFG.vocab_size, (2, 8), generator=g) for _ in range(2)]
        if interleave:  # both forwards, then both backwards (GPipe order)
            outs = [m(h, labels=y, reduction="sum") / 64 for h, y in zip(hs, ys)]
            with opt.no_sync():
                outs[0].backward()
            outs[1].backward()
        else:
            outs = []
            for k, (h, y) in enumerate(zip(hs, ys)):
                outs.append(m(h, labels=y, reduction="sum") / 64)
                with opt.no_sync() if k == 0 else contextlib.nullcontext():
                    outs[-1].backward()
        losses.append(sum(o.item() for o in outs))
        opt.step(LR)
    with opt.gathered():
        params = [p.detach().clone() for p in m.parameters()]
    opt.teardown()
    return losses, None, params


def _dp2(rank: int, world: int) -> dict:
    out: dict = {}
    WORLD = dist.group.WORLD
    singles = [dist.new_group([r]) for r in range(world)]
    for dtype in (FP32, BF16):  # dp=1: bit-identical to the plain loop, clipping and accumulation on
        ref = plain(0.5, 2, dtype)
        out[f"dp1_{dtype}"] = [same(run(s, singles[rank], clip=0.5, micro=2, dtype=dtype), ref)
                               for s in range(4)]
    exact = [run(s, WORLD) for s in range(4)]
    out["exact"] = [same(r, exact[0]) for r in exact[1:]]
    bf16 = [run(s, WORLD, dtype=BF16) for s in range(4)]  # 2-rank bf16 sums: a+b rounded, any layout
    out["exact_bf16"] = [same(r, bf16[0]) for r in bf16[1:]]
    for name, clip, micro in (("accum", 0.0, 2), ("clip", 0.5, 2)):
        runs = [run(s, WORLD, clip=clip, micro=micro) for s in range(4)]
        out[name] = [(same(r, runs[0]), reld(r, runs[0])) for r in runs[1:]]
    for mode in ("full", "selective"):  # ZeRO-3 under activation checkpointing (ac.py): the
        m = make_model()                # recompute reads the units the output-grad hook gathered
        AC.apply_ac(m, mode)
        out[f"ac_{mode}"] = same(run(3, WORLD, model=m), exact[3])
    tied0 = run(0, WORLD, tie=True)
    out["tied"] = [same(run(s, WORLD, tie=True), tied0) for s in (1, 3)]
    # ZeRO-2: no full-size gradient survives backward
    m = make_model()
    opt = Z.apply_zero_0_to_2(m, 2, WORLD, P.OptimConfig(lr=LR))
    x, y = dataset()
    m(x[:2], labels=y[:2], reduction="sum").backward()
    out["zero2_grads_none"] = all(p.grad is None for p in m.parameters())
    opt.teardown()
    out["gathered"] = gathered_counts(rank)
    pp = {(s, i, a): pipeline_like(rank, s, i, a) for s, i, a in
          ((0, False, False), (3, False, False), (3, True, False), (3, True, True))}
    out["pp_interleaved_exact"] = same(pp[3, True, False], pp[3, False, False])
    out["pp_ac_exact"] = same(pp[3, True, True], pp[3, True, False])
    out["pp_vs_dp"] = reld(pp[3, True, False], pp[0, False, False])
    return out


def test_zero_dp2_exactness_and_stage3_mechanics():
    res = run_ranks(_dp2, 2)
    for out in res:
        assert out[f"dp1_{FP32}"] == [True] * 4 and out[f"dp1_{BF16}"] == [True] * 4
        assert out["exact"] == [True, True, True] and out["exact_bf16"] == [True, True, True]  # stages 1-3
        assert out["ac_full"] and out["ac_selective"]
        assert out["accum"][0][0], out["accum"]  # stage 1 keeps full grads: same sum order
        assert all(d <= 1e-6 for _, d in out["accum"] + out["clip"]), (out["accum"], out["clip"])
        assert out["tied"] == [True, True]
        assert out["zero2_grads_none"]
        for (prefetch, tie), got in out["gathered"].items():
            fwd_max, after_fwd, bwd, after_bwd, no_grads, launched, units = got
            # this layer + the ones fetched ahead (tied: the head's site fetches the embedding too)
            assert fwd_max == 1 + prefetch + tie, (prefetch, tie, fwd_max)
            assert after_fwd == 0 and after_bwd == 0 and no_grads  # everything freed after use
            # at each layer's output-grad hook (2 layers, top first): this layer and the layers below
            # it fetched ahead — never the embedding (its backward reads only the ids); tied, the
            # embedding the head's backward read stays until its gradient is in (the lookup adds
            # its part last; a pipeline's deferred W may still unpack the head's saved view of it)
            assert bwd == [1 + min(prefetch, 1) + tie, 1 + tie], (prefetch, tie, bwd)
            # backward gathers every unit once but the embedding's (unit 0); tied, the head reads it
            assert sorted(launched) == list(range(0 if tie else 1, units)), (tie, launched)
        assert out["pp_interleaved_exact"] and out["pp_ac_exact"]
        assert out["pp_vs_dp"] <= 1e-6


def _dp4(rank: int, world: int) -> dict:
    out: dict = {}
    WORLD = dist.group.WORLD
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    runs = [run(s, WORLD, clip=0.5, micro=2) for s in range(4)]
    out["curves"] = [(r[0], r[1]) for r in runs]
    out["vs_stage0"] = [reld(r, runs[0]) for r in runs[1:]]
    out["tied_curves"] = [run(s, WORLD, clip=0.5, micro=2, tie=True)[:2] for s in (0, 3)]
    # persistent bytes per rank, measured after backward (grads present) of the second step
    out["bytes"] = {}
    for dtype in (BF16, FP32):
        for stage in range(4):
            m = make_model()
            opt = Z3.apply_zero(m, stage, WORLD, P.OptimConfig(lr=LR), dtype, bucket_mb=0.002)
            x, y = dataset()
            for k in range(2):
                m(x[:2], labels=y[:2], reduction="sum").backward()
                opt.finish()
                if k == 0:
                    opt.step(LR)
            out["bytes"][dtype, stage] = (ZM.persistent_bytes(opt), len(opt.buckets) if stage else 0)
            opt.teardown()
    out["tpdp"] = tp_dp(rank, tp_groups[rank // 2], dp_groups[rank % 2])
    return out


def tp_dp(rank: int, tp_group, dp_group) -> list:
    """Every stage with tp=2 inside each dp rank: the tp group shards the model (tp.py), ZeRO shards
    each tp shard over dp; the grad norm all-reduces over dp (ZeRO) and tp (norm_groups)."""
    curves = []
    tp_rank = dist.get_rank(tp_group)
    for stage in range(4):
        m = M.build(CFG)
        shards = TP.apply_tp(m, tp_group)
        W.materialize(m, "cpu", seed=0, shards=shards)
        curves.append(run(stage, dp_group, clip=0.5, micro=2, model=m, norm_groups=[tp_group],
                          counted=lambda n: n in shards or tp_rank == 0)[:2])
    return curves


def test_zero_dp4_memory_and_tp2_dp2():
    ref = reference()
    ref_tied = reference(tie_word_embeddings=True)
    res = run_ranks(_dp4, 4)
    psi = sum(p.numel() for p in make_model().parameters())
    N = 4
    for out in res:
        for losses, norms in out["curves"] + out["tpdp"]:
            assert rel(losses, ref[0]) <= 1e-5 and rel(norms, ref[1]) <= 1e-5, (losses, ref[0])
        for losses, norms in out["tied_curves"]:
            assert rel(losses, ref_tied[0]) <= 1e-5 and rel(norms, ref_tied[1]) <= 1e-5
        assert max(out["vs_stage0"]) <= 1e-5, out["vs_stage0"]
    for dtype, c in ((BF16, 2), (FP32, 4)):  # c: bytes of a compute param / grad
        master = 4 if dtype == BF16 else 0  # fp32 stage 0: the masters ARE the parameters
        formulas = {0: (c * psi, c * psi, master * psi), 1: (c * psi, c * psi, 4 * psi / N),
                    2: (c * psi, c * psi / N, 4 * psi / N), 3: (c * psi / N, c * psi / N, 4 * psi / N)}
        for stage, (params, grads, mast) in formulas.items():
            per_rank = [out["bytes"][dtype, stage][0] for out in res]
            pad = res[0]["bytes"][dtype, stage][1] * N * 4  # < N padding elements per bucket/unit
            for b in per_rank:
                want = dict(params=params, grads=grads, master=mast, adam_m=4 * psi / N if stage else 4 * psi,
                            adam_v=4 * psi / N if stage else 4 * psi)
                for k, v in want.items():
                    assert abs(b[k] - v) <= pad, (dtype, stage, k, b[k], v)
            if stage:  # the master pieces of all ranks together are exactly the model
                assert sum(b["master"] for b in per_rank) == 4 * psi


def _tp2_dp4(rank: int, world: int) -> list:
    tp_groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(4)]
    dp_groups = [dist.new_group([0, 2, 4, 6]), dist.new_group([1, 3, 5, 7])]
    return tp_dp(rank, tp_groups[rank // 2], dp_groups[rank % 2])


def test_zero_tp2_dp4():
    ref = reference()
    for curves in run_ranks(_tp2_dp4, 8):
        for losses, norms in curves:
            assert rel(losses, ref[0]) <= 1e-5 and rel(norms, ref[1]) <= 1e-5, (losses, ref[0])


def grid_groups(rank: int, tp: int, dp_size: int, pp: int) -> list:
    """train.py's grid (tp innermost, then dp, then pp): this rank's tp, dp, pp and embedding group."""
    at = lambda p, d, t: p * dp_size * tp + d * tp + t  # noqa: E731
    lists = ([[at(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp_size)],
             [[at(p, d, t) for d in range(dp_size)] for p in range(pp) for t in range(tp)],
             [[at(p, d, t) for p in range(pp)] for d in range(dp_size) for t in range(tp)],
             tied_embedding_ranks(tp * dp_size * pp, pp))
    return [group_of(rank, ranks) for ranks in lists]


def _pp2_tied(rank: int, world: int, tp: int, runs: list[tuple[int, bool, int]]) -> dict:
    """Tied embeddings, pp=2 (layers [3, 1]) × dp × tp, 1F1B over this dp rank's 3 micro-batches,
    AdamW with clipping; `runs` = (ZeRO stage, pass `tied`, steps). Per run: losses, grad norms,
    whether the two copies were bitwise equal after each step, and the final weights (tp=1)."""
    tp_g, dp_g, pp_g, emb = grid_groups(rank, tp, world // (2 * tp), 2)
    tp_rank, pp_rank = dist.get_rank(tp_g), dist.get_rank(pp_g)
    dp_rank, dp_size = dist.get_rank(dp_g), dist.get_world_size(dp_g)
    out = {}
    for stage, tie, steps in runs:
        m = split_stage(M.build(TIED), pp_rank, 2, partition(TIED.num_hidden_layers, 2, [3, 1]))
        shards = TP.apply_tp(m, tp_g)
        W.materialize(m, "cpu", seed=3, shards=shards)
        pp_counted = norm_counted(m)
        opt = Z3.apply_zero(m, stage, dp_g, PP_OPT, bucket_mb=0.001, norm_groups=[tp_g, pp_g],
                            counted=lambda n: pp_counted(n) and (n in shards or tp_rank == 0),
                            tied=tied_copy(m) if tie else None, embed_group=emb)
        losses, norms, equal = [], [], []
        for i in range(steps):
            glob = batches(6, seed=300 + i)  # uneven masks: micro-batch i drops ~15·i % of its labels
            k = len(glob) // dp_size
            loss = run_pipeline(m, one_f_one_b(k, pp_rank, 2), glob[k * dp_rank: k * dp_rank + k], pp_g,
                                targets(glob), no_sync=opt.no_sync, hidden_size=m.config.hidden_size)
            opt.finish()
            dist.all_reduce(loss, group=dp_g)
            losses.append(float(loss))
            norms.append(opt.step(PP_LR))
            with opt.gathered():
                copies = [torch.empty_like(tied_copy(m)) for _ in range(2)]
                dist.all_gather(copies, tied_copy(m).detach(), group=emb)
                weights = {ref_name(m, n): p.detach().clone() for n, p in m.named_parameters()}
            equal.append(torch.equal(*copies))
        opt.teardown()
        out[stage, tie] = (losses, norms, equal, weights if tp == 1 else None)
    return out


def check_tied(results: list[dict], steps: int) -> None:
    """Against the single process on the whole global batch: loss and grad norm <= 1e-5 relative at
    every step (the sums run in another order over micro-batches, dp, tp and the two copies), final
    weights <= 1e-5 per tensor (||a - b|| / ||b||); the copies bitwise equal after every step."""
    losses, norms, weights = train_ref(TIED, [batches(6, seed=300 + i) for i in range(steps)], True)
    weights = {n: w.detach() for n, w in weights.items()}
    for r in results:
        for (stage, tie), (got_l, got_n, equal, got_w) in r.items():
            if not tie:  # the control: without the sum the copies part at the first step
                assert equal == [False], equal
                continue
            assert equal == [True] * steps, (stage, equal)
            assert rel(got_l, losses) <= 1e-5 and rel(got_n, norms) <= 1e-5, (stage, got_l, losses)
            for n, w in (got_w or {}).items():
                assert float((w - weights[n]).norm() / weights[n].norm()) <= 1e-5, (stage, n)


def test_zero_tied_embeddings_pp2_dp2():
    runs = [(stage, True, 5) for stage in range(4)] + [(1, False, 1)]
    check_tied(run_ranks(_pp2_tied, 4, 1, runs), 5)


def test_zero_tied_embeddings_tp2_pp2_dp2():
    check_tied(run_ranks(_pp2_tied, 8, 2, [(2, True, 5), (3, True, 5)]), 5)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage reachable by Python's gc, each storage once — including
    tensors kept alive only by C++-held hook closures (the objects are still gc-tracked)."""
    seen, n = set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type != "meta" and not isinstance(o, FakeTensor):
            s = o.untyped_storage()
            try:
                s.data_ptr()
            except RuntimeError:  # a functional tensor an earlier test (compile) left in the forking parent
                continue
            if s.data_ptr() and s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                n += s.nbytes()
    return n


BUILDS = 10  # a leak of even one tensor per build shows as growth from the second build to the last


def _leak(rank: int, world: int) -> dict:
    x, y = dataset()

    def cycle(stage: int, teardown: bool = True):
        m = make_model()
        opt = Z3.apply_zero(m, stage, dist.group.WORLD, P.OptimConfig(lr=LR), bucket_mb=0.02)
        m(x[:2], labels=y[:2], reduction="sum").backward()
        opt.step(LR)
        m(x[:2], labels=y[:2], reduction="sum")  # a forward whose graph is dropped unused
        refs = weakref.ref(opt), weakref.ref(m), weakref.ref(next(m.parameters()))
        if teardown:
            opt.teardown()
        return refs

    out = {}
    for stage in range(4):
        refs, sizes = [], []
        for i in range(BUILDS):
            refs += cycle(stage)
            if i in (1, BUILDS - 1):  # from the second build: the first warms lazy caches
                time.sleep(0.2)  # gloo's worker thread drops a finished collective's buffers late
                gc.collect()
                sizes.append(live_tensor_bytes())
        out[stage] = (sum(r() is not None for r in refs), sizes)
    controls = [cycle(stage, teardown=False) for stage in range(4)]
    gc.collect()
    for stage, refs in enumerate(controls):  # without teardown the hook cycle keeps the parameters
        out[f"control{stage}"] = refs[2]() is not None
    return out


def test_zero_teardown_leaves_nothing_alive():
    for out in run_ranks(_leak, 2):
        for stage in range(4):
            alive, (first, last) = out[stage]
            assert alive == 0, (stage, alive)
            assert last <= first, (stage, first, last)  # nothing accumulates over the builds
            assert out[f"control{stage}"], stage  # the test can fail: without teardown hooks leak


def test_bad_input():
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3, got 4"):
        Z3.apply_zero(make_model(), 4, None, P.OptimConfig())
    with pytest.raises(ValueError, match=r"0, 1 or 2 here \(stage 3: zero3.apply_zero\), got 3"):
        Z.apply_zero_0_to_2(make_model(), 3, None, P.OptimConfig())  # zero.py alone builds stages 0-2
    m = make_model()  # no embedding group; a parameter of another model (the group is never used)
    for tied, group in ((m.lm_head.weight, None), (torch.nn.Parameter(torch.zeros(1)), object())):
        with pytest.raises(ValueError, match="tied must be a trainable parameter .* embedding group"):
            Z.apply_zero_0_to_2(m, 1, None, P.OptimConfig(), tied=tied, embed_group=group)


def _overlap(rank: int, world: int) -> dict:
    """ZeRO-1/2 at dp=2, buckets of ~one layer: what the forward after step() finds and does."""
    out: dict = {}
    x, y = dataset()
    for stage in (1, 2):
        m = make_model()
        opt = Z.apply_zero_0_to_2(m, stage, dist.group.WORLD, P.OptimConfig(lr=LR), bucket_mb=0.02)
        launched: list[int] = []
        real = opt._launch_gather

        def launch() -> None:
            launched.append(opt._order[opt._launched])
            real()
        opt._launch_gather = launch
        seen = []  # per site, after its pre-hook: (gathers waited, in flight), in forward order
        for mod in (m.model.embed_tokens, *m.model.layers.values(), m.model.norm):
            mod.register_forward_pre_hook(lambda *_: seen.append((opt._landed, opt._launched - opt._landed)))
        steps = []
        for _ in range(3):
            seen.clear()
            launched.clear()
            m(x[rank::2][:2], labels=y[rank::2][:2], reduction="sum").backward()
            after_backward = opt._landed
            opt.step(LR)
            steps.append(dict(seen=list(seen), after_backward=after_backward, after_step=(
                opt._landed, opt._launched), launched=list(launched)))
        out[stage, "steps"], out[stage, "order"] = steps, opt._order
        out[stage, "buckets"], out[stage, "inflight"] = len(opt.buckets), opt.inflight
        # complete parameters after finish_gathers() (no forward ran): the masters, cast
        opt.finish_gathers()
        pieces = [p.detach().reshape(-1)[pc.start:pc.start + pc.n] for p, pc in zip(opt.params, opt.pieces)]
        out[stage, "finished"] = all(torch.equal(a, b.to(a.dtype)) for a, b in zip(pieces, opt.master))
        full = [p.detach().clone() for p in opt.params]
        copies = [torch.empty_like(t) for t in full for _ in range(2)]
        for k, t in enumerate(full):
            dist.all_gather(copies[2 * k:2 * k + 2], t)
        out[stage, "same_on_ranks"] = all(torch.equal(copies[2 * k], copies[2 * k + 1]) for k in range(len(full)))
        # hooks asked in different orders: rank 0 waits for the last site first, rank 1 the first
        # (the launch order is fixed, so the collectives still pair up)
        m(x[:2], labels=y[:2], reduction="sum").backward()
        opt.step(LR)
        sites = list(range(len(opt._site_pos)))
        for s in (sites[::-1] if rank == 0 else sites):
            opt._wait_site(s, None, ())
        out[stage, "any_order"] = opt._landed == len(opt._order)
        opt.teardown()
    # gradient buckets: grads completing in opposite orders on the two ranks (rank 1: the embedding
    # first) are still reduced in one order; a bucket with no gradient blocks those behind it
    for case in ("orders", "missing"):
        m = make_model()
        opt = Z.apply_zero_0_to_2(m, 1, dist.group.WORLD, P.OptimConfig(lr=LR), bucket_mb=0.02)
        launched, real = [], opt.sync._launch
        opt.sync._launch = lambda b: launched.append(b) or real(b)
        for p in opt.params:
            p.grad = torch.full_like(p, rank + 1.0)
        positions = list(range(len(opt.params)))
        skip = set(opt.sync.buckets[0].index) if case == "missing" else set()
        for i in (positions if rank == 0 else positions[::-1]):
            if i not in skip:
                opt.sync._on_grad(opt.sync._where[i][0], i, opt.params[i])
        try:
            opt.finish()
            out[case] = (launched, all(bool((p.grad.view(-1)[pc.start:pc.start + pc.n] == 3).all())
                                       for p, pc in zip(opt.params, opt.pieces)))
        except RuntimeError as e:
            out[case] = (launched, str(e))
        opt.teardown()
    return out


def test_zero12_parameter_gather_overlaps_the_next_forward():
    """After step() the all-gathers are due, none launched; the next forward's site hooks launch and
    wait for them bucket by bucket in forward order (the embedding's first), never more than
    `inflight` in flight, all complete before the head; the launch order is the same fixed one
    every step on every rank, so hooks asked in any order complete; finish_gathers() leaves every
    parameter equal to its master (cast) and the same on both ranks. Gradient buckets: reduced in
    one fixed order whatever order their gradients complete in on each rank."""
    for out in run_ranks(_overlap, 2):
        for stage in (1, 2):
            n, k, order = out[stage, "buckets"], out[stage, "inflight"], out[stage, "order"]
            assert n > 2 * k and sorted(order) == list(range(n))
            steps = out[stage, "steps"]
            assert all(st["after_step"] == (0, 0) and st["after_backward"] == n for st in steps)
            assert steps[0]["seen"] == [(n, 0)] * len(steps[0]["seen"])  # the init: complete
            for st in steps[1:]:  # the forward after a step
                landed = [a for a, _ in st["seen"]]
                assert landed == sorted(landed) and 1 <= landed[0] < n and landed[-1] == n, st["seen"]
                assert all(f <= k for _, f in st["seen"]) and st["seen"][-1] == (n, 0)
                assert st["launched"] == order  # by the forward's hooks, in the one order
            assert out[stage, "finished"] and out[stage, "same_on_ranks"] and out[stage, "any_order"]
        launched, summed = out["orders"]
        assert launched == sorted(launched) and len(launched) > 2 and summed is True  # index order
        launched, error = out["missing"]
        assert launched == [] and "bucket 0 got no gradient" in error, error


def _fp32_accumulation(rank: int, world: int) -> dict:
    """bf16 compute, 8 micro-batches of one row per rank: the fp32 gradient the optimizer sees
    (`_master_grads()`: whole params at stage 0, this rank's pieces at stages 1-3) vs the fp64 sum of
    the very same bf16 micro-batch gradients (a plain bf16 copy of the model), rounded to fp32."""
    x, y = dataset()
    micro = 8
    single = [dist.new_group([r]) for r in range(world)][rank]
    out: dict = {}
    for label, group, rows in (("dp2", dist.group.WORLD, range(2 * micro)),
                               ("dp1", single, range(rank * micro, (rank + 1) * micro))):
        targets = int(sum(P.count_targets(y[i]) for i in rows))
        ref = make_model()
        for p in ref.parameters():  # as MixedPrecisionOptimizer: params only (RoPE buffers stay fp32)
            p.data = p.data.to(BF16)
        exact = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
        for i in rows:
            P.normalized_loss(ref(x[i:i + 1], labels=y[i:i + 1], reduction="sum"), targets).backward()
            for e, p in zip(exact, ref.parameters()):
                e += p.grad.double()
            ref.zero_grad(set_to_none=True)
        exact = [e.float().reshape(-1) for e in exact]
        mine = list(rows)[-micro:] if label == "dp1" else range(rank * micro, (rank + 1) * micro)
        for reduce_dtype in (FP32, None):
            for stage in range(4):
                m = make_model()
                opt = Z3.apply_zero(m, stage, group, P.OptimConfig(lr=LR), BF16, bucket_mb=0.01,
                                    reduce_dtype=reduce_dtype)
                for k, i in enumerate(mine):
                    with opt.no_sync() if k < micro - 1 else contextlib.nullcontext():
                        P.normalized_loss(m(x[i:i + 1], labels=y[i:i + 1], reduction="sum"),
                                          targets).backward()
                opt.finish()
                out[label, reduce_dtype, stage, "bf16 grads"] = sum(p.grad is not None for p in m.parameters())
                err = 0.0  # largest |seen - exact| relative to the parameter's largest exact grad
                pc = getattr(opt, "pieces", None)  # stages 1-3: this rank's piece of each parameter
                for i, g in enumerate(opt._master_grads()):
                    e = exact[i] if pc is None else exact[i][pc[i].start:pc[i].start + pc[i].n]
                    err = max(err, ((g.reshape(-1) - e).abs().max() / exact[i].abs().max()).item()
                              if e.numel() else 0.0)
                out[label, reduce_dtype, stage] = (err, len(opt.sync.handles))
                opt.teardown()
                out[label, reduce_dtype, stage, "handles"] = len(opt.sync.handles)
    return out


def test_fp32_accumulation_of_bf16_grads():
    """With bf16 compute and reduce_dtype=fp32 every stage accumulates the micro-steps and sums over
    dp in fp32: the optimizer's grads equal the exactly rounded fp32 sum to ~fp32 precision
    (measured <= 4e-8, an fp32 ulp or so of the largest grad; bound 1e-6). With
    reduce_dtype=None the sum rounds to 8 mantissa bits at each add (measured 7e-3 - 9e-3; must be > 1e-4).
    At dp=1 stage 0 hooks only when fp32 accumulation is asked for. With fp32 reductions no stage
    leaves a bf16 .grad behind after finish(): the step reads the fp32 sums (stage 0 used to round
    them into .grad too: 2Ψ and a kernel per parameter that nothing read)."""
    for out in run_ranks(_fp32_accumulation, 2):
        for label in ("dp2", "dp1"):
            for stage in range(4):
                wide, hooks = out[label, FP32, stage]
                narrow, hooks_bf16 = out[label, None, stage]
                assert wide <= 1e-6 and narrow > 1e-4, (label, stage, wide, narrow)
                assert out[label, FP32, stage, "bf16 grads"] == 0, (label, stage)  # the fp32 sums only
                assert out[label, FP32, stage, "handles"] == out[label, None, stage, "handles"] == 0
                if label == "dp1" and stage == 0:
                    assert hooks > 0 and hooks_bf16 == 0  # dp=1 bf16 accumulation stays hook-free


def _virtual_gathers(rank: int, world: int) -> dict:
    """ZeRO-3 at dp=2 on the last of 2 pipeline stages with v=2 chunks (virtual stages 1 and 3:
    layer 1; layer 3, norm and head), one micro-batch through both chunks: all-gathers per unit."""
    from pp import stage_chunks
    cfg = M.LlamaConfig(**{**CFG.__dict__, "num_hidden_layers": 4})
    ranges = partition(4, 4)
    model = W.materialize(split_stage(M.build(cfg), 1, 2, ranges), "cpu", seed=3)
    opt = Z3.apply_zero(model, 3, None, P.OptimConfig(lr=LR), FP32, prefetch=1)
    chunks = stage_chunks(model, ranges, 1, 2)
    counts, launch = [0] * len(opt.flat_params), Z3.launch

    def counted(fn, full, *args):
        counts[next(u for u, f in enumerate(opt.flat_params) if f is full)] += 1
        return launch(fn, full, *args)

    Z3.launch = counted
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(2, 8, cfg.hidden_size, generator=g, requires_grad=True)  # (B, S, H) from stage 0
        labels = torch.randint(0, cfg.vocab_size, (2, 8), generator=g)
        h = chunks[0](x)  # (B, S, H), to virtual stage 2 (rank 0)
        h2 = h.detach().requires_grad_()
        loss = chunks[1](h2, labels=labels, reduction="sum")
        loss.backward()
        h.backward(h2.grad)
        opt.finish()
    finally:
        Z3.launch = launch
    units = [[opt.names[i] for i in b.index] for b in opt.buckets]
    opt.teardown()
    return {"counts": counts, "units": units}


def test_zero3_virtual_stages_gather_each_unit_twice():
    """Issue 22: the chunks of virtual stages share the model's hook dicts, so the head's
    end-of-site hook ran after every chunk's forward and hooked each output: the head was gathered
    again in every chunk's backward. Each unit is gathered exactly twice per micro-batch: once for
    its forward, once for its backward."""
    for r in run_ranks(_virtual_gathers, 2):
        assert r["counts"] == [2] * len(r["units"]), (r["counts"], r["units"])
        assert any("lm_head.weight" in u for u in r["units"]) and len(r["units"]) == 3
