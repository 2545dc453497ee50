"""Whole MoE models (mixtral, qwen3_moe, olmoe) against transformers' own classes, and through the CLI.

Reference: tiny random models with odd sizes (hidden 40, 5 heads, 5 experts, k = 2), built with
transformers' config and model classes (its eager expert loop: grouped_mm needs 16-byte strides)
and saved with save_pretrained; every parameter is perturbed (norms away from 1).
- In process: logits, the loss without and with the load-balancing loss (output_router_logits,
  router_aux_loss_coef 0.3 so the term weighs), in both reductions, and every gradient within 1e-5
  relative (fp32: the same products, the experts' sums grouped differently); an expert that no
  token picks (its gradient zero on both sides; against transformers in fp64, within 1e-5 or twice
  transformers' own fp32 error); full AC gives the same loss and gradients (the
  routers are not counted twice), and selective AC; export → AutoModelForCausalLM bit-equal logits, and the file
  holds transformers' per-expert keys exactly; cached greedy generation equals uncached; packed rows
  with a padding tail: transformers' loss with the aux term masked to the real tokens (real_tokens).
- Through the CLI: dp 2 · ZeRO-2 · full AC and dp 2 · ZeRO-3 · selective AC against the single process (micro-batches 2: each
  forward then holds the same rows on both sides, so the per-forward aux loss is the same), 1e-5;
  --sft (packed, padded rows) at dp 2 against the single process.
- Bad input: one message naming the key and its value; the layouts not built yet are refused
  (tp and pp: tests/test_moe_layouts.py).
OLMoE's configs default pad_token_id 1, which transformers' embedding freezes (padding_idx); ours
has no padding row, so the tests set pad_token_id None (docs/moe.md).
"""
import json
import re

import pytest
import torch
import transformers as T
from safetensors import safe_open
from safetensors.torch import save_file

import ac
import cli
import data
import grid as G
import model as M
import sft
import weights as W
from dist import run_ranks
from test_model import assert_close
from test_train import _main, assert_curve, losses

CASES = {  # family: (config class, its switches)
    "mixtral": (T.MixtralConfig, dict(num_local_experts=5, sliding_window=9)),
    # layer 1 dense (mlp_only_layers), the rest sparse, renormalized top-k
    "qwen3_moe": (T.Qwen3MoeConfig, dict(num_experts=5, moe_intermediate_size=14, mlp_only_layers=[1],
                                          head_dim=12, norm_topk_prob=True)),
    "olmoe": (T.OlmoeConfig, dict(num_experts=5, pad_token_id=None)),
}


def hf_model(family: str, seed: int = 0, vocab: int = 101, **kw) -> torch.nn.Module:
    config_cls, switches = CASES[family]
    torch.manual_seed(seed)
    cfg = config_cls(**{**dict(vocab_size=vocab, hidden_size=40, intermediate_size=22, num_hidden_layers=3,
                               num_attention_heads=5, num_key_value_heads=1, num_experts_per_tok=2,
                               max_position_embeddings=128, output_router_logits=True,
                               router_aux_loss_coef=0.3), **switches, **kw})
    cfg._experts_implementation = "eager"  # their reference loop
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    ref = hf_model(request.param)
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return request.param, ref, W.load_hf(d), d


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids (2, 24), transformers' labels (it shifts them) and ours (already aligned: ours[t] = theirs[t+1])."""
    g = torch.Generator().manual_seed(seed)
    ids, theirs = torch.randint(0, 101, (2, 24), generator=g), torch.randint(0, 101, (2, 24), generator=g)
    theirs[0, :6] = -100
    ours = torch.cat([theirs[:, 1:], torch.full((2, 1), -100)], dim=1)
    return ids, theirs, ours


def grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_config_switches_read(pair):
    family, ref, ours, _ = pair
    c = ours.config
    assert M.LlamaConfig.from_hf(c.to_hf()) == c
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers.values()]
    assert kinds == (["MoE", "MLP", "MoE"] if family == "qwen3_moe" else ["MoE"] * 3)
    a = ours.model.layers["0"].self_attn
    assert (None if a.q_norm is None else tuple(a.q_norm.weight.shape)) == {
        "mixtral": None, "qwen3_moe": (12,), "olmoe": (40,)}[family]
    assert [ours.model.layers[str(i)].self_attn.window for i in range(3)] == (
        [9] * 3 if family == "mixtral" else [None] * 3)
    assert (c.num_experts, c.num_experts_per_tok, c.router_aux_loss_coef, c.output_router_logits) == (5, 2, 0.3, True)


def test_logits_loss_aux_and_grads_equal_transformers(pair):
    """The loss with the aux term (transformers: CE mean + coef · load_balancing_loss over all
    layers), without it (output_router_logits off), and the summed reduction (sum / count = mean)."""
    family, ref, ours, _ = pair
    ids, theirs, labels = batch()
    with torch.no_grad():
        assert_close(ours(ids), ref(ids, use_cache=False).logits)
    out = ref(ids, labels=theirs, use_cache=False)
    assert out.aux_loss > 0.1  # the aux term weighs in the comparison
    loss = ours(ids, labels=labels)
    assert_close(loss, out.loss)
    want, got = grads(ref, out.loss), grads(ours, loss)
    assert got.keys() == want.keys()
    for n, g in got.items():
        assert_close(g, want[n])
    count = (labels != -100).sum()
    assert_close(ours(ids, labels=labels, reduction="sum") / count, out.loss)
    ours.config.output_router_logits = False
    try:  # without the aux term: the token loss alone, as transformers
        plain = ref(ids, labels=theirs, use_cache=False, output_router_logits=False).loss
        assert_close(ours(ids, labels=labels), plain)
        assert abs(plain - out.loss) > 1e-2
    finally:
        ours.config.output_router_logits = True


def test_packed_padding_aux_equals_transformers_masked(pair):
    """Packed rows with a padding tail (sft.py's layout: positions restart, label -100, real_tokens
    False): the loss is transformers' token loss on those positions + coef · its
    load_balancing_loss_func with the attention_mask of the real tokens. Without the mask ours is
    transformers' unmasked loss instead (the padding's picks and probabilities count), and differs."""
    family, ref, ours, _ = pair
    ids, theirs, labels = batch(6)
    docs, pad = ((10, 8), (24,)), (6, 0)  # row 0: two documents and 6 padding tokens; row 1: full
    pos = torch.stack([torch.cat([torch.arange(n) for n in (*d, p) if n]) for d, p in zip(docs, pad)])
    real = torch.arange(24) < torch.tensor([24 - p for p in pad])[:, None]  # (2, 24)
    labels[~real], theirs[:, 1:][~real[:, :-1]] = -100, -100  # ours[t] = theirs[t+1]
    with torch.no_grad():  # losses only: the gradients of the aux term are the existing tests'
        out = ref(ids, position_ids=pos, labels=theirs, use_cache=False)  # its aux term unmasked
        token = out.loss - ref.config.router_aux_loss_coef * out.aux_loss
        hf_aux = getattr(T.models, family).__dict__[f"modeling_{family}"].load_balancing_loss_func
        masked = hf_aux(out.router_logits, 5, 2, attention_mask=real.long())
        want = token + ref.config.router_aux_loss_coef * masked
        assert abs(masked - out.aux_loss) > 1e-2  # the padding weighs in the comparison (measured >= 1.8e-2)
        assert_close(ours(ids, position_ids=pos, labels=labels, real_tokens=real), want)
        unmasked = ours(ids, position_ids=pos, labels=labels)  # counter-check: the padding counted
        assert_close(unmasked, out.loss)
        assert abs(unmasked - want) > 1e-3  # measured 5e-3 .. 1.4e-2
        # no padding: a mask of ones is bit-identical to none
        assert torch.equal(ours(ids, labels=labels, real_tokens=torch.ones_like(real)), ours(ids, labels=labels))


def test_expert_without_tokens():
    """Expert 4 never picked: a constant channel 0 of every embedding (the norm keeps it large and
    positive) and a router row that reads only it, negatively. Its gradients are zero; all equal.
    The reference is transformers in fp64 (exact to fp32's eyes). The bound per tensor is
    max(1e-5, 2x transformers' own fp32 error against it): the constant channel makes the norms'
    sums long and cancelling, so two fp32 orders may differ by more than 1e-5 (1.3e-5 on Intel)."""
    ref = hf_model("qwen3_moe")
    with torch.no_grad():
        ref.model.embed_tokens.weight[:, 0] = 3.0
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight[4] = 0.0
                layer.mlp.gate.weight[4, 0] = -10.0
    cfg = M.LlamaConfig.from_hf(ref.config.to_dict())
    ours = M.build(cfg).to_empty(device="cpu")
    ours.load_state_dict(ref.state_dict())
    ours.model.rotary_emb.reset_buffers()
    ids, theirs, labels = batch(2)
    out = ref(ids, labels=theirs, use_cache=False)
    for logits in out.router_logits:  # not vacuous: no token picks expert 4 in any sparse layer
        assert 4 not in logits.topk(2, dim=-1).indices
    fp32 = grads(ref, out.loss)
    exact_model = ref.double()
    exact = exact_model(ids, labels=theirs, use_cache=False).loss
    want = grads(exact_model, exact)
    loss = ours(ids, labels=labels)
    assert_close(loss.double(), exact, rtol=max(1e-5, 2 * rel_err(out.loss.double(), exact)))
    got = grads(ours, loss)
    for n, g in got.items():
        assert_close(g.double(), want[n], rtol=max(1e-5, 2 * rel_err(fp32[n].double(), want[n])))
    for n in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.down_proj"):
        assert not got[n][4].any() and got[n][3].any()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """assert_close's measure: the largest difference over the largest magnitude."""
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def test_ac_counts_each_router_once(pair):
    """ac.apply_ac, full and selective: recompute reruns routers in backward; loss and gradients as without."""
    family, _, ours, _ = pair
    ids, _, labels = batch(3)
    loss = ours(ids, labels=labels)
    want = grads(ours, loss)
    for mode in ("full", "selective"):
        ac.apply_ac(ours, mode)
        try:
            loss_ac = ours(ids, labels=labels)
            got = grads(ours, loss_ac)
        finally:
            ac.remove_ac(ours)
        assert torch.equal(loss_ac, loss), mode
        for n, g in got.items():
            assert torch.equal(g, want[n]), (mode, n)


def test_export_loads_bit_equal_with_transformers_keys(pair, tmp_path):
    family, ref, ours, saved = pair
    W.save_hf(dict(ours.named_parameters()), ours.config, tmp_path / "out")
    keys = {}
    for d in (saved, tmp_path / "out"):
        with safe_open(d / "model.safetensors", "pt") as f:
            keys[d] = set(f.keys())
    assert keys[saved] == keys[tmp_path / "out"]  # save_pretrained's layout: one tensor per expert
    assert any(".experts.4." in k for k in keys[saved])
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager").eval()
    assert type(back) is type(ref)
    ids = batch(4)[0]
    with torch.no_grad():
        assert torch.equal(back(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)
    # the fused in-memory layout on disk (a transformers state_dict saved as it is) reads too
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "out" / "model.safetensors")
    with torch.no_grad():
        assert torch.equal(W.load_hf(tmp_path / "out")(ids), ours(ids))


def test_cached_generation_equals_uncached(pair):
    """The KV cache (model.generate) through sparse layers: the same greedy tokens as rerunning the prefix."""
    _, _, ours, _ = pair
    x = batch(5)[0][:, :5]
    assert torch.equal(M.generate(ours, x, 8), M.generate(ours, x, 8, use_cache=False))


def test_refusals_name_key_and_value():
    good = hf_model("mixtral").config.to_dict()
    cases = {
        "router_jitter_noise=0.1 (only 0.0)": dict(good, router_jitter_noise=0.1),
        "num_experts=4 != num_local_experts=5": dict(good, num_experts=4),
        "'mlp_only_layers' must be a list of layer indices or null": dict(good, mlp_only_layers=[-1]),
        "clip_qkv=8.0 (only null)": dict(hf_model("olmoe").config.to_dict(), clip_qkv=8.0),
        "need 1 <= num_experts_per_tok=6 <= num_experts=5": dict(good, num_experts_per_tok=6),
    }
    for message, d in cases.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            M.LlamaConfig.from_hf(d)
    cfg = M.LlamaConfig.from_hf(good)
    grid = G.Grid(rank=0, world=4, device=torch.device("cpu"))
    aux = M.LlamaConfig.from_hf(dict(good, output_router_logits=True))
    sft = ["--sft", "--data", "chats.jsonl", "--seq-len", "16"]
    for flags, message in ((sft + ["--tp", "2", "--sp"], "--sft --sp with an MoE model (mixtral, 5 experts): not yet"),):
        errors = cli.validate(cli.parse_args(flags), aux, grid)
        assert any(message in e for e in errors), (flags, errors)
    assert not cli.validate(cli.parse_args(sft), aux, grid)  # packed SFT: the padding masked (real_tokens)
    assert not cli.validate(cli.parse_args(["--cp", "2", "--seq-len", "8"]), aux, grid)  # within its window 9
    assert not cli.validate(cli.parse_args(["--zero", "3", "--ac-mode", "full", "--seq-len", "16"]), cfg, grid)
    assert not cli.validate(cli.parse_args(["--compile", "--seq-len", "16"]), cfg, grid)


def test_cli_dp_zero_ac_equal_single_process(tmp_path):
    """qwen3_moe (a dense layer among the sparse ones) from its save_pretrained dir through train.main."""
    hf_model("qwen3_moe", vocab=260, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8).save_pretrained(tmp_path / "init")
    (tmp_path / "corpus.txt").write_text(open(__file__, encoding="utf-8").read() * 4)
    data.prepare(tmp_path / "corpus.txt", tmp_path / "data")

    def argv(world: int, *extra: str) -> list[str]:
        return ["--init-from", str(tmp_path / "init"), "--data", str(tmp_path / "data"), "--steps", "4",
                "--seq-len", "16", "--batch-size", "4", "--lr", "3e-3", "--warmup", "1",
                "--metrics", str(tmp_path / f"{world}.jsonl"), *extra]
    run_ranks(_main, 1, argv(1, "--micro-batches", "2"))
    want = losses(tmp_path / "1.jsonl")
    assert want[-1] < want[0] - 0.05
    for zero, mode in (("2", "full"), ("3", "selective")):
        run_ranks(_main, 2, argv(2, "--zero", zero, "--ac-mode", mode, "--micro-batches", "1",
                                 "--export-hf", str(tmp_path / f"export{zero}")), timeout=120)
        assert_curve(losses(tmp_path / "2.jsonl"), want)
    keys = {}
    for d in (tmp_path / "init", tmp_path / "export3"):  # train.py's export: save_pretrained's keys
        with safe_open(d / "model.safetensors", "pt") as f:
            keys[d] = set(f.keys())
    assert keys[tmp_path / "init"] == keys[tmp_path / "export3"] and any(".experts.1." in k for k in keys[d])


def test_cli_packed_sft_dp2_equal_single_process(tmp_path):
    """--sft (FFD-packed rows with padding tails, real_tokens masking them from the aux loss) of an
    olmoe save_pretrained dir: dp 2 equals one process at micro-batches 2 (the same rows per forward)."""
    hf_model("olmoe", vocab=260, hidden_size=32, num_attention_heads=4, num_key_value_heads=2).save_pretrained(
        tmp_path / "init")
    chats, _ = sft.arithmetic_chats(n_train=40, n_eval=2, seed=3)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))

    def argv(world: int, *extra: str) -> list[str]:
        return ["--init-from", str(tmp_path / "init"), "--sft", "--data", str(tmp_path / "chats.jsonl"),
                "--steps", "3", "--seq-len", "64", "--batch-size", "4", "--lr", "3e-3", "--warmup", "1",
                "--metrics", str(tmp_path / f"{world}.jsonl"), *extra]
    run_ranks(_main, 1, argv(1, "--micro-batches", "2"))
    run_ranks(_main, 2, argv(2, "--micro-batches", "1"), timeout=120)
    assert_curve(losses(tmp_path / "2.jsonl"), losses(tmp_path / "1.jsonl"))
