"""Every launch line of README.md runs: a broken line fails here.

Each `python train.py` / `torchrun ... train.py` line (continuations joined, the comment dropped)
is checked twice:
- as written: cli.validate with the line's flags, its world size (--nproc_per_node) and its model
  (the preset, or the tiny preset the README's own exports come from) returns no error;
- run, shortened: train.main on that many forked gloo ranks, with --steps 1 and small rows
  (--seq-len 64, --batch-size 8; --model 1b becomes tiny). Relative paths land in a temporary
  folder, so the README's chain holds: a line that reads `--init-from out/X` runs after the line
  that writes `--export-hf out/X`.
`python pp.py ...` runs in process. The pip and pytest lines, and the bench lines, are left to
tests/test_bench.py and to CI itself.
"""
import contextlib
import io
import re
import runpy
import shlex
import sys
import time
from pathlib import Path

import torch

import cli
import feed
import grid as G
import model as M
from dist import run_ranks
from test_faults import _run

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"--steps": "1", "--seq-len": "64", "--batch-size": "8"}


def launch_lines() -> list[str]:
    """The README's indented command lines, continuations joined, comments dropped."""
    lines, out, held = (ROOT / "README.md").read_text().splitlines(), [], ""
    for line in lines:
        if not line.startswith("    ") and not held:
            continue
        text = held + " " + line.strip() if held else line.strip()
        if text.endswith("\\"):
            held = text[:-1].strip()
            continue
        held = ""
        out.append(re.sub(r"\s+#.*$", "", text).strip())
    return [t for t in out if t.startswith(("python train.py", "torchrun", "python pp.py")) and "&&" not in t]


def split(line: str) -> tuple[int, list[str]]:
    """(world size, train.py's flags) of a launch line."""
    words = shlex.split(line)
    at = words.index("train.py")
    launcher = words[:at]
    world = int(launcher[launcher.index("--nproc_per_node") + 1]) if "--nproc_per_node" in launcher else 1
    return world, words[at + 1:]


def shorten(flags: list[str]) -> list[str]:
    out, i = [], 0
    while i < len(flags):
        if flags[i] in SHORT:
            i += 2
            continue
        out.append("tiny" if out and out[-1] == "--model" and flags[i] == "1b" else flags[i])
        i += 1
    return out + [x for kv in SHORT.items() for x in kv]


def few_eval_questions(rank: int) -> None:
    """In a shortened run's rank: the built-in held-out evaluations ask 4 questions, not 1500."""
    real = feed.evaluate
    feed.evaluate = lambda model, tok, eval_set, **kw: real(model, tok, eval_set[:4], **kw)


def test_readme_launch_lines_run(tmp_path, monkeypatch):
    lines = launch_lines()
    train_lines = [t for t in lines if "train.py" in t]
    assert len(train_lines) >= 10 and any("--grpo" in t for t in train_lines)  # the extraction finds them
    for line in train_lines:  # as written
        world, flags = split(line)
        args = cli.parse_args(flags)
        cfg = M.PRESETS[args.model or "tiny"]
        errors = cli.validate(args, cfg, G.Grid(rank=0, world=world, device=torch.device("cpu")))
        assert not errors, (line, errors)
    monkeypatch.chdir(tmp_path)  # the forked ranks inherit it: out/..., ckpt land here
    todo = list(train_lines)
    while todo:
        ready = [t for t in todo if "--init-from" not in (f := split(t)[1])
                 or Path(f[f.index("--init-from") + 1]).is_dir()]
        assert ready, f"no README line writes what these read: {todo}"
        for line in ready:
            world, flags = split(line)
            t = time.time()
            assert run_ranks(_run, world, shorten(flags), few_eval_questions, timeout=300) == [0] * world, line
            print(f"{time.time() - t:.1f}s  {line}")
            todo.remove(line)
    for line in (t for t in lines if t.startswith("python pp.py")):
        monkeypatch.setattr(sys, "argv", shlex.split(line)[1:])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(ROOT / "pp.py"), run_name="__main__")
        assert "bubble" in out.getvalue(), line
