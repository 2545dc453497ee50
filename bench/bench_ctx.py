"""bench.py's shared context: what every section reads (arguments, config, this rank, the global
batches) and the means to time, check and report — the alternating race, the ours-vs-peer rows, the
peers' optimizer. bench.py, bench_theory.py and bench_mfu.py import it; it imports none of them.

Run
    torchrun --nproc_per_node 4 -m bench.bench --model tiny --steps 40

Builds on: model.py, precision.py, weights.py
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import model as M
import precision as P
import weights as W

TOL = 1e-5  # fp32, relative (GUIDE); the bf16 MFU row states its own
CHECKED = 3  # steps whose losses must agree (see Ctx.add_row)
Side = Callable[[int], tuple[torch.Tensor, float]]  # step i → (loss, grad norm)


# ------------------------------------------------------------------------------------- measuring
def md_row(cells: list) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


@dataclass
class Ctx:
    """What every section reads (arguments, config, this rank, the global batches) and the means to
    time, check and report (bench_theory.py and bench_mfu.py use it too)."""
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
        if title not in self.tables:
            self.tables[title] = ([note, ""] if note else []) + [md_row(header), "|---" * len(header) + "|"]
        self.tables[title] += map(md_row, rows)

    def batch(self, i: int, parts: int = 1, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and (shifted) labels of part `part` of `parts` of global batch i."""
        rows = self.data[i % len(self.data)].chunk(parts)[part]  # (B/parts, S+1)
        return rows[:, :-1], rows[:, 1:]

    def fresh(self, edit: Callable[[M.Llama], M.Llama] = lambda m: m) -> M.Llama:
        """The model from the seed; `edit` runs on the meta-device model first (a pipeline split)."""
        return W.materialize(edit(M.build(self.cfg)), self.device, seed=self.args.seed)

    def race(self, sides: dict[str, Side], loss_from: int | None = None,
             distributed: bool = True) -> dict[str, tuple[float, list]]:
        """Alternate the sides' steps; {side: (median ms after warm-up, per step [loss, grad norm])}.
        Times: max over ranks. Losses (and norms alike): summed over ranks, or those of rank loss_from."""
        n, names = self.args.warmup + self.args.steps, list(sides)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else lambda: None
        times = torch.zeros(len(names), n, dtype=torch.float64)
        losses = torch.zeros(len(names), n, 2, dtype=torch.float64)
        for i in range(n):
            for j in (range(len(names)) if i % 2 == 0 else reversed(range(len(names)))):
                if distributed:
                    dist.barrier()
                sync()
                t0 = time.perf_counter()
                loss, norm = sides[names[j]](i)
                sync()
                times[j, i] = time.perf_counter() - t0
                losses[j, i] = torch.tensor([float(loss), norm])
        if distributed:  # on the data device: NCCL reduces no CPU tensors
            times, losses = times.to(self.device), losses.to(self.device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            dist.all_reduce(losses) if loss_from is None else dist.broadcast(losses, src=loss_from)
        return {s: (1e3 * statistics.median(times[j, self.args.warmup:].tolist()), losses[j].tolist())
                for j, s in enumerate(names)}

    def add_row(self, feature: str, ours: str, peer: str, a: tuple, b: tuple, tol: float = TOL) -> None:
        """Same result: the grad norm of the first step, where both sides hold the same weights (AdamW's
        m/sqrt(v) hides a wrongly scaled gradient from the loss, not from the norm), and the losses of
        the first CHECKED steps (two updates). Later steps are shown, not checked: training amplifies
        the last-bit differences of summation order (dp vs DDP: 2e-8 after 3 steps, 3e-5 after 63; the
        norm drifts faster still: TP 4e-5 after 10 steps, the one-process run between the two sides)."""
        rel = lambda x, y: abs(x - y) / max(abs(y), 1e-12)  # noqa: E731
        errs = [rel(u[0], v[0]) for u, v in zip(a[1], b[1])]
        loss_err, norm_err = max(errs[:CHECKED]), rel(a[1][0][1], b[1][0][1])
        self.rows.append(dict(feature=feature, ours=ours, peer=peer, ours_ms=a[0], peer_ms=b[0],
                              ratio=a[0] / b[0], loss_ours=a[1][-1][0], loss_peer=b[1][-1][0],
                              loss_err=loss_err, norm_err=norm_err, drift=errs[-1],
                              ok=max(loss_err, norm_err) <= tol, tol=tol))


def adamw(model: torch.nn.Module, ocfg: P.OptimConfig, cls: type = torch.optim.AdamW, **kw):
    """The peers' optimizer: torch's AdamW with our decay groups and hyper-parameters (fused on
    CUDA, as precision.py's: the same update kernel on both sides)."""
    named = list(model.named_parameters())
    kw.setdefault("fused", named[0][1].is_cuda or None)
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
        x, y = ctx.batch(i, parts, part)
        with context():
            loss = P.normalized_loss(model(x, labels=y, reduction="sum"), ctx.targets)
            (loss * scale).backward()
        norm, loss = update(), loss.detach()
        return (loss.to_local() if isinstance(loss, DTensor) else loss), norm
    return step
