"""Benchmarks: each attotron feature beside PyTorch's own implementation, on the same model and data.

What it does
    Each pair is built from the same seed and trained on the same global batches, its steps
    ALTERNATING (ours, peer, peer, ours, ...), so machine noise and cache warmth hit both. Reported:
    the median step time after warm-up (per step, the slowest rank) and ours/peer. Both sides must
    compute the same result — the grad norm of the first step and the losses of the first three,
    1e-5 relative in fp32 — or the row is marked VOID: a benchmark of a wrong result is worth nothing.
      dp      dp.GradSync (zero stage 0)          DistributedDataParallel
      zero1   sharded fp32 master + Adam          DDP + ZeroRedundancyOptimizer (the same layout:
                                                  full params and grads, sharded optimizer state)
      zero2   + reduce-scattered grads            FSDP2 reshard_after_forward=False (one all-gather
                                                  and one reduce-scatter per step, sharded grads and
                                                  optimizer, as ZeRO-2; between steps it keeps
                                                  sharded params where ZeRO-2 keeps full ones)
      zero3   per-layer units                     FSDP2 fully_shard with the same units
      tp      Megatron column/row + vocab CE      parallelize_module Colwise/Rowwise + loss_parallel
      pp      run_pipeline gpipe / 1f1b           torch.distributed.pipelining ScheduleGPipe/1F1B
      ac      apply_ac full / selective           no checkpointing (one process)
    Then: per-rank persistent bytes from the tensors (zero.persistent_bytes) beside the ZeRO formulas,
    with each layout's saved activations (ac.SavedActivationMeter); saved activations per layer beside
    ac.py's formula; the pipeline bubble per stage (time inside pp.py's communication calls) beside
    pp.simulate and (p-1)/(m+p-1); SFT packing, FFD vs padding to the batch's longest on the same
    conversations; on CUDA, 1B single-GPU bf16 tokens/s and MFU, ours vs transformers' Llama.

Run
    torchrun --nproc_per_node 4 bench.py --model tiny --steps 40 --out bench.md    # ~2 min on 2 cores
    torchrun --nproc_per_node 1 bench.py --only mfu            # one GPU: 1B bf16 tokens/s and MFU

Choices
    - Timed sections run fp32 on both sides (no peer has our fp32-master mixed precision); the memory
      tables use bf16 params with fp32 masters (the ZeRO formulas' layout); the MFU section is bf16.
    - Loss = token-loss sum / global target count and dp grads are SUMMED (the project's rule); DDP
      and FSDP2 average, so their backward runs on loss × dp. Peers clip by the same global norm.
    - Batches are random token ids from torch.Generator(seed), made before any timer starts; each
      configuration is torn down (hooks removed) before the next is built.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel as DDP

import ac as AC
import model as M
import pp as PP
import precision as P
import tp as TP
import train
import zero as Z

SECTIONS = ("dp", "zero", "tp", "pp", "ac", "memory", "sft", "mfu")
TOL = 1e-5  # fp32, relative (GUIDE); the bf16 MFU row states its own
CHECKED = 3  # steps whose losses must agree (see add_row)
PEAK_FLOPS = 989e12  # H100/H200 dense bf16
Side = Callable[[int], tuple[torch.Tensor, float]]  # step i → (loss, grad norm)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", default="tiny", choices=sorted(M.PRESETS), help="preset of all but the mfu section")
    a("--seq-len", type=int, default=128)
    a("--batch-size", type=int, default=16, help="global sequences per step")
    a("--micro-batches", type=int, default=8, help="pipeline micro-batches per step")
    a("--steps", type=int, default=10, help="timed steps per side")
    a("--warmup", type=int, default=3, help="untimed steps per side before them")
    a("--lr", type=float, default=1e-3)
    a("--seed", type=int, default=0)
    a("--only", default=",".join(SECTIONS), help="comma-separated subset of the sections")
    a("--quick", action="store_true", help="tiny sizes and 2 steps (the test); overrides the sizes")
    a("--mfu-batch", type=int, default=4, help="sequences per step of the 1B CUDA section")
    a("--mfu-seq-len", type=int, default=2048)
    a("--out", default="bench.md", help="markdown report written by rank 0")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.batch_size, args.micro_batches, args.steps, args.warmup = \
            "tiny", 16, 8, 4, 2, 1
    args.only = [s for s in args.only.split(",") if s]
    bad = [s for s in args.only if s not in SECTIONS]
    if bad or args.steps < 1 or args.warmup < 0 or args.batch_size % args.micro_batches:
        p.error(f"unknown sections {bad} (known: {SECTIONS}), or --steps < 1, --warmup < 0, or "
                f"--batch-size {args.batch_size} not divisible by --micro-batches {args.micro_batches}")
    return args


# ------------------------------------------------------------------------------------- measuring
@dataclass
class Ctx:
    args: argparse.Namespace
    cfg: M.LlamaConfig
    ocfg: P.OptimConfig
    rank: int
    world: int
    device: torch.device
    data: list[torch.Tensor] = field(default_factory=list)  # global batches (B, S+1), one per step
    targets: int = 0  # target tokens of one global batch
    tables: dict[str, list[str]] = field(default_factory=dict)  # title → markdown lines
    rows: list[dict] = field(default_factory=list)  # ours-vs-peer rows (the test reads them)

    def table(self, title: str, header: list[str], rows: list[list], note: str = "") -> None:
        lines = self.tables.setdefault(title, ([note, ""] if note else []) + [
            "| " + " | ".join(header) + " |", "|---" * len(header) + "|"])
        lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]


def batch(ctx: Ctx, i: int, parts: int = 1, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and (shifted) labels of part `part` of `parts` of global batch i."""
    rows = ctx.data[i % len(ctx.data)].chunk(parts)[part]  # (B/parts, S+1)
    return rows[:, :-1], rows[:, 1:]


def fresh(ctx: Ctx) -> M.Llama:
    return M.materialize(M.build(ctx.cfg), ctx.device, seed=ctx.args.seed)


def adamw(model: torch.nn.Module, ocfg: P.OptimConfig, cls: type = torch.optim.AdamW, **kw):
    """The peers' optimizer: torch's AdamW with our decay groups and hyper-parameters."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if P.decays(n, p)], "weight_decay": ocfg.weight_decay},
              {"params": [p for n, p in named if not P.decays(n, p)], "weight_decay": 0.0}]
    return cls(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, **kw)


def peer_update(ctx: Ctx, model: torch.nn.Module, opt, group: dist.ProcessGroup | None = None):
    """The peers' step: clip as clip_grad_norm_ does, with get_total_norm per kind of tensor (one
    foreach call cannot mix DTensor and plain tensors: TP leaves norms plain) and the squares summed
    over `group` (pipeline stages hold different parameters); then AdamW. Returns the norm."""
    def update() -> float:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        kinds = [[g for g in grads if isinstance(g, DTensor) == d] for d in (True, False)]
        sq = torch.zeros((), device=ctx.device)
        for gs in filter(None, kinds):
            n = torch.nn.utils.get_total_norm(gs)
            sq += (n.full_tensor() if isinstance(n, DTensor) else n) ** 2
        if group is not None:
            dist.all_reduce(sq, group=group)
        norm = float(sq.sqrt())
        for gs in filter(None, kinds):
            torch._foreach_mul_(gs, min(ctx.ocfg.clip / (norm + 1e-6), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return norm
    return update


def side(ctx: Ctx, model: torch.nn.Module, update: Callable[[], float], parts: int = 1, part: int = 0,
         scale: float = 1.0, context: Callable = contextlib.nullcontext) -> Side:
    """Step i: forward on this rank's part of global batch i, backward of loss × scale, update()."""
    def step(i: int) -> tuple[torch.Tensor, float]:
        x, y = batch(ctx, i, parts, part)
        with context():
            loss = P.normalized_loss(model(x, labels=y, reduction="sum"), ctx.targets)
            (loss * scale).backward()
        norm, loss = update(), loss.detach()
        return (loss.to_local() if isinstance(loss, DTensor) else loss), norm
    return step


def race(ctx: Ctx, sides: dict[str, Side], loss_from: int | None = None,
         distributed: bool = True) -> dict[str, tuple[float, list]]:
    """Alternate the sides' steps; {side: (median ms after warm-up, per step [loss, grad norm])}.
    Times: max over ranks. Losses (and norms alike): summed over ranks, or those of rank loss_from."""
    n, names, cuda = ctx.args.warmup + ctx.args.steps, list(sides), ctx.device.type == "cuda"
    times = torch.zeros(len(names), n, dtype=torch.float64)
    losses = torch.zeros(len(names), n, 2, dtype=torch.float64)
    for i in range(n):
        for j in (range(len(names)) if i % 2 == 0 else reversed(range(len(names)))):
            if distributed:
                dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, norm = sides[names[j]](i)
            if cuda:
                torch.cuda.synchronize()
            times[j, i] = time.perf_counter() - t0
            losses[j, i] = torch.tensor([float(loss), norm])
    if distributed:  # on the data device: NCCL reduces no CPU tensors
        times, losses = times.to(ctx.device), losses.to(ctx.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(losses) if loss_from is None else dist.broadcast(losses, src=loss_from)
    return {s: (1e3 * statistics.median(times[j, ctx.args.warmup:].tolist()), losses[j].tolist())
            for j, s in enumerate(names)}


def add_row(ctx: Ctx, feature: str, ours: str, peer: str, a: tuple, b: tuple, tol: float = TOL) -> None:
    """Same result: the grad norm of the first step, where both sides hold the same weights (AdamW's
    m/sqrt(v) hides a wrongly scaled gradient from the loss, not from the norm), and the losses of the
    first CHECKED steps (two updates). Later steps are shown, not checked: training amplifies the
    last-bit differences of summation order (dp vs DDP: 2e-8 after 3 steps, 3e-5 after 63; the norm
    drifts faster still: TP 4e-5 after 10 steps, the one-process run between the two sides)."""
    rel = lambda x, y: abs(x - y) / max(abs(y), 1e-12)  # noqa: E731
    errs = [rel(u[0], v[0]) for u, v in zip(a[1], b[1])]
    loss_err, norm_err = max(errs[:CHECKED]), rel(a[1][0][1], b[1][0][1])
    ctx.rows.append(dict(feature=feature, ours=ours, peer=peer, ours_ms=a[0], peer_ms=b[0], ratio=a[0] / b[0],
                         loss_ours=a[1][-1][0], loss_peer=b[1][-1][0], loss_err=loss_err, norm_err=norm_err,
                         drift=errs[-1], ok=max(loss_err, norm_err) <= tol, tol=tol))


# ------------------------------------------------------------------------------------- sections
def sec_dp(ctx: Ctx, stages: tuple[int, ...]) -> None:
    """dp vs DDP; ZeRO-1 vs DDP + ZeroRedundancyOptimizer; ZeRO-2/3 vs FSDP2."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    peers = ["DDP", "DDP + ZeroRedundancyOptimizer", "FSDP2 reshard_after_forward=False", "FSDP2 fully_shard"]
    for stage in stages:
        ours, peer = fresh(ctx), fresh(ctx)
        opt = Z.apply_zero(ours, stage, None, ctx.ocfg)
        if stage < 2:  # DDP's bucket is 25 MB as ours; buffers are equal by construction: no sync
            peer = DDP(peer, forward_sync_buffers=False)
            popt = adamw(peer, ctx.ocfg) if stage == 0 else adamw(
                peer, ctx.ocfg, ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW,
                parameters_as_bucket_view=True)
        else:  # our stage-3 units: embedding, each layer, [norm, lm_head]
            m = peer.model
            for unit in (m.embed_tokens, *m.layers.values(), [m.norm, peer.lm_head]):
                fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3)
            fully_shard(peer, mesh=mesh, reshard_after_forward=stage == 3)
            popt = adamw(peer, ctx.ocfg)
        kw = dict(parts=ctx.world, part=ctx.rank)
        r = race(ctx, {"ours": side(ctx, ours, lambda: opt.step(ctx.args.lr), **kw),
                       "peer": side(ctx, peer, peer_update(ctx, peer, popt), scale=ctx.world, **kw)})
        name = f"ZeRO-{stage}" if stage else "dp"
        add_row(ctx, f"zero{stage}" if stage else "dp", f"{name} (dp={ctx.world})", peers[stage],
                r["ours"], r["peer"])
        opt.teardown()


def sec_tp(ctx: Ctx) -> None:
    """The largest tp dividing the world and the config (tp.tp_validate's rule: heads, kv heads,
    intermediate); the remaining ranks form replica tp groups on the same data."""
    c = ctx.cfg
    t = math.gcd(ctx.world, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
    group = [dist.new_group(list(range(r * t, r * t + t))) for r in range(ctx.world // t)][ctx.rank // t]
    ours = M.build(ctx.cfg)
    shards = TP.apply_tp(ours, group)
    M.materialize(ours, ctx.device, seed=ctx.args.seed, shards=shards)
    lead = dist.get_rank(group) == 0  # replicated params (norms) counted once in the grad norm
    opt = P.MixedPrecisionOptimizer(ours.named_parameters(), ctx.ocfg, norm_groups=[group],
                                    counted=lambda n: n in shards or lead)
    peer = fresh(ctx)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}  # loss_parallel
    for i in peer.model.layers:
        plan |= {f"model.layers.{i}.{n}": ColwiseParallel() for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
        plan |= {f"model.layers.{i}.{n}": RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")}
    mesh = init_device_mesh(ctx.device.type, (ctx.world // t, t), mesh_dim_names=("rep", "tp"))["tp"]
    parallelize_module(peer, mesh, plan)
    update = peer_update(ctx, peer, adamw(peer, ctx.ocfg))
    r = race(ctx, {"ours": side(ctx, ours, lambda: opt.step(ctx.args.lr)),
                   "peer": side(ctx, peer, update, context=loss_parallel)}, loss_from=0)
    add_row(ctx, "tp", f"tp={t} (x{ctx.world // t} replicas)", "parallelize_module + loss_parallel",
            r["ours"], r["peer"])


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


def sec_pp(ctx: Ctx) -> None:
    p, m, L = ctx.world, ctx.args.micro_batches, ctx.cfg.num_hidden_layers
    if L < p or ctx.cfg.tie_word_embeddings:
        ctx.tables["Pipeline"] = [f"skipped: needs untied embeddings and layers ({L}) >= pp ({p})"]
        return
    ranges, first, last, world = PP.partition(L, p), ctx.rank == 0, ctx.rank == p - 1, dist.group.WORLD

    def micro(i: int) -> list[dict]:
        x, y = batch(ctx, i)
        return [{"input_ids": a, "labels": b} for a, b in zip(x.chunk(m), y.chunk(m))]

    for name, cls in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        ours, peer = (M.materialize(PP.split_stage(M.build(ctx.cfg), ctx.rank, p, ranges), ctx.device,
                                    seed=ctx.args.seed) for _ in range(2))
        opt = P.MixedPrecisionOptimizer(ours.named_parameters(), ctx.ocfg, norm_groups=[world],
                                        counted=PP.norm_counted(ours))
        actions = PP.SCHEDULES[name](m, ctx.rank, p)
        schedule = cls(PipelineStage(peer, ctx.rank, p, ctx.device), m, scale_grads=False,
                       loss_fn=lambda out, y: M.cross_entropy(out, y, "sum") / ctx.targets)
        update = peer_update(ctx, peer, adamw(peer, ctx.ocfg), world)

        def ours_step(i: int) -> tuple[torch.Tensor, float]:
            loss = PP.run_pipeline(ours, actions, micro(i), world, ctx.targets)
            return loss, opt.step(ctx.args.lr)

        def peer_step(i: int) -> tuple[torch.Tensor, float]:
            x, y, losses = *batch(ctx, i), []
            schedule.step(*([x] if first else []), **(dict(target=y, losses=losses) if last else {}))
            return torch.stack(losses).detach().sum() if losses else torch.zeros(()), update()

        r = race(ctx, {"ours": ours_step, "peer": peer_step}, loss_from=p - 1)
        add_row(ctx, f"pp {name}", f"run_pipeline {name} (pp={p}, m={m})", f"pipelining {cls.__name__}",
                r["ours"], r["peer"])
        bubble(ctx, ours, actions, micro, name, m)


def sec_ac(ctx: Ctx) -> None:
    """One process (rank 0) on the whole global batch: no AC, full, selective, alternating."""
    if ctx.rank == 0:
        sides = {}
        for mode in ("none", "full", "selective"):
            model = fresh(ctx)
            if mode != "none":
                AC.apply_ac(model, mode)
            opt = P.MixedPrecisionOptimizer(model.named_parameters(), ctx.ocfg)
            sides[mode] = side(ctx, model, (lambda o: lambda: o.step(ctx.args.lr))(opt))
        r = race(ctx, sides, distributed=False)
        for mode in ("full", "selective"):
            add_row(ctx, f"ac {mode}", f"apply_ac {mode} (1 process)", "no checkpointing", r[mode], r["none"])
    dist.barrier()


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.3f}"


def measure_layout(ctx: Ctx, stage: int, use_ac: bool, pp: int, groups: dict) -> dict:
    """Two bf16 steps of one layout (pp > 1: 1F1B); in the second, the saved activations (peak live)
    and, after the gradient reduction, the persistent bytes; on CUDA the allocator's peak."""
    dp = ctx.world // pp
    s, d = divmod(ctx.rank, dp)  # grid: dp inner, pp outer
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if ctx.device.type == "cuda" else 0
    model = M.build(ctx.cfg)
    if pp > 1:
        PP.split_stage(model, s, pp, PP.partition(ctx.cfg.num_hidden_layers, pp))
    M.materialize(model, ctx.device, seed=ctx.args.seed)
    if use_ac:
        AC.apply_ac(model, "full")
    psi = sum(p.numel() for p in model.parameters())
    opt = Z.apply_zero(model, stage, groups["dp"][s], ctx.ocfg, torch.bfloat16,
                       norm_groups=[groups["pp"][d]] if pp > 1 else ())
    x, y = batch(ctx, 0, dp, d)
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
    peak = torch.cuda.max_memory_allocated() - base if ctx.device.type == "cuda" else None
    return dict(held, psi=psi, dp=dp, act=meter.peak_nbytes, autograd=meter.param_nbytes, peak=peak)


def sec_memory(ctx: Ctx) -> None:
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
    if ctx.rank == 0:  # one decoder layer, batch 1, bf16; ac.py's formulas (q, kv widths: head_dim free)
        rows = []
        h, i, a = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
        q, kv = a * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        formula = {"none": lambda t: t * (16 * h + 4 * q + 4 * kv + 8 * i) + 4 * t * a + 8 * t,
                   "selective": lambda t: t * (6 * h + 4 * q + 4 * kv + 4 * i) + 4 * t * a,
                   "full": lambda t: 2 * t * h}
        layer = M.materialize(M.build(cfg), ctx.device, seed=ctx.args.seed).to(torch.bfloat16)
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


def sec_sft(ctx: Ctx) -> None:
    """Random FFD rows (block-diagonal attention) vs the same conversations padded to the batch's
    longest (plain causal), forward + backward on one model: the loss sums must agree."""
    if ctx.rank == 0:
        import data
        import sft
        S, b = (128, 2) if ctx.args.quick else (sft.DEFAULT_SEQ_LEN, 4)
        ds = sft.SFTDataset(sft.arithmetic_chats(n_train=600 if ctx.args.quick else 6000)[0],
                            data.ByteTokenizer(), S, "ffd")
        pick = torch.randperm(len(ds), generator=torch.Generator().manual_seed(ctx.args.seed)).tolist()
        packed, padded, real, model = [], [], [], fresh(ctx)
        for i in range(ctx.args.warmup + ctx.args.steps):  # random rows: FFD's first hold its longest
            rows = [ds[r] for r in pick[i * b:i * b + b]]
            packed.append({k: torch.stack([r[k] for r in rows]).to(ctx.device) for k in rows[0]})  # (b, S)
            spans = [(ds.offsets[c], ds.offsets[c + 1]) for r in pick[i * b:i * b + b] for c in ds.rows[r]]
            ids = torch.full((len(spans), max(e - a for a, e in spans)), ds.pad_id)  # (convs, longest)
            lab = torch.full_like(ids, -100)
            for k, (a, e) in enumerate(spans):
                ids[k, :e - a], lab[k, :e - a] = ds.tokens[a:e], ds.labels[a:e]
            padded.append({"input_ids": ids.to(ctx.device), "labels": lab.to(ctx.device)})
            real.append(sum(e - a for a, e in spans))  # the same tokens in both layouts

        def run(batches: list[dict]) -> Side:
            def step(i: int) -> tuple[torch.Tensor, float]:
                mb = batches[i]
                loss = model(mb["input_ids"], mb.get("position_ids"), mb["labels"], reduction="sum")
                loss.backward()
                norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
                model.zero_grad(set_to_none=True)
                return loss.detach(), norm
            return step
        r = race(ctx, {"ffd": run(packed), "pad": run(padded)}, distributed=False)
        add_row(ctx, "sft ffd", f"FFD rows of {S}, {b} per step", "padding to the batch's longest",
                r["ffd"], r["pad"])
        real, st = statistics.mean(real), ds.stats
        pad_pos = statistics.mean(mb["input_ids"].numel() for mb in padded)
        ctx.table("SFT packing (default arithmetic set, byte tokenizer; forward + backward)",
                  ["layout", "positions/step", "real tokens/step", "fill", "ms/step", "real tokens/s"],
                  [[name, f"{pos:.0f}", f"{real:.0f}", f"{real / pos:.1%}", f"{r[k][0]:.1f}",
                    f"{real / r[k][0] * 1e3:,.0f}"] for k, name, pos in (
                      ("ffd", "FFD packed", b * S),
                      ("pad", "padded to longest", pad_pos))],
                  note=f"{st.conversations} conversations, {st.tokens} tokens; FFD {st.ffd_rows} rows of {S} "
                       f"(bound {math.ceil(st.tokens / S)}), fill {st.tokens / (st.ffd_rows * S):.2%}; one "
                       f"per row padded to {S}: fill {st.tokens / ((st.conversations - st.dropped) * S):.2%}")
    dist.barrier()


def sec_mfu(ctx: Ctx) -> None:
    """1B config, one GPU, bf16 compute with fp32 masters on both sides: model.py vs transformers."""
    title = "1B single-GPU bf16 tokens/s and MFU (989 TFLOP/s peak; FLOPs/token = 6N + 12·L·H·Q·T)"
    if ctx.device.type != "cuda":
        ctx.tables[title] = ["skipped (no CUDA)"]
    elif ctx.rank == 0:
        import transformers
        cfg, S, b = M.PRESETS["1b"], ctx.args.mfu_seq_len, ctx.args.mfu_batch
        ours = M.materialize(M.build(cfg), ctx.device, seed=ctx.args.seed)
        with ctx.device:  # initialised on the GPU (fast), then overwritten with our weights
            hf = transformers.AutoModelForCausalLM.from_config(
                transformers.LlamaConfig.from_dict(cfg.to_hf()), attn_implementation="sdpa")
        hf.load_state_dict(ours.state_dict())
        g = torch.Generator().manual_seed(ctx.args.seed)
        xs = [torch.randint(0, cfg.vocab_size, (b, S + 1), generator=g).to(ctx.device) for _ in range(4)]

        def run(model: torch.nn.Module, loss_sum: Callable) -> Side:
            opt = P.MixedPrecisionOptimizer(model.named_parameters(), ctx.ocfg, torch.bfloat16)

            def step(i: int) -> tuple[torch.Tensor, float]:
                x = xs[i % len(xs)]
                loss = P.normalized_loss(loss_sum(x[:, :-1], x[:, 1:]), b * S)
                loss.backward()
                return loss.detach(), opt.step(ctx.args.lr)
            return step
        torch.cuda.reset_peak_memory_stats()
        r = race(ctx, {"ours": run(ours, lambda x, y: ours(x, labels=y, reduction="sum")),
                       "hf": run(hf, lambda x, y: M.cross_entropy(hf(input_ids=x, use_cache=False).logits,
                                                                  y, "sum"))}, distributed=False)
        # bf16 (8-bit mantissa): the two models round in different kernels and orders
        add_row(ctx, "1b bf16", "model.py (1 GPU)", "transformers LlamaForCausalLM (sdpa)",
                r["ours"], r["hf"], 2e-2)
        tps = {k: b * S / r[k][0] * 1e3 for k in r}
        fpt = train.flops_per_token(cfg, S)
        ctx.table(title, ["model", "ms/step", "tokens/s", "MFU"],
                  [[name, f"{r[k][0]:.0f}", f"{tps[k]:,.0f}", f"{tps[k] * fpt / PEAK_FLOPS:.1%}"]
                   for k, name in (("ours", "attotron model.py"), ("hf", "transformers LlamaForCausalLM"))],
                  note=f"{torch.cuda.get_device_name()}, batch {b} x {S}, {cfg.num_params() / 1e9:.2f}B "
                       f"params, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (both models "
                       f"resident)")
    dist.barrier()


# ------------------------------------------------------------------------------------- report
def report(ctx: Ctx, argv: list[str] | None, load: float) -> str:
    a = ctx.args
    out = ["# attotron bench\n", f"`torchrun --nproc_per_node {ctx.world} bench.py "
           f"{' '.join(sys.argv[1:] if argv is None else argv)}`  ",
           f"{platform.node()}: {os.cpu_count()} CPU cores, torch {torch.__version__}, {dist.get_backend()} "
           f"on {ctx.device.type}, world {ctx.world}; load average {load:.1f} at start, "
           f"{os.getloadavg()[0]:.1f} at end  ",
           f"model {a.model} ({ctx.cfg.num_params() / 1e6:.2f}M params), global batch {a.batch_size} x "
           f"{a.seq_len}, {a.warmup} warm-up + {a.steps} timed steps per side, alternating\n"]
    if ctx.rows:
        out += ["## Step time: ours vs PyTorch (median ms, slowest rank)\n",
                "| feature | ours | PyTorch peer | ours ms | peer ms | ours/peer | "
                f"loss diff (steps 1-{CHECKED}) | norm diff (step 1) | same result | last loss ours | "
                "last loss peer | last loss diff |",
                "|---" * 12 + "|"]
        out += [f"| {r['feature']} | {r['ours']} | {r['peer']} | {r['ours_ms']:.2f} | {r['peer_ms']:.2f} | "
                f"{r['ratio']:.2f} | {r['loss_err']:.1e} | {r['norm_err']:.1e} | "
                f"{'yes' if r['ok'] else 'VOID (tolerance %.0e)' % r['tol']} | {r['loss_ours']:.6f} | "
                f"{r['loss_peer']:.6f} | {r['drift']:.1e} |"
                for r in ctx.rows] + [""]
    for title, lines in ctx.tables.items():
        out += [f"## {title}\n", *lines, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    """Run the chosen sections; rank 0 prints and writes the markdown. Returns {"rows", "markdown"}
    (rows complete on rank 0). Uses an existing process group (tests), else train.setup()."""
    args, load = parse_args(argv), os.getloadavg()[0]
    own = not dist.is_initialized()
    if own:
        g = train.setup()
        rank, world, device = g.rank, g.world, g.device
    else:
        rank, world = dist.get_rank(), dist.get_world_size()
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    cfg = M.PRESETS[args.model]
    if args.batch_size % world or args.seq_len > cfg.max_position_embeddings:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by the world size {world} "
                         f"and --seq-len {args.seq_len} <= {cfg.max_position_embeddings} (max positions)")
    ctx = Ctx(args, cfg, P.OptimConfig(lr=args.lr), rank, world, device)
    g = torch.Generator().manual_seed(args.seed)
    ctx.data = [torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), generator=g).to(device)
                for _ in range(args.warmup + args.steps)]
    ctx.targets = int(P.count_targets(ctx.data[0][:, 1:]))  # every label is a target: all batches alike
    sections = {"dp": lambda c: sec_dp(c, (0,)), "zero": lambda c: sec_dp(c, (1, 2, 3)), "tp": sec_tp,
                "pp": sec_pp, "ac": sec_ac, "memory": sec_memory, "sft": sec_sft, "mfu": sec_mfu}
    try:
        for name in (s for s in SECTIONS if s in args.only):
            t0 = time.time()
            sections[name](ctx)
            if rank == 0:
                print(f"[bench] {name} done in {time.time() - t0:.1f}s", flush=True)
        text = report(ctx, argv, load)
        if rank == 0:
            print(text, flush=True)
            with open(args.out, "w") as f:
                f.write(text + "\n")
        bad = [r["feature"] for r in ctx.rows if not r["ok"]]
        assert not (args.quick and bad), f"ours and the peer computed different results: {bad}"
        return {"rows": ctx.rows, "markdown": text}
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
