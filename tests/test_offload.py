"""offload.py: --offload equals the run without it, and its copies keep the CUDA contract.

Exactness: on CPU the host is the device. The step is the same torch.optim.AdamW on the same fp32
pieces, the norm is read from the same device gradients, and the bf16 (here fp32) shard reaches the
flat through a staging buffer instead of directly: the same values. So the curves (loss and grad
norm, every step) must be equal bit for bit, not close.
"""
import json
from pathlib import Path

import pytest
import torch

import offload as OFF
from dist import run_ranks
from test_train import _main, args_for, setup_dirs  # noqa: F401  (a fixture)


def _records(path: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize("world,zero", [(1, "1"), (2, "1"), (2, "2")])
def test_offload_equals_the_run_without(setup_dirs, world, zero):  # noqa: F811
    d = setup_dirs
    runs = {}
    for flag in ([], ["--offload"]):
        name = f"off{world}{zero}{len(flag)}.jsonl"
        run_ranks(_main, world, args_for(d, "--zero", zero, "--steps", "3", *flag, metrics=name), timeout=240)
        runs[bool(flag)] = _records(d / name)
    assert len(runs[True]) == 3 and runs[True] == runs[False]


def test_offload_copies_under_the_contract(monkeypatch):
    """A stage-2 step on the meta device (CUDA's stand-in) at dp 2 on the fake group: the host
    buffers are pinned and contiguous, and each bucket's bf16 shard goes host → device non_blocking."""
    from cuda_contract import Contract, fake_world, on_meta
    import model as M
    import weights as W
    import precision as P
    import train  # noqa: F401  (the library's import order)
    on_meta(monkeypatch)
    cfg = M.PRESETS["tiny"]
    with fake_world(0, 2, monkeypatch), Contract() as contract:
        model = M.build(cfg)
        init = W.param_reader(model, seed=0)
        W.materialize_buffers(model, "meta")
        opt = OFF.apply_offload(model, 2, None, P.OptimConfig(), torch.bfloat16, init=init,
                                device=torch.device("meta"), bucket_mb=0.05)
        assert all(t.is_pinned() for t in [*opt.master, *opt.host_grads, *opt.staging])
        x = torch.randint(0, cfg.vocab_size, (2, 33), device="meta")
        model(x[:, :-1], labels=x[:, 1:], reduction="sum").backward()
        opt.finish()
        grads = opt._master_grads()
        opt._publish()  # every bucket's shard: one non_blocking host → device copy
        opt.teardown()
    assert contract.seen["pin_memory"] > 0 and contract.seen["blocking copy"] == 0
    # one device → host copy per gradient piece, one host → device copy per bucket holding a piece
    owned = sum(any(opt.pieces[i].n for i in b.index) for b in opt.buckets)
    assert contract.seen["non_blocking copy"] == sum(g is not None for g in grads) + owned
    assert any(g is not None for g in grads) and all(g is None or g.device.type == "cpu" for g in grads)


def test_offload_refusals():
    import cli
    import grid as G
    import model as M
    cfg, grid = M.PRESETS["tiny"], G.Grid(0, 1, torch.device("cpu"))
    for argv in (["--offload"], ["--offload", "--zero", "3"], ["--offload", "--zero", "1", "--fp8"],
                 ["--offload", "--zero", "2", "--save", "x"]):
        assert any("--offload goes with --zero 1 or 2" in e for e in cli.validate(cli.parse_args(argv), cfg, grid))
    assert not cli.validate(cli.parse_args(["--offload", "--zero", "2"]), cfg, grid)
    with pytest.raises(ValueError, match="stage 1 or 2"):
        OFF.apply_offload(M.build(cfg), 0, None, None)
