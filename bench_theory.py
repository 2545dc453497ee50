"""bench.py's measured-beside-theory tables: the pipeline bubble, persistent bytes per rank of every
ZeRO layout, saved activations per decoder layer — each beside the formula it should match.

What it does
    bubble      run_pipeline with pp.py's communication calls timed (TimedDist): the idle share of
                each stage beside pp.simulate (F=1, B=2) and (p-1)/(m+p-1); bench.sec_pp calls it.
    sec_memory  two bf16 steps of ZeRO stages 0-3 without and with full AC (and pp=2 1F1B with
                ZeRO-1/2): the bytes each rank holds after the gradient reduction, read from the
                tensors (zero.persistent_bytes), beside 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N; with the
                step's saved activations (ac.SavedActivationMeter) and, on CUDA, the allocator's
                peak. Then one decoder layer's saved activations (no AC, selective, full) beside
                ac.py's formulas and Korthikanti et al.'s sbh(34 + 5as/h).

Run
    torchrun --nproc_per_node 4 bench.py --only pp,memory

Builds on: bench.py, ac.py, model.py, pp.py, precision.py, zero.py
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

import ac as AC
import model as M
import pp as PP
import precision as P
import zero as Z

if TYPE_CHECKING:  # bench.py imports this file and passes its Ctx in
    from bench import Ctx


# ------------------------------------------------------------------------------------- bubble
class TimedDist:
    """pp.py's `dist` while the bubble is measured: its communication calls are timed (there a stage
    waits); every other name is torch.distributed's own."""
    def __init__(self) -> None:
        self.wait = 0.0

    def __getattr__(self, name: str):
        fn = getattr(dist, name)
        if name not in ("batch_isend_irecv", "broadcast", "all_gather_single"):
            return fn

        def timed(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            if name == "batch_isend_irecv":  # pp.py waits on every work right away: do it here
                for work in out:
                    work.wait()
                out = []
            self.wait += time.perf_counter() - t0
            return out
        return timed


def bubble(ctx: Ctx, model: M.Llama, actions: list, micro: Callable, schedule: str, m: int) -> None:
    """Idle share per stage = (makespan − this stage's busy time) / makespan, where busy is its wall
    time outside communication and the makespan the slowest stage's; beside simulate (F=1, B=2)."""
    timed, rec, p = TimedDist(), [], ctx.world
    PP.dist = timed
    try:
        for i in range(ctx.args.steps):
            mbs = micro(i)
            dist.barrier()
            timed.wait, t0 = 0.0, time.perf_counter()
            PP.run_pipeline(model, actions, mbs, dist.group.WORLD, ctx.targets)
            wall = time.perf_counter() - t0
            rec.append([wall, wall - timed.wait])
            model.zero_grad(set_to_none=True)
    finally:
        PP.dist = dist
    mine = torch.tensor(rec, dtype=torch.float64, device=ctx.device)  # (steps, 2): wall, busy
    allr = torch.zeros(p * mine.numel(), dtype=torch.float64, device=ctx.device)
    dist.all_gather_single(allr, mine.view(-1))
    allr = allr.view(p, *mine.shape).cpu()  # (p, steps, 2)
    span = allr[:, :, 0].max(dim=0).values  # (steps,)
    idle = (span - allr[:, :, 1]) / span  # (p, steps)
    sim = PP.simulate([PP.SCHEDULES[schedule](m, s, p) for s in range(p)], 1, 2)
    tag, ms, theory = f"{schedule} p={p} m={m}", f"{1e3 * span.median():.1f}", f"{(p - 1) / (m + p - 1):.1%}"
    rows = [[tag, s, ms, f"{1e3 * allr[s, :, 1].median():.1f}", f"{idle[s].median():.1%}",
             f"{sim.idle[s] / sim.makespan:.1%}", theory] for s in range(p)]
    rows.append([tag, "all", ms, "", f"{idle.mean(0).median():.1%}", f"{float(sim.bubble):.1%}", theory])
    ctx.table("Pipeline bubble (idle share of the step; busy = outside communication)",
              ["schedule", "stage", "step ms", "busy ms", "measured idle", "simulator (F=1, B=2)",
               "(p-1)/(m+p-1)"], rows)


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
    formula = {"none": lambda t: t * (16 * h + 4 * q + 4 * kv + 8 * i) + 4 * t * a + 8 * t,
               "selective": lambda t: t * (6 * h + 4 * q + 4 * kv + 4 * i) + 4 * t * a,
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
