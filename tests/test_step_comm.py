"""train.py's step seen from the host: host syncs and collectives counted per optimizer step.

Method. Each rank runs the real CLI (`train.main`) with recorders patched in (tests/dist.py forks it):
- every `torch.distributed` collective and point-to-point call is recorded with the size of its
  group and the chain of project functions that called it;
- every conversion of a tensor to a Python value (`item`, `tolist`, `numpy`, `float()`, `int()`,
  `bool()`, `index`) and every blocking copy (`.to(device)` without non_blocking, `.cpu()`,
  `.cuda()`) made by the training thread is recorded with its call site. On CUDA each of these,
  applied to a device tensor, waits for the GPU (a device→host read or a synchronizing copy). On
  this CPU there are no device tensors, so the sites are judged by what they read on CUDA: all the
  step's tensors are device tensors but for two kinds made on the host by design, listed in HOST
  with the reason; the batch is made by the prefetch thread (not recorded: it never waits for the
  GPU) and copied with non_blocking;
- `Prefetcher.next` marks the start of each step, so a step's window runs up to the next one;
- `new_group` is recorded too: every group exists before the first step (none is made later).
Steps 2 and 3 of 4 are counted (--log-every 100: step 1 and the last step log and evaluate).

Targets (issue 14): at most one host sync in a step that does not log (exactly one: the grad norm,
whose non-finite check decides the update); no collective on a group of one rank (a single process
runs none in its step); ZeRO-1 at dp=2: 4 all-reduces (targets, loss, grad norm, and issue 28's stop
flag: async, on the gloo io group, read one step later from host memory) plus one reduce-scatter and
one all-gather per bucket, the all-gathers launched by the next forward.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import data
import feed
import memory as MEM
import model as M
import train
import weights as W
import zero3 as Z3
from dist import run_ranks

ROOT = Path(__file__).resolve().parents[1]
CFG = M.LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=64)
COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast",
               "reduce_scatter_single", "reduce_scatter_tensor", "reduce", "barrier", "all_to_all_single",
               "batch_isend_irecv", "gather", "scatter")  # (isend/irecv: P2POp checks their identity)
CONVERSIONS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
# call sites whose tensor lives in host memory on CUDA too (so reading it waits for nothing)
HOST = {("train.py", "one_step", "__float__"): "feed.host_copy: the loss copied in stream order, read "
                                           "after the step's sync",
        ("pp.py", "_check_step", "tolist"): "the pp check's header: host values gathered over gloo",
        ("preempt.py", "wait", "__int__"): "the stop flag: a host tensor MAX-reduced over gloo, started "
                                            "at the previous step boundary",
        ("optimizer.py", "_get_value", "item"): "torch's AdamW step counter, a CPU tensor unless fused "
                                                 "(precision.py: fused on CUDA, no such read)"}
SYNC = ("precision.py", "step", "__float__")  # the one: the grad norm


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("step_comm")
    W.save_hf(dict(W.materialize(M.build(CFG), "cpu", seed=11).named_parameters()), CFG, d / "init")
    text = "".join(open(p, encoding="utf-8").read() for p in sorted(ROOT.glob("*.py")))
    (d / "corpus.txt").write_text(text[:40_000])
    data.prepare(d / "corpus.txt", d / "data")
    return d


def _site(depth: int = 2, ours: bool = True) -> list[tuple[str, str]]:
    """The frames on the stack (ours: the project's only), innermost first: (file, function)."""
    frames, f = [], sys._getframe(depth)
    while f is not None:
        path = Path(f.f_code.co_filename)
        if path.parent == ROOT or not ours:
            frames.append((path.name, f.f_code.co_name))
        f = f.f_back
    return frames


def _moves(args: tuple, kwargs: dict) -> bool:
    """Does this .to(...) name a device (a copy that may cross host and device) without non_blocking?"""
    named = "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)
    return named and not kwargs.get("non_blocking", False) and not (len(args) > 1 and args[1] is True)


def _recorded(rank: int, world: int, argv: list[str]) -> dict:
    main_thread = threading.get_ident()
    events: list[tuple] = []
    opts: list = []

    def collective(name: str, fn):
        def run(*args, **kwargs):
            group = kwargs.get("group")
            if name == "batch_isend_irecv":
                group = args[0][0].group
            events.append(("coll", name, dist.get_world_size(group), tuple(f for _, f in _site())))
            return fn(*args, **kwargs)
        return run

    def conversion(name: str, fn):
        def run(t, *args, **kwargs):
            if threading.get_ident() == main_thread and not getattr(t, "is_meta", False):
                if name != "to" or _moves(args, kwargs):
                    events.append(("sync", name, _site(ours=False)[0]))
            return fn(t, *args, **kwargs)
        return run

    real_next, real_zero = feed.Prefetcher.next, Z3.apply_zero

    def marked(self):
        events.append(("step",))
        return real_next(self)

    def capture(*args, **kwargs):
        opts.append(real_zero(*args, **kwargs))
        return opts[-1]

    for name in COLLECTIVES:
        setattr(dist, name, collective(name, getattr(dist, name)))
    new_group = dist.new_group
    dist.new_group = lambda *a, **k: events.append(("group",)) or new_group(*a, **k)
    for name in CONVERSIONS + ("to", "cpu", "cuda"):
        setattr(torch.Tensor, name, conversion(name, getattr(torch.Tensor, name)))
    feed.Prefetcher.next, Z3.apply_zero = marked, capture
    # the CPU peak meter (a profiler session, phase markers) is CPU-only instrumentation, no part of the
    # step on CUDA (there it reads allocator counters); off, it also leaves gloo's threads alone
    MEM.exact_cpu_accounting = lambda: False  # the meter is then unavailable: no profiler session
    train.main(argv)
    steps = [[]]
    for e in events:
        if e == ("step",):
            steps.append([])
        else:
            steps[-1].append(e)
    return {"steps": steps[1:], "buckets": len(opts[0].buckets) if opts[0].stage else 0,
            "inflight": opts[0].inflight}


def run(d: Path, world: int, *flags: str) -> list[dict]:
    argv = ["--init-from", str(d / "init"), "--data", str(d / "data"), "--steps", "4", "--seq-len", "32",
            "--batch-size", "8", "--micro-batches", "2", "--log-every", "100", *flags]
    return run_ranks(_recorded, world, argv, timeout=240)


def check_quiet_steps(results: list[dict]) -> list[list[tuple]]:
    """Steps 2 and 3 of every rank: one sync (the grad norm), host reads only at HOST sites, nothing
    on a group of one. Returns those steps' collectives per rank."""
    out = []
    for rank, r in enumerate(results):
        assert len(r["steps"]) == 4
        assert not [e for step in r["steps"] for e in step if e == ("group",)]  # all made before
        colls = []
        for step in r["steps"][1:3]:
            syncs = Counter(e[2] + (e[1],) for e in step if e[0] == "sync")
            device = {k: n for k, n in syncs.items() if k not in HOST}
            assert device == {SYNC: 1}, (rank, syncs)
            assert not [e for e in step if e[0] == "coll" and e[2] < 2], (rank, step)
            colls.append([e for e in step if e[0] == "coll"])
        assert Counter(e[:3] for e in colls[0]) == Counter(e[:3] for e in colls[1])  # every step alike
        out.append(colls[0])
    return out


def test_single_process_step_has_one_sync_and_no_collective(dirs):
    (colls,) = check_quiet_steps(run(dirs, 1))
    assert colls == []


def test_zero1_dp2_collectives_per_step(dirs):
    results = run(dirs, 2, "--zero", "1", "--bucket-mb", "0.05")
    for r, colls in zip(results, check_quiet_steps(results)):
        nb = r["buckets"]
        assert nb > r["inflight"]  # so that the forward's hooks keep launching as they go
        assert Counter(e[1] for e in colls) == {"all_reduce": 4, "reduce_scatter_single": nb,
                                                "all_gather_single": nb}
        gathers = [e[3] for e in colls if e[1] == "all_gather_single"]
        assert all("_wait_site" in chain for chain in gathers)  # launched by the forward's hooks


def test_tp2_pp2_step_skips_groups_of_one(dirs):
    """dp = 1 here: no target-count, loss or dp all-reduce; the grad norm over tp and pp (size 2)."""
    results = run(dirs, 4, "--tp", "2", "--pp", "2", "--zero", "1")
    for colls in check_quiet_steps(results):
        names = Counter(e[1] for e in colls if "_check_step" not in e[3])
        checks = [e for e in colls if "_check_step" in e[3]]
        assert [e[1] for e in checks] == ["all_gather_single"]  # the pp check, over gloo
        assert names["reduce_scatter_single"] == names["all_gather_single"] == 0  # ZeRO over dp = 1: copies
        assert names["batch_isend_irecv"] > 0 and names["broadcast"] == 1  # the loss, from the last stage
        assert sum(1 for e in colls if "grad_norm" in e[3]) == 2  # tp, then pp


def test_muon_adds_two_all_to_alls_and_one_tp_gather(dirs):
    """--optimizer muon at tp2 · dp2 · ZeRO-1: per step, one all-to-all sends the pieces to their
    owners, one sends the results back (dp, size 2), and the owners gather their matrices over tp
    once (size 2). Still one host sync. The rest of the step is AdamW's."""
    for colls in check_quiet_steps(run(dirs, 4, "--tp", "2", "--zero", "1", "--optimizer", "muon")):
        ours = [e[1:3] for e in colls if {"_to_owners", "_from_owners", "_tp_gather"} & set(e[3])]
        assert Counter(ours) == {("all_to_all_single", 2): 2, ("all_gather", 2): 1}, ours
