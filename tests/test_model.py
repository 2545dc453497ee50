"""model.py against the independent reference: transformers' LlamaForCausalLM.

Tolerance: our forward follows HF's op order, so fp32 logits agree to 1e-5 relative (measured: equal
bit for bit on this machine; the tolerance only allows for other BLAS builds)."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import attention as A
import model as M
from loss import cross_entropy
import weights as W

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
CASES = {
    "gqa-kv1": dict(num_key_value_heads=1),
    "gqa-kv2-tied": dict(num_key_value_heads=2, tie_word_embeddings=True),
    "llama3-rope": dict(num_key_value_heads=2, rope_parameters=LLAMA3),
    "bias-headdim": dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, head_dim=24),
}


def hf_model(seed: int = 0, **kw) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = HFConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, max_position_embeddings=128, **kw)
    return LlamaForCausalLM(cfg).eval()


def assert_close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
    assert err <= rtol, f"relative error {err:.2e} > {rtol}"


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    ref = hf_model(**CASES[request.param])
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return ref, W.load_hf(d), d


def test_logits_and_loss_equal_transformers(pair):
    ref, ours, _ = pair
    x = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(ours(x), ref(x).logits)
        labels = x.clone()
        labels[0, :10] = -100  # masked prefix: both sides must ignore it
        # HF shifts labels inside; ours takes them already aligned with the logits
        ref_loss = ref(x, labels=labels).loss
        assert_close(ours(x[:, :-1], labels=labels[:, 1:]), ref_loss)


def test_gradients_equal_transformers(pair):
    ref, ours, _ = pair
    x = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    ref(x, labels=x).loss.backward()
    ours(x[:, :-1], labels=x[:, 1:]).backward()
    hf_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        assert_close(p.grad, hf_grads[name])
    ref.zero_grad()
    ours.zero_grad()


def test_save_reloads_in_transformers_identically(pair, tmp_path):
    ref, ours, _ = pair
    W.save_hf(dict(ours.named_parameters()), ours.config, tmp_path)
    files = json.loads((tmp_path / "config.json").read_text())
    assert files["tie_word_embeddings"] == ours.config.tie_word_embeddings
    from safetensors import safe_open
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) != ours.config.tie_word_embeddings  # tied: no key
    back = LlamaForCausalLM.from_pretrained(tmp_path)
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_sharded_checkpoint_roundtrip(tmp_path):
    ref = hf_model(num_key_value_heads=2)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="50KB")  # several files + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = W.load_hf(tmp_path / "hf")
    W.save_hf(dict(ours.named_parameters()), ours.config, tmp_path / "ours", max_shard_bytes=40_000)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    back = LlamaForCausalLM.from_pretrained(tmp_path / "ours")
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def test_rope_buffers_recomputed_after_to_empty(pair):
    """to_empty leaves non-persistent buffers uninitialised; materialize must recompute them.
    Reference: HF's own rotary embedding (llama3 rescaling included)."""
    ref, ours, d = pair
    hf_rope = LlamaRotaryEmbedding(ref.config)
    assert torch.equal(ours.model.rotary_emb.inv_freq, hf_rope.inv_freq)
    m = M.build(ours.config)
    m.to_empty(device="cpu")
    m.model.rotary_emb.inv_freq.fill_(1.0)  # what garbage could look like
    W.materialize(m, "cpu", hf_dir=str(d))
    assert torch.equal(m.model.rotary_emb.inv_freq, hf_rope.inv_freq)


def test_packed_rows_equal_separate_documents():
    torch.manual_seed(0)
    m = W.materialize(M.build(M.PRESETS["tiny"]), "cpu", seed=3)
    lens = [7, 12, 5]
    docs = [torch.randint(0, 260, (n + 1,)) for n in lens]
    ids = torch.cat([d[:-1] for d in docs])[None]
    labels = torch.cat([d[1:] for d in docs])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    packed_logits = m(ids, pos)
    packed_loss = m(ids, pos, labels, reduction="sum")
    start, total = 0, 0.0
    for d, n in zip(docs, lens):
        alone = m(d[None, :-1])
        assert_close(packed_logits[:, start:start + n], alone)
        total = total + m(d[None, :-1], labels=d[None, 1:], reduction="sum")
        start += n
    assert_close(packed_loss, total)


def test_init_depends_only_on_seed_and_name():
    cfg = M.PRESETS["tiny"]
    a = W.materialize(M.build(cfg), "cpu", seed=5)
    b = W.materialize(M.build(cfg), "cpu", seed=5)
    c = W.materialize(M.build(cfg), "cpu", seed=6)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
        assert n.endswith("norm.weight") or not torch.equal(p, r)
    # a slice materialised alone equals the slice of the full init (what tp.py relies on)
    m = M.build(cfg)
    m.model.layers["1"].mlp.up_proj.weight = torch.nn.Parameter(torch.empty(88, 64, device="meta"))
    shard = {"model.layers.1.mlp.up_proj.weight": M.Shard(0, 88, 88)}
    W.materialize(m, "cpu", seed=5, shards=shard)
    assert torch.equal(m.model.layers["1"].mlp.up_proj.weight, a.model.layers["1"].mlp.up_proj.weight[88:])
    std = a.model.layers["0"].self_attn.q_proj.weight.std().item()
    assert abs(std - cfg.initializer_range) < 0.002


def test_padded_shard_reads_zero_past_the_end(pair):
    ref, ours, d = pair
    m = M.build(ours.config)
    m.model.embed_tokens.weight = torch.nn.Parameter(torch.empty(50, 64, device="meta"))  # rows 50..99
    if m.lm_head is not None and not ours.config.tie_word_embeddings:
        m.lm_head = None
    W.materialize(m, "cpu", hf_dir=str(d), shards={"model.embed_tokens.weight": M.Shard(0, 50, 50)})
    w = m.model.embed_tokens.weight
    assert torch.equal(w[:47], ref.model.embed_tokens.weight[50:]) and not w[47:].any()


def test_greedy_generate_matches_transformers(pair):
    ref, ours, _ = pair
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    want = ref.generate(x, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(M.generate(ours, x, 8), want)


def test_config_errors_and_roundtrip(tmp_path):
    good = hf_model(num_key_value_heads=2, rope_parameters=LLAMA3).config.to_dict()
    cfg = M.LlamaConfig.from_hf(good)
    assert M.LlamaConfig.from_hf(cfg.to_hf()) == cfg
    bad = dict(good, hidden_act="gelu", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="hidden_act='gelu'.*rope_type='yarn'"):
        M.LlamaConfig.from_hf(bad)
    with pytest.raises(ValueError, match="num_key_value_heads=0, head_dim=-2: must be at least 1"):
        M.build(M.LlamaConfig(num_key_value_heads=0, head_dim=-2))  # not a ZeroDivisionError
    with pytest.raises(FileNotFoundError, match="config.json"):
        W.load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(good))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        W.load_hf(tmp_path)


def test_truncated_or_incomplete_checkpoint_is_named(tmp_path):
    ref = hf_model(num_key_value_heads=2)
    ref.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:300])
    with pytest.raises(ValueError, match=r"model.safetensors: corrupt or truncated"):
        W.load_hf(tmp_path)
    ref.save_pretrained(tmp_path / "hf", max_shard_size="50KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    (tmp_path / "hf" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(FileNotFoundError, match="listed in the index are missing"):
        W.load_hf(tmp_path / "hf")


# ----------------------------------------------------------------------------------------- packed documents
# Two rows of 80 tokens: a 1-token document, both sides of a bucket edge (16 | 17), GQA in most CASES.
LENS = [[1, 16, 17, 30, 16], [40, 33, 7]]


def packed_batch(vocab: int, lens: list[list[int]] = LENS, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])  # (B, S)
    ids = torch.randint(0, vocab, pos.shape, generator=g)
    labels = torch.randint(0, vocab, pos.shape, generator=g)
    labels[torch.rand(pos.shape, generator=g) < 0.3] = -100
    return ids, pos, labels


def test_documents_boundaries_and_plan():
    # row 0: [0 1 2][0 1][0][5 6] (5 does not continue 0); row 1 starts a document at its first token
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 5, 6], [3, 4, 5, 6, 0, 1, 2, 3]])
    d = A.Documents.from_position_ids(pos)
    assert d.lengths == (3, 2, 1, 2, 4, 4) and d.max_len == 4 and d.shape == (2, 8)
    assert d.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12, 16] and d.cu_seqlens.dtype == torch.int32
    assert d.to("cpu") is d and d.to("meta").cu_seqlens.device.type == "meta"
    # bucket: multiples of GRANULE up to 8·GRANULE, then 8 buckets per octave
    assert [A.bucket(n) for n in (1, 16, 17, 127, 129, 257, 1025)] == [16, 16, 32, 128, 144, 288, 1152]
    groups, gather, scatter = d.plan(torch.device("cpu"))
    assert groups == [(6, 16)]
    assert torch.equal(gather[scatter], torch.arange(16))  # every token's output slot holds the token
    starts = d.cu_seqlens[:-1].tolist()
    for s, n, slots in zip(starts, d.lengths, gather.view(6, 16).tolist()):  # the document, then its last token
        assert slots == list(range(s, s + n)) + [s + n - 1] * (16 - n)
    with pytest.raises(ValueError, match="never crosses a row"):
        A.Documents([3, 6, 7], (2, 8))
    with pytest.raises(ValueError, match="need the position_ids"):
        M.build(M.PRESETS["tiny"])(torch.zeros(1, 8, dtype=torch.long, device="meta"), docs=d)


def test_packed_attention_equals_dense_mask_and_transformers(pair):
    """Document-aware attention (Documents: length groups on CPU) against today's dense block-diagonal
    mask and against transformers on the same packed position_ids (its own packed-sequence mask; no
    cache, or it skips the packing detection): loss, logits and every gradient within 1e-6 relative
    (fp32; only the kernels' summation order differs; measured <= 3.5e-7)."""
    ref, ours, _ = pair
    ids, pos, labels = packed_batch(97)
    docs = A.Documents.from_position_ids(pos)

    def run(model, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        out = model(ids, position_ids=pos, **kw)
        logits = out.logits if hasattr(out, "logits") else out
        loss = cross_entropy(logits, labels, "sum")  # one loss on both sides: no HF label shift
        loss.backward()
        return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logits, loss, grads = run(ours, docs=docs)
    d_logits, d_loss, d_grads = run(ours, docs=A.attention_mask(pos))
    assert abs(loss - d_loss) <= 1e-6 * abs(d_loss)
    for n, g in grads.items():
        assert_close(g, d_grads[n], 1e-6)
    hf_logits, _, hf_grads = run(ref, use_cache=False)
    assert_close(logits, hf_logits, 1e-6)
    for n, g in grads.items():
        assert_close(g, hf_grads[n], 1e-6)
    with torch.no_grad():  # the check is sensitive: without the boundaries, attention leaks
        assert (ours(ids) - logits).abs().max() > 1e-2 * logits.abs().max()


def test_cuda_varlen_call_convention(monkeypatch):
    """The CUDA path (varlen_attn, flash, bf16/fp16) cannot run on CPU. Checked here: what it is
    handed — flattened (B·S, heads, hd) views, int32 cu_seqlens, the longest document, the causal
    window and GQA — against a per-document reference of varlen_attn's documented semantics, in fp32."""
    def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
        assert cu_q is cu_k and cu_q.dtype == torch.int32 and window_size == (-1, 0)
        assert enable_gqa == (q.shape[1] != k.shape[1]) and max_q == max_k == docs.max_len
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):  # (n, heads, hd) per document
            one = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            out[a:b] = F.scaled_dot_product_attention(*one, is_causal=True, enable_gqa=enable_gqa)[0].transpose(0, 1)
        return out

    model = W.materialize(M.build(M.PRESETS["tiny"]), "cpu", seed=3)
    ids, pos, labels = packed_batch(260)
    docs = A.Documents.from_position_ids(pos)
    want = model(ids, pos, labels, reduction="sum", docs=A.attention_mask(pos))
    monkeypatch.setattr(A, "varlen_attn", reference_varlen)
    monkeypatch.setattr(A, "use_varlen", lambda q: True)
    got = model(ids, pos, labels, reduction="sum", docs=docs)
    assert abs(got - want) <= 1e-6 * abs(want)


def test_packed_saved_bytes_are_linear_in_s():
    """Nothing S²-sized is saved with Documents, with or without AC: one layer's saved bytes equal the
    packed-row formula of ac.py's docstring byte for byte (measured by ac.SavedActivationMeter) at
    S = 128 and 512. The dense mask, measured the same way, adds an S² float bias (the check can fail)."""
    from ac import SavedActivationMeter, apply_ac
    cfg = dataclasses.replace(M.PRESETS["tiny"], num_hidden_layers=1)
    h, a, i, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.head_dim
    qh, gh = a * hd, cfg.num_key_value_heads * hd
    for reps in (1, 4):
        lens = [5, 17, 40, 2, 64] * reps  # one row of S = 128·reps
        t, slots = sum(lens), sum(A.bucket(n) for n in lens)  # tokens, CPU-path slots T'
        pos = torch.cat([torch.arange(n) for n in lens])[None]  # (1, S)
        attn = 4 * slots * (2 * qh + 2 * gh + a) + 8 * slots + 8 * t  # gathered q, k, v, out, lse; indices
        rest = attn + 8 * t  # + the norms' fp32 rstd
        want = {None: 4 * t * (4 * h + 3 * i + qh) + rest, "selective": 4 * t * (2 * h + 2 * i + qh) + rest,
                "full": 4 * t * h}
        for mode in want:
            model = W.materialize(M.build(cfg), "cpu")
            if mode:
                apply_ac(model, mode)
            layer = model.model.layers["0"]
            x = torch.randn(1, t, h, requires_grad=True)
            cos, sin = model.model.rotary_emb(pos, torch.float32)
            saved = {}
            for name, docs in (("docs", A.Documents.from_position_ids(pos)), ("dense", A.attention_mask(pos))):
                with SavedActivationMeter() as meter:
                    layer(x, cos, sin, docs)
                saved[name] = meter.nbytes - cos.nbytes - sin.nbytes  # cos/sin: shared by all layers
            assert saved["docs"] == want[mode], (reps, mode, saved)
            if mode is None:  # the dense mask's float bias: 4·S² bytes per layer
                assert saved["dense"] >= 4 * t * t, (reps, saved)
