"""Pretraining validation loss: the held-out split of --data, `--eval-every` / `--eval-batches`.

The single-process value is checked against an independent reference — transformers'
LlamaForCausalLM on the exported weights, mean cross-entropy over the same held-out rows — and every
parallel layout against the single process, like the training loss. Tolerance 1e-5 relative (fp32:
tp/dp/pp only change the summation order of the same products).
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import cli
import data
import feed
import grid as G
import model as M
import train
import weights as W
from dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
CFG = M.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=64)


@pytest.fixture(scope="module")
def setup_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("val")
    W.save_hf(dict(W.materialize(M.build(CFG), "cpu", seed=11).named_parameters()), CFG, d / "init")
    docs = [p.read_text(encoding="utf-8")[:3000] for p in sorted(ROOT.glob("*.py"))]
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return d


def args_for(d: Path, *extra: str, metrics: str) -> list[str]:
    return ["--init-from", str(d / "init"), "--data", str(d / "c.jsonl"), "--val-fraction", "0.2",
            "--steps", "4", "--seq-len", "32", "--batch-size", "8", "--micro-batches", "2", "--lr", "3e-3",
            "--warmup", "2", "--eval-every", "2", "--eval-batches", "3", "--metrics", str(d / metrics),
            *extra]


def _main(rank: int, world: int, argv: list[str]) -> None:
    train.main(argv)


def val_curve(path: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def reference(setup_dirs):
    d = setup_dirs
    run_ranks(_main, 1, args_for(d, "--export-hf", str(d / "export"), metrics="ref.jsonl"))
    curve = val_curve(d / "ref.jsonl")
    assert [s for s, _ in curve] == [2, 4]  # every 2 steps; the last step is one of them
    assert curve[1][1] < curve[0][1] - 0.05  # it moves: comparing it is not vacuous
    return curve


def test_val_loss_equals_transformers_on_the_held_out_rows(setup_dirs, reference):
    """The last val loss = mean token cross-entropy of HF's LlamaForCausalLM (exported weights)
    over the first 3 × 8 rows of the held-out split — documents that never appear in training."""
    from transformers import LlamaForCausalLM
    d = setup_dirs
    prepared = feed.cache_path(cli.parse_args(["--data", str(d / "c.jsonl")]))
    val = data.TokenDataset(prepared, 32, split="val")
    rows = torch.stack([val[i] for i in range(24)])  # (24, 33)
    hf = LlamaForCausalLM.from_pretrained(d / "export").eval()
    with torch.no_grad():
        logits = hf(rows[:, :-1]).logits.double()  # (24, 32, V)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert abs(reference[-1][1] - want) <= 1e-5 * want
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["num_val_documents"] == len(list(ROOT.glob("*.py"))) // 5  # every 5th document
    tok = data.ByteTokenizer()
    train_text = tok.decode(np.fromfile(prepared / "tokens.bin", dtype=meta["dtype"]))
    assert tok.decode(val[0][:32]) not in train_text  # the held-out document never trains


@pytest.mark.parametrize("name,world,extra", [
    ("tp2-pp2-sp-zero3-ac", 8, ["--tp", "2", "--pp", "2", "--sp", "--zero", "3", "--ac"]),
    ("pp2-dp2-zero1-gpipe", 4, ["--pp", "2", "--zero", "1", "--schedule", "gpipe"]),
])
def test_val_loss_is_the_same_in_every_layout(setup_dirs, reference, name, world, extra):
    run_ranks(_main, world, args_for(setup_dirs, *extra, metrics=f"{name}.jsonl"), timeout=240)
    got = val_curve(setup_dirs / f"{name}.jsonl")
    assert [s for s, _ in got] == [s for s, _ in reference]
    for (_, g), (_, w) in zip(got, reference):
        assert abs(g - w) <= 1e-5 * w, (got, reference)


def test_eval_needs_a_held_out_split(setup_dirs):
    """A .txt file is one document: --eval-every cannot be served, and the message says why."""
    d = setup_dirs
    (d / "one.txt").write_text("x" * 5000)
    with pytest.raises(RuntimeError, match=r"SystemExit: 2"):
        run_ranks(_main, 1, ["--data", str(d / "one.txt"), "--seq-len", "16", "--eval-every", "2",
                             "--steps", "2", "--batch-size", "2"])
    grid = G.Grid(rank=0, world=1, device=torch.device("cpu"))
    args = cli.parse_args(["--data", str(d / "one.txt"), "--seq-len", "16", "--eval-every", "2"])
    with pytest.raises(ValueError, match=r"--eval-every 2: .*one.txt-\w+.attotron has no held-out split: "
                                         r"1 documents × val_fraction 0.01 < 1 \(a .txt file is one"):
        feed.load_val(args, feed.load_data(args, grid), grid)
