"""model.generate with a KV cache against the same model without one, per family, at tp1 and tp2.

References
- The uncached decode (use_cache=False: every step reruns the whole prefix through the plain
  forward, the path tests/test_families.py holds to transformers) — greedy, fp32, token for token;
  the cached decode against transformers' own generate is tests/test_model.py and test_families.py
  (model.generate uses the cache by default).
- The single process for tp2 (the same weights, loaded from one saved dir by each rank's slices).
- Brute force for sampling: every drawn token is among the top_k logits of the uncached forward at
  its step; a row's reply equals the same row decoded alone with the same seed.
- Brute force for the stop token: the reply without eos_id, cut after its first eos_id.
Tiny models (hidden 32, 2 layers), perturbed so every bias and norm weight matters; the windowed
families slide a window of 3 over 5 + 12 positions, so decoding runs far past it.
"""
import dataclasses

import pytest
import torch

import model as M
import tp as T
import weights as W
from dist import run_ranks

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2)
FAMILIES = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", qkv_bias=True, sliding_window=3, layer_types=("full_attention",
                                                                                  "sliding_attention")),
    "qwen3": dict(model_type="qwen3", qk_norm=True, attention_bias=True),
    "mistral": dict(model_type="mistral", sliding_window=3),
}
PROMPT, NEW = 5, 12


def tiny(family: str, seed: int = 0) -> M.Llama:
    model = W.materialize(M.build(M.LlamaConfig(**BASE, **FAMILIES[family])), "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # biases off 0, norms off 1: a forgotten one shows
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def prompts(b: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (b, PROMPT), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_equals_uncached(family):
    model, x = tiny(family), prompts()
    cached = M.generate(model, x, NEW)
    assert cached.shape == (3, PROMPT + NEW)
    assert torch.equal(cached, M.generate(model, x, NEW, use_cache=False))
    if model.config.sliding_window:  # the window matters here: a model without it decodes otherwise
        plain = W.materialize(M.build(dataclasses.replace(model.config, sliding_window=None,
                                                          layer_types=None)), "cpu")
        plain.load_state_dict(model.state_dict())
        assert not torch.equal(cached, M.generate(plain, x, NEW))


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_of_different_lengths_in_one_batch(family):
    """Right-padded prompts of 2, 5 and 4 tokens in one batch (`lengths`), junk in the padding: each
    row's reply is the reply it gets decoded alone (greedy, sampled with its seed, and stopped at an
    end token), cached and uncached, token for token in fp32; the cells after a reply hold eos_id
    (0 without one). The windowed families decode far past their window of 3."""
    model, x, lengths = tiny(family), prompts(), [2, 5, 4]
    junk = x.clone()
    junk[0, 2:], junk[2, 4:] = 7, 7
    eos = int(M.generate(model, x[:1, :2], NEW)[0, 2 + NEW // 2])  # row 0 emits it halfway
    for kw in (dict(), dict(temperature=1.0, top_k=8, seeds=[1, 2, 3]), dict(eos_id=eos)):
        for use_cache in (True, False):
            got = M.generate(model, junk, NEW, lengths=lengths, use_cache=use_cache, **kw)
            for b, n in enumerate(lengths):
                alone = M.generate(model, x[b:b + 1, :n], NEW, **{**kw, "seeds": kw["seeds"][b:b + 1]}
                                   if "seeds" in kw else kw)[0]  # (n + new,)
                assert torch.equal(got[b, :len(alone)], alone), (kw, use_cache, b)
                assert (got[b, len(alone):] == kw.get("eos_id", 0)).all(), (kw, use_cache, b)
    with pytest.raises(ValueError, match="lengths"):
        M.generate(model, x, NEW, lengths=[2, 6, 4])


def test_sampling_per_sample_seeds_and_top_k():
    model, x = tiny("qwen3"), prompts(4)
    kw = dict(temperature=0.8, top_k=5, seeds=[11, 12, 13, 14])
    out = M.generate(model, x, NEW, **kw)
    assert torch.equal(out, M.generate(model, x, NEW, **kw))  # reproducible
    assert torch.equal(out, M.generate(model, x, NEW, use_cache=False, **kw))
    alone = M.generate(model, x[2:3], NEW, temperature=0.8, top_k=5, seeds=[13])
    assert torch.equal(out[2:3], alone)  # a row's reply depends on its prompt and seed, not its batch
    other = M.generate(model, x, NEW, temperature=0.8, top_k=5, seeds=[21, 22, 23, 24])
    assert not torch.equal(out, other)
    with torch.no_grad():
        for t in range(PROMPT, PROMPT + NEW):  # every draw is among that step's top 5
            top = model(out[:, :t])[:, -1].topk(5, dim=-1).indices  # (B, 5)
            assert (top == out[:, t:t + 1]).any(-1).all()
    assert torch.equal(M.generate(model, x, NEW, temperature=1.0, top_k=1, seeds=[0] * 4),
                       M.generate(model, x, NEW))  # top_k=1 is greedy
    with pytest.raises(ValueError, match="one seed per row"):
        M.generate(model, x, NEW, temperature=1.0)
    with pytest.raises(ValueError, match="capacity"):
        model(x, cache=M.KVCache(PROMPT - 1))


def test_gumbel_sampler_draws_the_softmax():
    """next_token's counter-based Gumbel-max against the softmax it samples: 40,000 rows with their own
    seeds draw from fixed logits; each token's frequency lies within 5 sigma of its probability, at
    temperature 1 and at 0.7 with top_k 3 (the rest never drawn). Two steps of one row are independent
    (the joint frequency of a pair of tokens is the product). A row's draw depends on its seed and step
    only: the first 5 rows alone draw the same. One seed, 3,000 steps: the same distribution."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.3, 1.5])
    n = 40_000
    seeds = torch.arange(n) * 7919 + 2**40 + 12345  # seeds use both 32-bit halves

    def within(draws: torch.Tensor, p: torch.Tensor) -> None:
        freq = torch.bincount(draws, minlength=p.numel()).double() / draws.numel()
        sigma = (p * (1 - p) / draws.numel()).sqrt()
        assert ((freq - p).abs() <= 5 * sigma + 1e-12).all(), (freq, p)

    for temperature, k in ((1.0, None), (0.7, 3)):
        scaled = (logits / temperature).double()
        if k:
            scaled[scaled < scaled.topk(k).values[-1]] = -torch.inf
        p = scaled.softmax(-1)
        got = M.next_token(logits.expand(n, -1), temperature, k, seeds, step=3)
        within(got, p)
        assert torch.equal(M.next_token(logits.expand(5, -1), temperature, k, seeds[:5], step=3), got[:5])
    p = logits.double().softmax(-1)
    a, b = (M.next_token(logits.expand(n, -1), 1.0, None, seeds, step=s) for s in (3, 4))
    within(a * 8 + b, (p[:, None] * p[None, :]).flatten())  # independent across steps
    one = torch.stack([M.next_token(logits[None], 1.0, None, seeds[:1], step=s) for s in range(3_000)])
    within(one.flatten(), p)


def test_stops_at_the_end_token():
    model, x = tiny("llama"), prompts()
    free = M.generate(model, x, NEW)[:, PROMPT:].tolist()
    eos = free[0][2]  # row 0 emits it at its third step
    got = M.generate(model, x, NEW, eos_id=eos)
    want = [r[:r.index(eos) + 1] if eos in r else r for r in free]
    n = max(map(len, want))  # decoding stops once every row has ended
    assert got.shape[1] == PROMPT + n
    assert got[:, PROMPT:].tolist() == [r + [eos] * (n - len(r)) for r in want]


def _tp_generate(rank: int, world: int, root: str) -> dict:
    out = {}
    for family in FAMILIES:
        hf_dir = f"{root}/{family}"
        model = M.build(W.load_config(hf_dir))
        W.materialize(model, "cpu", hf_dir=hf_dir, shards=T.apply_tp(model, None))
        x, cache = prompts(), M.KVCache(PROMPT)
        model.eval()
        with torch.no_grad():
            model(x, cache=cache)
        out[family] = dict(heads=cache.layers["0"].k.shape[2], greedy=M.generate(model, x, NEW),
                           uncached=M.generate(model, x, NEW, use_cache=False),
                           ragged=M.generate(model, x, NEW, lengths=[2, 5, 4]),
                           sampled=M.generate(model, x, NEW, temperature=1.0, top_k=8, seeds=[1, 2, 3]))
    return out


def test_tp2_each_rank_caches_its_heads(tmp_path):
    """One launch of 2 ranks for all four families; each rank's cache holds nkv/2 heads; prompts of
    different lengths in one batch too."""
    want = {}
    for family in FAMILIES:
        model, x = tiny(family), prompts()
        W.save_hf(model.state_dict(), model.config, tmp_path / family)
        want[family] = dict(greedy=M.generate(model, x, NEW), ragged=M.generate(model, x, NEW, lengths=[2, 5, 4]),
                            sampled=M.generate(model, x, NEW, temperature=1.0, top_k=8, seeds=[1, 2, 3]))
    for ranks in run_ranks(_tp_generate, 2, str(tmp_path)):
        for family, r in ranks.items():
            assert r["heads"] == BASE["num_key_value_heads"] // 2, family
            for k in ("greedy", "sampled", "ragged"):
                assert torch.equal(r[k], want[family][k]), (family, k)
            assert torch.equal(r["uncached"], want[family]["greedy"]), family
