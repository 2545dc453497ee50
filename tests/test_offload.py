"""offload.py: --offload equals the run without it, and its copies keep the CUDA contract.

Exactness: on CPU the host is the device. The step is the same torch.optim.AdamW on the same fp32
pieces, the norm is read from the same device gradients, and the bf16 (here fp32) shard reaches the
flat through a staging buffer instead of directly: the same values. So the curves (loss and grad
norm, every step) must be equal bit for bit, not close.
"""
import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class HostCopies(TorchDispatchMode):
    """Counts the copies into the given host buffers (empty ones hold nothing to copy)."""

    def __init__(self, buffers: list[torch.Tensor]):
        super().__init__()
        self.ptrs, self.n = {b.data_ptr() for b in buffers if b.numel()}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.copy_.default and args[0].data_ptr() in self.ptrs
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stage,every", [(1, False), (2, False), (2, True)])
def test_gradients_leave_during_backward(stage, every):
    """Dp 1 on CPU (CUDA's code path, streams aside), small buckets, two micro-batches a step.
    Every gradient piece reaches its host buffer before step() is called, most during backward.
    The last `inflight` buckets land at finish(). At stage 2 per micro-batch every micro-batch
    sends its running sums. And the steps equal plain ZeRO's bit for bit (fp32)."""
    import precision as P
    import zero as Z
    from test_dp import LR, dataset, make_model
    x, y = dataset()
    targets = P.count_targets(y[:4])
    runs = {}
    for off in (False, True):
        model = make_model()
        build = OFF.apply_offload if off else Z.apply_zero_0_to_2
        opt = build(model, stage, None, P.OptimConfig(lr=LR), torch.float32, bucket_mb=0.004,
                    reduce_every_micro_batch=every)
        counts, runs[off] = [], []
        for step in range(2):
            with HostCopies(getattr(opt, "host_grads", [])) as copies:
                for k in range(2):
                    with opt.no_sync() if k == 0 else contextlib.nullcontext():
                        rows = slice(2 * k, 2 * k + 2)
                        P.normalized_loss(model(x[rows], labels=y[rows], reduction="sum"), targets).backward()
                    counts.append(copies.n)
                opt.finish()
                counts.append(copies.n)
                norm = opt.step(LR)
                counts.append(copies.n)
            runs[off].append((norm, [p.detach().clone() for p in model.parameters()]))
        opt.teardown()
    assert len(opt.buckets) > opt.inflight  # so some buckets land within backward
    pieces = sum(pc.n > 0 for pc in opt.pieces)
    first, last, landed, stepped = counts[:4]  # the first step's; the second's repeat them
    assert counts[4:] == counts[:4]
    assert 0 < last < landed and stepped == landed  # during backward; at finish(); none in step()
    assert (first > 0, landed) == (True, 2 * pieces) if every else (first, landed) == (0, pieces)
    for (n0, p0), (n1, p1) in zip(runs[False], runs[True]):
        assert n0 == n1 and all(torch.equal(a, b) for a, b in zip(p0, p1))


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_copies_under_the_contract(monkeypatch, stage):
    """A step on the meta device (CUDA's stand-in) at dp 2 on the fake group. The host buffers are
    pinned and contiguous. Each gradient piece goes device → host non_blocking as its bucket lands,
    most during backward, none in step(). Each bucket's bf16 shard goes host → device non_blocking.
    Host syncs at the dispatcher: before step() only those non_blocking copies (0 blocking ones)."""
    from cuda_contract import Contract, fake_world, on_meta
    import model as M
    import weights as W
    import precision as P
    import train  # noqa: F401  (the library's import order)
    on_meta(monkeypatch)
    cfg = M.PRESETS["tiny"]
    with fake_world(0, 2, monkeypatch), Contract(host_values=True) as contract:
        model = M.build(cfg)
        init = W.param_reader(model, seed=0)
        W.materialize_buffers(model, "meta")
        opt = OFF.apply_offload(model, stage, None, P.OptimConfig(), torch.bfloat16, init=init,
                                device=torch.device("meta"), bucket_mb=0.05)
        assert all(t.is_pinned() for t in [*opt.master, *opt.host_grads, *opt.staging])
        built = contract.syncs.copy()  # the masters' moves to the host
        x = torch.randint(0, cfg.vocab_size, (2, 33), device="meta")
        model(x[:, :-1], labels=x[:, 1:], reduction="sum").backward()
        in_backward = contract.seen["non_blocking copy"]
        opt.finish()
        landed, syncs = contract.seen["non_blocking copy"], contract.syncs - built
        opt.step(1e-3)  # the norm's read (host_values: 0), AdamW on the host, the shards back
        stepped = contract.syncs - built - syncs
        opt.teardown()
    d2h = sum(pc.n > 0 for pc in opt.pieces)  # one per piece this rank owns
    assert 0 < in_backward < landed == d2h and contract.seen["blocking copy"] == 0
    assert syncs == Counter({"aten::copy_": d2h})  # non_blocking into pinned memory: no wait
    assert stepped["aten::copy_"] == 0  # step() sends no gradient: they all left before it
    assert contract.seen["pin_memory"] > 0
    # one host → device copy per bucket holding a piece
    owned = sum(any(opt.pieces[i].n for i in b.index) for b in opt.buckets)
    assert contract.seen["non_blocking copy"] == d2h + owned


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
