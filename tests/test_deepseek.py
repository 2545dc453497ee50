"""DeepSeek-V3 (deepseek.py) against transformers' DeepseekV3ForCausalLM, and its router by hand.

Reference: tiny random models built with transformers' DeepseekV3Config and saved with
save_pretrained. Every parameter is perturbed (norms away from 1), and the router's
e_score_correction_bias is random, so it steers the selection. Two configs: q through its
low-rank bottleneck with interleaved RoPE pairs, and a plain q_proj with attention biases and
rotate_half RoPE; and the first with YaRN RoPE (factor 4, mscale_all_dim 0.7). All have a dense
first layer, 4 groups of 2 experts (topk_group 2) and routed_scaling_factor 2.5.
- logits, the loss and every gradient within 1e-5 relative (fp32: the same products; the
  experts' sums grouped differently);
- export: transformers' keys exactly, every tensor bit-equal, and transformers' reload gives
  bit-equal logits;
- packed rows equal each document alone (MLA through attention.py's document path, v padded);
- the router's selection and the bias update against hand-computed cases;
- refused by name: another RoPE type, FP8 quantization_config, groups that do not divide.
"""
import dataclasses
import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import deepseek as DS
import model as M
import weights as W
from test_model import assert_close

CASES = {
    "q_lora": dict(q_lora_rank=24, rope_interleave=True),
    "q_proj": dict(q_lora_rank=None, rope_interleave=False, attention_bias=True),
    # DeepSeek-V3's long-context RoPE; mscale_all_dim != mscale, so attention_factor != 1 too
    "yarn": dict(q_lora_rank=24, max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0,
        mscale_all_dim=0.7, beta_fast=32, beta_slow=1)),
}


def hf_model(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = T.DeepseekV3Config(**{**dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
        n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=128,
        pad_token_id=None), **kw})
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    ref = hf_model(**CASES[request.param])
    d = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(d)
    return ref, W.load_hf(d), d


def test_matches_transformers(pair, tmp_path):
    ref, ours, saved = pair
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers.values()]
    assert kinds == ["MLP", "DeepSeekMoE", "DeepSeekMoE"]
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (2, 20), generator=g), torch.randint(0, 64, (2, 20), generator=g)
    labels[0, :5] = -100
    with torch.no_grad():
        assert_close(ours(ids), ref(ids, use_cache=False).logits)
    logits = ref(ids, use_cache=False).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss = ours(ids, labels=labels)
    assert_close(loss, want)
    want.backward()
    loss.backward()
    theirs = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert_close(p.grad, theirs[n].grad)
    ref.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    # export: transformers' keys, bit-equal tensors, the bias included; its reload bit-equal
    W.save_hf({n: t.detach() for n, t in W.named_state(ours).items()}, ours.config, tmp_path / "out")
    a, b = load_file(saved / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    back = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(back(ids, use_cache=False).logits, logits)
    assert M.LlamaConfig.from_hf(json.loads((tmp_path / "out" / "config.json").read_text())) == ours.config


def test_packed_rows_equal_documents(pair):
    """Two documents packed in one row (positions restart): each equals its own row, through
    attention.py's document path with MLA's padded v."""
    _, ours, _ = pair
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = ours(ids, position_ids=pos)
        assert_close(packed[:, :12], ours(ids[:, :12]))
        assert_close(packed[:, 12:], ours(ids[:, 12:]))


def test_router_by_hand():
    """8 experts in 4 groups of 2, topk_group 2, k 3. Group scores are the sum of a group's two
    biased scores. The bias lifts group 3 over group 1 and expert 6 into the top 3, while the
    weights stay the plain scores, renormalized, times 2.5."""
    s = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.1, 0.1, 0.5, 0.4]])
    logits = torch.logit(s)
    bias = torch.tensor([0.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.6, 0.0])
    w, e = DS.select(logits, bias, top_k=3, n_group=4, topk_group=2, renormalize=True, scale=2.5)
    # biased: [.9 .8 | .2 .6 | .1 .1 | 1.1 .4] → groups 1.7, .8, .2, 1.5 → groups 0 and 3
    # inside them: 1.1 (6), .9 (0), .8 (1)
    order = e[0].argsort()
    assert e[0][order].tolist() == [0, 1, 6]
    plain = torch.tensor([0.9, 0.8, 0.5])
    assert torch.allclose(w[0][order], plain / (plain.sum() + 1e-20) * 2.5, rtol=1e-6, atol=0)
    w0, e0 = DS.select(logits, torch.zeros(8), 3, 4, 2, True, 2.5)  # unbiased: groups 0 and 1
    assert sorted(e0[0].tolist()) == [0, 1, 2]


@pytest.mark.parametrize("key,value,message", [
    ("rope_scaling", {"type": "dynamic", "factor": 4.0}, "rope_type='dynamic'"),
    ("quantization_config", {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
     "quantization_config"),
    ("n_group", 3, "n_group=3"),
])
def test_refused_by_name(pair, key, value, message):
    _, ours, _ = pair
    d = ours.config.to_hf() | {key: value}
    d.pop("rope_parameters") if key == "rope_scaling" else None
    with pytest.raises(ValueError, match=message):
        M.LlamaConfig.from_hf(d)


def tiny(layers: int = 2) -> M.Llama:
    cfg = dataclasses.replace(M.PRESETS["dsv3-tiny"], num_hidden_layers=layers)
    return W.materialize(M.build(cfg), "cpu", seed=0)


def test_bias_update_by_hand():
    """Loads [3, 1, 2, 2, ...] (mean 2): the overloaded expert's bias falls by γ, the underloaded
    one's rises by γ, the ones at the mean stay. The forward records the picks it made, once per
    forward: not under no_grad (evaluation), not in activation checkpointing's recompute."""
    import ac
    m = tiny()
    bal = DS.BiasBalancer(m, 0.25)
    gate = m.model.layers["1"].mlp.gate
    bal.loads[0] = torch.tensor([3, 1, 2, 2, 2, 2, 2, 2])
    summed = bal.step()
    assert summed[0].tolist() == [3, 1, 2, 2, 2, 2, 2, 2] and not bal.loads.any()
    assert gate.e_score_correction_bias.tolist() == [-0.25, 0.25, 0, 0, 0, 0, 0, 0]
    ids = torch.randint(0, 260, (2, 16), generator=torch.Generator().manual_seed(0))
    picks = []
    gate.register_forward_hook(lambda mod, args, out: picks.append(out[2]))
    with torch.no_grad():
        m(ids)
    assert not bal.loads.any()  # evaluation counts nothing
    ac.apply_ac(m, "full")
    m(ids, labels=ids).backward()  # the recompute reruns the router in backward
    assert len(picks) == 3
    want = DS.moe.expert_counts(picks[1], 8)
    assert bal.loads[0].tolist() == want.tolist() and int(want.sum()) == 2 * 16 * 2


def test_bias_update_balances():
    """The sparse layer starts with a bias that favours group 0. Over 10 AdamW steps the loads'
    spread (max / mean) falls with the update (γ = 0.05) and stays high without it."""
    def run(speed: float) -> list[float]:
        m = tiny()
        gate = m.model.layers["1"].mlp.gate
        with torch.no_grad():
            gate.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
            gate.e_score_correction_bias.copy_(torch.tensor([0.2, 0.15, 0.1, 0.05, 0, 0, 0, 0]))
        bal = DS.BiasBalancer(m, speed)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        spreads = []
        for _ in range(10):
            ids = torch.randint(0, 260, (4, 64), generator=g)
            m(ids, labels=torch.roll(ids, -1, 1)).backward()
            opt.step()
            opt.zero_grad()
            spreads.append(DS.spread(bal.step()).item())
        return spreads
    fixed, moving = run(0.0), run(0.05)
    assert fixed[0] == moving[0] > 2.0  # the same first step: the update acts after it
    late = lambda s: sum(s[-5:]) / 5  # noqa: E731
    assert late(moving) < 0.7 * late(fixed) and late(moving) < 0.7 * moving[0]  # measured 1.46 vs 2.32, from 2.64


def _mains(rank: int, world: int, runs: list[list[str]]) -> None:
    """train.main for each argv in turn; each run destroys its process group, the next makes one."""
    import torch.distributed as dist

    import train
    from dist import reinit
    for argv in runs:
        if not dist.is_initialized():
            reinit()
        train.main(argv)


def test_layouts_equal_single_process(tmp_path):
    """--model dsv3-tiny (seeded init by name: every layout starts from the same weights), the
    bias update on. One 8-rank launch runs ep2 · tp2 · pp2 (dp 2), cp2 · tp2 · pp2 (dp 1) with
    ZeRO-3 and AC, and the first layout with ZeRO-2 resumed from the reference's step-2 checkpoint.
    One 2-rank launch runs ep2 (with ZeRO-1), tp2, pp2, cp2 and tp2 + sp alone.
    The loss and grad-norm curves equal the single process within 1e-5 (measured <= 1.5e-7);
    the routers' biases (exported) are equal, bit for bit: the loads are integers."""
    import data
    from dist import run_ranks
    from test_moe_ep import grad_norms
    from test_train import _main, assert_curve, losses
    (tmp_path / "corpus.txt").write_text(open(__file__, encoding="utf-8").read() * 4)
    data.prepare(tmp_path / "corpus.txt", tmp_path / "data")

    def argv(name: str, *extra: str) -> list[str]:
        return ["--model", "dsv3-tiny", "--data", str(tmp_path / "data"), "--steps", "4", "--seq-len", "16",
                "--batch-size", "4", "--lr", "1e-3", "--warmup", "1", "--metrics", str(tmp_path / f"{name}.jsonl"),
                "--export-hf", str(tmp_path / f"out_{name}"), *extra]
    run_ranks(_main, 1, argv("ref", "--micro-batches", "2", "--save", str(tmp_path / "ckpt"), "--save-every", "2"))
    want, norms = losses(tmp_path / "ref.jsonl"), grad_norms(tmp_path / "ref.jsonl")
    assert want[-1] < want[0] - 0.05  # the curve moves: comparing it is not vacuous
    layouts = {"ep2_tp2_pp2": ["--ep", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"],
               "cp2_tp2_pp2_zero3_ac": ["--cp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2",
                                        "--zero", "3", "--ac"],
               # the bias lives in the checkpoint: resumed in another layout, steps 3-4 as the reference's
               "resume_ep2_tp2_pp2": ["--ep", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2",
                                      "--zero", "2", "--resume", str(tmp_path / "ckpt" / "step_00000002")]}
    run_ranks(_mains, 8, [argv(name, *flags) for name, flags in layouts.items()], timeout=300)
    alone = {"ep2": ["--ep", "2", "--zero", "1"], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "cp2": ["--cp", "2"],
             "tp2_sp": ["--tp", "2", "--sp"]}
    run_ranks(_mains, 2, [argv(name, "--micro-batches", "2", *flags) for name, flags in alone.items()],
              timeout=300)
    layouts |= alone
    ref = load_file(tmp_path / "out_ref" / "model.safetensors")
    bias = "model.layers.3.mlp.gate.e_score_correction_bias"
    assert ref[bias].abs().sum() > 0  # the bias moved
    for name in layouts:
        done = slice(2 if name.startswith("resume") else 0, None)  # a resumed run logs steps 3-4
        assert_curve(losses(tmp_path / f"{name}.jsonl"), want[done])
        assert_curve(grad_norms(tmp_path / f"{name}.jsonl"), norms[done])
        got = W.SafetensorsDir(tmp_path / f"out_{name}")
        for k in (bias, "model.layers.1.mlp.gate.e_score_correction_bias"):
            assert torch.equal(got.block(k, ref[k].shape, (slice(None),)), ref[k]), (name, k)


def test_flags_refused_by_name():
    """One message names each flag not built or not tested with deepseek_v3, before any work."""
    import cli
    import grid as G

    def validate(*argv: str) -> str:
        grid = G.Grid(rank=0, world=2, device=torch.device("cpu"))
        return "\n".join(cli.validate(cli.parse_args(["--seq-len", "32", "--model", "dsv3-tiny", "--tp", "2", *argv]),
                                       M.PRESETS["dsv3-tiny"], grid))
    text = validate("--compile", "--dpo")
    for flag in ("--compile", "--dpo"):
        assert f"{flag} with a deepseek_v3 model" in text
    assert validate("--sft") == validate("--sp") == ""
    # MFU's attention term: heads × the mean of the q·k (16 + 8) and v (16) head dims, v unpadded
    c = M.PRESETS["dsv3-tiny"]
    assert cli.flops_per_token(c, 32) == 6 * cli.active_params(c) + 12 * 4 * 4 * (16 + 8 + 16) / 2 * 32
    # flags of other branches, refused once they exist (an argparse namespace that holds them)
    import argparse
    later = argparse.Namespace(lora=8, fp8=True, optimizer="muon")
    text = "\n".join(DS.refusals(later, M.PRESETS["dsv3-tiny"]))
    for flag in ("--lora", "--fp8", "--optimizer muon"):
        assert f"{flag} with a deepseek_v3 model" in text


def test_generate_cached_equals_uncached():
    """MLA's padded v through the KVCache: cached greedy decoding gives the uncached tokens."""
    m = tiny(2)
    ids = torch.randint(0, 260, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(M.generate(m, ids, 4, use_cache=True, lengths=[7, 5]),
                       M.generate(m, ids, 4, use_cache=False, lengths=[7, 5]))


def test_cuda_paths_bf16(monkeypatch):
    """train.py's step for dsv3-tiny in bf16 on the meta device under tests/cuda_contract.py's
    rules: MLA's padded v takes SDPA's flash kernel on plain rows, and flash varlen forward and
    backward in every layer on packed rows; the experts take grouped_mm."""
    from test_cuda_paths import Packed, Rows, fake_world, on_meta, one_step
    on_meta(monkeypatch)
    calls = []
    grouped = DS.moe.experts_grouped
    monkeypatch.setattr(DS.moe, "experts_grouped", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    layers = M.PRESETS["dsv3-tiny"].num_hidden_layers
    with fake_world(0, 1, monkeypatch):
        seen = one_step(["--micro-batches", "2", "--model", "dsv3-tiny"], Rows())
        assert seen["sdpa flash"] and seen["aten::_fused_adamw_"]
        assert len(calls) == 2 * (layers - 1)  # the sparse layers, both micro-batches
        seen = one_step(["--micro-batches", "2", "--model", "dsv3-tiny", "--sft"], Packed())
        assert seen["torch_attn::_varlen_attn"] == seen["torch_attn::_varlen_attn_backward"] == 2 * layers
