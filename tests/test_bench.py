"""bench.py --quick on 4 gloo ranks (~15 s + one compile): every ours-vs-PyTorch row is present and both
sides computed the same result, and every table of the report is there. Timings are never asserted (the
GUIDE: speed is measured in the benchmark, not tested). Then bench_mfu.py --smoke: the GPU check's
script end to end on CPU (the tiny preset; eager rows of every AC mode, one compiled row, transformers).

The agreement checked is bench.py's own: the global grad norm of the first step (both sides still hold
the same weights) and the losses of the first three steps (all of --quick's) within 1e-5 relative
(fp32; the sides differ only in summation order: gloo's reduction order, DTensor's and the pipelining
schedule's accumulation order).
The grad norm is part of it because AdamW's update m/sqrt(v) is blind to a wrongly scaled gradient
(say DDP's mean left unscaled), while the norm is not.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from bench import bench, bench_mfu  # imported once here: the forked ranks inherit them
from dist import run_ranks

ROWS = ["dp", "zero1", "zero2", "zero3", "tp", "cp", "pp gpipe", "pp 1f1b", "pp interleaved", "pp zb", "ac full",
        "ac selective", "compile", "optim step", "sft ffd"]
TABLES = ["Step time: ours vs PyTorch", "Pipeline bubble (idle share", "Persistent bytes per rank",
          "Saved activations per layer", "SFT packing", "1B single-GPU bf16 tokens/s and MFU",
          "Activation checkpointing: host time per decoder layer", "Gradient accumulation and reduction dtype"]


def _bench(rank: int, world: int, out: str) -> dict:
    return bench.main(["--quick", "--out", out])


def test_quick_every_row_same_result(tmp_path):
    out = tmp_path / "bench.md"
    result = run_ranks(_bench, 4, str(out), timeout=240)[0]  # rank 0 holds every row
    rows = {r["feature"]: r for r in result["rows"]}
    assert list(rows) == ROWS
    for name, r in rows.items():
        assert r["ok"] and max(r["loss_err"], r["norm_err"]) <= 1e-5, (name, r["loss_err"], r["norm_err"])
        assert r["ours_ms"] > 0 and r["peer_ms"] > 0
    text = out.read_text()
    assert text.strip() == result["markdown"].strip()
    for title in TABLES:
        assert f"## {title}" in text, title
    for name in ROWS:
        assert f"| {name} |" in text, name
    if not torch.cuda.is_available():
        assert "skipped (no CUDA)" in text
    # the layout table: every ZeRO layout ± AC and PP with ZeRO, each its formula up to the padding
    # of flat buffers to a multiple of dp (< dp elements per bucket: far below 0.1% here)
    layouts = [line for line in text.splitlines() if line.startswith(("| baseline", "| ZeRO", "| PP2"))]
    assert len(layouts) == 10
    assert all(abs(float(line.split("|")[9]) - 1) < 1e-3 for line in layouts), layouts


def _smoke(rank: int, world: int, out: str) -> dict:
    return bench_mfu.main(["--smoke", "--out", out])


def test_gpu_check_smoke_on_cpu(tmp_path):
    """bench_mfu.py --smoke in a forked process (its compile stays out of the pytest process): every row
    ran and computed the eager model's first loss (bf16, 2e-2), the attention op was recorded for both
    kinds of rows, and the report was written."""
    out = tmp_path / "mfu.md"
    result = run_ranks(_smoke, 1, str(out), timeout=400)[0]
    rows = [(r["layers"], r["ac"]) for r in result["rows"]]
    assert rows == [("eager", "none"), ("eager", "selective"), ("eager", "full"), ("compiled", "full"),
                    ("transformers LlamaForCausalLM (sdpa)", "none")]
    assert all(r["same"] and r["ms"] > 0 for r in result["rows"]), result["rows"]
    assert result["grads"]["worst"] <= 5e-2, result["grads"]  # bf16 gradients vs transformers
    assert set(result["kernels"]) == {"pretraining rows", "packed rows"}
    assert all("scaled_dot_product" in k or "varlen" in k for k in result["kernels"].values()), result["kernels"]
    assert out.read_text().strip().endswith(result["markdown"].strip().split("\n")[-1])


def test_runs_by_path_from_any_folder(tmp_path):
    """`python bench/bench.py` (by path, from another folder) imports the library from the root and its
    own package, not bench/bench.py as `bench` (--help: the imports are what is checked, ~3 s of CPU);
    its help states that a report is written only when --out asks."""
    script = Path(__file__).resolve().parent.parent / "bench" / "bench.py"
    run = subprocess.run([sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "default: print only" in re.sub(r"\s+", " ", run.stdout)
    assert not list(tmp_path.iterdir())
