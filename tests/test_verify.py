"""verify.py: the unchanged code passes; each mutation of a known bug class fails, named.

Reference: verify's own one-process run of the same small model (its comparison), the closed form
of a step's collectives (its ledger), each communicator's members against each other (its order).
- Unchanged: a Qwen3-MoE-like model at tp 2 · dp 2 · ep 2 with ZeRO-1 is exact, its order agrees,
  and the ledger equals the closed form (tp, dp, ZeRO's reduce-scatter and all-gather, ep's all-to-all);
  the parameters a rank holds, built on meta under the fake process group, equal the formula's.
- Mutations, each inside the layout's forked ranks only (the reference stays right):
  tp's backward all-reduce dropped → the first wrong gradient is the final norm's, where
  backward first meets an f (before the vocab-parallel head); expert gradients reduced over all
  of dp (the ep ranks hold other experts) → an expert tensor; the loss normalized per micro-batch
  (SFT rows: target counts differ) → a step's loss, every earlier gradient equal; a pipeline stage's router statistics not
  summed with the earlier stage's → step 1's loss and a router's gradient; two reduce-scatters in
  another order on rank 1 → the order check names the dp group, both ranks and both sizes; the
  deadlock check names the cycle.
- Bad input: exit 2 with one message, before any rank runs. The README's command (tp 2 · pp 2 · dp 2,
  ZeRO-1) exits 0, its ledger equal to the closed form.
Small worlds (2-4 ranks; the README's 8), 2 layers, 3 steps: each case takes a few seconds.
"""
import json
from pathlib import Path

import pytest
import transformers as T

import moe
import pp as PP
import precision as P
import tp as TP
import train
import verify
import zero as Z

ROOT = Path(__file__).resolve().parents[1]

MOE = dict(vocab_size=260, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
           output_router_logits=True, router_aux_loss_coef=0.3, max_position_embeddings=256)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify") / "qwen3_moe"
    T.Qwen3MoeConfig(**MOE).save_pretrained(d)
    return str(d)


def check(argv, nproc, patch=None, timeout=120):
    return verify.verify(argv, nproc, patch, timeout=timeout, collective_timeout=10)


def test_unmutated_moe_layout_is_exact_and_the_ledger_equals_the_closed_form(moe_dir):
    rep = check(["--init-from", moe_dir, "--tp", "2", "--ep", "2", "--zero", "1"], 4)
    assert rep["ok"], verify.summary(rep)
    rows = {c["what"]: c for c in rep["ledger"]["closed_form"]}
    assert {"tp all_reduce", "ep all_to_all_single", "dp reduce_scatter_single", "dp all_gather_single"} <= set(rows)
    assert all(c["equal"] for c in rows.values()), rows
    assert rep["ledger"]["per_role"]["tp all_reduce"]["count"] > 0
    assert rep["plan"]["meta_check"]["equal"], rep["plan"]["meta_check"]  # each stage built on meta
    assert "qk_norm True" in rep["model"]["kept"] and any("seq_len" in c for c in rep["model"]["cut"])


def _drop_tp_backward_all_reduce(rank):
    TP.CopyToRegion.backward = staticmethod(lambda ctx, grad: (grad, None))


def test_dropped_tp_backward_all_reduce_is_named():
    rep = check(["--model", "tiny", "--tp", "2"], 2, _drop_tp_backward_all_reduce)
    assert not rep["ok"] and not rep["comparison"].get("loss_origin")  # the forward is right
    # backward meets the head's f first: the final norm's gradient is the first wrong one
    assert rep["comparison"]["origin"] == "model.norm.weight"
    assert {"model.layers.1.post_attention_layernorm.weight", "model.embed_tokens.weight"} <= \
        {g["parameter"] for g in rep["comparison"]["gradients"]}


def _experts_over_all_of_dp(rank):
    train.expert_reduction = lambda model, grid: (lambda name: None)  # every parameter over dp


def test_expert_grads_reduced_over_all_of_dp_are_named(moe_dir):
    rep = check(["--init-from", moe_dir, "--ep", "2"], 2, _experts_over_all_of_dp)
    assert not rep["ok"]
    assert ".mlp.experts." in rep["comparison"]["origin"]


def _loss_per_micro_batch(rank):
    forward = PP._Run.forward

    def per_micro_batch(self, a):  # each micro-batch's mean, averaged over micro-batches and dp
        step = self.denominator
        self.denominator = P.count_targets(self.microbatches[a.microbatch]["labels"]).clamp(min=1) * \
            len(self.microbatches) * 2
        try:
            forward(self, a)
        finally:
            self.denominator = step
    PP._Run.forward = per_micro_batch


def test_loss_normalized_per_micro_batch_is_named():
    rep = check(["--model", "tiny", "--sft", "--micro-batches", "2"], 2, _loss_per_micro_batch)
    assert not rep["ok"] and "loss" in rep["comparison"].get("loss_origin", ""), verify.summary(rep)


def _router_stats_not_summed(rank):
    take = moe.RouterLosses.take_keys
    moe.RouterLosses.take_keys = lambda s, m, a, kw: take(s, m, a, {**kw, "router_stats": None})


def test_skipped_router_statistics_sum_is_named(moe_dir):
    rep = check(["--init-from", moe_dir, "--pp", "2"], 2, _router_stats_not_summed)
    assert not rep["ok"] and rep["comparison"]["loss_origin"]
    assert any(".mlp.gate." in g["parameter"] for g in rep["comparison"]["gradients"])


def _two_buckets_swapped_on_rank_1(rank):
    if rank != 1:
        return
    launch, held = Z.ReduceScatterSync._launch, []

    def swapped(self, b):  # the step's first bucket goes out after the second
        if not self._launched and not held:
            held.append(b)
            return
        launch(self, b)
        while held:
            launch(self, held.pop())
    Z.ReduceScatterSync._launch = swapped


def test_collectives_in_another_order_on_one_rank_are_named():
    rep = check(["--model", "tiny", "--zero", "1"], 2, _two_buckets_swapped_on_rank_1, timeout=30)
    assert not rep["ok"] and rep["order"], verify.summary(rep)
    assert rep["order"][0].startswith("dp group [0, 1], collective #2")
    assert rep["deadlock"].startswith("cycle: rank 0 waits in dp [0, 1] #2 reduce_scatter_single") and "rank 1 issues reduce_scatter_single" in rep["order"][0]


def test_bad_input_exits_2_before_any_rank(capsys, tmp_path):
    assert verify.main(["--model", "tiny", "--tp", "3"]) == 2
    assert "tp=3 must divide" in capsys.readouterr().err
    assert verify.main(["--model", "tiny", "--json", str(tmp_path / "no" / "r.json")]) == 2
    assert verify.main(["--model", "tiny", "--gpu-gib", "0"]) == 2


def test_readme_command_exits_0_with_the_ledger_equal_to_the_closed_form(tmp_path):
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.strip().startswith("python -m verify"))
    assert verify.main(line.split("#")[0].split()[3:] + ["--json", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["ledger"]["closed_form"]
    assert {"tp all_reduce", "pp_pair send", "dp reduce_scatter_single"} <= {c["what"] for c in rows}
    assert all(c["equal"] for c in rows), rows


def test_all_layouts_runs_every_valid_layout_of_the_world(monkeypatch, capsys):
    seen = []

    def fake(argv, nproc):  # the enumeration only: each layout's own check is the tests above
        a = verify.cli.parse_args(argv)
        seen.append((a.tp, a.cp, a.pp))
        if a.tp == 4:
            raise ValueError("tp=4 must divide num_key_value_heads=2")
        ok = (a.tp, a.cp, a.pp) != (1, 2, 2)
        return {"ok": ok, "exact": ok, "deadlock": None, "order": []}
    monkeypatch.setattr(verify, "verify", fake)
    assert verify.main(["--model", "tiny", "--nproc", "4", "--all-layouts"]) == 1  # (1, 2, 2) fails
    assert sorted(seen) == sorted((t, c, p) for t in (1, 2, 4) for c in (1, 2, 4) for p in (1, 2, 4) if t * c * p <= 4)
    assert "skipped (tp=4" in capsys.readouterr().out
