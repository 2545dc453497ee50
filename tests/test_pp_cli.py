"""train.py with --schedule interleaved / zb, end to end, against the single process.

Every layout runs the real CLI (`train.main(argv)`) on forked gloo ranks (tests/dist.py) and compares
its `--metrics` loss curve (5 AdamW steps) with the single-process run of the same flags and data:
interleaved at pp=2, v=2 and pp=4, v=2, zb at pp=2 and pp=4, each with tp=2 and ZeRO-1 on 8 ranks;
tied embeddings; ZeRO-3 under zb; ZeRO-2 under interleaved and zb with two chunks per rank; compiled
layers (--compile) with selective AC under interleaved (inductor reorders the norms' reductions:
~1e-7); a v=2 checkpoint resumed in the same layout (bit for bit), in one process and at v=4.
Tolerance: 1e-5 relative (fp32; the layouts change only the summation order of
the same products: tp all-reduces, dp/ZeRO reduce-scatters, the tied copies' sum; measured ~3e-7).
An 8-layer model, so that pp=4 can hold v=2 chunks of one layer each.
"""
from pathlib import Path

import pytest
import torch

import cli
import data
import grid as G
import model as M
import weights as W
from dist import run_ranks
from test_train import _main, assert_curve, losses

ROOT = Path(__file__).resolve().parents[1]
CFG = M.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=64)
TIED = M.LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pp_cli")
    for name, cfg, seed in (("init", CFG, 11), ("init_tied", TIED, 12)):
        W.save_hf(dict(W.materialize(M.build(cfg), "cpu", seed=seed).named_parameters()), cfg, d / name)
    text = "".join(open(p, encoding="utf-8").read() for p in sorted(ROOT.glob("*.py")))
    (d / "corpus.txt").write_text(text[:60_000])
    data.prepare(d / "corpus.txt", d / "data")
    return d


def args_for(d: Path, *extra: str, metrics: str, init: str = "init") -> list[str]:
    return ["--init-from", str(d / init), "--data", str(d / "data"), "--steps", "5", "--seq-len", "32",
            "--batch-size", "8", "--micro-batches", "4", "--lr", "3e-3", "--warmup", "2",
            "--metrics", str(d / metrics), *extra]


@pytest.fixture(scope="module")
def reference(dirs):
    curves = {}
    for init in ("init", "init_tied"):
        run_ranks(_main, 1, args_for(dirs, metrics=f"ref_{init}.jsonl", init=init))
        curves[init] = losses(dirs / f"ref_{init}.jsonl")
        assert curves[init][-1] < curves[init][0] - 0.05  # the curve moves: comparing it is not vacuous
    return curves


LAYOUTS = {  # name: (world, flags, init)
    "interleaved-pp2v2-tp2-zero1": (8, ["--tp", "2", "--pp", "2", "--zero", "1", "--schedule", "interleaved"], "init"),
    "interleaved-pp4v2-tp2-zero1": (8, ["--tp", "2", "--pp", "4", "--zero", "1", "--schedule", "interleaved",
                                        "--virtual-stages", "2"], "init"),
    "zb-pp2-tp2-zero1": (8, ["--tp", "2", "--pp", "2", "--zero", "1", "--schedule", "zb"], "init"),
    "zb-pp4-tp2-zero1": (8, ["--tp", "2", "--pp", "4", "--zero", "1", "--schedule", "zb"], "init"),
    "zb-pp2v2-zero3": (4, ["--pp", "2", "--zero", "3", "--schedule", "zb", "--virtual-stages", "2"], "init"),
    "tied-interleaved-pp2v2-zero1": (4, ["--pp", "2", "--zero", "1", "--schedule", "interleaved"], "init_tied"),
    "tied-zb-pp2-tp2": (4, ["--pp", "2", "--tp", "2", "--schedule", "zb"], "init_tied"),
    # compiled layers under the pipeline executor, with selective AC (compile's policy) and ZeRO-1
    "compile-interleaved-pp2v2-zero1-ac": (4, ["--pp", "2", "--zero", "1", "--schedule", "interleaved",
                                               "--compile", "--ac"], "init"),
    # ZeRO-2 reduces once per step: a bucket holding both chunks' parameters (one 25 MB bucket per
    # rank here) is reduce-scattered after the later of the two chunks' last backward
    "interleaved-pp2v2-zero2": (4, ["--pp", "2", "--zero", "2", "--schedule", "interleaved"], "init"),
    "zb-pp2v2-zero2": (4, ["--pp", "2", "--zero", "2", "--schedule", "zb", "--virtual-stages", "2"], "init"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_schedule_matches_single_process(dirs, reference, name, capfd):
    world, extra, init = LAYOUTS[name]
    run_ranks(_main, world, args_for(dirs, *extra, metrics=f"{name}.jsonl", init=init), timeout=300)
    assert_curve(losses(dirs / f"{name}.jsonl"), reference[init])
    out = capfd.readouterr().out
    schedule = extra[extra.index("--schedule") + 1]
    assert f"pipeline: {schedule}, " in out and "simulated bubble" in out
    assert ("compiled layers" in out) == ("--compile" in extra)


def test_interleaved_checkpoint_is_layout_free(dirs, reference):
    """pp=2, v=2 saves after step 2; the same layout resumes bit for bit, one process and pp=2 with
    v=4 chunks continue the single-process curve (1e-5)."""
    d = dirs
    layout = ["--pp", "2", "--zero", "1", "--schedule", "interleaved"]
    ck = str(d / "ck")
    run_ranks(_main, 4, args_for(d, *layout, "--save", ck, "--steps", "2", metrics="r.jsonl"), timeout=300)
    run_ranks(_main, 4, args_for(d, *layout, "--resume", ck + "/step_00000002", metrics="r.jsonl"), timeout=300)
    run_ranks(_main, 4, args_for(d, *layout, metrics="straight.jsonl"), timeout=300)
    assert losses(d / "r.jsonl") == losses(d / "straight.jsonl")  # steps 1-2 kept, 3-5 redone: equal
    for world, extra in ((1, []), (2, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "4"])):
        (d / "x.jsonl").unlink(missing_ok=True)
        run_ranks(_main, world, args_for(d, *extra, "--resume", ck + "/step_00000002", metrics="x.jsonl"),
                  timeout=300)
        assert_curve(losses(d / "x.jsonl"), reference["init"][2:])


def validate(argv: list[str], world: int) -> str:
    grid = G.Grid(rank=0, world=world, device=torch.device("cpu"))
    return "\n".join(cli.validate(cli.parse_args(["--seq-len", "32", *argv]), CFG, grid))


def test_pipeline_flags():
    assert validate(["--pp", "4", "--schedule", "interleaved"], 4) == ""  # v = 2 by default: 8 chunks
    assert "9 layers" not in validate(["--pp", "4", "--schedule", "zb", "--virtual-stages", "2"], 4)
    assert "8 layers cannot fill 12 pipeline stages" in validate(["--pp", "4", "--schedule", "interleaved",
                                                                  "--virtual-stages", "3"], 4)
    assert "--pp-layers [3, 5] has 2 entries for 4 (virtual) stages" in validate(
        ["--pp", "2", "--schedule", "interleaved", "--pp-layers", "3,5"], 2)
    assert validate(["--pp", "2", "--schedule", "interleaved", "--pp-layers", "3,2,2,1"], 2) == ""
    assert "--schedule interleaved needs --virtual-stages >= 2" in validate(
        ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "1"], 2)
    assert "more than 1 goes with --schedule interleaved or zb" in validate(
        ["--pp", "2", "--virtual-stages", "2"], 2)
    assert "--virtual-stages 0 needs >= 1" in validate(["--virtual-stages", "0"], 1)  # not the default
    assert "--schedule zb with --ac" in validate(["--pp", "2", "--schedule", "zb", "--ac"], 2)
    assert validate(["--pp", "2", "--schedule", "interleaved", "--zero", "2"], 4) == ""  # (see LAYOUTS)
    # the default micro-batches: 4·pp (1f1b) or 2·pp (interleaved, zb), a divisor of the dp rank's rows
    args = lambda *a: cli.parse_args(["--batch-size", "16", *a])  # noqa: E731
    assert cli.micro_batches(args("--pp", "2"), 2) == 8 and cli.micro_batches(args("--pp", "4"), 4) == 16
    assert cli.micro_batches(args("--pp", "4", "--schedule", "zb"), 8) == 8  # dp=2: 8 rows each
    assert cli.micro_batches(args("--pp", "2", "--schedule", "zb"), 12) == 2  # dp=6: 16 // 6 = 2 rows
    assert "--batch-size 16 is not divisible by dp size 6" in validate(["--batch-size", "16", "--pp", "2"], 12)
    assert cli.micro_batches(args(), 1) == 1 and cli.micro_batches(args("--micro-batches", "2"), 1) == 2
