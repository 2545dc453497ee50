"""MoE models under tp, tp + sp, pp (1f1b, interleaved, zb), cp and ep, with AC, through train.py, against one process.

Reference: the single process of the same flags, seed, data and global batch, from the same
save_pretrained directory (transformers' own classes, test_moe_models.hf_model), with
output_router_logits true and router_aux_loss_coef 0.3, so the load-balancing term weighs.
- Layouts: tp2, tp2 + sp, pp2 1f1b, pp2 zb on both families; tp2 · sp · pp2 interleaved with
  selective AC on Qwen3-MoE-like (layer 0 dense through mlp_only_layers: the first chunk has no
  router, its statistics are constants), tp2 · pp2 1f1b with full AC on OLMoE-like (its q/k norm
  spans the whole projection: under tp its statistics span the tp ranks, tp.ShardedRMSNorm).
  1f1b and interleaved keep several micro-batches in flight: their statistics must not mix.
  cp2 (OLMoE-like) and ep2 · cp2 (Qwen3-MoE-like): each cp rank routes its zigzag share of the
  rows, the statistics summed over cp (cp.apply_cp); ep2 also with tp2 · sp (Qwen3-MoE-like), tp2
  and pp2 (OLMoE-like).
- The aux loss is per forward (docs/moe.md), so every layout runs the same rows per forward: the
  reference's micro-batches are REF_MICRO, a layout's are REF_MICRO / dp.
- Compared per step: the loss and the grad norm (a 2× gradient, or a replicated parameter counted
  twice, changes the norm even where AdamW's update would hide it), 3 AdamW steps, within 1e-5
  relative (fp32; the layouts change only summation orders: tp all-reduces, the statistics summed
  per stage; measured at most 2.3e-7).
- Counter-check (can fail): with the last stage's aux loss pooled over its own layers only (the
  earlier stages' statistics dropped), pp2 1f1b misses the reference's first loss by 9.3e-3
  relative (Qwen3-MoE-like; measured), 930× the tolerance. Under cp (measured on Qwen3-MoE-like cp2, not rerun
  here): without the cp sum cp2 misses the first loss by 1.4e-4 relative, with a forward-only sum
  (backward identity) the second by 6.1e-4.
Adding a layout is one line of LAYOUTS: (world, flags).
"""
import json

import pytest

import data
import moe
import train
from dist import run_ranks
from test_moe_models import hf_model
from test_train import _main, assert_curve

REF_MICRO = 4  # micro-batches of the reference: 2 rows per forward at --batch-size 8
LAYOUTS = {  # name: (world, flags), on every family; dp = world / (tp · pp · cp)
    "tp2": (2, ["--tp", "2"]),
    "tp2-sp": (2, ["--tp", "2", "--sp"]),
    "pp2-1f1b": (2, ["--pp", "2", "--schedule", "1f1b"]),
    "pp2-zb": (2, ["--pp", "2", "--schedule", "zb"]),
}
FAMILIES = {  # family: (hf_model overrides, its own layouts: tp2 · pp2 with AC, one variant each)
    # 4 layers (pp 2 × 2 virtual stages of one layer); layer 0 dense: under interleaved the first
    # chunk has no router, its statistics are constants
    "qwen3_moe": (dict(mlp_only_layers=[0], num_experts=4),  # 4 experts: ep 2 holds 2 per rank
                  {"tp2-sp-pp2-interleaved-ac": (4, ["--tp", "2", "--sp", "--pp", "2", "--schedule", "interleaved",
                                                     "--ac"]),
                   "ep2-tp2-sp": (4, ["--ep", "2", "--tp", "2", "--sp"]),
                   "ep2-cp2": (4, ["--ep", "2", "--cp", "2"])}),
    "olmoe": (dict(num_experts=4), {"tp2-pp2-1f1b-ac-full": (4, ["--tp", "2", "--pp", "2", "--ac-mode", "full"]),
                                    "cp2": (2, ["--cp", "2"]),
                       "ep2-tp2": (4, ["--ep", "2", "--tp", "2"]), "ep2-pp2": (4, ["--ep", "2", "--pp", "2"])}),
}


def _degree(flags: list[str], flag: str) -> int:
    return int(flags[flags.index(flag) + 1]) if flag in flags else 1


def curve(path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())]


def _main_own_stage_aux(rank: int, world: int, argv: list[str]) -> None:
    """The counter-check's wrong pipeline: a stage ignores the earlier stages' router statistics."""
    fn = moe.RouterLosses.take_keys
    moe.RouterLosses.take_keys = lambda s, m, a, kw: fn(s, m, a, {**kw, "router_stats": None})
    train.main(argv)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layouts_equal_single_process(family, tmp_path):
    hf_model(family, vocab=260, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=4, **FAMILIES[family][0]).save_pretrained(tmp_path / "init")
    (tmp_path / "corpus.txt").write_text(open(__file__, encoding="utf-8").read() * 8)
    data.prepare(tmp_path / "corpus.txt", tmp_path / "data")

    def argv(name: str, world: int, flags: list[str]) -> list[str]:
        dp = world // (_degree(flags, "--tp") * _degree(flags, "--pp") * _degree(flags, "--cp"))
        return ["--init-from", str(tmp_path / "init"), "--data", str(tmp_path / "data"), "--steps", "3",
                "--seq-len", "16", "--batch-size", "8", "--micro-batches", str(REF_MICRO // dp), "--lr", "3e-3",
                "--warmup", "1", "--metrics", str(tmp_path / f"{name}.jsonl"), *flags]

    run_ranks(_main, 1, argv("ref", 1, []))
    want = curve(tmp_path / "ref.jsonl")
    assert want[-1][0] < want[0][0] - 0.02  # the curve moves (> 300x the 1e-5 tolerance): not vacuous
    for name, (world, flags) in {**LAYOUTS, **FAMILIES[family][1]}.items():
        run_ranks(_main, world, argv(name, world, flags), timeout=120)
        got = curve(tmp_path / f"{name}.jsonl")
        for j in (0, 1):  # the losses, then the grad norms
            assert_curve([g[j] for g in got], [w[j] for w in want]), (name, j)
    if family != "qwen3_moe":
        return
    # counter-check: pooled per stage, the aux loss is another number from the first step on
    run_ranks(_main_own_stage_aux, 2, argv("own", 2, LAYOUTS["pp2-1f1b"][1]))
    miss = abs(curve(tmp_path / "own.jsonl")[0][0] - want[0][0]) / want[0][0]
    assert miss > 100 * 1e-5, miss
