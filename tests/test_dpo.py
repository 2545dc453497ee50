"""dpo.py against the formula, transformers and the single process.

References
- dpo.textbook_dpo_loss (full logits, a reply per row) against DPOLoss on packed rows: fp32 rounding.
- The formula, by hand in float64 on fixed log-probs; policy = reference gives exactly ln 2 (fp32:
  every margin is exactly 0, the reference sums being the same forward's).
- transformers' LlamaForCausalLM: log_softmax of its logits, each document alone (unpacked), summed
  over the reply targets, against our packed rows — fp32, 1e-5 relative (kernel order only); and
  our padded rows (--packing none, a reply per row; this test keeps one more pair in them).
- The single process (train.main, same seed, data and global batch) for tp2·sp, pp2, dp2·zero2 and
  dp2·zero3, and (--packing none, its own single process) cp2 and cp2·dp2·zero1: every step's loss
  and grad norm within 1e-5 relative; the curve moves, so the comparison is not vacuous. The grad
  norm matters: AdamW's update is scale free, so a gradient off by a constant factor (cp's
  all-reduce without its backward: exactly 1/2 at cp2) leaves the loss curve within 2e-6.
"""
import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

import cli
import data
import dpo
import grid as G
import model as M
import sft
import weights as W
from dist import run_ranks
from test_train import _main, assert_curve, losses

TPL = sft.chat_template(data.load_tokenizer(None))
CFG = M.LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                    initializer_range=0.1)


REWARDS = ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")  # the step log's


def pairs(n: int = 6, seed: int = 0) -> list[dpo.Pair]:
    return dpo.arithmetic_pairs(n, seed=seed, n_eval=4, max_operands=(9, 9), ops=("+", "-"), p_follow_up=0.3)


def rows(ds: dpo.PairDataset) -> dict[str, torch.Tensor]:
    items = [ds[r] for r in range(len(ds))]
    return {k: torch.cat([it[k].view(-1, it[k].shape[-1]) for it in items]) for k in items[0]}  # as feed.py


def test_formula_and_ln2():
    pc, pr, rc, rr = (torch.tensor(v) for v in ([-3.0, -9.5, -1.0], [-4.0, -2.0, -1.0],
                                                 [-3.5, -7.0, -2.0], [-3.0, -2.5, -1.5]))
    want = [-math.log(1 / (1 + math.exp(-0.2 * ((a - c) - (b - d)))))
            for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())]
    assert torch.allclose(dpo.dpo_loss(pc, pr, rc, rr, 0.2).double(), torch.tensor(want, dtype=torch.float64),
                          rtol=1e-6)
    model = W.materialize(M.build(CFG), "cpu", seed=1)
    ds = dpo.PairDataset(pairs(), TPL, 256)
    loss = dpo.apply_dpo([model], beta=0.5, cp_group=None)
    b = rows(ds)
    kw = dict(position_ids=b["position_ids"], dpo_seq=b["dpo_seq"], dpo_ref=b["dpo_ref"])
    loss.record = []
    with torch.no_grad():
        model(b["input_ids"], labels=b["labels"], reduction="sum", **kw)
    ds.set_reference(list(range(len(ds))), loss.record[0])
    loss.record = None
    assert (ds.ref < 0).all()  # every reply has targets
    b = rows(ds)
    kw["dpo_ref"] = b["dpo_ref"]
    per_pair = model(b["input_ids"], labels=b["labels"], reduction="none", **kw)
    n = len(ds.docs)
    assert n >= 4 and per_pair.shape == (n,) and dpo.count_pairs(b) == n
    assert torch.equal(per_pair, torch.full((n,), math.log(2.0)))
    mean = model(b["input_ids"], labels=b["labels"], reduction="mean", **kw)
    assert mean.item() == pytest.approx(math.log(2))

    # the log's implicit rewards r̂ = β(π − r): all 0 while π = r; then the formula on fixed log-probs
    assert loss.stats(loss.reduce_log(torch.device("cpu"))) == dict.fromkeys(REWARDS, 0.0)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        loss.record = []
        model(b["input_ids"], labels=b["labels"], **kw)  # the moved policy's sums, as the reference's
    ref = ds.ref.clone()  # (pairs, 2): r_c, r_r
    ds.set_reference(list(range(len(ds))), loss.record[0])
    pi, ds.ref, loss.record = ds.ref.double(), ref, None  # π_c, π_r by pair
    model(b["input_ids"], labels=b["labels"], reduction="sum", **kw)
    r_hat = 0.5 * (pi - ref.double())  # (pairs, 2): β(π − r), chosen and rejected
    right = (r_hat[:, 0] > r_hat[:, 1]).double().mean().item()
    assert 0 < right < 1  # some pairs each way: the comparison's direction is checked
    want = {"reward_chosen": r_hat[:, 0].mean().item(), "reward_rejected": r_hat[:, 1].mean().item(),
            "reward_margin": (r_hat[:, 0] - r_hat[:, 1]).mean().item(), "reward_accuracy": right}
    assert loss.stats(loss.reduce_log(torch.device("cpu"))) == pytest.approx(want, rel=1e-5, abs=1e-6)


def record_reference(model: torch.nn.Module, ds: dpo.PairDataset, beta: float) -> dpo.DPOLoss:
    """The reference pass: model's DPO loss records each row's sums, and ds keeps them."""
    loss = dpo.apply_dpo([model], beta=beta, cp_group=None)
    loss.record = []
    b = rows(ds)
    with torch.no_grad():
        model(b["input_ids"], labels=b["labels"], position_ids=b["position_ids"], dpo_seq=b["dpo_seq"],
              dpo_ref=b["dpo_ref"])
    ds.set_reference(list(range(len(ds))), loss.record[0])
    return loss


def test_textbook_equals_production():
    """dpo.textbook_dpo_loss (full logits, a reply per row) against DPOLoss on packed rows (no logits,
    the reference's sums precomputed): the loss and the policy's gradients within fp32 rounding."""
    def padded(docs: list) -> tuple[torch.Tensor, torch.Tensor]:  # (N, L) ids, (N, L-1) labels
        L = max(len(ids) for ids, _ in docs)
        return (torch.tensor([ids + [TPL.pad_id] * (L - len(ids)) for ids, _ in docs]),
                torch.tensor([lab + [-100] * (L - 1 - len(lab)) for _, lab in docs]))

    policy = W.materialize(M.build(CFG), "cpu", seed=1)
    reference = copy.deepcopy(policy)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)  # the policy has moved: margins are not 0
    ds = dpo.PairDataset(pairs(8), TPL, 256)
    assert len(ds) < len(ds.docs)  # packed: rows hold several pairs
    want = dpo.textbook_dpo_loss(policy, reference, padded([d[0] for d in ds.docs]),
                                 padded([d[1] for d in ds.docs]), beta=0.5)
    want.backward()
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    record_reference(reference, ds, beta=0.5)
    dpo.apply_dpo([policy], beta=0.5, cp_group=None)
    b = rows(ds)
    got = policy(b["input_ids"], labels=b["labels"], position_ids=b["position_ids"], dpo_seq=b["dpo_seq"],
                 dpo_ref=b["dpo_ref"])
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6) and want.item() > 0.1
    for p, w in zip(policy.parameters(), grads):
        assert (p.grad - w).abs().max() <= 1e-5 * w.abs().max()


def test_sequence_logps_match_transformers(tmp_path):
    import transformers as T
    torch.manual_seed(0)
    ref = T.LlamaForCausalLM(T.LlamaConfig(**{k: getattr(CFG, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings")})).eval()
    ref.save_pretrained(tmp_path)
    ours = W.load_hf(tmp_path)
    ps = pairs(5, seed=3)
    ds = dpo.PairDataset(ps, TPL, 200)
    assert len(ds) < 5  # pairs packed: rows hold several documents
    loss = record_reference(ours, ds, beta=0.1)
    padded = dpo.PairDataset(ps, TPL, 200, packing="none")  # a reply per row, folded by DPOLoss
    assert len(padded) == len(padded.docs) > len(ds.docs) and "packing none" in padded.report()
    loss.rows_per_pair, loss.record = 2, []
    b = rows(padded)  # (2·pairs, S): chosen, rejected, ...
    assert b["input_ids"].shape == (2 * len(padded), 200) and dpo.count_pairs(b) == len(padded)
    with torch.no_grad():
        ours(b["input_ids"], labels=b["labels"], dpo_seq=b["dpo_seq"], dpo_ref=b["dpo_ref"])
    padded.set_reference(list(range(len(padded))), loss.record[0])
    wants: dict[tuple, torch.Tensor] = {}  # a document → transformers' sum (each computed once)
    for got in (ds, padded):
        for k, pair in enumerate(got.docs):
            for half, (ids, labels) in enumerate(pair):
                if tuple(ids) not in wants:
                    with torch.no_grad():
                        logits = ref(torch.tensor([ids[:-1]])).logits[0]  # (L-1, V)
                    lab = torch.tensor(labels)
                    keep = lab != -100
                    wants[tuple(ids)] = F.log_softmax(logits, -1)[keep].gather(1, lab[keep, None]).sum()
                want = wants[tuple(ids)]
                assert abs(got.ref[k, half] - want) <= 1e-5 * abs(want), (got.packing, k, half)


def test_jsonl_formats_and_errors(tmp_path):
    p = tmp_path / "pairs.jsonl"
    user = [{"role": "user", "content": "2+2?"}]
    p.write_text(json.dumps({"chosen": user + [{"role": "assistant", "content": "4"}],
                             "rejected": user + [{"role": "assistant", "content": "5"}]}) + "\n\n"
                 + json.dumps({"prompt": user, "chosen": [{"role": "assistant", "content": "4"}],
                               "rejected": [{"role": "assistant", "content": "5"}]}) + "\n")
    a, b = dpo.load_pairs(p)
    assert a == b and a[0][-1]["content"] == "4" and a[1][-1]["content"] == "5"
    p.write_text(json.dumps({"chosen": user}) + "\n")
    with pytest.raises(ValueError, match=r"pairs.jsonl:1: .*'rejected'"):
        dpo.load_pairs(p)
    ds = dpo.PairDataset(pairs(8), TPL, 100)
    assert ds.dropped > 0 and "longer than a row dropped" in ds.report()
    for c, r in pairs(20):
        assert c[:-1] == r[:-1] and c[-1]["content"] != r[-1]["content"]


def test_flags_refused():
    def errors(*argv: str) -> str:
        grid = G.Grid(rank=0, world=2, device=torch.device("cpu"))
        return "\n".join(cli.validate(cli.parse_args(["--seq-len", "32", *argv]), M.PRESETS["tiny"], grid))
    assert errors("--dpo") == ""
    assert "choose one" in errors("--dpo", "--sft")
    assert "--cp with --dpo needs --packing none" in errors("--dpo", "--cp", "2")
    assert errors("--dpo", "--cp", "2", "--packing", "none") == ""
    assert "--packing goes with --sft or --dpo" in errors("--packing", "none")
    assert "--dpo-beta must be > 0" in errors("--dpo", "--dpo-beta", "0")
    assert "--dpo-beta goes with --dpo" in errors("--dpo-beta", "0.2")


LAYOUTS = {"tp2-sp": ["--tp", "2", "--sp"], "pp2": ["--pp", "2"], "dp2-zero2": ["--zero", "2"],
           "dp2-zero3": ["--zero", "3"]}


# --packing none (a reply per row): what cp needs; its own single-process run (other global batches)
PADDED = {"cp2": (2, ["--cp", "2"]), "cp2-dp2-zero1": (4, ["--cp", "2", "--zero", "1"])}


def _argv(tmp_path, name: str, *extra: str) -> list[str]:
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"chosen": c, "rejected": r}) + "\n" for c, r in pairs(32, seed=5)))
    return ["--dpo", "--allow-random-init", "--data", str(path), "--model", "tiny", "--seq-len", "192",
            "--batch-size", "4", "--steps", "4", "--lr", "3e-3", "--warmup", "0", "--dpo-beta", "0.5",
            "--log-every", "100", "--metrics", str(tmp_path / f"{name}.jsonl"), *extra]


def test_layouts_match_single_process(tmp_path):
    """Also the step log's implicit rewards: 0 at step 1 (π = r); the layouts' within 1e-5, and the
    held-out pairs' (3 of the 32) after the last step."""
    run_ranks(_main, 1, _argv(tmp_path, "single"))
    want = losses(tmp_path / "single.jsonl")
    assert want[0] == pytest.approx(math.log(2), abs=1e-6) and want[-1] < want[0] - 0.01
    rewards = records(tmp_path / "single.jsonl")
    assert [rewards[0][k] for k in REWARDS] == [0.0] * 4
    assert rewards[-1]["reward_margin"] > 0 and rewards[-1]["reward_accuracy"] > 0  # the chosen replies gain
    for name, extra in LAYOUTS.items():
        run_ranks(_main, 2, _argv(tmp_path, name, *extra))
        assert_curve(losses(tmp_path / f"{name}.jsonl"), want)
        assert_curve(grad_norms(tmp_path / f"{name}.jsonl"), grad_norms(tmp_path / "single.jsonl"))
        assert_rewards(tmp_path / f"{name}.jsonl", tmp_path / "single.jsonl")
        held = [{k: v for k, v in records(tmp_path / f"{n}.jsonl")[-1].items() if k.startswith("val_reward")}
                for n in (name, "single")]  # the held-out pairs' rewards after the last step
        assert len(held[1]) == 4 and held[0] == pytest.approx(held[1], rel=1e-5, abs=1e-5)


def test_resume_keeps_the_starting_reference(tmp_path):
    """Saved at step 2 and resumed: steps 3-4 equal the uninterrupted run within 1e-5 (loss, grad
    norm, rewards), at one process and at dp2·ZeRO-1. The reference is the --init-from policy, not
    the resumed one: with the resumed policy as reference step 3 would be exactly ln 2."""
    for name, world, extra in (("single", 1, []), ("dp2-zero1", 2, ["--zero", "1"])):
        ck = tmp_path / f"{name}-ck"
        run_ranks(_main, world, _argv(tmp_path, name, "--save", str(ck), "--save-every", "2", *extra))
        run_ranks(_main, world, _argv(tmp_path, f"{name}-resumed", "--resume", str(ck / "step_00000002"), *extra))
        want, got = records(tmp_path / f"{name}.jsonl")[2:], records(tmp_path / f"{name}-resumed.jsonl")
        assert [r["step"] for r in got] == [3, 4], name
        assert abs(got[0]["loss"] - math.log(2)) > 1e-3, name  # the margin is not reset to 0
        for k in ("loss", "grad_norm", *REWARDS):
            assert [r[k] for r in got] == pytest.approx([r[k] for r in want], rel=1e-5, abs=1e-6), (name, k)


def records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_rewards(got, want) -> None:
    """The implicit-reward log of every step within 1e-5, relative or absolute. Absolute, because
    r̂ = β(π − r) is a difference of fp32 sums about 20 in size: their round-off (~1e-6 relative, so
    ~2e-5 absolute) does not shrink with the difference (measured 3.1e-6 on a margin of 0.21 at cp2)."""
    for g, w in zip(records(got), records(want), strict=True):
        assert {k: g[k] for k in REWARDS} == pytest.approx({k: w[k] for k in REWARDS}, rel=1e-5, abs=1e-5)


def grad_norms(path) -> list[float]:
    """The logged grad norms: AdamW hides a gradient off by a constant factor from the loss curve
    (m/√v is scale free), the norm shows it."""
    return [json.loads(line)["grad_norm"] for line in path.read_text().splitlines()]


def test_cp_layouts_match_single_process(tmp_path):
    """--packing none at cp2 and cp2·dp2 against one process with --packing none: every step within
    1e-5. The rows are padded at the end, so a reply's tokens spread over both cp ranks' zigzag chunks
    (192/4 = 48 positions a chunk): the per-document sums are partial on each rank and only their
    all-reduce over cp gives the loss."""
    run_ranks(_main, 1, _argv(tmp_path, "padded", "--packing", "none"))
    want, norms = losses(tmp_path / "padded.jsonl"), grad_norms(tmp_path / "padded.jsonl")
    tokens = [json.loads(line)["tokens"] for line in (tmp_path / "padded.jsonl").read_text().splitlines()]
    assert tokens == [step * 4 * 2 * 192 for step in range(1, 5)]  # 4 pairs a step, two rows of 192 each
    assert want[0] == pytest.approx(math.log(2), abs=1e-6) and want[-1] < want[0] - 0.01
    for name, (world, extra) in PADDED.items():
        run_ranks(_main, world, _argv(tmp_path, name, "--packing", "none", *extra))
        assert_curve(losses(tmp_path / f"{name}.jsonl"), want)
        assert_curve(grad_norms(tmp_path / f"{name}.jsonl"), norms)
        assert_rewards(tmp_path / f"{name}.jsonl", tmp_path / "padded.jsonl")  # cp ranks count pairs alike
