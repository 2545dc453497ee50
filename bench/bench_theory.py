"""bench.py's measured-beside-theory tables: the pipeline bubble, persistent bytes per rank of every
ZeRO layout, saved activations per decoder layer — each beside the formula it should match.

What it does
    bubble      run_pipeline with each computation timed (ComputeTimer: CUDA events on CUDA, wall
                clock on CPU): the idle share of each stage beside pp.simulate with unit costs and
                with the measured F/B/W costs, and the closed form; bench.sec_pp calls it.
    sec_memory  two bf16 steps of ZeRO stages 0-3 without and with full AC (and pp=2 1F1B with
                ZeRO-1/2), built from the meta device as train.py builds: the bytes each rank holds
                after the gradient reduction, read from the tensors (zero_memory.persistent_bytes), beside
                16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N, with the step's saved activations
                (ac.SavedActivationMeter); then three columns per layout: persistent bytes, the
                measured peak (memory.PeakMeter, at the allocator on CPU and CUDA alike) and the
                formula with zero_memory.peak_extras, beside the peak minus the activations (what grows
                with the micro-batch: the peak at twice the rows minus the peak). Then one decoder
                layer's saved activations (no AC, selective, full) beside ac.py's formulas and
                Korthikanti et al.'s sbh(34 + 5as/h).
    fake_pg     (`python -m bench.bench_theory`) one rank of a large layout on this machine: torch's fake
                process group runs one rank of dp ranks in one process with real compute and memory
                and no-op collectives; the 1b preset's setup and step peak under ZeRO-3 beside
                16Ψ/N and zero_memory.peak_extras.

Run
    torchrun --nproc_per_node 4 -m bench.bench --only pp,memory
    python -m bench.bench_theory --model 1b --dp 8 --zero 3 --ac     # one rank of dp=8, fake process group
    python -m bench.bench_theory --formulas     # 1b and 8b: offload's GPU bytes at dp 1, FP8's gather bytes

Builds on: bench_ctx.py, ac.py, dp.py, memory.py, model.py, pp.py, precision.py, weights.py, zero.py, zero3.py
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.distributed as dist

import ac as AC
import memory as MEM
import model as M
import pp as PP
import precision as P
import weights as W
import zero as Z
import zero3 as Z3
import zero_memory as ZM
from bench.bench_ctx import Ctx


# ------------------------------------------------------------------------------------- bubble
class ComputeTimer:
    """run_pipeline's `timer`: how long each computation (F, B, W) takes — CUDA events on CUDA (a
    host timer around queued kernels measures their launch, not their run), perf_counter on CPU.
    The step's span is timed the same way (start/stop), so idle = span - busy on either device."""
    def __init__(self, device: torch.device) -> None:
        self.cuda, self.marks = device.type == "cuda", []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, action: PP.Action):
        start = self._mark()
        yield
        self.marks.append((action.kind, start, self._mark()))

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def read(self) -> tuple[float, dict[str, list[float]]]:
        """(busy seconds, durations per kind), then forget the marks."""
        if self.cuda:
            torch.cuda.synchronize()
        per: dict[str, list[float]] = {}
        for kind, a, b in self.marks:
            per.setdefault(kind, []).append(self.seconds(a, b))
        self.marks = []
        return sum(sum(d) for d in per.values()), per


def bubble(ctx: Ctx, chunks: list, actions: list, micro: Callable, schedule: str, m: int, p: int,
           v: int, group: dist.ProcessGroup, peers: dict[int, dist.ProcessGroup]) -> None:
    """Idle share per stage = (step span − this stage's busy time) / span, span = the slowest
    stage's; beside pp.simulate with unit costs (F=1, B=2; zb F=B=W=1), with the measured mean F/B/W
    costs (free messages: what is left is latency and imbalance), and the closed form."""
    timer, rec = ComputeTimer(ctx.device), []
    kinds = {PP.F: [], PP.B: [], PP.W: []}
    for i in range(ctx.args.steps):
        mbs = micro(i)
        dist.barrier(group=group)
        start = timer._mark()
        PP.run_pipeline(chunks, actions, mbs, group, ctx.targets, timer=timer, peer_groups=peers,
                        hidden_size=ctx.cfg.hidden_size)
        stop = timer._mark()
        busy, per = timer.read()
        rec.append([timer.seconds(start, stop), busy])
        for kind, d in per.items():
            kinds[kind] += d
        for c in chunks:
            c.zero_grad(set_to_none=True)
    mine = torch.tensor(rec + [[statistics.mean(kinds[k]) if kinds[k] else 0.0 for k in (PP.F, PP.B)],
                               [statistics.mean(kinds[PP.W]) if kinds[PP.W] else 0.0, 0.0]],
                        dtype=torch.float64, device=ctx.device)  # (steps + 2, 2): span, busy; mean F, B; W
    allr = torch.zeros(p * mine.numel(), dtype=torch.float64, device=ctx.device)
    dist.all_gather_single(allr, mine.view(-1), group=group)
    allr = allr.view(p, *mine.shape).cpu()  # (p, steps + 2, 2)
    steps, costs = allr[:, :-2], allr[:, -2:].mean(dim=0)  # costs: [[F, B], [W, 0]] averaged over ranks
    span = steps[:, :, 0].max(dim=0).values  # (steps,)
    idle = (span - steps[:, :, 1]) / span  # (p, steps)
    scheds = [PP.SCHEDULES[schedule](m, s, p, v) for s in range(p)]
    unit = PP.simulate(scheds, 1, 1 if schedule == "zb" else 2, 1)
    f, b, w = float(costs[0, 0]), float(costs[0, 1]), float(costs[1, 0])
    measured = PP.simulate(scheds, f, b, w)
    tag = f"{schedule} p={p} m={m}" + (f" v={v}" if v > 1 else "")
    ms, theory = f"{1e3 * span.median():.1f}", f"{float(PP.bubble_formula(schedule, m, p, v, 1, 1, 1)):.1%}"
    rows = [[tag, s, ms, f"{1e3 * steps[s, :, 1].median():.1f}", f"{idle[s].median():.1%}",
             f"{float(unit.idle[s] / unit.makespan):.1%}", f"{float(measured.idle[s] / measured.makespan):.1%}",
             theory] for s in range(p)]
    rows.append([tag, "all", ms, f"F {1e3 * f:.2f} / B {1e3 * b:.2f}" + (f" / W {1e3 * w:.2f}" if w else "") + " ms",
                 f"{idle.mean(0).median():.1%}", f"{float(unit.bubble):.1%}", f"{float(measured.bubble):.1%}", theory])
    ctx.table("Pipeline bubble (idle share of the step; busy = inside F/B/W, CUDA events on CUDA)",
              ["schedule", "stage", "step ms", "busy ms", "measured idle", "simulator (unit costs)",
               "simulator (measured F/B/W)", "formula (unit costs)"], rows)


# ------------------------------------------------------------------------------------- memory
def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.3f}"


def measure_layout(ctx: Ctx, stage: int, use_ac: bool, pp: int, groups: dict, double: bool = False,
                   every: bool = False) -> dict:
    """Two bf16 steps of one layout (pp > 1: 1F1B), built as train.py builds (meta device, then
    zero3.apply_zero from weights.param_reader): the setup peak, and in the second step the peak per
    phase (memory.PeakMeter), the saved activations and, after the gradient reduction, the
    persistent bytes. double: every micro-batch twice the rows (the activations' share of a peak is
    the difference). every: ZeRO-2 reduces every micro-batch. Buckets and the step's chunk are 1/16
    of the model here, as 25 MB is of a large one."""
    dp = ctx.world // pp
    s, d = divmod(ctx.rank, dp)  # grid: dp inner, pp outer
    gc.collect()  # the previous layout's optimizer (reference cycles) must not count here
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    meter = MEM.PeakMeter(ctx.device)
    meter.phase("base")  # what this process holds already (the bench's batches): not the layout's
    meter.phase("setup")
    model = PP.split_stage(M.build(ctx.cfg), s, pp, PP.partition(ctx.cfg.num_hidden_layers, pp))
    init = W.param_reader(model, seed=ctx.args.seed)
    W.materialize_buffers(model, ctx.device)
    if use_ac:
        AC.apply_ac(model, "full")
    psi = sum(p.numel() for p in model.parameters())
    opt = Z3.apply_zero(model, stage, groups["dp"][s], ctx.ocfg, torch.bfloat16,
                        bucket_mb=psi * 2 / 16 / 2**20, norm_groups=[groups["pp"][d]] if pp > 1 else (),
                        init=init, device=ctx.device, reduce_every_micro_batch=every)
    meter.phase(None)
    meter.settle()
    meter.watch(model)
    x, y = ctx.batch(0, dp, d)
    if double:
        x, y = torch.cat([x, x]), torch.cat([y, y])
    m = math.gcd(x.shape[0], 2 * pp)
    mbs = [{"input_ids": a, "labels": b} for a, b in zip(x.chunk(m), y.chunk(m))]
    first = dict(meter.peaks)
    for it in range(2):
        meter.peaks = dict(first)  # the second step: Adam's state allocated
        with AC.SavedActivationMeter() if it else contextlib.nullcontext() as saved:
            if pp > 1:
                PP.run_pipeline(model, PP.one_f_one_b(m, s, pp), mbs, groups["pp"][d], ctx.targets,
                                no_sync=opt.no_sync, hidden_size=ctx.cfg.hidden_size)
            else:
                loss = P.normalized_loss(model(x, labels=y, reduction="sum"), ctx.targets)
        if pp == 1:
            loss.backward()
        opt.finish()
        if it:
            held = ZM.persistent_bytes(opt)
        meter.phase("step")
        opt.step(ctx.args.lr)
        meter.phase(None)
        meter.settle()
    extras = ZM.peak_extras(opt)
    base = meter.peaks["base"]
    peaks = {name: (p.allocated - base.allocated, p.reserved) for name, p in meter.peaks.items()}
    meter.close()
    opt.teardown()
    return dict(held, psi=psi, dp=dp, act=saved.peak_nbytes, autograd=saved.param_nbytes, peaks=peaks,
                extras=extras)


def sec_memory(ctx: Ctx) -> None:
    """Every layout's persistent bytes and peak beside the formula (the fullest rank's row); then,
    on rank 0, activations()."""
    cfg = ctx.cfg  # PP rows: pp=2 with dp >= 2, untied (tied copies would need zero's tied sync)
    with_pp = ctx.world % 2 == 0 and ctx.world >= 4 and cfg.num_hidden_layers >= 2 \
        and not cfg.tie_word_embeddings
    groups = {}
    for pp in (1, 2) if with_pp else (1,):  # every rank creates every group, in the same order
        dp = ctx.world // pp
        groups[pp] = {"dp": [dist.new_group(list(range(s * dp, s * dp + dp))) for s in range(pp)]}
        if pp > 1:
            groups[pp]["pp"] = [dist.new_group(list(range(d, ctx.world, dp))) for d in range(dp)]
    held_rows, peak_rows, chunk = [], [], P.STEP_CHUNK_BYTES
    P.STEP_CHUNK_BYTES = cfg.num_params() * 4 // 16
    layouts = [(s, a, 1, False) for s in range(4) for a in (False, True)] + \
        [(1, False, 2, False), (2, False, 2, False), (2, False, 2, True)] * with_pp
    try:
        for stage, use_ac, pp, every in layouts:
            runs = []
            for double in (False, True):
                everyone = [None] * ctx.world
                dist.all_gather_object(everyone, measure_layout(ctx, stage, use_ac, pp, groups[pp], double,
                                                                every))
                runs.append(everyone)
            name = ("baseline (DP)" if stage == 0 else f"ZeRO-{stage}") + (" + AC full" if use_ac else "")
            name = f"PP{pp} 1F1B + {name}" if pp > 1 else name
            if not every:
                held_rows.append(persistent_row(name, stage, runs[0]))
            mode = {(2, 2, False): " (reduces once per step)", (2, 2, True): " (every micro-batch)"}
            peak_rows.append(peak_row(name + mode.get((pp, stage, every), ""), stage, *runs))
    finally:
        P.STEP_CHUNK_BYTES = chunk
    ctx.table("Persistent bytes per rank (MiB; bf16 params/grads, fp32 master + Adam m, v)",
              ["layout", "dp", "params", "grads", "master", "Adam m+v", "total", "formula", "total/formula",
               "saved act. (peak)", "param storage held by autograd"], held_rows)
    ctx.table("Peak bytes per rank (MiB; memory.PeakMeter: allocator-level, the fullest rank)",
              ["dp", "layout", "persistent", "measured peak", "phase", "activations", "peak - activations",
               "formula + extras", "(peak - act.) / (formula + extras)", "every phase within", "setup peak"],
              peak_rows, note="Training peak = the largest of forward, backward and step (second step). "
              "Activations = what grows with the micro-batch: peak(2b) - peak(b), so peak - activations "
              "= 2 peak(b) - peak(2b), the fixed part of the peak. Extras: zero_memory.peak_extras (buckets, "
              "units and step chunk here 1/16 of the model).")
    if ctx.rank == 0:
        activations(ctx)


def held_total(r: dict) -> int:
    return r["params"] + r["grads"] + r["master"] + r["adam_m"] + r["adam_v"]


def persistent_row(name: str, stage: int, everyone: list[dict]) -> list:
    r = max(everyone, key=held_total)  # the fullest rank
    formula = ZM.formula_bytes(stage, r["psi"], r["dp"])
    return [name, r["dp"], *map(mib, (r["params"], r["grads"], r["master"], r["adam_m"] + r["adam_v"],
                                      held_total(r), formula)),
            f"{held_total(r) / formula:.4f}", mib(r["act"]), mib(r["autograd"])]


def peak_row(name: str, stage: int, once: list[dict], twice: list[dict]) -> list:
    """The rank whose training peak is largest; per phase 2 peak(b) - peak(2b) against the bound."""
    def top(r: dict) -> tuple[int, str]:
        return max((r["peaks"][p][0], p) for p in MEM.TRAINING)
    k = max(range(len(once)), key=lambda i: top(once[i])[0])
    r, r2 = once[k], twice[k]
    formula = ZM.formula_bytes(stage, r["psi"], r["dp"])
    fixed = {p: 2 * r["peaks"][p][0] - r2["peaks"][p][0] for p in MEM.TRAINING}
    within = all(fixed[p] <= formula + r["extras"][p] for p in MEM.TRAINING)
    peak, phase = top(r)
    bound = formula + r["extras"][phase]
    reserved = r["peaks"][phase][1]  # CUDA: the caching allocator's reserve beside
    measured = mib(peak) + (f" ({mib(reserved)} reserved)" if reserved is not None else "")
    return [r["dp"], name, mib(held_total(r)), measured, phase, mib(peak - fixed[phase]),
            mib(fixed[phase]), mib(bound), f"{fixed[phase] / bound:.3f}", "yes" if within else "NO",
            mib(r["peaks"]["setup"][0])]


def activations(ctx: Ctx) -> None:
    """One decoder layer, batch 1, bf16; ac.py's formulas (q, kv widths: head_dim free)."""
    cfg, rows = ctx.cfg, []
    h, i, a = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    q, kv = a * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    formula = {"none": lambda t: t * (8 * h + 4 * q + 4 * kv + 6 * i) + 4 * t * a + 8 * t,
               "selective": lambda t: t * (4 * h + 4 * q + 4 * kv + 4 * i) + 4 * t * a + 8 * t,
               "full": lambda t: 2 * t * h}
    layer = ctx.fresh().to(torch.bfloat16)
    for s in (8, 16) if ctx.args.quick else (128, 512, 2048):
        x = torch.randn(1, s, h, dtype=torch.bfloat16, device=ctx.device, requires_grad=True)
        cos, sin = layer.model.rotary_emb(torch.arange(s, device=ctx.device)[None], x.dtype)
        row = [s]
        for mode in formula:
            if mode != "none":
                AC.apply_ac(layer, mode)
            with AC.SavedActivationMeter() as meter:
                layer.model.layers["0"](x, cos, sin, None)
            AC.remove_ac(layer)
            row += [mib(meter.nbytes - cos.nbytes - sin.nbytes), mib(formula[mode](s))]  # cos/sin: shared
        rows.append(row + [mib(s * h * (34 + 5 * a * s / h))])
    ctx.table("Saved activations per layer (MiB, batch 1, bf16; formulas from ac.py)",
              ["seq", "none", "formula", "selective", "formula", "full", "formula",
               "Korthikanti sbh(34+5as/h)"], rows)


# ------------------------------------------------------------------------------------- fake process group
class TiledCollectives:
    """dp.py's, zero.py's and zero3.py's `dist` under the fake process group, whose collectives do
    nothing: the buffers they would fill keep whatever memory held (a NaN would skip AdamW, whose
    state is part of the peak). Here every rank is taken to hold this rank's values: the all-gather
    tiles the shard, the reduce-scatter keeps this rank's slice — the same buffers as the real
    collectives."""

    def __getattr__(self, name: str):
        return getattr(dist, name)

    @staticmethod
    def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False) -> None:
        out.view(-1, inp.numel()).copy_(inp)  # (N, S): every rank's shard

    @staticmethod
    def reduce_scatter_single(out: torch.Tensor, inp: torch.Tensor, group=None,
                              async_op: bool = False) -> None:
        out.copy_(inp.view(-1, out.numel())[dist.get_rank(group)])  # (S,): this rank's slice


def fake_pg(argv: list[str] | None = None) -> str:
    """One rank of a dp layout in this process (torch's fake process group): setup and per-phase
    peaks of two bf16 steps, beside the ZeRO formula and zero_memory.peak_extras. Returns the markdown."""
    import argparse

    import dp as DP
    from torch.testing._internal.distributed.fake_pg import FakeStore
    p = argparse.ArgumentParser(description=fake_pg.__doc__.split("\n")[0])
    p.add_argument("--model", default="1b", choices=sorted(M.PRESETS))
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--zero", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--rows", type=int, default=1, help="sequences per step on this rank")
    p.add_argument("--ac", action="store_true", help="full activation checkpointing")
    a = p.parse_args(argv)
    dist.init_process_group("fake", store=FakeStore(), rank=a.rank, world_size=a.dp)
    DP.dist = Z.dist = Z3.dist = TiledCollectives()
    cfg, t0 = M.PRESETS[a.model], time.time()
    meter = MEM.PeakMeter("cpu")
    meter.phase("setup")
    model = M.build(cfg)
    init = W.param_reader(model, seed=0)
    W.materialize_buffers(model, "cpu")
    if a.ac:
        AC.apply_ac(model, "full")
    opt = Z3.apply_zero(model, a.zero, None, P.OptimConfig(), torch.bfloat16, init=init, device="cpu")
    meter.phase(None)
    meter.settle()
    meter.watch(model)
    t_setup = time.time() - t0
    x = torch.randint(0, cfg.vocab_size, (a.rows, a.seq_len + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        meter.peaks = {"setup": meter.peaks["setup"]}
        with AC.SavedActivationMeter() as saved:
            loss = P.normalized_loss(model(x[:, :-1], labels=x[:, 1:], reduction="sum"), a.rows * a.seq_len)
        loss.backward()
        opt.finish()
        held = sum(ZM.persistent_bytes(opt).values())
        meter.phase("step")
        opt.step(1e-4)
        meter.phase(None)
        meter.settle()
    psi, extras = cfg.num_params(), ZM.peak_extras(opt)
    formula = ZM.formula_bytes(a.zero, psi, a.dp)
    unit = max(b.size for b in opt.sync.buckets) * 2  # the largest bucket / unit, bf16 bytes
    gib = lambda n: f"{n / 2**30:.4f}"  # noqa: E731
    md_row = lambda cells: "| " + " | ".join(map(str, cells)) + " |"  # noqa: E731
    act = {"forward": saved.peak_nbytes, "backward": saved.peak_nbytes, "step": 0}
    rows = [["setup", gib(meter.peaks["setup"].allocated), "-", "-", gib(formula + unit),
             "16Ψ/N + the largest unit (bf16)"]]
    rows += [[phase, gib(meter.peaks[phase].allocated), gib(act[phase]),
              gib(meter.peaks[phase].allocated - act[phase]), gib(formula + extras[phase]),
              "16Ψ/N + zero_memory.peak_extras"] for phase in MEM.TRAINING]
    text = "\n".join([
        f"`python bench_theory.py {' '.join(sys.argv[1:] if argv is None else argv)}`: rank {a.rank} of "
        f"dp={a.dp}, ZeRO-{a.zero}{' + AC full' if a.ac else ''}, {a.model} ({psi / 1e9:.3f}B params), "
        f"bf16 + fp32 masters, {a.rows} x {a.seq_len} tokens; fake process group, {time.time() - t0:.0f} s "
        f"(setup {t_setup:.0f} s). Persistent after the reduction {gib(held)} GiB, formula "
        f"{gib(formula)} GiB.", "",
        md_row(["phase", "measured peak", "saved activations", "peak - saved act.", "bound", "bound is"]),
        "|---" * 6 + "|", *map(md_row, rows)])
    print(text, flush=True)
    meter.close()
    opt.teardown()
    dist.destroy_process_group()
    return text


H200_BYTES = 141e9  # one H200's HBM as sold (torch reports about 139 GiB of it usable)


def formulas(presets: tuple[str, ...] = ("1b", "8b"), n: int = 8) -> str:
    """Formula-only rows (no model is built): one rank's state at dp 1 with and without ZeRO-Offload,
    beside one H200; and ZeRO-3's gather bytes at dp n in bf16 and with FP8 linears (docs/fp8.md)."""
    md_row = lambda cells: "| " + " | ".join(map(str, cells)) + " |"  # noqa: E731
    gb = lambda b: f"{b / 1e9:.1f}"  # noqa: E731
    rows = [md_row(["model", "Ψ", "16Ψ, dp 1 (GB)", "offload ZeRO-1, dp 1: GPU / host (GB)", "fits one H200 (141 GB)",
                    f"ZeRO-3 gather at dp {n}: bf16 / FP8 (GB)"]), "|---" * 6 + "|"]
    for name in presets:
        cfg = M.PRESETS[name]
        psi, layers = cfg.num_params(), cfg.num_hidden_layers
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        linear = layers * (cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size)
        gpu, host = ZM.offload_formula_bytes(1, psi, 1)
        bf16, fp8 = ZM.fp8_gather_bytes(psi, linear, 7 * layers, n)
        rows.append(md_row([name, f"{psi / 1e9:.2f}B", gb(ZM.formula_bytes(0, psi, 1)), f"{gb(gpu)} / {gb(host)}",
                            f"{'yes' if gpu < H200_BYTES else 'no'} ({gb(H200_BYTES - gpu)} GB left for activations)",
                            f"{gb(bf16)} / {gb(fp8)}"]))
    text = "\n".join(rows)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    formulas() if sys.argv[1:] == ["--formulas"] else fake_pg()
