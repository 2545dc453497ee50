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
      pp      run_pipeline gpipe / 1f1b /         torch.distributed.pipelining ScheduleGPipe / 1F1B /
              interleaved / zb (v=2)              ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble
      ac      apply_ac full / selective           no checkpointing (one process); then bench_speed.py's
                                                  host time per layer of each mode, beside torch's
                                                  op-level selective checkpoint in eager
      compile model.compile_layers (--compile)    the eager layers (one process, bench_speed.py)
      optim   MixedPrecisionOptimizer.step (fp32)   clip_grad_norm_ + AdamW (one process)
    bench_speed.py's error of bf16 gradient accumulation/reduction beside fp32's (--reduce-dtype).
    Then bench_theory.py's tables, each measurement beside its formula: the pipeline bubble per
    stage (outside F/B/W: CUDA events on CUDA) beside pp.simulate and the closed form, per-rank
    persistent bytes of every ZeRO layout, saved activations per layer; SFT packing, FFD vs padding
    to the batch's longest on the same conversations; on CUDA, bench_mfu.py's GPU check (1B bf16
    tokens/s and MFU, eager and compiled, each AC mode, the SDPA kernels, transformers' Llama).

Run
    torchrun --nproc_per_node 4 -m bench.bench --model tiny --steps 40    # ~2 min on 2 cores
    torchrun --nproc_per_node 1 -m bench.bench --only mfu      # one GPU: bench_mfu.py's GPU check
    python -m bench.bench --model small --only compile,ac --steps 20     # CPU speed targets
    From the repository root; `python bench/bench.py` works too. `--out FILE` also writes the report.

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
import math
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.distributed as dist

import memory
# the bench meters CPU memory: accounting on before torch's pipelining, which allocates a tensor at
# import (its free at exit, with c10's block accounting on, would warn about a block of unknown size)
memory.exact_cpu_accounting()
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                         ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence

import ac as AC
from bench import bench_mfu
from bench import bench_speed
from bench import bench_theory
import cp as CP
import grid as G
from bench.bench_ctx import CHECKED, Ctx, Side, adamw, md_row, peer_update, side
from loss import cross_entropy
import model as M
import pp as PP
import precision as P
import tp as TP
import weights as W
import zero as Z
import zero3 as Z3

SECTIONS = ("dp", "zero", "tp", "cp", "pp", "ac", "compile", "optim", "accum", "memory", "sft", "mfu")


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
    a("--mfu-batch", type=int, default=8, help="sequences per step of the 1B CUDA section")
    a("--mfu-seq-len", type=int, default=2048)
    a("--out", default=None, help="also write the markdown report there (rank 0); default: print only")
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


# ------------------------------------------------------------------------------------- sections
def sec_dp(ctx: Ctx, stages: tuple[int, ...]) -> None:
    """dp vs DDP; ZeRO-1 vs DDP + ZeroRedundancyOptimizer; ZeRO-2/3 vs FSDP2."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    peers = ["DDP", "DDP + ZeroRedundancyOptimizer", "FSDP2 reshard_after_forward=False", "FSDP2 fully_shard"]
    for stage in stages:
        ours, peer = ctx.fresh(), ctx.fresh()
        opt = Z3.apply_zero(ours, stage, None, ctx.ocfg)
        if stage < 2:  # DDP's bucket is 25 MB as ours; buffers are equal by construction: no sync
            peer = DDP(peer, forward_sync_buffers=False)
        else:  # our stage-3 units: embedding, each layer, [norm, lm_head]
            m = peer.model
            for unit in (m.embed_tokens, *m.layers.values(), [m.norm, peer.lm_head]):
                fully_shard(unit, mesh=mesh, reshard_after_forward=stage == 3)
            fully_shard(peer, mesh=mesh, reshard_after_forward=stage == 3)
        popt = adamw(peer, ctx.ocfg) if stage != 1 else adamw(
            peer, ctx.ocfg, ZeroRedundancyOptimizer, optimizer_class=torch.optim.AdamW,
            parameters_as_bucket_view=True)
        kw = dict(parts=ctx.world, part=ctx.rank)  # (stages 1-2: the step's parameter all-gathers
        # run in ours' next forward, inside its own timed step: none leaks into the peer's time)
        r = ctx.race({"ours": side(ctx, ours, partial(opt.step, ctx.args.lr), **kw),
                      "peer": side(ctx, peer, peer_update(ctx, peer, popt), scale=ctx.world, **kw)})
        name = f"ZeRO-{stage}" if stage else "dp"
        ctx.add_row(f"zero{stage}" if stage else "dp", f"{name} (dp={ctx.world})", peers[stage],
                    r["ours"], r["peer"])
        opt.teardown()
    if 1 in stages:
        zero_overlap(ctx)


def zero_overlap(ctx: Ctx, blocks: int = 3, per_block: int = 3) -> None:
    """ZeRO-1/2, ours only: steps with the parameter all-gather overlapped with the next forward
    (the default) vs waited at the end of each step, timed in blocks of consecutive steps (a block
    ends with finish_gathers(), so no block's gathers run on another's time), alternating; and the
    gradient reduction left to wait for after backward (finish()), the embedding's bucket last."""
    rows, blocks = [], 1 if ctx.args.quick else blocks
    for stage in (1, 2):
        for bucket_mb in (25.0, 2.0):
            model = ctx.fresh()
            opt = Z.apply_zero_0_to_2(model, stage, None, ctx.ocfg, bucket_mb=bucket_mb)
            waits: list[float] = []
            finish = opt.sync.finish

            def timed_finish() -> None:
                t0 = time.perf_counter()
                finish()
                waits.append(time.perf_counter() - t0)
            opt.sync.finish = timed_finish
            step = side(ctx, model, partial(opt.step, ctx.args.lr), parts=ctx.world, part=ctx.rank)
            times = {True: [], False: []}
            for i in range(ctx.args.warmup + 2 * blocks):
                overlap = i % 2 == 0
                dist.barrier()
                t0 = time.perf_counter()
                for k in range(per_block):
                    step(i * per_block + k)
                    if not overlap:
                        opt.finish_gathers()
                opt.finish_gathers()
                if i >= ctx.args.warmup:
                    times[overlap].append((time.perf_counter() - t0) / per_block)
            stats = torch.tensor([statistics.median(times[True]), statistics.median(times[False]),
                                  statistics.median(waits[ctx.args.warmup * per_block:])], dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            on, off, wait = (1e3 * v for v in stats.tolist())
            last = opt.sync.buckets[opt.sync.order[-1]]
            rows.append([stage, f"{bucket_mb:g} MB: {len(opt.sync.buckets)}", f"{off:.1f}", f"{on:.1f}",
                         f"{on / off:.2f}", f"{wait:.1f}", f"{last.size * 4 / 2**20:.2f} MB"])
            opt.teardown()
    ctx.table("ZeRO-1/2: parameter all-gather overlapped with the next forward (ours, median ms per step)",
              ["stage", "bucket size: buckets", "gathers waited in step()", "overlapped (default)",
               "overlapped / waited", "reduction left after backward", "last bucket reduced (fp32)"], rows,
              note=f"dp={ctx.world}, fp32; {per_block} consecutive steps per block, blocks alternating; slowest "
                   f"rank. The last bucket holds the embedding (its gradient is ready last in backward)")


def sec_tp(ctx: Ctx) -> None:
    """The largest tp dividing the world and the config (tp.tp_validate's rule: heads, kv heads,
    intermediate); the remaining ranks form replica tp groups on the same data."""
    c = ctx.cfg
    t = math.gcd(ctx.world, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size)
    group = [dist.new_group(list(range(r * t, r * t + t))) for r in range(ctx.world // t)][ctx.rank // t]
    ours = M.build(ctx.cfg)
    shards = TP.apply_tp(ours, group)
    W.materialize(ours, ctx.device, seed=ctx.args.seed, shards=shards)
    lead = dist.get_rank(group) == 0  # replicated params (norms) counted once in the grad norm
    opt = P.MixedPrecisionOptimizer(ours.named_parameters(), ctx.ocfg, norm_groups=[group],
                                    counted=lambda n: n in shards or lead)
    peer = ctx.fresh()  # DTensor logits through loss_parallel's cross-entropy, not our chunked loss
    peer.loss_fn = lambda h, weight, labels, reduction: cross_entropy(peer.lm_head(h), labels, reduction)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}  # loss_parallel
    for i in peer.model.layers:
        plan |= {f"model.layers.{i}.{n}": ColwiseParallel() for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
        plan |= {f"model.layers.{i}.{n}": RowwiseParallel() for n in ("self_attn.o_proj", "mlp.down_proj")}
    mesh = init_device_mesh(ctx.device.type, (ctx.world // t, t), mesh_dim_names=("rep", "tp"))["tp"]
    parallelize_module(peer, mesh, plan)
    update = peer_update(ctx, peer, adamw(peer, ctx.ocfg))
    r = ctx.race({"ours": side(ctx, ours, partial(opt.step, ctx.args.lr)),
                  "peer": side(ctx, peer, update, context=loss_parallel)}, loss_from=0)
    ctx.add_row("tp", f"tp={t} (x{ctx.world // t} replicas)", "parallelize_module + loss_parallel",
                r["ours"], r["peer"])


def sec_cp(ctx: Ctx) -> None:
    """Context parallelism over all ranks (cp = world: every rank its zigzag share of every row's
    tokens, ring attention) vs the single process on whole rows — torch's own
    `tensor.experimental.context_parallel` does not run on CPU/gloo in 2.13 (no sharding strategy
    for aten._scaled_dot_product_flash_attention_for_cpu). The single process runs on rank 0 alone,
    so it has the machine to itself; the others wait."""
    cp, S = ctx.world, ctx.args.seq_len
    if S % (2 * cp):
        ctx.tables["Context parallelism"] = [f"skipped: seq-len {S} is not a multiple of 2·cp = {2 * cp}"]
        return
    ours = ctx.fresh(lambda model: CP.apply_cp(model, dist.group.WORLD) or model)
    opt = Z.apply_zero_0_to_2(ours, 0, None, ctx.ocfg)  # the cp ranks sum their gradients, as dp replicas do
    peer = ctx.fresh()
    popt = P.MixedPrecisionOptimizer(peer.named_parameters(), ctx.ocfg)

    def ours_step(i: int) -> tuple[torch.Tensor, float]:
        x, y = (CP.shard_sequence(t, cp, ctx.rank) for t in ctx.batch(i))
        loss = P.normalized_loss(ours(x, labels=y, reduction="sum"), ctx.targets)
        loss.backward()
        dist.all_reduce(loss := loss.detach())
        return loss, opt.step(ctx.args.lr)

    def peer_step(i: int) -> tuple[torch.Tensor, float]:
        if ctx.rank:
            return torch.zeros(()), 0.0
        x, y = ctx.batch(i)
        loss = P.normalized_loss(peer(x, labels=y, reduction="sum"), ctx.targets)
        loss.backward()
        return loss.detach(), popt.step(ctx.args.lr)

    r = ctx.race({"ours": ours_step, "peer": peer_step}, loss_from=0)
    ctx.add_row("cp", f"cp={cp} ring attention, zigzag", "one process, whole rows (torch's "
                "context_parallel: CUDA only)", r["ours"], r["peer"])
    opt.teardown()


def sec_pp(ctx: Ctx) -> None:
    """Each schedule vs its torch.distributed.pipelining peer, on the largest pp that divides the
    world and leaves a layer per chunk (v = 2 for interleaved and zb: ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble); the other ranks form replica pipelines on the same data."""
    m, L = ctx.args.micro_batches, ctx.cfg.num_hidden_layers
    if ctx.cfg.tie_word_embeddings:
        ctx.tables["Pipeline"] = ["skipped: needs untied embeddings"]
        return
    groups: dict[int, tuple[dist.ProcessGroup, dict[int, dist.ProcessGroup]]] = {}
    for name, cls, v in (("gpipe", ScheduleGPipe, 1), ("1f1b", Schedule1F1B, 1),
                         ("interleaved", ScheduleInterleaved1F1B, 2), ("zb", ScheduleInterleavedZeroBubble, 2)):
        p = max(d for d in range(1, ctx.world + 1) if ctx.world % d == 0 and d * v <= L)
        if p < 2:
            ctx.tables.setdefault("Pipeline", []).append(f"{name} skipped: {L} layers, {ctx.world} ranks")
            continue
        if p not in groups:  # every rank creates every replica's group, in the same order
            pipelines = [list(range(k, k + p)) for k in range(0, ctx.world, p)]
            mine = [dist.new_group(ranks) for ranks in pipelines]
            groups[p] = mine[ctx.rank // p], PP.peer_groups(pipelines)  # on NCCL: one group per pair
        (group, peers), r, ranges = groups[p], ctx.rank % p, PP.partition(L, p * v)
        first, last = r == 0, r == p - 1
        ours, peer = (ctx.fresh(lambda model: PP.split_stage(model, r, p, ranges)) for _ in range(2))
        chunks, peer_chunks = PP.stage_chunks(ours, ranges, r, p), PP.stage_chunks(peer, ranges, r, p)
        opt = P.MixedPrecisionOptimizer(ours.named_parameters(), ctx.ocfg, norm_groups=[group],
                                        counted=PP.norm_counted(ours))
        actions = PP.SCHEDULES[name](m, r, p, v)
        stages = [PipelineStage(c, k * p + r, p * v, ctx.device, group=group) for k, c in enumerate(peer_chunks)]
        schedule = cls(stages if v > 1 else stages[0], m, scale_grads=False,
                       loss_fn=lambda out, y: cross_entropy(out, y, "sum") / ctx.targets)
        update = peer_update(ctx, peer, adamw(peer, ctx.ocfg), group)

        def micro(i: int) -> list[dict]:
            x, y = ctx.batch(i)
            return [{"input_ids": a, "labels": b} for a, b in zip(x.chunk(m), y.chunk(m))]

        def ours_step(i: int) -> tuple[torch.Tensor, float]:
            loss = PP.run_pipeline(chunks, actions, micro(i), group, ctx.targets, peer_groups=peers,
                                   hidden_size=ctx.cfg.hidden_size)
            return loss, opt.step(ctx.args.lr)

        def peer_step(i: int) -> tuple[torch.Tensor, float]:
            x, y, losses = *ctx.batch(i), []
            schedule.step(*([x] if first else []), **(dict(target=y, losses=losses) if last else {}))
            return torch.stack(losses).detach().sum() if losses else torch.zeros(()), update()

        r_ = ctx.race({"ours": ours_step, "peer": peer_step}, loss_from=p - 1)
        layout = f"pp={p}" + (f", v={v}" if v > 1 else "") + f", m={m}" + \
            (f", x{ctx.world // p} replicas" if ctx.world > p else "")
        ctx.add_row(f"pp {name}", f"run_pipeline {name} ({layout})", f"pipelining {cls.__name__}",
                    r_["ours"], r_["peer"])
        bench_theory.bubble(ctx, chunks, actions, micro, name, m, p, v, group, peers)


def sec_ac(ctx: Ctx) -> None:
    """One process (rank 0) on the whole global batch: no AC, full, selective, alternating."""
    if ctx.rank == 0:
        sides = {}
        for mode in ("none", "full", "selective"):
            model = ctx.fresh()
            if mode != "none":
                AC.apply_ac(model, mode)
            opt = P.MixedPrecisionOptimizer(model.named_parameters(), ctx.ocfg)
            sides[mode] = side(ctx, model, partial(opt.step, ctx.args.lr))
        r = ctx.race(sides, distributed=False)
        for mode in ("full", "selective"):
            ctx.add_row(f"ac {mode}", f"apply_ac {mode} (1 process)", "no checkpointing", r[mode], r["none"])
        bench_speed.ac_host(ctx)
    dist.barrier()


def sec_sft(ctx: Ctx) -> None:
    """Random FFD rows (document-aware attention: attention.Documents, built here as feed.get_batch
    does) vs the same conversations padded to the batch's longest (plain causal), forward + backward
    on one model: the loss sums must agree. Also timed: the same FFD rows under the dense
    block-diagonal mask (what packing used before). Saved attention bytes: one layer's attention
    call on the first batch, measured by ac.SavedActivationMeter."""
    if ctx.rank == 0:
        import attention as A
        import data
        import sft
        S, b = (128, 2) if ctx.args.quick else (sft.DEFAULT_SEQ_LEN, 4)
        ds = sft.SFTDataset(sft.arithmetic_chats(n_train=600 if ctx.args.quick else 6000,
                                                n_eval=20, max_operands=(9, 9))[0],
                            data.ByteTokenizer(), S, "ffd")
        pick = torch.randperm(len(ds), generator=torch.Generator().manual_seed(ctx.args.seed)).tolist()
        packed, dense, padded, real, model = [], [], [], [], ctx.fresh()

        def pad(seqs: list[torch.Tensor], value: int) -> torch.Tensor:  # (convs, longest)
            return pad_sequence(seqs, batch_first=True, padding_value=value).long().to(ctx.device)

        for i in range(ctx.args.warmup + ctx.args.steps):  # random rows: FFD's first hold its longest
            rows = [ds[r] for r in pick[i * b:i * b + b]]
            mb = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}  # (b, S)
            docs = A.Documents.from_position_ids(mb["position_ids"], ctx.device)
            mb = {k: v.to(ctx.device) for k, v in mb.items()}
            packed.append({**mb, "docs": docs})
            dense.append({**mb, "docs": A.attention_mask(mb["position_ids"])})  # (b, 1, S, S)
            spans = [ds.spans[c] for r in pick[i * b:i * b + b] for c in ds.rows[r]]
            ids, labels = ([t[a:e] for a, e in spans] for t in (ds.tokens, ds.labels))
            padded.append({"input_ids": pad(ids, ds.pad_id), "labels": pad(labels, -100)})
            real.append(sum(e - a for a, e in spans))  # the same tokens in all layouts

        def run(batches: list[dict]) -> Side:
            def step(i: int) -> tuple[torch.Tensor, float]:
                mb = batches[i]
                loss = model(mb["input_ids"], mb.get("position_ids"), mb["labels"], reduction="sum",
                             docs=mb.get("docs"))
                loss.backward()
                norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
                model.zero_grad(set_to_none=True)
                return loss.detach(), norm
            return step

        def attention_saved(mb: dict) -> int:
            """Bytes one layer's attention call keeps for backward (q, k, v fresh leaves)."""
            rows, seq = mb["input_ids"].shape
            c = ctx.cfg
            q, k, v = (torch.randn(rows, seq, n, c.head_dim, device=ctx.device, requires_grad=True)
                       for n in (c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads))
            with AC.SavedActivationMeter() as meter:
                A.attend(q, k, v, mb.get("docs"))
            return meter.nbytes

        r = ctx.race({"ffd": run(packed), "dense": run(dense), "pad": run(padded)}, distributed=False)
        ctx.add_row("sft ffd", f"FFD rows of {S}, {b} per step", "padding to the batch's longest",
                    r["ffd"], r["pad"])
        real, st = statistics.mean(real), ds.stats
        pad_pos = statistics.mean(mb["input_ids"].numel() for mb in padded)
        ctx.table("SFT packing (single-digit arithmetic chats, byte tokenizer; forward + backward)",
                  ["layout", "attention", "positions/step", "real tokens/step", "fill", "ms/step",
                   "real tokens/s", "vs padded", "saved by attention, one layer"],
                  [[name, how, f"{pos:.0f}", f"{real:.0f}", f"{real / pos:.1%}", f"{r[k][0]:.1f}",
                    f"{real / r[k][0] * 1e3:,.0f}", f"{r['pad'][0] / r[k][0]:.2f}x",
                    f"{attention_saved(batches[0]) / 2**20:.3f} MiB"] for k, name, how, pos, batches in (
                      ("ffd", "FFD packed", "Documents: length groups", b * S, packed),
                      ("dense", "FFD packed", "dense (b, 1, S, S) mask", b * S, dense),
                      ("pad", "padded to longest", "plain causal", pad_pos, padded))],
                  note=f"{st.conversations} conversations, {st.tokens} tokens; FFD {st.ffd_rows} rows of {S} "
                       f"(bound {math.ceil(st.tokens / S)}), fill {st.tokens / (st.ffd_rows * S):.2%}; one "
                       f"per row padded to {S}: fill {st.tokens / ((st.samples - st.dropped) * S):.2%}. "
                       f"The same rows each step in all three layouts, alternating; saved bytes: one layer's "
                       f"attention call on the first step's batch ({b} rows)")
    dist.barrier()


# ------------------------------------------------------------------------------------- report
def report(ctx: Ctx, argv: list[str] | None, load: float) -> str:
    a = ctx.args
    out = ["# attotron bench\n", f"`torchrun --nproc_per_node {ctx.world} -m bench.bench "
           f"{' '.join(sys.argv[1:] if argv is None else argv)}`  ",
           f"{platform.node()}: {os.cpu_count()} CPU cores, torch {torch.__version__}, {dist.get_backend()} "
           f"on {ctx.device.type}, world {ctx.world}; load average {load:.1f} at start, "
           f"{os.getloadavg()[0]:.1f} at end  ",
           f"model {a.model} ({ctx.cfg.num_params() / 1e6:.2f}M params), global batch {a.batch_size} x "
           f"{a.seq_len}, {a.warmup} warm-up + {a.steps} timed steps per side, alternating\n"]
    if ctx.rows:
        header = ["feature", "ours", "PyTorch peer", "ours ms", "peer ms", "ours/peer",
                  f"loss diff (steps 1-{CHECKED})", "norm diff (step 1)", "same result", "last loss ours",
                  "last loss peer", "last loss diff"]
        out += ["## Step time: ours vs PyTorch (median ms, slowest rank)\n", md_row(header),
                "|---" * len(header) + "|"]
        out += [md_row([r["feature"], r["ours"], r["peer"], f"{r['ours_ms']:.2f}", f"{r['peer_ms']:.2f}",
                        f"{r['ratio']:.2f}", f"{r['loss_err']:.1e}", f"{r['norm_err']:.1e}",
                        "yes" if r["ok"] else f"VOID (tolerance {r['tol']:.0e})", f"{r['loss_ours']:.6f}",
                        f"{r['loss_peer']:.6f}", f"{r['drift']:.1e}"]) for r in ctx.rows] + [""]
    for title, lines in ctx.tables.items():
        out += [f"## {title}\n", *lines, ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    """Run the chosen sections; rank 0 prints and writes the markdown. Returns {"rows", "markdown"}
    (rows complete on rank 0). Uses an existing process group (tests), else grid.setup()."""
    args, load = parse_args(argv), os.getloadavg()[0]
    own = not dist.is_initialized()
    if own:
        g = G.setup()
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
    sections = {"dp": partial(sec_dp, stages=(0,)), "zero": partial(sec_dp, stages=(1, 2, 3)),
                "tp": sec_tp, "cp": sec_cp, "pp": sec_pp, "ac": sec_ac, "compile": bench_speed.sec_compile,
                "optim": bench_speed.sec_optim, "accum": bench_speed.sec_accum,
                "memory": bench_theory.sec_memory,
                "sft": sec_sft, "mfu": bench_mfu.sec_mfu}
    try:
        for name in (s for s in SECTIONS if s in args.only):
            t0 = time.time()
            sections[name](ctx)
            if rank == 0:
                print(f"[bench] {name} done in {time.time() - t0:.1f}s", flush=True)
        text = report(ctx, argv, load)
        if rank == 0:
            print(text, flush=True)
            if args.out:
                Path(args.out).write_text(text + "\n")
        bad = [r["feature"] for r in ctx.rows if not r["ok"]]
        assert not (args.quick and bad), f"ours and the peer computed different results: {bad}"
        return {"rows": ctx.rows, "markdown": text}
    finally:
        if own:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
