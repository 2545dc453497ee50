"""dp.py: the dp-rank sampler (pure Python) and GradSync against the single-process step.

References: the dp=1 sampler's global order (brute force over positions) and a single process
training on the whole global batch with MixedPrecisionOptimizer. Tolerances: dp vs single process
1e-5 relative on the loss curve (fp32; the matmuls sum the batch in another grouping); dp=1 and
bucket-size changes at dp=2 are bit-exact (no communication; a+b is a+b however it is bucketed).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import dp
import model as M
import precision as P
from dist import run_ranks
import weights as W

CFG = M.LlamaConfig(vocab_size=96, hidden_size=30, intermediate_size=60, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
SEQ, N_ROWS, G, STEPS, LR = 16, 40, 8, 5, 1e-2


def make_model(seed: int = 0, **over) -> M.Llama:
    return W.materialize(M.build(replace(CFG, **over)), "cpu", seed=seed)


def dataset(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with very uneven target counts: row i keeps a random prefix of labels (every 5th row a
    single target), so dp ranks and micro-batches see different numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (N_ROWS, SEQ), generator=g)
    y = torch.randint(0, CFG.vocab_size, (N_ROWS, SEQ), generator=g)
    keep = torch.randint(1, SEQ + 1, (N_ROWS,), generator=g)
    keep[::5] = 1
    y[torch.arange(SEQ)[None] >= keep[:, None]] = -100
    return x, y


def train(model: nn.Module, opt, sampler: dp.DPSampler, micro: int, group=None, no_sync=None,
          finish=None, steps: int = STEPS) -> tuple[list[float], list[float]]:
    """The training loop of train.py in miniature: loss of step = sum over micro-batches and dp
    ranks of token-loss sums / global target count. Returns (loss curve, grad norms)."""
    x, y = dataset()
    losses, norms = [], []
    for _ in range(steps):
        idx = torch.tensor(sampler.next_batch())
        xs, ys = x[idx].chunk(micro), y[idx].chunk(micro)
        local = sum(P.count_targets(t) for t in ys)
        targets = dp.global_count(local, group) if group is not None else int(local)
        total = torch.zeros(())
        for k, (xb, yb) in enumerate(zip(xs, ys)):
            with no_sync() if no_sync and k < micro - 1 else contextlib.nullcontext():
                loss = P.normalized_loss(model(xb, labels=yb, reduction="sum"), targets)
                loss.backward()
            total += loss.detach()
        if finish:
            finish()
        if group is not None:
            dist.all_reduce(total, group=group)
        losses.append(total.item())
        norms.append(opt.step(LR))
    return losses, norms


def reference(steps: int = STEPS, **model_over) -> tuple[list[float], list[float]]:
    """Single process, whole global batch in one backward."""
    m = make_model(**model_over)
    opt = P.MixedPrecisionOptimizer(m.named_parameters(), P.OptimConfig(lr=LR, clip=0.5))
    return train(m, opt, dp.DPSampler(N_ROWS, G, 0, 1, seed=7), 1, steps=steps)


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(u - v) / abs(v) for u, v in zip(a, b))


# ---------------------------------------------------------------------------------------- sampler
def test_sampler_epoch_coverage_and_layout_free_batches():
    state = torch.random.get_rng_state()
    for n, remainder in ((40, "drop"), (43, "drop"), (43, "wrap")):
        single = dp.DPSampler(n, G, 0, 1, seed=3, remainder=remainder)
        steps = single.steps_per_epoch
        assert steps == (n // G if remainder == "drop" else -(-n // G))
        ref = [single.next_batch() for _ in range(2 * steps)]  # two epochs
        perm0 = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist()
        flat0 = [i for b in ref[:steps] for i in b]
        if remainder == "drop":  # each sample at most once; exactly the permutation's head
            assert flat0 == perm0[:steps * G] and len(set(flat0)) == len(flat0)
        else:  # every sample exactly once, then the last batch padded from the epoch's start
            assert flat0 == perm0 + perm0[:steps * G - n] and set(flat0) == set(range(n))
        assert ref[steps] != ref[0]  # epoch 1 reshuffles (seed + epoch)
        for dp_size in (2, 4, 8):
            ranks = [dp.DPSampler(n, G, r, dp_size, seed=3, remainder=remainder) for r in range(dp_size)]
            for k in range(2 * steps):
                parts = [s.next_batch() for s in ranks]
                assert all(len(p) == G // dp_size for p in parts)
                assert sum(parts, []) == ref[k], (n, remainder, dp_size, k)  # same global batch
        # a TP/PP peer constructs the sampler with the same dp rank: identical rows
        a, b = dp.DPSampler(n, G, 1, 2, seed=3), dp.DPSampler(n, G, 1, 2, seed=3)
        assert [a.next_batch() for _ in range(3)] == [b.next_batch() for _ in range(3)]
    assert torch.equal(torch.random.get_rng_state(), state), "the sampler touched the global RNG"


def test_sampler_resume_exact_and_across_dp_sizes():
    n = 43
    ref = dp.DPSampler(n, G, 0, 1, seed=5)
    expected = [ref.next_batch() for _ in range(12)]  # crosses two epoch boundaries (5 steps/epoch)
    for stop in (0, 3, 5, 7):
        old = [dp.DPSampler(n, G, r, 2, seed=5) for r in range(2)]
        for _ in range(stop):
            [s.next_batch() for s in old]
        state = old[0].state_dict()
        assert state["dp_size"] == 2 and state["offset"] == (stop % 5) * G and state["epoch"] == stop // 5
        for dp_size in (2, 4, 1):  # same layout, and a different dp size: the global offset maps
            new = [dp.DPSampler(n, G, r, dp_size, seed=5) for r in range(dp_size)]
            for s in new:
                s.load_state_dict(state)
            got = [sum((s.next_batch() for s in new), []) for _ in range(12 - stop)]
            assert got == expected[stop:], (stop, dp_size)
    state = dp.DPSampler(n, G, 0, 2, seed=5).state_dict()
    for k, bad in (("global_batch", dict(global_batch=16)), ("seed", dict(seed=6)),
                   ("num_samples", dict(num_samples=44)), ("remainder", dict(remainder="wrap"))):
        args = dict(num_samples=n, global_batch=G, dp_rank=0, dp_size=2, seed=5) | bad
        with pytest.raises(ValueError, match=k):
            dp.DPSampler(**args).load_state_dict(state)
    with pytest.raises(ValueError, match="offset"):
        dp.DPSampler(n, G, 0, 2, seed=5).load_state_dict(state | {"offset": 3})


def test_sampler_rejects_bad_layouts():
    with pytest.raises(ValueError, match="global batch 10 is not a positive multiple of dp size 4"):
        dp.DPSampler(100, 10, 0, 4, seed=0)
    with pytest.raises(ValueError, match="7 samples cannot fill one global batch of 8"):
        dp.DPSampler(7, 8, 0, 1, seed=0)
    with pytest.raises(ValueError, match="dp_rank=2"):
        dp.DPSampler(100, 8, 2, 2, seed=0)
    with pytest.raises(ValueError, match="remainder"):
        dp.DPSampler(100, 8, 0, 2, seed=0, remainder="pad")
    assert dp.DPSampler(7, 8, 0, 2, seed=0, remainder="wrap").steps_per_epoch == 1


# ---------------------------------------------------------------------------------------- grad sync
def grads_once(model: nn.Module, group, bucket_mb: float, reduce_dtype=None) -> list[torch.Tensor]:
    """One synced backward of this rank's rows; returns the dp-summed grads."""
    x, y = dataset()
    rank = dist.get_rank(group)
    sync = dp.GradSync(list(model.parameters()), group, bucket_mb, reduce_dtype)
    xb, yb = x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]
    model(xb, labels=yb, reduction="sum").div(100).backward()
    sync.finish()
    sync.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _dp_ranks(rank: int, world: int) -> dict:
    out: dict = {}
    world_group = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    pair = pairs[rank // 2]
    cfg = P.OptimConfig(lr=LR, clip=0.5)
    # dp=4 and dp=2 vs the single process; with and without accumulation; tiny and large buckets
    layouts = (("dp4", world_group, 4, 1, 25.0), ("dp4_acc", world_group, 4, 2, 1e-4),
               ("dp2_acc", pair, 2, 2, 25.0))
    for name, group, dp_size, micro, mb in layouts:
        m = make_model()
        opt = P.MixedPrecisionOptimizer(m.named_parameters(), cfg)
        sync = dp.GradSync(list(m.parameters()), group, bucket_mb=mb)
        out[f"{name}_buckets"] = len(sync.buckets)
        sampler = dp.DPSampler(N_ROWS, G, dist.get_rank(group), dp_size, seed=7)
        out[name] = train(m, opt, sampler, micro, group, sync.no_sync, sync.finish)
        sync.remove()
    # bucketed == unbucketed: one bucket per parameter vs a single bucket
    for name, group in (("pair", pair), ("world", world_group)):
        tiny, huge = grads_once(make_model(), group, 1e-6), grads_once(make_model(), group, 1e4)
        out[f"bucket_exact_{name}"] = all(torch.equal(a, b) for a, b in zip(tiny, huge))
        out[f"bucket_maxdiff_{name}"] = max(((a - b).abs().max() / b.abs().max()).item()
                                            for a, b in zip(tiny, huge))
    # dp=1 group: no hooks, bit-identical to the plain loop
    m = make_model()
    sync = dp.GradSync(list(m.parameters()), singles[rank], bucket_mb=1e-4)
    out["dp1_handles"] = len(sync.handles)
    opt = P.MixedPrecisionOptimizer(m.named_parameters(), cfg)
    sampler = dp.DPSampler(N_ROWS, G, 0, 1, seed=7)
    out["dp1"] = train(m, opt, sampler, 2, singles[rank], sync.no_sync, sync.finish)
    m2 = make_model()
    opt = P.MixedPrecisionOptimizer(m2.named_parameters(), cfg)
    out["plain"] = train(m2, opt, dp.DPSampler(N_ROWS, G, 0, 1, seed=7), 2)
    out["dp1_params_equal"] = all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    # bf16 grads summed in fp32 (rounded once) vs in bf16 (rounded at each add), against fp64 sums
    m16 = make_model().to(torch.bfloat16)
    g16 = grads_once(m16, world_group, 25.0)
    g32 = grads_once(m16, world_group, 25.0, reduce_dtype=torch.float32)
    x, y = dataset()
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in m16.parameters()]
    for r in range(world):  # every rank's local grads, summed in fp64: the exactly rounded sum
        m16(x[4 * r:4 * r + 4], labels=y[4 * r:4 * r + 4], reduction="sum").div(100).backward()
        for e, p in zip(exact, m16.parameters()):
            e += p.grad.double()
        m16.zero_grad(set_to_none=True)
    for name, got in (("bf16_err", g16), ("fp32_err", g32)):  # distance to the exactly rounded sum
        out[name] = sum((a.double() - e.to(torch.bfloat16).double()).abs().sum().item()
                        for a, e in zip(got, exact))
    # a second synced backward before finish() is an error, not a silent double sum
    m = make_model()
    sync = dp.GradSync(list(m.parameters()), world_group)
    m(x[:2], labels=y[:2], reduction="sum").backward()
    try:
        m(x[:2], labels=y[:2], reduction="sum").backward()
        out["twice"] = "no error"
    except RuntimeError as e:
        out["twice"] = str(e)
    sync.remove()
    # a parameter missing from a synced backward: a clear error, never a hang
    lin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    sync = dp.GradSync(list(lin.parameters()), world_group)
    lin[0](torch.ones(2, 4)).sum().backward()
    try:
        sync.finish()
        out["missing"] = "no error"
    except RuntimeError as e:
        out["missing"] = str(e)
    sync.remove()
    return out


def test_dp_matches_single_process_and_bucketing():
    ref = reference()
    res = run_ranks(_dp_ranks, 4)
    for r, out in enumerate(res):
        for name in ("dp4", "dp4_acc", "dp2_acc"):
            losses, norms = out[name]
            assert rel(losses, ref[0]) <= 1e-5, (r, name, losses, ref[0])
            assert rel(norms, ref[1]) <= 1e-5, (r, name, norms, ref[1])
        assert out["dp4_acc_buckets"] == len(list(make_model().parameters())) > out["dp4_buckets"] == 1
        assert out["bucket_exact_pair"], out["bucket_maxdiff_pair"]  # 2 ranks: a+b in any bucket
        assert out["bucket_maxdiff_world"] <= 1e-6  # 4 ranks: gloo's add order depends on buffer size
        assert out["dp1_handles"] == 0
        assert out["fp32_err"] < out["bf16_err"] / 100  # one rounding instead of three
        assert "reduced twice" in out["twice"] and "no_sync" in out["twice"]
        assert "only some of their gradients" in out["missing"]
        assert out["dp1"] == out["plain"] and out["dp1_params_equal"]  # dp=1: the exact no-op
