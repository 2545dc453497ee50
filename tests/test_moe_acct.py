"""The accounting of a mixture of experts: FLOPs per token, the memory formula at ep, compile.

- FLOPs/token (cli.flops_per_token, the logged MFU) count the active parameters: the router whole,
  k of E experts. Checked against a hand count of a Mixtral-8x7B-like and a Qwen3-30B-A3B-like
  config (two dense layers by mlp_only_layers); dense presets give the pre-MoE number exactly
  (integers: bit-equal).
- zero_memory.ep_formula_bytes: each ZeRO stage against a hand count, and its parameter term
  against the bytes a model sharded by moe.shard_experts at ep 2 and 4 holds (one rank of a
  world of 8 on the fake process group: real tensors, no-op collectives).
- ep_formula_bytes against what train.py's ep-aware optimizer holds: 4 forked ranks, --ep 2, ZeRO
  0-3, bf16 params and grads (the table's), the model and optimizer from train.build_model and
  train.make_optimizer; persistent_bytes after a step (Adam's moments exist) and a backward,
  between finish() and step(). Equal up to the buckets' padding (below).
- compile_layers on a tiny MoE model (aot_eager): the MoE blocks stay eager between two graphs,
  and loss and every gradient equal eager within 1e-6, test_families' bound (measured: bit-equal;
  aot_eager runs the same kernels in the same order).
- bench.bench_moe's all-to-all byte count equals the formula 2·N·k·H·b·(ep−1)/ep per direction
  under balanced routing at ep = 2 (2 forked gloo ranks, a few ms of compute).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import cli
import grid as G
import model as M
import moe
import train
import weights as W
import zero_memory as ZM
from dist import run_ranks
from test_families import assert_same, run

# Mixtral-8x7B-like: V 32000, H 4096, L 32, 32 heads of 128 (8 kv), I 14336, E 8, k 2, untied
MIXTRAL = M.LlamaConfig(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True)
# Qwen3-30B-A3B-like: H 2048, L 48, 32 heads of 128 (4 kv), per-head q/k norm, E 128, k 8, expert I 768;
# layers 0 and 47 dense (mlp_only_layers) with I 6144
QWEN = M.LlamaConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     qk_norm=True, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     norm_topk_prob=True, mlp_only_layers=(0, 47))


def test_flops_count_active_parameters():
    T = 4096
    # Mixtral: per layer q, o (4096²), k, v (1024·4096), two norms, router 8·4096, 2 of 8 experts
    h = 4096
    layer = 2 * h * h + 2 * 1024 * h + 2 * h + 8 * h + 2 * 3 * h * 14336
    active = 32 * layer + h + 32000 * h  # + final norm + lm_head (the input embedding: a lookup)
    assert cli.active_params(MIXTRAL) == active  # 12.75e9: the published 12.9B counts the embedding
    assert cli.flops_per_token(MIXTRAL, T) == 6 * active + 12 * 32 * 32 * 128 * T
    every = MIXTRAL.num_params() - 32000 * h
    assert every - active == 32 * 6 * 3 * h * 14336  # the old count's excess: the 6 unpicked experts
    # Qwen3-MoE: q (4096, 2048), k, v (512, 2048), o, the q/k norms (128 each), two norms; 46 sparse
    # layers (router 128·2048, 8 experts of 3·2048·768), 2 dense (3·2048·6144)
    h = 2048
    attn = 4096 * h * 2 + 512 * h * 2 + 2 * 128 + 2 * h
    active = 48 * attn + 46 * (128 * h + 8 * 3 * h * 768) + 2 * 3 * h * 6144 + h + 151936 * h
    assert cli.active_params(QWEN) == active  # 3.04e9 (+ the embedding: the published 3.3B)
    assert cli.flops_per_token(QWEN, T) == 6 * active + 12 * 48 * 32 * 128 * T
    # dense models: the pre-MoE count, bit-equal
    dense = [c for c in M.PRESETS.values() if not c.num_experts]  # (the dsv3-* presets are MoE)
    for cfg in (*dense, dataclasses.replace(M.PRESETS["1b"], tie_word_embeddings=False)):
        n = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
        want = 6 * n + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * T
        assert cli.flops_per_token(cfg, T) == want and type(cli.flops_per_token(cfg, T)) is type(want)


TINY = M.LlamaConfig(model_type="mixtral", vocab_size=67, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                     max_position_embeddings=64)


def test_ep_memory_formula():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    # the pieces, by hand: d dense and e expert parameters, n = dp·cp = 8 ranks
    d, e, n = 1000, 4096, 8
    for ep in (1, 2, 4, 8):
        hand = {0: 16 * d + 16 * e / ep,
                1: 4 * d + 12 * d / n + 4 * e / ep + 12 * e / ep / (n / ep),  # replica group n/ep
                2: 2 * d + 14 * d / n + 2 * e / ep + 14 * e / ep / (n / ep),
                3: 16 * d / n + 16 * e / ep / (n / ep)}
        for stage, want in hand.items():
            assert ZM.ep_formula_bytes(stage, d, e, n, ep) == pytest.approx(want, rel=1e-15), (stage, ep)
    assert ZM.ep_formula_bytes(2, d, e, n, 1) == pytest.approx(ZM.formula_bytes(2, d + e, n), rel=1e-15)
    for bad in ((n, 3), (6, 4)):  # ep must divide n (and the experts)
        with pytest.raises(ValueError, match="must divide"):
            ZM.ep_formula_bytes(1, d, e, *bad)
    # the parameter term against a sharded model's tensors: rank 5 of a world of 8, bf16
    full = W.materialize(M.build(TINY), "cpu", seed=0).to(torch.bfloat16)
    experts = sum(p.numel() for p in moe.expert_parameters(full))
    dense = sum(p.numel() for p in full.parameters()) - experts
    h, i = TINY.hidden_size, TINY.moe_intermediate_size
    assert experts == 2 * 8 * 3 * h * i and dense + experts == TINY.num_params()
    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        for ep in (2, 4):
            model = moe.shard_experts(W.materialize(M.build(TINY), "cpu", seed=0).to(torch.bfloat16),
                                      moe.ep_groups(ep))
            held = sum(p.nbytes for p in model.parameters())
            assert held == 2 * (dense + experts // ep)  # bf16 params: the table's 2Ψ
            assert ZM.ep_formula_bytes(0, dense, experts, 8, ep) == 8 * held  # 16 bytes a held parameter
    finally:
        dist.destroy_process_group()


# hidden 30: flats whose sizes 4 (dense) and 2 (experts) do not divide, so ZeRO pads the buckets
ODD = dataclasses.replace(TINY, hidden_size=30)


def _held(rank: int, world: int) -> dict:
    """What train.py's optimizer holds at --ep 2 (dp 4), ZeRO 0-3: persistent_bytes after one step
    and a second backward, and the padding elements of its buckets (units at ZeRO-3)."""
    grid = G.Grid(rank, world, torch.device("cpu"))
    G.make_grid(grid, 1, 1, ep=2)
    ids = torch.randint(0, ODD.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    out = {}
    for stage in range(4):
        args = cli.parse_args(["--ep", "2", "--zero", str(stage), "--dtype", "bf16", "--reduce-dtype", "bf16",
                               "--bucket-mb", "0.01", "--seq-len", "8"])
        args.virtual_stages = cli.virtual_stages(args)
        model, shards, init = train.build_model(args, ODD, grid)
        opt = train.make_optimizer(args, model, shards, init, grid)
        for k in range(2):
            model(ids, labels=ids, reduction="sum").backward()
            opt.finish()
            if k == 0:
                opt.step(1e-3)
        out[stage] = (sum(ZM.persistent_bytes(opt).values()), sum(b.size - b.numel for b in opt.sync.buckets))
        opt.teardown()
    return out


def test_ep_memory_formula_equals_the_optimizer_state():
    """ep_formula_bytes(stage, Ψ_d, Ψ_e, n 4, ep 2) against the state the ep-aware optimizer holds.
    Padding: a bucket (a unit at ZeRO-3) of size s holding m elements, padded to its group's size,
    has s − m zeros at its end. A flat of it (bf16 params, grads) holds them; the fp32 masters and
    moments hold real elements only, so the rank whose shard ends in the padding holds up to s − m
    fewer than Ψ/n. Each padded element moves a rank's account by at most 16 bytes either way: the
    bound is |held − formula| ≤ 16 · Σ (s − m) over the buckets: 32 bytes here (2 padded elements
    of the dense class, none of the experts'), measured −16 to +11 (the formula's fractional Ψ_d/4
    included); ZeRO-0 pads nothing and is exact."""
    full = W.materialize(M.build(ODD), "cpu", seed=0)
    experts = sum(p.numel() for p in moe.expert_parameters(full))
    dense = sum(p.numel() for p in full.parameters()) - experts
    padded = 0
    for out in run_ranks(_held, 4):
        for stage, (held, pad) in out.items():
            want = ZM.ep_formula_bytes(stage, dense, experts, 4, 2)
            assert abs(held - want) <= 16 * pad, (stage, held, want, pad)
            padded += pad
            # ep-blind (every expert on every rank): off by more than the padding, but at ZeRO-3
            # EP saves nothing between steps, so there it is the same number
            blind = ZM.formula_bytes(stage, dense + experts, 4)
            assert (abs(held - blind) > 16 * pad) == (stage < 3), (stage, held, blind)
    assert padded  # the bound is exercised


def test_compiled_moe_layers_equal_eager():
    """aot_eager (the trace without inductor's codegen): each MoE block eager between two graphs of its
    layer, named in what compile_layers returns; a checkpointed MoE layer is left eager whole."""
    import ac as AC
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = (W.materialize(M.build(TINY), "cpu", seed=7) for _ in range(2))
    assert M.compile_layers(compiled, backend="aot_eager") == ["0.mlp", "1.mlp"]
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    assert_same(run(compiled, ids, ids), run(eager, ids, ids), 1e-6)
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])  # before, after the block
    checkpointed = W.materialize(M.build(TINY), "cpu", seed=7)
    AC.apply_ac(checkpointed, "selective")
    assert M.compile_layers(checkpointed, backend="aot_eager") == ["0", "1"]


def _exchange(rank: int, world: int) -> dict:
    from bench import bench_moe as BM
    torch.manual_seed(0)
    block = moe.shard_experts(moe.MoE(moe.MoEConfig(hidden=8, intermediate=4, num_experts=4, top_k=2)),
                              moe.ep_groups(world))
    x, g = (torch.randn(12, 8, generator=torch.Generator().manual_seed(rank + s)) for s in (1, 9))
    real = BM.count_bytes(block, x, g)
    BM.fixed_routing(block, "balanced")
    return {"real": real, "balanced": BM.count_bytes(block, x, g)}


def test_all_to_all_bytes_equal_the_formula_when_balanced():
    """bench_moe's count at ep = 2 (2 forked ranks, 12 tokens, k 2, H 8, fp32): balanced routing sends
    exactly 2·N·k·H·b·(ep−1)/ep token-row bytes forward and again backward, plus the (ep−1)·E/ep
    int64 counts in forward only; any routing sends as much backward as forward (the reverse splits)."""
    from bench.bench_moe import all_to_all_formula
    formula = all_to_all_formula(12, 2, 8, 4, 2)
    assert formula == 2 * 12 * 2 * 8 * 4 / 2
    for out in run_ranks(_exchange, 2):
        assert out["balanced"] == {("forward", "counts"): 2 * 8, ("forward", "rows"): formula,
                                   ("backward", "rows"): formula}, out
        assert out["real"][("forward", "rows")] == out["real"][("backward", "rows")], out
