"""bench.py's measured-beside-theory tables: the pipeline bubble, persistent bytes per rank of every
ZeRO layout, saved activations per decoder layer — each beside the formula it should match.

What it does
    bubble      run_pipeline with each computation timed (ComputeTimer: CUDA events on CUDA, wall
                clock on CPU): the idle share of each stage beside pp.simulate with unit costs and
                with the measured F/B/W costs, and the closed form; bench.sec_pp calls it.
    sec_memory  two bf16 steps of ZeRO stages 0-3 without and with full AC (and pp=2 1F1B with
                ZeRO-1/2): the bytes each rank holds after the gradient reduction, read from the
                tensors (zero.persistent_bytes), beside 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; with the
                step's saved activations (ac.SavedActivationMeter) and, on CUDA, the allocator's
                peak. Then one decoder layer's saved activations (no AC, selective, full) beside
                ac.py's formulas and Korthikanti et al.'s sbh(34 + 5as/h).

Run
    torchrun --nproc_per_node 4 bench.py --only pp,memory

Builds on: bench_ctx.py, ac.py, pp.py, precision.py, zero.py
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import ac as AC
import pp as PP
import precision as P
import zero as Z
from bench_ctx import Ctx


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
           v: int, group: dist.ProcessGroup) -> None:
    """Idle share per stage = (step span − this stage's busy time) / span, span = the slowest
    stage's; beside pp.simulate with unit costs (F=1, B=2; zb F=B=W=1), with the measured mean F/B/W
    costs (free messages: what is left is latency and imbalance), and the closed form."""
    timer, rec = ComputeTimer(ctx.device), []
    kinds = {PP.F: [], PP.B: [], PP.W: []}
    for i in range(ctx.args.steps):
        mbs = micro(i)
        dist.barrier(group=group)
        start = timer._mark()
        PP.run_pipeline(chunks, actions, mbs, group, ctx.targets, timer=timer)
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


def measure_layout(ctx: Ctx, stage: int, use_ac: bool, pp: int, groups: dict) -> dict:
    """Two bf16 steps of one layout (pp > 1: 1F1B); in the second, the saved activations (peak live)
    and, after the gradient reduction, the persistent bytes; on CUDA the allocator's peak."""
    dp, cuda = ctx.world // pp, ctx.device.type == "cuda"
    s, d = divmod(ctx.rank, dp)  # grid: dp inner, pp outer
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    model = ctx.fresh(lambda m: PP.split_stage(m, s, pp, PP.partition(ctx.cfg.num_hidden_layers, pp)))
    if use_ac:
        AC.apply_ac(model, "full")
    psi = sum(p.numel() for p in model.parameters())
    opt = Z.apply_zero(model, stage, groups["dp"][s], ctx.ocfg, torch.bfloat16,
                       norm_groups=[groups["pp"][d]] if pp > 1 else ())
    x, y = ctx.batch(0, dp, d)
    m = math.gcd(x.shape[0], 2 * pp)
    mbs = [{"input_ids": a, "labels": b} for a, b in zip(x.chunk(m), y.chunk(m))]
    for it in range(2):
        with AC.SavedActivationMeter() if it else contextlib.nullcontext() as meter:
            if pp > 1:
                PP.run_pipeline(model, PP.one_f_one_b(m, s, pp), mbs, groups["pp"][d], ctx.targets,
                                opt.no_sync)
            else:
                loss = P.normalized_loss(model(x, labels=y, reduction="sum"), ctx.targets)
        if pp == 1:
            loss.backward()
        if it:
            opt.finish()
            held = Z.persistent_bytes(opt)
        opt.step(ctx.args.lr)
    opt.teardown()
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return dict(held, psi=psi, dp=dp, act=meter.peak_nbytes, autograd=meter.param_nbytes, peak=peak)


def sec_memory(ctx: Ctx) -> None:
    """Every layout's persistent bytes (the fullest rank's row); then, on rank 0, activations()."""
    cfg = ctx.cfg  # PP rows: pp=2 with dp >= 2, untied (tied copies would need zero's tied sync)
    with_pp = ctx.world % 2 == 0 and ctx.world >= 4 and cfg.num_hidden_layers >= 2 \
        and not cfg.tie_word_embeddings
    groups = {}
    for pp in (1, 2) if with_pp else (1,):  # every rank creates every group, in the same order
        dp = ctx.world // pp
        groups[pp] = {"dp": [dist.new_group(list(range(s * dp, s * dp + dp))) for s in range(pp)]}
        if pp > 1:
            groups[pp]["pp"] = [dist.new_group(list(range(d, ctx.world, dp))) for d in range(dp)]
    rows = []
    layouts = [(s, a, 1) for s in range(4) for a in (False, True)] + [(1, False, 2), (2, False, 2)] * with_pp
    for stage, use_ac, pp in layouts:
        everyone = [None] * ctx.world
        dist.all_gather_object(everyone, measure_layout(ctx, stage, use_ac, pp, groups[pp]))
        total = lambda r: r["params"] + r["grads"] + r["master"] + r["adam_m"] + r["adam_v"]  # noqa: E731
        r = max(everyone, key=total)  # the fullest rank
        psi, n = r["psi"], r["dp"]
        formula = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
        name = ("baseline (DP)" if stage == 0 else f"ZeRO-{stage}") + (" + AC full" if use_ac else "")
        rows.append([f"PP{pp} 1F1B + {name}" if pp > 1 else name, n, *map(mib, (
            r["params"], r["grads"], r["master"], r["adam_m"] + r["adam_v"], total(r), formula)),
            f"{total(r) / formula:.4f}", mib(r["act"]), mib(r["autograd"]), mib(r["peak"])])
    ctx.table("Persistent bytes per rank (MiB; bf16 params/grads, fp32 master + Adam m, v)",
              ["layout", "dp", "params", "grads", "master", "Adam m+v", "total", "formula", "total/formula",
               "saved act. (peak)", "param storage held by autograd", "CUDA peak"], rows)
    if ctx.rank == 0:
        activations(ctx)


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
