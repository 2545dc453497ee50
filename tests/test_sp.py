"""Sequence parallelism (`tp.apply_tp(..., sequence_parallel=True)`) against independent references:
plain torch math for the two sequence comm ops, the single-process model (same seed, same data) for
whole models, pipeline stages and 5 AdamW steps, and a byte count derived by hand for the saved
activations.

Tolerances (fp32), as in test_tp.py:
- ops <= 1e-6 relative (a reduce-scatter adds 2 or 4 partial tensors in gloo's order), exact
  (torch.equal) where data only moves (all-gather, the tp=1 no-ops);
- whole model, pipeline stages, 5 AdamW steps <= 1e-5 relative: the norm weights' gradients are now
  summed per rank over S/tp tokens, then over ranks — another order of the same float sum;
- exact where no arithmetic differs: replicated gradients across tp ranks (one all-reduce result).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import model as M
import tp as T
from ac import SavedActivationMeter
from dist import run_ranks
from precision import MixedPrecisionOptimizer, count_targets, normalized_loss
from test_tp import CONFIGS, OPT, SEED, STEPS, from_numpy, make_batch, rel, to_numpy, tp_groups
import weights as W


def _check_ops(g: dist.ProcessGroup) -> None:
    tp, r = dist.get_world_size(g), dist.get_rank(g)
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(2, 4 * tp, 3, generator=gen)  # (B, S, H) identical on every rank
    G = torch.randn(tp, 2, 4 * tp, 3, generator=gen)  # per-rank partial sums / upstream gradients

    x = X.chunk(tp, 1)[r].clone().requires_grad_()  # gather: all-gather forward, reduce-scatter back
    y = T.gather_from_sequence_region(x, g)
    y.backward(G[r])
    assert torch.equal(y, X) and rel(x.grad, G.sum(0).chunk(tp, 1)[r]) <= 1e-6

    x = G[r].clone().requires_grad_()  # reduce-scatter forward, all-gather backward
    y = T.reduce_scatter_to_sequence_region(x, g)
    y.backward(X.chunk(tp, 1)[r])
    assert rel(y, G.sum(0).chunk(tp, 1)[r]) <= 1e-6 and torch.equal(x.grad, X)


def _stages(g: dist.ProcessGroup) -> None:
    """Pipeline stages under sequence parallelism (tied CFG_B): stage 0 = embed + layer 0 hands on
    (B, S/tp, H), this rank's tokens of the plain model's hidden states; stage 1 = layer 1 + norm +
    head fed that shard gives the plain loss — with and without position_ids."""
    cfg, r, tp = CONFIGS["B"], dist.get_rank(g), dist.get_world_size(g)
    plain = W.materialize(M.build(cfg), "cpu", seed=SEED)
    ids, labels, packed = make_batch(cfg)
    first, last = M.build(cfg), M.build(cfg)
    del first.model.layers["1"]
    first.model.norm, first.lm_head = None, None
    del last.model.layers["0"]
    last.model.embed_tokens = None
    for stage in (first, last):
        W.materialize(stage, "cpu", seed=SEED, shards=T.apply_tp(stage, g, sequence_parallel=True))
    with torch.no_grad():
        for pos in (None, packed):
            S = ids.shape[1]
            full_pos = torch.arange(S).expand_as(ids) if pos is None else pos
            mask = None if pos is None else M.attention_mask(pos)
            h_ref = plain.model.layers["0"](plain.model.embed_tokens(ids),
                                            *plain.model.rotary_emb(full_pos, torch.float32), mask)
            h = first(ids, pos)
            assert h.shape == (ids.shape[0], S // tp, cfg.hidden_size)
            assert rel(h, h_ref.chunk(tp, 1)[r]) <= 1e-6
            assert rel(last(h, pos, labels), plain(ids, pos, labels)) <= 1e-6


def _meter_layer(g: dist.ProcessGroup, sp: bool, B: int, S: int) -> int:
    """Bytes one decoder layer (CFG_B at this tp) saves for backward, given full-length cos/sin."""
    cfg = CONFIGS["B"]
    model = M.build(cfg)
    W.materialize(model, "cpu", seed=SEED, shards=T.apply_tp(model, g, sequence_parallel=sp))
    tp, r = dist.get_world_size(g), dist.get_rank(g)
    x = torch.randn(B, S, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    x = (x.chunk(tp, 1)[r] if sp else x).clone().requires_grad_()  # its own storage, as in training
    cos, sin = model.model.rotary_emb(torch.arange(S).expand(B, S), x.dtype)
    with SavedActivationMeter() as meter:
        model.model.layers["0"](x, cos, sin, None)
    return meter.nbytes - cos.nbytes - sin.nbytes  # cos/sin: one copy shared by all layers


def _ops_stages_errors(rank: int, world: int) -> dict:
    g1, g2, g4 = (tp_groups(rank, world, n) for n in (1, 2, 4))
    for g in (g2, g4):
        _check_ops(g)
    _stages(g2)
    # tp=1: sequence parallelism is the plain model too; the ops return their input object
    model = M.build(CONFIGS["A"])
    before = dict(model.named_modules())
    assert T.apply_tp(model, g1, sequence_parallel=True) == {} and dict(model.named_modules()) == before
    x = torch.randn(2, 3, 4)
    assert T.gather_from_sequence_region(x, g1) is x and T.reduce_scatter_to_sequence_region(x, g1) is x
    # a sequence that does not split into tp shards: refused by the embedding, before any collective
    model = M.build(CONFIGS["B"])
    W.materialize(model, "cpu", seed=SEED, shards=T.apply_tp(model, g4, sequence_parallel=True))
    ids, labels, _ = make_batch(CONFIGS["B"], S=14)
    with pytest.raises(ValueError, match=r"sequence of 14 tokens does not split into tp=4"):
        model(ids, labels=labels)
    B, S = 2, 16
    return {tp: (_meter_layer(g, False, B, S), _meter_layer(g, True, B, S)) for tp, g in ((2, g2), (4, g4))}


def test_sp_ops_stages_errors_and_saved_bytes():
    saved = run_ranks(_ops_stages_errors, 4)[0]
    # Each RMSNorm keeps for backward its input x and its rstd (h + 1 values per token; ops.py), now
    # for S/tp tokens instead of S. What stays full
    # length: the gathered norm outputs that q/k/v and gate/up save, and the head-sharded attention
    # and MLP tensors (already 1/tp under plain TP).
    h, B, S = CONFIGS["B"].hidden_size, 2, 16
    for tp, (plain_tp, sp) in saved.items():
        print(f"saved activations per layer, tp={tp}: {plain_tp} B without SP, {sp} B with SP")
        assert plain_tp - sp == 2 * (h + 1) * B * S * (tp - 1) // tp * 4, (tp, plain_tp, sp)


def test_validate_sequence_length():
    T.tp_validate(CONFIGS["B"], 4, seq_len=32)
    with pytest.raises(ValueError, match=r"tp=4 must divide the sequence length 30"):
        T.tp_validate(CONFIGS["B"], 4, seq_len=30)


# ------------------------------------------------------------------------------------ whole model
def _run(model: M.Llama, shards: dict, group, cfg: M.LlamaConfig) -> dict:
    """Loss and gradients without position_ids (RoPE of the whole sequence from a sharded residual),
    then STEPS AdamW steps on one packed batch."""
    tp_rank = dist.get_rank(group) if group is not None else 0
    named = list(model.named_parameters())
    ids, labels, pos = make_batch(cfg)
    plain_loss = model(ids, None, labels, reduction="sum")
    plain_loss.backward()
    out = {"plain_loss": plain_loss.detach(), "plain_grads": {n: p.grad.clone() for n, p in named}}
    model.zero_grad(set_to_none=True)
    opt = MixedPrecisionOptimizer(named, OPT, torch.float32, norm_groups=[group] if group is not None else [],
                                  counted=lambda n: n in shards or tp_rank == 0)
    out["losses"], out["norms"] = [], []
    for step in range(STEPS):
        loss = normalized_loss(model(ids, pos, labels, reduction="sum"), count_targets(labels))
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in named}
        out["norms"].append(opt.step(OPT.lr))
        out["losses"].append(loss.item())
    return out


def _sp_rank(rank: int, world: int, cfg_name: str) -> dict:
    cfg, g = CONFIGS[cfg_name], tp_groups(rank, world, world)
    model = M.build(cfg)
    shards = T.apply_tp(model, g, sequence_parallel=True)
    W.materialize(model, "cpu", seed=SEED, shards=shards)
    out = _run(model, shards, g, cfg)
    for key in ("grads", "plain_grads"):
        out["full_" + key] = T.gather_full(out[key], shards, g, cfg)
        out[key] = {n: v for n, v in out[key].items() if n not in shards}  # replicated ones only
    return to_numpy(out)


@functools.lru_cache
def _reference(cfg_name: str) -> dict:
    cfg = CONFIGS[cfg_name]
    return _run(W.materialize(M.build(cfg), "cpu", seed=SEED), {}, None, cfg)


@pytest.mark.parametrize("cfg_name,tp", [("A", 2), ("B", 4)])
def test_sp_model_matches_single_process(cfg_name, tp):
    ref = _reference(cfg_name)
    results = from_numpy(run_ranks(_sp_rank, tp, cfg_name))
    r0 = results[0]
    assert rel(r0["plain_loss"], ref["plain_loss"]) <= 1e-5
    for key in ("plain_grads", "grads"):  # without / with position_ids; gathered to full HF shapes
        assert r0["full_" + key].keys() == ref[key].keys()
        for name, want in ref[key].items():
            got = r0["full_" + key][name]
            assert got.shape == want.shape and rel(got, want) <= 1e-5, (key, name, rel(got, want))
    # the norm weights (and A's row biases) saw S/tp tokens per rank; after their in-graph
    # all-reduce every tp rank holds the same full gradient, so counting them on tp rank 0 is right
    assert any(n.endswith("norm.weight") for n in r0["grads"])
    for res in results[1:]:
        for key in ("plain_grads", "grads"):
            assert all(torch.equal(v, r0[key][n]) for n, v in res[key].items()), key
        assert res["losses"] == r0["losses"]
    for step, (got, want) in enumerate(zip(r0["losses"], ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    for step, (got, want) in enumerate(zip(r0["norms"], ref["norms"])):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    assert ref["losses"][-1] < ref["losses"][0] - 0.1 and max(ref["norms"]) > OPT.clip
