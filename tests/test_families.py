"""The four families (llama, qwen2, qwen3, mistral) against transformers' own classes, and through the CLI.

Reference: tiny random models with odd sizes, built with transformers' config and model classes and
saved with save_pretrained; every parameter is perturbed (biases and q/k norms away from 0 and 1).
- In process: logits, loss and every gradient within 1e-5 relative (fp32; our forward follows
  transformers' op order, the masks differ in kernel choice only); packed rows against transformers on
  the same position_ids (its packed-sequence mask, plus the window); Mistral's window on a sequence
  longer than the window, where the plain causal model differs; greedy generation past the window;
  export → AutoModelForCausalLM loads the same class with bit-equal logits; compiled layers.
- Through the CLI (`train.main` on forked gloo ranks, tests/dist.py): per family one 8-rank launch
  (tp2 · pp2 · cp2, or dp2 where the window refuses cp; ZeRO-3, AC, sp for some) against the single
  process of the same flags and data, 5 AdamW steps, 1e-5 relative on every step's loss.
- Bad input: one message naming the key and its value.
"""
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
import transformers as T

import attention as A
import cli
import data
import grid as G
import model as M
import weights as W
from dist import run_ranks
from loss import cross_entropy
from test_model import assert_close
from test_train import _main, assert_curve, losses

ROOT = Path(__file__).resolve().parents[1]
HF = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
      "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM)}
# name: (family, its switches); odd sizes: hidden 40, 5 heads of 10 (qwen3: head_dim 12 explicit), 1 kv head
CASES = {
    "llama": ("llama", dict(mlp_bias=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),  # Qwen2.5's small models tie their head
    # layer 0 full, layers 1-2 slide (max_window_layers), the window shorter than the sequence
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=12, attention_bias=True)),
    "mistral": ("mistral", dict(sliding_window=7)),
}


def hf_model(case: str, vocab: int = 101, seed: int = 0, **kw) -> torch.nn.Module:
    family, switches = CASES[case]
    config_cls, model_cls = HF[family]
    torch.manual_seed(seed)
    cfg = config_cls(**{**dict(vocab_size=vocab, hidden_size=40, intermediate_size=88, num_hidden_layers=3,
                               num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=128),
                        **switches, **kw})
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # biases off 0, norms off 1: a forgotten one shows
            p.add_(torch.randn(p.shape) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    ref = hf_model(request.param)
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return request.param, ref, W.load_hf(d)


def run(model, ids, labels, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """logits, summed loss over `labels` (already aligned) and every gradient."""
    model.zero_grad(set_to_none=True)
    out = model(ids, **kw)
    logits = out.logits if hasattr(out, "logits") else out
    loss = cross_entropy(logits, labels, "sum")  # one loss on both sides: no HF label shift
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(got: tuple, want: tuple, rtol: float = 1e-5) -> None:
    assert_close(got[0], want[0], rtol)
    assert_close(got[1], want[1], rtol)
    assert got[2].keys() == want[2].keys()
    for n, g in got[2].items():
        assert_close(g, want[2][n], rtol)


def test_family_switches_read_from_config(pair):
    case, ref, ours = pair
    c, a = ours.config, ours.model.layers["1"].self_attn
    assert c.model_type == CASES[case][0] and c.head_dim == (getattr(ref.config, "head_dim", None) or 8)
    assert (a.q_proj.bias is not None, a.o_proj.bias is not None) == {
        "llama": (False, False), "qwen2": (True, False), "qwen2-window": (True, False),
        "qwen3": (True, True), "mistral": (False, False)}[case]
    assert (a.q_norm is not None) == (case == "qwen3")
    assert [ours.model.layers[str(i)].self_attn.window for i in range(3)] == {
        "qwen2-window": [None, 6, 6], "mistral": [7, 7, 7]}.get(case, [None] * 3)
    assert M.LlamaConfig.from_hf(c.to_hf()) == c


def test_logits_loss_grads_equal_transformers(pair):
    """Rows of 24 tokens: longer than every window here."""
    case, ref, ours = pair
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 101, (2, 24), generator=g), torch.randint(0, 101, (2, 24), generator=g)
    labels[0, :5] = -100
    assert_same(run(ours, ids, labels), run(ref, ids, labels, use_cache=False))


def test_packed_rows_equal_transformers(pair):
    """Packed documents (one longer than every window) on the Documents path against transformers
    given the same position_ids (its packed-sequence mask), and the dense reference mask."""
    case, ref, ours = pair
    g = torch.Generator().manual_seed(2)
    lens = [[3, 17, 12], [1, 31]]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens])  # (2, 32)
    ids, labels = torch.randint(0, 101, pos.shape, generator=g), torch.randint(0, 101, pos.shape, generator=g)
    want = run(ref, ids, labels, position_ids=pos, use_cache=False)
    assert_same(run(ours, ids, labels, position_ids=pos, docs=A.Documents.from_position_ids(pos)), want)
    assert_same(run(ours, ids, labels, position_ids=pos, docs=A.attention_mask(pos)), want)


def test_mistral_window_is_applied_where_causal_differs():
    """A 20-token sequence, window 7: transformers' Mistral and ours agree; the same weights without
    the window (a plain causal model) differ beyond the window; generation past it equals transformers'."""
    ref = hf_model("mistral")
    ours = W.materialize(M.build(M.LlamaConfig.from_hf(ref.config.to_dict())), "cpu")
    with torch.no_grad():
        for n, p in ours.named_parameters():
            p.copy_(ref.state_dict()[n])
    causal = W.materialize(M.build(dataclasses.replace(ours.config, sliding_window=None)), "cpu")
    causal.load_state_dict(ours.state_dict())
    x = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want, plain = ours(x), ref(x, use_cache=False).logits, causal(x)
    assert_close(got, want)
    assert_close(got[:, :7], plain[:, :7])  # inside the window: the same
    assert (got[:, 7:] - plain[:, 7:]).abs().max() > 1e-2 * want.abs().max()  # beyond it: not
    prompt = x[:, :4]
    hf_out = ref.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(M.generate(ours, prompt, 12), hf_out)


def test_window_on_every_cpu_path_and_the_cuda_call(monkeypatch):
    """attend with a window: the packed CPU path (length groups) and the dense rows against the dense
    band mask; the CUDA varlen call (it cannot run here) against a per-document reference of flash's
    window_size (left, 0): keys i - left <= j <= i."""
    g = torch.Generator().manual_seed(4)
    pos = torch.cat([torch.arange(n) for n in (5, 40, 19)])[None]  # (1, 64)
    q, k, v = (torch.randn(1, 64, h, 8, generator=g) for h in (4, 2, 2))
    docs, dense = A.Documents.from_position_ids(pos), A.attention_mask(pos)
    band = dense & A.window_mask(64, 9)
    want = A.attend(q, k, v, band)
    assert_close(A.attend(q, k, v, docs, window=9), want, 1e-6)
    assert_close(A.attend(q, k, v, dense, window=9), want, 1e-6)
    rows = A.attend(q, k, v, None, window=9)
    assert_close(rows, A.attend(q, k, v, A.window_mask(64, 9)[None, None]), 1e-6)
    assert torch.equal(A.attend(q, k, v, docs, window=40), A.attend(q, k, v, docs))  # no longer doc

    def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
        left, right = window_size
        assert right == 0 and cu_q.dtype == torch.int32 and max_q == max_k
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            n = b - a
            i = torch.arange(n)
            mask = (i[:, None] >= i[None, :]) & ((i[:, None] - i[None, :] <= left) | (left < 0))
            one = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                *one, attn_mask=mask, enable_gqa=enable_gqa)[0].transpose(0, 1)
        return out

    monkeypatch.setattr(A, "varlen_attn", reference_varlen)
    monkeypatch.setattr(A, "use_varlen", lambda q: True)
    assert_close(A.attend(q, k, v, docs, window=9), want, 1e-6)
    assert_close(A.attend(q, k, v, None, window=9), rows, 1e-6)


def test_window_cuda_paths_on_meta(monkeypatch):
    """The windowed CUDA branches (flash varlen with window_size; plain rows as one document each)
    run forward and backward on the meta device under tests/cuda_contract.py's rules."""
    from cuda_contract import Contract, on_meta
    on_meta(monkeypatch)
    pos = torch.cat([torch.arange(n) for n in (5, 40, 19)])[None]  # (1, 64)
    docs = A.Documents.from_position_ids(pos, device="meta")
    q, k, v = (torch.randn(1, 64, h, 8, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for h in (4, 2, 2))
    with Contract() as contract:
        for d in (docs, None):
            A.attend(q, k, v, d, window=9).sum().backward()
    assert contract.seen["torch_attn::_varlen_attn"] == contract.seen["torch_attn::_varlen_attn_backward"] == 2


def test_export_loads_as_the_same_class_bit_equal(pair, tmp_path):
    case, ref, ours = pair
    W.save_hf(dict(ours.named_parameters()), ours.config, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert (d["model_type"], d["architectures"]) == (ref.config.model_type, [type(ref).__name__])
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(back) is type(ref)
    for key in ("head_dim", "sliding_window", "layer_types", "tie_word_embeddings", "num_key_value_heads"):
        assert getattr(back.config, key, None) == getattr(ref.config, key, None), key
    x = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(x, use_cache=False).logits, ref(x, use_cache=False).logits)


def test_compiled_layers_equal_eager():
    """compile_layers on a Qwen3 whose layer 1 slides (q/k norms traced, the windowed attention
    eager; aot_eager: the trace without inductor's codegen): loss and gradients as eager."""
    hf = hf_model("qwen3", num_hidden_layers=2, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    cfg = M.LlamaConfig.from_hf(hf.config.to_dict())
    eager, compiled = (W.materialize(M.build(cfg), "cpu", seed=7) for _ in range(2))
    M.compile_layers(compiled, backend="aot_eager")
    ids = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(6))
    assert_same(run(compiled, ids, ids), run(eager, ids, ids), 1e-6)


def test_bad_configs_name_key_and_value():
    good = hf_model("qwen2").config.to_dict()
    cases = {
        "model_type='gemma2'": dict(good, model_type="gemma2"),
        "rope_type='yarn'": dict(good, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
        "attention_dropout=0.1": dict(good, attention_dropout=0.1),
        "sliding_window=None": dict(good, layer_types=["full_attention", "sliding_attention", "full_attention"]),
        "layer_types=['full_attention', 'chunked_attention', 'full_attention']":
            dict(good, use_sliding_window=True, layer_types=["full_attention", "chunked_attention", "full_attention"]),
        "layer_types=['sliding_attention']": dict(hf_model("mistral").config.to_dict(),
                                                  layer_types=["sliding_attention"]),
        "'sliding_window' must be a positive integer or null, got 0": dict(good, sliding_window=0),
    }
    for message, d in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            M.LlamaConfig.from_hf(d)
    with pytest.raises(ValueError, match=re.escape("model_type='qwen2' has qkv_bias=False")):
        M.build(dataclasses.replace(M.LlamaConfig.from_hf(good), qkv_bias=False))
    # cp: refused before any work where the window is shorter than the sequence
    mistral = M.LlamaConfig.from_hf(hf_model("mistral").config.to_dict())
    grid = G.Grid(rank=0, world=2, device=torch.device("cpu"))
    errors = cli.validate(cli.parse_args(["--cp", "2", "--seq-len", "32"]), mistral, grid)
    assert any("sliding_window=7 < --seq-len 32" in e for e in errors)
    assert not cli.validate(cli.parse_args(["--cp", "2", "--seq-len", "4"]), mistral, grid)


def _cp_forward(rank: int, world: int, cfg: M.LlamaConfig, seq: int) -> str:
    import cp as CP
    model = W.materialize(M.build(cfg), "cpu", seed=1)
    CP.apply_cp(model, torch.distributed.group.WORLD)
    ids = CP.shard_sequence(torch.arange(seq)[None] % 101, world, rank)
    try:
        return str(model(ids).shape)
    except ValueError as e:
        return str(e)


def test_cp_ring_refuses_a_window_shorter_than_the_sequence():
    """A library caller of cp.apply_cp (no CLI check): the ring raises naming the window; a window
    no shorter than the sequence masks nothing and runs."""
    cfg = M.LlamaConfig.from_hf(hf_model("mistral").config.to_dict())
    got = run_ranks(_cp_forward, 2, cfg, 16)
    assert all("sliding_window=7" in r and "shorter than the sequence (16 tokens)" in r for r in got), got
    assert run_ranks(_cp_forward, 2, cfg, 4) == ["torch.Size([1, 2, 101])"] * 2


# ----------------------------------------------------------------------------------------- the CLI
# name: (case, 8-rank flags). cp where the family allows it (Mistral's window < seq-len refuses it).
LAYOUTS = {
    "llama": ("llama", ["--tp", "2", "--pp", "2", "--cp", "2", "--zero", "3", "--ac"]),
    "qwen2": ("qwen2", ["--tp", "2", "--pp", "2", "--cp", "2", "--zero", "3", "--ac", "--ac-mode", "full"]),
    "qwen3": ("qwen3", ["--tp", "2", "--sp", "--pp", "2", "--cp", "2", "--zero", "3", "--ac"]),
    "mistral": ("mistral", ["--tp", "2", "--sp", "--pp", "2", "--zero", "3", "--ac"]),
}


@pytest.fixture(scope="module")
def cli_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("families_cli")
    for name, (case, _) in LAYOUTS.items():
        hf_model(case, vocab=260, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 hidden_size=32, intermediate_size=64).save_pretrained(d / name)
    text = "".join(open(p, encoding="utf-8").read() for p in sorted(ROOT.glob("*.py")))
    (d / "corpus.txt").write_text(text[:30_000])
    data.prepare(d / "corpus.txt", d / "data")
    return d


def cli_args(d: Path, name: str, *extra: str, metrics: str) -> list[str]:
    return ["--init-from", str(d / name), "--data", str(d / "data"), "--steps", "5", "--seq-len", "32",
            "--batch-size", "4", "--micro-batches", "2", "--lr", "3e-3", "--warmup", "2",
            "--metrics", str(d / metrics), *extra]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cli_layouts_equal_single_process(cli_dirs, name):
    """The family's save_pretrained dir through train.main: one process (exported at the end: the
    export loads in transformers as the same class, logits as ours within 1e-5), then 8 ranks."""
    d, (case, flags) = cli_dirs, LAYOUTS[name]
    run_ranks(_main, 1, cli_args(d, name, "--export-hf", str(d / f"{name}_out"), metrics=f"{name}_1.jsonl"))
    want = losses(d / f"{name}_1.jsonl")
    assert want[-1] < want[0] - 0.05  # the curve moves: comparing it is not vacuous
    run_ranks(_main, 8, cli_args(d, name, *flags, metrics=f"{name}_8.jsonl"), timeout=300)
    assert_curve(losses(d / f"{name}_8.jsonl"), want)
    back = T.AutoModelForCausalLM.from_pretrained(d / f"{name}_out").eval()
    assert type(back) is HF[CASES[case][0]][1]
    x = torch.randint(0, 260, (1, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert_close(W.load_hf(d / f"{name}_out")(x), back(x, use_cache=False).logits)
