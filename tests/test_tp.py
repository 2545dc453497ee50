"""tp.py against independent references: plain single-process torch math for every comm op and layer,
the single-process model (same seed, same data) for whole models and 5 AdamW steps, and HF
transformers for loading a `save_pretrained` directory and for exporting.

Tolerances (fp32):
- ops and layers <= 1e-6 relative to the tensor's largest value: a tp split only reorders a few
  float sums (two or four partial GEMMs added by gloo instead of one GEMM's inner loop);
- whole model, 5 AdamW steps, transformers <= 1e-5 relative: the same reorderings compound over
  layers and steps (gloo sums fp32 in its own order at 4 ranks);
- exact (torch.equal) where no arithmetic differs: comm ops at tp=1 (the input object itself), the
  tp=1 model, init slicing, gather_full of the init, replicated gradients across tp ranks.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import ac as AC
import model as M
from loss import IGNORE_INDEX, cross_entropy, linear_cross_entropy, vocab_parallel_cross_entropy
import tp as T
from dist import run_ranks
from precision import MixedPrecisionOptimizer, OptimConfig, count_targets, normalized_loss
import weights as W

# A: GQA with kv == tp=2, biases (row-parallel bias added once), vocab 257 (padded to 258), untied.
CFG_A = M.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, attention_bias=True, mlp_bias=True,
                      initializer_range=0.1)
# B: tied embeddings; at tp=4 kv == tp and vocab 250 is padded to 252; at tp=2 no padding, 2 kv/rank.
CFG_B = M.LlamaConfig(vocab_size=250, hidden_size=32, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                      max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.1)
CONFIGS = {"A": CFG_A, "B": CFG_B}
SEED, STEPS = 7, 5
OPT = OptimConfig(lr=1e-2, weight_decay=0.1, clip=1.0)  # clip active: the tp grad norm matters


def to_numpy(obj):
    """Tensors travel back from ranks as numpy arrays: torch's queue would share their storage by
    file descriptor, which is gone once the rank exits."""
    return tree_map(lambda x: x.numpy() if isinstance(x, torch.Tensor) else x, obj)


def from_numpy(obj):
    return tree_map(lambda x: torch.from_numpy(x) if hasattr(x, "__array__") else x, obj)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def tp_groups(rank: int, world: int, size: int) -> dist.ProcessGroup:
    """Consecutive blocks of `size` ranks (tp innermost); every rank creates every group."""
    mine = None
    for start in range(0, world, size):
        g = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g
    return mine


def make_batch(cfg: M.LlamaConfig, B: int = 2, S: int = 16, seed: int = 0):
    """Random ids, shifted labels with ~25% ignored, two packed documents per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    ids[0, 0] = cfg.vocab_size - 1  # the last real id: in the last (padded) vocab slice
    labels = torch.full((B, S), IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    labels[torch.rand(B, S, generator=g) < 0.25] = IGNORE_INDEX
    cut = S // 3
    pos = torch.cat([torch.arange(cut), torch.arange(S - cut)]).expand(B, S)
    labels[:, cut - 1] = IGNORE_INDEX  # no target across the document boundary
    return ids, labels, pos


class MaxShape(TorchDispatchMode):
    """Records the largest dim and numel of every tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.dim = self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                self.dim, self.numel = max(self.dim, max(t.shape)), max(self.numel, t.numel())
        return out


# ------------------------------------------------------------------------------------ ops, layers
def _check_ops(g: dist.ProcessGroup) -> None:
    tp, r = dist.get_world_size(g), dist.get_rank(g)
    gen = torch.Generator().manual_seed(1)
    X = torch.randn(2, 3, 4 * tp, generator=gen)  # identical on every rank
    G = torch.randn(tp, 2, 3, 4 * tp, generator=gen)  # per-rank upstream gradients / inputs

    x = X.clone().requires_grad_()  # copy: identity forward, all-reduce backward
    y = T.copy_to_region(x, g)
    y.backward(G[r])
    assert torch.equal(y, X) and rel(x.grad, G.sum(0)) <= 1e-6

    x = G[r].clone().requires_grad_()  # reduce: all-reduce forward, identity backward
    y = T.reduce_from_region(x, g)
    y.backward(X)
    assert rel(y, G.sum(0)) <= 1e-6 and torch.equal(x.grad, X)

    x = X.chunk(tp, -1)[r].clone().requires_grad_()  # gather: all-gather forward, split backward
    y = T.gather_from_region(x, g)
    y.backward(G[r])
    assert torch.equal(y, X) and torch.equal(x.grad, G[r].chunk(tp, -1)[r])

    x = X.clone().requires_grad_()  # scatter: split forward, all-gather backward
    y = T.scatter_to_region(x, g)
    y.backward(G[r].chunk(tp, -1)[r])
    assert torch.equal(y, X.chunk(tp, -1)[r])
    assert torch.equal(x.grad, torch.cat([G[k].chunk(tp, -1)[k] for k in range(tp)], -1))


def _check_layers(g: dist.ProcessGroup) -> None:
    tp, r = dist.get_world_size(g), dist.get_rank(g)
    gen = torch.Generator().manual_seed(2)
    X = torch.randn(2, 5, 8, generator=gen)
    # column: out 12 split; gather the output so every rank computes the same scalar loss
    W, b = torch.randn(12, 8, generator=gen), torch.randn(12, generator=gen)
    C = torch.randn(2, 5, 12, generator=gen)
    x, ref = X.clone().requires_grad_(), X.clone().requires_grad_()
    Wr, br = W.clone().requires_grad_(), b.clone().requires_grad_()
    (F.linear(ref, Wr, br) * C).sum().backward()
    col = T.ColumnParallelLinear(8, 12, True, g)
    with torch.no_grad():
        col.weight.copy_(W.chunk(tp)[r]), col.bias.copy_(b.chunk(tp)[r])
    y = T.gather_from_region(col(x), g)
    (y * C).sum().backward()
    assert rel(y, F.linear(X, W, b)) <= 1e-6 and rel(x.grad, ref.grad) <= 1e-6
    assert rel(col.weight.grad, Wr.grad.chunk(tp)[r]) <= 1e-6
    assert rel(col.bias.grad, br.grad.chunk(tp)[r]) <= 1e-6

    # row: in 12 split, fed by scatter; bias replicated, added once after the reduce
    X2 = torch.randn(2, 5, 12, generator=gen)
    W, b = torch.randn(8, 12, generator=gen), torch.randn(8, generator=gen)
    C = torch.randn(2, 5, 8, generator=gen)
    x, ref = X2.clone().requires_grad_(), X2.clone().requires_grad_()
    Wr, br = W.clone().requires_grad_(), b.clone().requires_grad_()
    (F.linear(ref, Wr, br) * C).sum().backward()
    row = T.RowParallelLinear(12, 8, True, g)
    with torch.no_grad():
        row.weight.copy_(W.chunk(tp, 1)[r]), row.bias.copy_(b)
    y = row(T.scatter_to_region(x, g))
    (y * C).sum().backward()
    assert rel(y, F.linear(X2, W, b)) <= 1e-6 and rel(x.grad, ref.grad) <= 1e-6
    assert rel(row.weight.grad, Wr.grad.chunk(tp, 1)[r]) <= 1e-6 and rel(row.bias.grad, br.grad) <= 1e-6

    # embedding: vocab 13 is padded to 14 (tp=2) / 16 (tp=4); ids hit every slice and its edges
    V, H = 13, 8
    W, C = torch.randn(V, H, generator=gen), torch.randn(2, 7, H, generator=gen)
    ids = torch.tensor([[0, 3, 4, 6, 7, 12, 12], [1, 2, 5, 8, 9, 10, 11]])
    Wr = W.clone().requires_grad_()
    (F.embedding(ids, Wr) * C).sum().backward()
    emb = T.VocabParallelEmbedding(V, H, g)
    n = emb.n
    pad_w, pad_g = F.pad(W, (0, 0, 0, n * tp - V)), F.pad(Wr.grad, (0, 0, 0, n * tp - V))
    with torch.no_grad():
        emb.weight.copy_(pad_w[r * n:(r + 1) * n])
    y = emb(ids)
    (y * C).sum().backward()
    assert rel(y, F.embedding(ids, W)) <= 1e-6 and rel(emb.weight.grad, pad_g[r * n:(r + 1) * n]) <= 1e-6

    # vocab-parallel cross-entropy vs F.cross_entropy, ignored rows included; the padded columns
    # hold a huge logit, so any mass leaking to them would show
    L = torch.randn(3, 6, V, generator=gen) * 3
    labels = torch.randint(0, V, (3, 6), generator=gen)
    labels[0, :4] = IGNORE_INDEX
    labels[1, 0], labels[1, 1], labels[2, 0] = V - 1, 0, n - 1
    padded = torch.cat([L, torch.full((3, 6, n * tp - V), 50.0)], -1)  # (3, 6, n*tp)
    for reduction in ("sum", "mean", "none"):
        ref = L.clone().requires_grad_()
        want = F.cross_entropy(ref.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)
        want.backward(torch.ones_like(want))
        local = padded[..., r * n:(r + 1) * n].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(local, labels, reduction, group=g, vocab_size=V)
        got.backward(torch.ones_like(got))
        grad = F.pad(ref.grad, (0, n * tp - V))[..., r * n:(r + 1) * n]  # padded columns: zero grad
        assert rel(got, want) <= 1e-6 and rel(local.grad, grad) <= 1e-6, reduction
    # gathered logits for users: exactly the true vocab, gradient split back
    local = padded[..., r * n:(r + 1) * n].clone().requires_grad_()
    full = T.gather_logits(local, group=g, vocab_size=V)
    full.backward(torch.ones_like(full))
    assert full.shape == L.shape and torch.equal(full, L)
    assert torch.equal(local.grad, (torch.arange(r * n, (r + 1) * n) < V).float().expand_as(local))


def _no_full_vocab(g: dist.ProcessGroup) -> tuple[int, int, int]:
    """A training step at tp on a vocab much larger than tokens: no tensor has a full-vocab dim."""
    cfg = M.LlamaConfig(vocab_size=999, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=64, tie_word_embeddings=True)
    model = M.build(cfg)
    W.materialize(model, "cpu", seed=SEED, shards=T.apply_tp(model, g))
    ids, labels, _ = make_batch(cfg, 2, 16)
    with MaxShape() as rec:
        model(ids, labels=labels, reduction="sum").backward()
    with MaxShape() as control:  # the recorder can see a full-vocab tensor when there is one
        cross_entropy(model(ids).detach(), labels, "sum")
    return rec.dim, rec.numel, control.dim


def _pipeline_stages(g: dist.ProcessGroup) -> None:
    """apply_tp on pipeline stages (tied model): stage 0 = embed + layer 0, stage 1 = layer 1 + norm
    + its own copy of the tied head. Each equals the same part of the plain model."""
    cfg = CFG_B
    plain = W.materialize(M.build(cfg), "cpu", seed=SEED)
    ids, labels, _ = make_batch(cfg)
    with torch.no_grad():
        h_ref = plain.model.layers["0"](plain.model.embed_tokens(ids), *plain.model.rotary_emb(
            torch.arange(ids.shape[1]).expand_as(ids), torch.float32), None)
        loss_ref = plain(ids, labels=labels)
    first, last = M.build(cfg), M.build(cfg)
    del first.model.layers["1"]
    first.model.norm, first.lm_head = None, None
    del last.model.layers["0"]
    last.model.embed_tokens = None  # the head keeps its own Parameter, named lm_head.weight
    for stage, want in ((first, {"model.embed_tokens.weight"}), (last, {"lm_head.weight"})):
        shards = T.apply_tp(stage, g)
        assert set(shards) <= set(dict(stage.named_parameters())) and want <= set(shards)
        assert not any(k.startswith("model.layers.1" if stage is first else "model.layers.0") for k in shards)
        W.materialize(stage, "cpu", seed=SEED, shards=shards)
    with torch.no_grad():
        h = first(ids)
        x = plain.model.layers["1"](h_ref, *plain.model.rotary_emb(
            torch.arange(ids.shape[1]).expand_as(ids), torch.float32), None)
        assert rel(h, h_ref) <= 1e-6 and rel(last(h_ref, labels=labels), loss_ref) <= 1e-6
        assert rel(last(h_ref), plain.lm_head(plain.model.norm(x))) <= 1e-6


def _errors_and_tp1(g1: dist.ProcessGroup, g2: dist.ProcessGroup, g4: dist.ProcessGroup) -> None:
    # tp=1: nothing changes (the plain model is the tp=1 model, bit-identical by construction)
    model = M.build(CFG_A)
    before = dict(model.named_modules())
    assert T.apply_tp(model, g1) == {} and dict(model.named_modules()) == before
    assert model.loss_fn is linear_cross_entropy
    x = torch.randn(3, 4)
    for op in (T.copy_to_region, T.reduce_from_region, T.gather_from_region, T.scatter_to_region):
        assert op(x, g1) is x
    # kv heads 2 cannot be split over 4 ranks: refused before anything is replaced
    model = M.build(CFG_A)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        T.apply_tp(model, g4)
    assert type(model.model.layers["0"].self_attn.k_proj) is nn.Linear
    # after materialize it is too late: weights would be silently re-shaped
    model = W.materialize(M.build(CFG_A), "cpu")
    with pytest.raises(ValueError, match="meta"):
        T.apply_tp(model, g2)


def _collectives(g: dist.ProcessGroup, layers: int, ac_mode: str | None) -> tuple[Counter, Counter]:
    """The gloo collectives this rank runs in one forward and in its backward, by name (profiler
    events: each one really ran, so a selective-AC replay served from its cache is not counted)."""
    cfg = dataclasses.replace(CFG_A, num_hidden_layers=layers)
    model = M.build(cfg)
    W.materialize(model, "cpu", seed=SEED, shards=T.apply_tp(model, g))
    if ac_mode:
        AC.apply_ac(model, ac_mode)
    ids, labels, _ = make_batch(cfg)
    with profile(activities=[ProfilerActivity.CPU]) as fwd:
        loss = model(ids, labels=labels, reduction="sum")
    with profile(activities=[ProfilerActivity.CPU]) as bwd:
        loss.backward()
    return tuple(Counter(e.name for e in p.events() if e.name.startswith("gloo:")) for p in (fwd, bwd))


def _collective_counts(g: dist.ProcessGroup) -> dict:
    """{ac mode: (forward, backward)} collectives per decoder layer — half the difference between 3
    layers and 1 — and of the rest (embedding, head, loss) — 1 layer minus one layer's."""
    out = {}
    for mode in (None, "selective", "full"):
        one, three = _collectives(g, 1, mode), _collectives(g, 3, mode)
        layer = [Counter({k: (c3[k] - c1[k]) // 2 for k in c3}) for c1, c3 in zip(one, three)]
        out[mode] = {"layer": layer, "rest": [c1 - per for c1, per in zip(one, layer)]}
    return out


def _ops_and_layers(rank: int, world: int) -> tuple[int, int, int]:
    g1 = tp_groups(rank, world, 1)
    g2 = tp_groups(rank, world, 2)
    g4 = tp_groups(rank, world, 4)
    for g in (g2, g4):
        _check_ops(g)
        _check_layers(g)
    _pipeline_stages(g2)
    _errors_and_tp1(g1, g2, g4)
    return _no_full_vocab(g2), _collective_counts(g2)


def test_comm_ops_layers_loss_errors_tp2_tp4():
    for (dim, numel, control), counts in run_ranks(_ops_and_layers, 4):
        n, tokens = 500, 32  # vocab 999 padded to 1000: 500 rows per rank; batch 2 x 16
        assert dim <= n, f"a tensor with a dim of {dim} > the vocab slice {n}"
        assert numel <= tokens * n, f"a tensor of {numel} elements > tokens x vocab slice"
        assert control >= 999  # the same recorder sees the full-vocab logits of the plain loss
        # tp.py's docstring: per layer 2 all-reduces forward (o, down) and 2 backward (one per column
        # group: q/k/v, gate/up); selective AC keeps the forward's outputs; full AC's recompute repeats
        # o_proj's, not down_proj's (non-reentrant checkpoint stops once it rebuilt what backward reads).
        # The rest: forward = the embedding's + the loss's 3 per-token all-reduces, backward = the head's.
        ar = "gloo:all_reduce"
        for mode, backward in ((None, 2), ("selective", 2), ("full", 3)):
            layer, rest = counts[mode]["layer"], counts[mode]["rest"]
            assert layer == [Counter({ar: 2}), Counter({ar: backward})], (mode, layer)
            assert rest == [Counter({ar: 4}), Counter({ar: 1})], (mode, rest)


def test_validate_names_the_numbers():
    T.tp_validate(CFG_A, 1), T.tp_validate(CFG_A, 2), T.tp_validate(CFG_B, 4)
    with pytest.raises(ValueError, match=r"tp=4 must divide num_key_value_heads=2"):
        T.tp_validate(CFG_A, 4)
    all_three = r"num_attention_heads=8, num_key_value_heads=4, intermediate_size=100"
    with pytest.raises(ValueError, match=all_three):
        T.tp_validate(dataclasses.replace(CFG_B, intermediate_size=100), 3)
    with pytest.raises(ValueError, match="intermediate_size=100"):
        T.tp_validate(dataclasses.replace(CFG_B, intermediate_size=100), 8)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        T.tp_validate(CFG_A, 0)


# ------------------------------------------------------------------------------------ whole model
def _train(model: M.Llama, shards: dict, group, cfg: M.LlamaConfig) -> dict:
    """STEPS AdamW steps on one fixed batch (a systematic error then grows step by step)."""
    tp_rank = dist.get_rank(group) if group is not None else 0
    named = list(model.named_parameters())
    init = {n: p.detach().clone() for n, p in named}
    opt = MixedPrecisionOptimizer(named, OPT, torch.float32,
                                  norm_groups=[group] if group is not None else [],
                                  counted=lambda n: n in shards or tp_rank == 0)
    ids, labels, pos = make_batch(cfg)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        loss = normalized_loss(model(ids, pos, labels, reduction="sum"), count_targets(labels))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in named}
        norms.append(opt.step(OPT.lr))
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "grads": grads, "init": init}


def _tp_rank(rank: int, world: int, cfg_name: str) -> dict:
    cfg = CONFIGS[cfg_name]
    g = tp_groups(rank, world, world)
    model = M.build(cfg)
    shards = T.apply_tp(model, g)
    W.materialize(model, "cpu", seed=SEED, shards=shards)
    out = _train(model, shards, g, cfg)
    out["full_grads"] = T.gather_full(out["grads"], shards, g, cfg)
    out["full_init"] = T.gather_full(out["init"], shards, g, cfg)
    out["shards"] = shards
    if rank:  # peers only send what is compared across ranks
        out = {"losses": out["losses"], "init": out["init"], "shards": shards,
               "replicated": {n: v for n, v in out["grads"].items() if n not in shards}}
    return to_numpy(out)


@functools.lru_cache
def _reference(cfg_name: str) -> dict:
    cfg = CONFIGS[cfg_name]
    return _train(W.materialize(M.build(cfg), "cpu", seed=SEED), {}, None, cfg)


@pytest.mark.parametrize("cfg_name,tp", [("A", 2), ("B", 2), ("B", 4)])
def test_model_matches_single_process(cfg_name, tp):
    ref = _reference(cfg_name)
    results = from_numpy(run_ranks(_tp_rank, tp, cfg_name))
    r0 = results[0]
    # init: each rank holds exactly its slice of the seeded full init, zero padding past the vocab
    for r, res in enumerate(results):
        for name, local in res["init"].items():
            shard, full = res["shards"].get(name), ref["init"][name]
            if shard is None:
                assert torch.equal(local, full), name
                continue
            want = full.new_zeros(full.shape[:shard.dim] + (tp * shard.size,) + full.shape[shard.dim + 1:])
            want.narrow(shard.dim, 0, full.shape[shard.dim]).copy_(full)  # zero rows past the vocab
            assert torch.equal(local, want.narrow(shard.dim, shard.start, shard.size)), (r, name)
    assert r0["full_init"].keys() == ref["init"].keys()
    assert all(torch.equal(r0["full_init"][n], ref["init"][n]) for n in ref["init"])
    # step 0: loss and every gradient, gathered to the full HF shape
    assert r0["full_grads"].keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        assert r0["full_grads"][name].shape == want.shape, name
        assert rel(r0["full_grads"][name], want) <= 1e-5, (name, rel(r0["full_grads"][name], want))
    # replicated params (absent from the shard map) have the same gradient on every tp rank,
    # so counting them on tp rank 0 only is right
    assert set(ref["grads"]) - set(r0["shards"]) == set(results[1]["replicated"])
    for res in results[1:]:
        assert all(torch.equal(v, r0["grads"][n]) for n, v in res["replicated"].items())
        assert res["losses"] == r0["losses"]  # every tp rank reports the same loss
    # 5 AdamW steps: loss curve and clipped grad norm (counted once across tp ranks)
    for step, (got, want) in enumerate(zip(r0["losses"], ref["losses"])):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    for step, (got, want) in enumerate(zip(r0["norms"], ref["norms"])):
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
    assert ref["losses"][-1] < ref["losses"][0] - 0.1  # the curve moves: a frozen run cannot pass
    assert max(ref["norms"]) > OPT.clip  # clipping is active, so a wrong norm would change the curve


# ------------------------------------------------------------------------------------ transformers
class ReadLog:
    """Stands in for safetensors' safe_open and records the shape of every tensor read from disk."""
    real, reads = W.safe_open, []

    def __init__(self, *args, **kwargs):
        self.f = self.real(*args, **kwargs)

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, name: str):
        sl, reads = self.f.get_slice(name), self.reads

        class Slice:
            get_shape = sl.get_shape

            def __getitem__(self, index):
                t = sl[index]
                reads.append((name, tuple(t.shape)))
                return t
        return Slice()


def _load_and_export(rank: int, world: int, hf_dir: str, out_dir: str, ids: torch.Tensor) -> dict:
    model = M.build(W.load_config(hf_dir))
    shards = T.apply_tp(model, None)
    W.safe_open = ReadLog
    try:
        W.materialize(model, "cpu", hf_dir=hf_dir, shards=shards)
    finally:
        W.safe_open = ReadLog.real
    with torch.no_grad():
        logits = model(ids)
    state = T.gather_full(dict(model.named_parameters()), shards, None, model.config)
    if rank == 0:
        W.save_hf(state, model.config, out_dir)
    return {"logits": to_numpy(logits), "reads": ReadLog.reads, "shards": shards}


def test_tp2_loads_save_pretrained_and_exports(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 257, (2, 12))
    ids[0, 0] = 256
    with torch.no_grad():
        want = hf(ids).logits
    results = from_numpy(run_ranks(_load_and_export, 2, str(tmp_path / "hf"), str(tmp_path / "out"), ids))
    full = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    for res in results:
        assert res["logits"].shape == want.shape and rel(res["logits"], want) <= 1e-5
        # each sharded tensor was read as this rank's slice only (the embedding's last slice is
        # one row short: the padding row is never read), every replicated one whole
        reads = dict(res["reads"])
        assert reads.keys() == {k for k in full if k != "lm_head.weight"}  # tied: no head on disk
        for name, shape in reads.items():
            shard = res["shards"].get(name)
            want_shape = list(full[name])
            if shard is not None:
                want_shape[shard.dim] = min(shard.start + shard.size, full[name][shard.dim]) - shard.start
            assert shape == tuple(want_shape), (name, shape, want_shape)
        assert len(res["shards"]) > 0 and len(res["reads"]) == len(reads)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert back.get_input_embeddings().weight.shape == (257, 32)
    sd, ref_sd = back.state_dict(), hf.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in ref_sd.items())
