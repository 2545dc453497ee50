"""The textbook algorithms (tp.tp_mlp, zero.zero1_step, pp_schedules.textbook_1f1b) equal the production paths.

- 1F1B (pure Python): pp_schedules.textbook_1f1b (what 1f1b runs at v = 1) equals the general order
  it stands for, and the compute order of zb with its Ws left out (messages left out).
- TP pair and ZeRO-1 step: one launch of 2 gloo ranks (fp32). Both are bit-identical to production:
  the same products, 2-rank sums are a+b in any order, and AdamW is elementwise (no weight decay and
  no clipping here: the textbook step has one group and no norm). Each is also checked against the
  single process (TP, 1e-5 relative: the sum over ranks reorders the matmul's additions).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import model as M
import pp_schedules as S
import precision as P
import tp as TP
import weights as W
import zero as Z
from dist import run_ranks

CFG = M.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32)
LR, STEPS = 1e-2, 3


def test_textbook_1f1b_equals_the_general_schedule():
    """Warm-up / steady / cool-down, for m below, at and above p."""
    for p in (1, 2, 3, 4, 8):
        for m in (1, 2, p, p + 1, 2 * p, 3 * p + 1):
            for s in range(p):
                textbook = S.textbook_1f1b(m, s, p)
                assert S._one_f_one_b_order(m, s, p, 1, split=False) == textbook, (m, s, p)
                for sched in (S.one_f_one_b(m, s, p), S.zero_bubble(m, s, p)):
                    acts = [a for a in sched if isinstance(a, S.Action) and a.kind != S.W]
                    assert acts == textbook, (m, s, p)


def _tp_pair(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    H, I = 8, 16
    x0, w1, w2 = torch.randn(3, 5, H, generator=g), torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)
    rows = slice(rank * I // world, (rank + 1) * I // world)
    # textbook
    x, a, b = x0.clone().requires_grad_(), w1[rows].clone().requires_grad_(), w2[:, rows].clone().requires_grad_()
    y = TP.tp_mlp(x, a, b)
    y.square().sum().backward()
    # production
    col, row = TP.ColumnParallelLinear(H, I, False, None), TP.RowParallelLinear(I, H, False, None)
    with torch.no_grad():
        col.weight.copy_(w1[rows])
        row.weight.copy_(w2[:, rows])
    xp = x0.clone().requires_grad_()
    yp = row(F.silu(col(xp)))
    yp.square().sum().backward()
    # single process
    xr, ar, br = x0.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    yr = F.silu(xr @ ar.T) @ br.T
    yr.square().sum().backward()
    rel = lambda u, v: float((u - v).abs().max() / v.abs().max())  # noqa: E731
    return {"same": [torch.equal(y, yp), torch.equal(x.grad, xp.grad), torch.equal(a.grad, col.weight.grad),
                     torch.equal(b.grad, row.weight.grad)],
            "vs_one": max(rel(y, yr), rel(x.grad, xr.grad), rel(a.grad, ar.grad[rows]),
                          rel(b.grad, br.grad[:, rows]))}


def _zero1(rank: int, world: int) -> list[bool]:
    cfg = P.OptimConfig(lr=LR, weight_decay=0.0, clip=0.0)
    ours, prod = W.materialize(M.build(CFG), "cpu", seed=0), W.materialize(M.build(CFG), "cpu", seed=0)
    params = list(ours.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # (Ψ,)
    S_ = -(-flat.numel() // world)
    flat = F.pad(flat, (0, S_ * world - flat.numel()))  # (n·S,)
    master = flat[rank * S_:(rank + 1) * S_].clone().requires_grad_()  # (S,) this rank's fp32 slice
    adam = torch.optim.AdamW([master], lr=LR, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.0)
    opt = Z.apply_zero_0_to_2(prod, 1, None, cfg, torch.float32, bucket_mb=0.002)  # several buckets
    g = torch.Generator().manual_seed(100 + rank)  # every dp rank its own rows
    for _ in range(STEPS):
        ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=g)
        for m in (ours, prod):
            (m(ids, labels=ids, reduction="sum") / 48).backward()
        Z.zero1_step(params, master, adam)
        for p in params:
            p.grad = None
        opt.step(LR)
    opt.finish_gathers()
    init = W.materialize(M.build(CFG), "cpu", seed=0).parameters()
    moved = all(not torch.equal(a, b) for a, b in zip(params, init))  # the comparison is not vacuous
    same = [torch.equal(a, b) for a, b in zip(params, prod.parameters())]
    opt.teardown()
    return same + [moved]


def _both(rank: int, world: int) -> dict:
    return {"tp": _tp_pair(rank, world), "zero1": _zero1(rank, world)}


def test_textbook_tp_pair_and_zero1_step_equal_production():
    for r in run_ranks(_both, 2, timeout=120):
        assert all(r["tp"]["same"]), r["tp"]
        assert r["tp"]["vs_one"] <= 1e-5, r["tp"]
        assert len(r["zero1"]) > 0 and all(r["zero1"]), r["zero1"]
