"""memory.py's meter, and the peak memory of zero.py, zero3.py, precision.py and the chunked loss
against the ZeRO formulas. All byte counts are integers read from c10's allocator: the assertions
are exact.

What is compared with what:
- The meter against allocations made here: exact to the byte, including frees that happen on gloo's
  worker thread (the last reference to a collective's buffer dropped there). The control: without
  c10's per-block accounting the profiler alone misses those frees.
- Every ZeRO stage at dp=2 and dp=4 (bf16 compute, fp32 masters; the `tiny` preset with 10 kB
  buckets and a 16 kB step chunk, so that buckets, units and chunks are small against the model):
  per phase (forward, backward, step of the second step, Adam's state allocated), the measured peak
  minus the activations is at most the formula plus the stated extras (zero_memory.peak_extras). Activations
  are what grows with the micro-batch: 2·peak(b) − peak(2b) is the fixed part of the peak (it lies
  between the fixed parts at the program points where the two peaks occur), the loss chunk included.
  A control shows the bound can fail: the full fp32 gradient copy of the old step exceeds it.
- ZeRO-3 setup from a meta-device model: at most 6Ψ/N (fp32 master, compute shard) plus the one
  parameter being read (fp32, its rows) — materializing the model first exceeds it; from safetensors
  each rank reads exactly the rows that hold its shard.
- ZeRO-2 with two micro-batches: one reduce-scatter per bucket per step by default (its backward
  then holds the full-size gradient, as ZeRO-1), two with reduce_every_micro_batch (its peak within
  the formula); ZeRO-3 reduces every micro-batch.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import os
import time
from collections import Counter

import torch
import torch.distributed as dist

import memory as MEM
import model as M
import precision as P
import weights as W
import zero as Z
import zero3 as Z3
import zero_memory as ZM
from dist import run_ranks

CFG = M.PRESETS["tiny"]
BF16 = torch.bfloat16
BUCKET_MB, CHUNK = 0.01, 16 * 2**10  # small against the model (Ψ ≈ 0.22M: 436 kB of bf16)
SEQ = 32


def tokens(rows: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CFG.vocab_size, (rows, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    return x[:, :-1], x[:, 1:]


def meta_model() -> tuple[M.Llama, Z.Init]:
    m = M.build(CFG)
    init = W.param_reader(m, seed=0)
    W.materialize_buffers(m, "cpu")
    return m, init


def train_peaks(stage: int, rows: int, group, micro: int = 1, **kw) -> tuple[dict, dict]:
    """Two bf16 steps of `micro` micro-batches of `rows` rows: the second step's peak per phase,
    and zero_memory.peak_extras per phase."""
    gc.collect()  # a previous layout's optimizer (reference cycles) must not count here
    meter = MEM.PeakMeter("cpu")
    meter.phase("base")  # what this process holds already: not the layout's
    meter.phase(None)
    meter.settle()
    m, init = meta_model()
    opt = Z3.apply_zero(m, stage, group, P.OptimConfig(lr=1e-3), BF16, bucket_mb=BUCKET_MB,
                        init=init, device="cpu", **kw)
    meter.watch(m)
    x, y = tokens(rows * micro, dist.get_rank())
    base = meter.peaks["base"].allocated
    for _ in range(2):
        meter.peaks.clear()
        for k in range(micro):
            with opt.no_sync() if k < micro - 1 else contextlib.nullcontext():
                P.normalized_loss(m(x[k::micro], labels=y[k::micro], reduction="sum"), 1000).backward()
        opt.finish()
        time.sleep(0.2)  # gloo's worker drops a finished reduction's buffers just after wait(), on its
        meter.phase("step")  # own thread: let those frees land first (on NCCL nothing frees late)
        opt.step(1e-3)
        meter.phase(None)
        meter.settle()
    extras = ZM.peak_extras(opt)  # the stated extras, from this rank's buckets and pieces
    peaks = {name: p.allocated - base for name, p in meter.peaks.items()}
    meter.close()
    opt.teardown()
    return peaks, extras


def _layouts(rank: int, world: int) -> dict:
    P.STEP_CHUNK_BYTES = CHUNK
    group = dist.group.WORLD
    out = {}
    for stage in range(4):
        runs = [train_peaks(stage, rows, group) for rows in (2, 4)]
        out[stage], out["extras", stage] = [peaks for peaks, _ in runs], runs[0][1]
    out["m2"] = {mode: [train_peaks(2, rows, group, micro=2, reduce_every_micro_batch=mode)[0]
                        for rows in (1, 2)] for mode in (False, True)}
    P.STEP_CHUNK_BYTES = 2**40  # the control: one chunk, the whole fp32 gradient copy at once
    out["control"] = [train_peaks(0, rows, group)[0] for rows in (2, 4)]
    return out


def fixed(peaks: list[dict], phase: str) -> int:
    """Peak minus activations: 2·peak(b) − peak(2b) for this phase."""
    return 2 * peaks[0][phase] - peaks[1][phase]


def check_layouts(results: list[dict], n: int) -> None:
    psi = CFG.num_params()
    for out in results:
        for stage in range(4):
            for phase in MEM.TRAINING:
                got = fixed(out[stage], phase)
                want = ZM.formula_bytes(stage, psi, n) + out["extras", stage][phase]
                assert got <= want, (n, stage, phase, got, want)
            assert fixed(out[stage], "step") >= ZM.formula_bytes(stage, psi, n)  # all the state counted
        # two micro-batches at ZeRO-2: once per step holds the full-size gradient in backward
        # (ZeRO-1's 2Ψ + 2Ψ), every micro-batch keeps ZeRO-2's bound
        once, every = (fixed(out["m2"][mode], "backward") for mode in (False, True))
        assert every <= ZM.formula_bytes(2, psi, n) + out["extras", 2]["backward"] < once, (once, every)
        assert once >= ZM.formula_bytes(1, psi, n) - 2 * psi / n
        # control: an unchunked bf16 step (a full fp32 gradient copy) breaks the step bound
        assert fixed(out["control"], "step") > ZM.formula_bytes(0, psi, n) + out["extras", 0]["step"]


def test_zero_peaks_dp2():
    check_layouts(run_ranks(_layouts, 2, timeout=300), 2)


def test_zero_peaks_dp4():
    check_layouts(run_ranks(_layouts, 4, timeout=300), 4)


# ------------------------------------------------------------------------------------ the meter
def test_meter_counts_every_block_exactly():
    meter = MEM.PeakMeter("cpu")
    base = torch.zeros(1000)  # 4000 bytes, allocated before the phases: live in both
    meter.phase("a")
    x = torch.empty(250)  # 1000
    y = torch.empty(500)  # 2000: peak 7000
    del x
    meter.phase("b")
    z = torch.empty(100, dtype=torch.float64)  # 800 beside y: peak 6800
    del y, z
    meter.phase("a")  # a phase entered twice keeps its maximum
    meter.phase(None)
    meter.settle()
    before = meter.peaks["a"].allocated
    assert before - meter.peaks["b"].allocated == 200 and meter.peak("a", "b") == MEM.Peak(before)
    meter.phase("c")  # nothing allocated: the live bytes it started with, the probe left out
    meter.phase(None)
    meter.settle()
    assert before - meter.peaks["c"].allocated == 3000
    meter.close()
    del base


def test_step_holds_one_chunk_of_fp32_gradients(monkeypatch):
    """precision.step upcasts the bf16 gradients chunk by chunk: at most one chunk of fp32 copies is
    alive (plus AdamW's temporaries of one parameter), never two — a loop variable holding the last
    chunk's copies while the next chunk's are made doubled it (measured: 2 × 256 kB here)."""
    chunk, n, numel = 256 * 1024, 256, 1024  # 4 chunks of 64 parameters (4 kB each in fp32)
    monkeypatch.setattr(P, "STEP_CHUNK_BYTES", chunk)
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
    opt = P.MixedPrecisionOptimizer([(f"p{i}.weight", p) for i, p in enumerate(params)],
                                    P.OptimConfig(lr=1e-3), torch.bfloat16)
    meter = MEM.PeakMeter("cpu")
    for _ in range(2):  # the second step: Adam's state exists
        for p in params:
            p.grad = torch.randn_like(p)  # bf16
        meter.phase("before")
        meter.phase("step")
        opt.step(1e-3)
        meter.phase(None)
        meter.settle()
    extra = meter.peaks["step"].allocated - meter.peaks["before"].allocated
    assert chunk <= extra <= chunk + 12 * 4 * numel + 8 * n + 1024, extra
    meter.close()


def set_c10_accounting(on: bool) -> None:
    lib = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))[0]
    ctypes.c_bool.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_report_cpu_memory_usage").value = on


def collectives_leak(meter: MEM.PeakMeter) -> int:
    """Live bytes after minus before 100 reduce-scatters whose buffers are dropped right after
    wait(): gloo's worker often drops the last reference, on its own thread."""
    gc.collect()
    meter.phase("before")
    meter.phase("collectives")
    for _ in range(100):
        flat = torch.ones(1 << 14)
        out = torch.empty(flat.numel() // dist.get_world_size())
        dist.reduce_scatter_tensor(out, flat, async_op=True).wait()
        del out, flat
    dist.barrier()
    time.sleep(0.2)  # gloo's worker may drop its last reference to the final buffers just after wait()
    meter.phase("after")
    meter.phase(None)
    meter.settle()
    return meter.peaks["after"].allocated - meter.peaks["before"].allocated


class CountingDist:
    """zero.py's `dist` (where ZeRO's reduce-scatters run) with its reduce-scatters counted."""
    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def __getattr__(self, name: str):
        fn = getattr(dist, name)
        if name != "reduce_scatter_single":
            return fn

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)
        return counted


def _setup_reads_comm(rank: int, world: int, hf_dir: str) -> dict:
    out: dict = {}
    group = dist.group.WORLD
    # ZeRO-3 setup from the seeded init on a meta model, and (control) from a materialized one
    for name in ("meta", "materialized"):
        gc.collect()
        meter = MEM.PeakMeter("cpu")
        meter.phase("base")  # what the (forked) process holds already
        meter.phase("setup")
        if name == "meta":
            m, init = meta_model()
        else:
            m, init = W.materialize(M.build(CFG), "cpu", seed=0), None
        opt = Z3.apply_zero(m, 3, group, P.OptimConfig(), BF16, init=init, device="cpu")
        meter.phase(None)
        meter.settle()
        out[name] = (meter.peaks["setup"].allocated - meter.peaks["base"].allocated,
                     sum(ZM.persistent_bytes(opt).values()),
                     max(opt.params[i].numel() for i in range(len(opt.params))))
        meter.close()
        if name == "meta":  # the pieces equal the same elements of the full seeded init
            full = W.materialize(M.build(CFG), "cpu", seed=0)
            ref = dict(full.named_parameters())
            out["pieces_equal"] = all(torch.equal(w, ref[n].detach().reshape(-1)[pc.start:pc.start + pc.n])
                                      for n, w, pc in zip(opt.names, opt.master, opt.pieces))
        opt.teardown()
    # from safetensors: only the rows holding this rank's elements are read
    reads: list = []
    real = W.safe_open

    class Logged:
        def __init__(self, *a, **k):
            self.f = real(*a, **k)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_slice(self, name: str):
            sl = self.f.get_slice(name)

            class Slice:
                get_shape = sl.get_shape

                def __getitem__(self, index):
                    t = sl[index]
                    reads.append((name, t.numel()))
                    return t
            return Slice()
    m = M.build(CFG)
    init = W.param_reader(m, hf_dir=hf_dir)
    W.materialize_buffers(m, "cpu")
    W.safe_open = Logged
    try:
        opt = Z3.apply_zero(m, 3, group, P.OptimConfig(), BF16, init=init, device="cpu")
    finally:
        W.safe_open = real
    want = []  # the whole rows covering each piece
    for p, pc, name in zip(opt.params, opt.pieces, opt.names):
        row = p.shape[1:].numel()
        if pc.n:
            want.append((name, (-(-(pc.start + pc.n) // row) - pc.start // row) * row))
    out["reads"] = (reads, want)
    opt.teardown()
    # communication per step with two micro-batches
    counting = CountingDist()
    Z.dist = counting
    try:
        for stage, every in ((1, False), (2, False), (2, True), (3, False)):
            counting.calls.clear()
            peaks, sizes = train_peaks(stage, 1, group, micro=2, reduce_every_micro_batch=every)
            out["comm", stage, every] = (counting.calls["reduce_scatter_single"] // 2)  # per step
            out["buckets", stage] = len(Z3.apply_zero(meta_model()[0], stage, group, P.OptimConfig(),
                                                      BF16, bucket_mb=BUCKET_MB, init=meta_model()[1],
                                                      device="cpu").buckets)
    finally:
        Z.dist = dist
    # frees on gloo's worker thread: counted with c10's accounting, missed by the profiler alone
    meter = MEM.PeakMeter("cpu")
    out["leak"] = collectives_leak(meter)
    set_c10_accounting(False)  # the control, last: the accounting is stale from here on
    # gloo's worker drops the last reference only some of the time (a race): up to 5 rounds, until
    # some rank has seen it (one sighting shows the profiler alone misses it). The ranks agree on
    # each further round: a rank that ran one alone would wait in its reduce-scatter forever.
    seen = torch.zeros(1, dtype=torch.float64)
    for _ in range(5):
        seen = torch.maximum(seen, torch.tensor([float(collectives_leak(meter))], dtype=torch.float64))
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if seen.item() > 0:
            break
    out["leak_without"] = int(seen.item())
    meter.close()
    return out


def test_setup_reads_and_communication(tmp_path):
    W.save_hf(dict(W.materialize(M.build(CFG), "cpu", seed=0).named_parameters()), CFG, tmp_path)
    n = 4
    psi = CFG.num_params()
    for out in run_ranks(_setup_reads_comm, n, str(tmp_path), timeout=60, cpu_clock=True):  # measured 3 CPU s a rank
        peak, held, largest = out["meta"]
        assert held == 6 * psi // n  # compute shard + fp32 master (Adam's state comes at the first step)
        # the one parameter being read: drawn whole in fp32 (seeded init), its rows, its piece
        assert peak <= held + 3 * 4 * largest, (peak, held, largest)
        assert out["materialized"][0] > held + 3 * 4 * largest  # the old way: the model in full first
        assert out["pieces_equal"]
        reads, want = out["reads"]
        assert sorted(reads) == sorted(want) and sum(k for _, k in reads) < 1.1 * psi / n
        assert out["comm", 1, False] == out["buckets", 1]  # ZeRO-1: once per step
        assert out["comm", 2, False] == out["buckets", 2]  # ZeRO-2 default: once per step
        assert out["comm", 2, True] == 2 * out["buckets", 2]  # every micro-batch
        assert out["comm", 3, False] == 2 * out["buckets", 3]  # ZeRO-3 must: every micro-batch
        assert out["leak"] == 0 and out["leak_without"] > 0, (out["leak"], out["leak_without"])
