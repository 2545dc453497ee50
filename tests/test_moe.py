"""moe.py: the MoE block against transformers' Mixtral, Qwen3-MoE and OLMoE blocks, the grouped_mm
experts against the loop, the router losses against transformers' load_balancing_loss_func and the
formula, and expert parallelism at ep = 2 and 4 against the single process.

Tolerances (fp32). Outputs, router logits and input gradients are bit-equal to transformers' (the
same ops on the same rows). Weight gradients, and everything EP computes, sum per-token
contributions in another grouping (per expert block, per rank, then gloo's all-reduce): within 1e-6
of the reference's largest entry, a few fp32 roundings of sums of O(10) terms.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as ckpt

import moe
from dist import run_ranks

H, I, E, K = 16, 8, 8, 2


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> None:
    """|a - b| <= tol · max(1, max |b|): 1e-6 relative to the reference's scale."""
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    err = (a - b).abs().max().item() if b.numel() else 0.0
    assert a.shape == b.shape and err <= tol * scale, f"max err {err:.3g} at scale {scale:.3g}"


def hf_blocks():
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    common = dict(hidden_size=H, num_experts_per_tok=K)
    yield MixtralSparseMoeBlock, MixtralConfig(num_local_experts=E, intermediate_size=I, **common)
    for norm in (True, False):
        yield Qwen3MoeSparseMoeBlock, Qwen3MoeConfig(num_experts=E, moe_intermediate_size=I,
                                                     norm_topk_prob=norm, **common)
    yield OlmoeSparseMoeBlock, OlmoeConfig(num_experts=E, intermediate_size=I, **common)


def starve_last_experts(block: torch.nn.Module, x: torch.Tensor, n: int = 1) -> None:
    """Inputs x > 0 and router rows < 0 (the others > 0): the last n experts never make the top k."""
    with torch.no_grad():
        block.gate.weight.abs_()
        block.gate.weight[-n:].neg_()
    assert (x > 0).all()


def test_block_matches_hf() -> None:
    for cls, cfg in hf_blocks():
        cfg._experts_implementation = "eager"  # their reference loop
        torch.manual_seed(0)
        theirs = cls(cfg)
        for p in theirs.parameters():
            torch.nn.init.normal_(p, std=0.5)
        x = torch.rand(3, 5, H) + 0.1
        starve_last_experts(theirs, x)
        g = torch.randn(3, 5, H)
        for impl in ("grouped_mm", "loop"):
            ours = moe.MoE(moe.MoEConfig.from_hf(cfg, experts_impl=impl))
            ours.load_state_dict(theirs.state_dict())
            theirs.zero_grad(set_to_none=True)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ref_logits = theirs.gate(xa.view(-1, H))[0]
            _, _, chosen = theirs.gate(xa.view(-1, H))
            assert not (chosen == E - 1).any()  # an expert that receives no token
            ref = theirs(xa)
            with moe.record_router_logits(ours) as logits:
                out = ours(xb)
            assert torch.equal(out, ref) and torch.equal(logits[0], ref_logits), (cls, impl)
            ref.backward(g)
            out.backward(g)
            assert torch.equal(xb.grad, xa.grad)
            want = dict(theirs.named_parameters())
            for name, p in ours.named_parameters():
                close(p.grad, want[name].grad)
            assert not ours.experts.gate_up_proj.grad[-1].any()  # the starved expert: zero grad


def test_bf16_bit_equal_to_hf_grouped_mm() -> None:
    """bf16: the same ops in the same dtypes as transformers' grouped_mm experts path: bit-equal,
    which needs each family's dtype of the combine weights (fp32 for Mixtral only)."""
    for cls, cfg in hf_blocks():
        cfg._experts_implementation = "grouped_mm"
        torch.manual_seed(0)
        theirs = cls(cfg)
        for p in theirs.parameters():
            torch.nn.init.normal_(p, std=0.5)
        theirs.to(torch.bfloat16)
        ours = moe.MoE(moe.MoEConfig.from_hf(cfg)).to(torch.bfloat16)
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(3, 5, H, dtype=torch.bfloat16)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref, out = theirs(xa), ours(xb)
        g = torch.randn_like(ref)
        ref.backward(g)
        out.backward(g)
        assert torch.equal(out, ref) and torch.equal(xb.grad, xa.grad), cls
        want = dict(theirs.named_parameters())
        for name, p in ours.named_parameters():
            assert torch.equal(p.grad, want[name].grad), (cls, name)


def test_grouped_mm_equals_loop() -> None:
    torch.manual_seed(1)
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 4])  # two experts with no row
    x = torch.randn(int(counts.sum()), H)
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    g = torch.randn(x.shape[0], H)
    runs = []
    for fn, c in ((moe.experts_grouped, counts), (moe.experts_loop, counts.tolist())):
        for stride0 in (False, True):  # a real gradient, then .sum()'s expanded (stride-0) one
            ts = [t.clone().requires_grad_() for t in (x, gate_up, down)]
            y = fn(ts[0], c, ts[1], ts[2])
            (y.sum() if stride0 else (y * g).sum()).backward()
            runs.append([y] + [t.grad for t in ts])
    for grouped, loop in ((runs[0], runs[2]), (runs[1], runs[3])):  # per gradient kind
        for a, b in zip(grouped, loop):
            close(a, b)


def test_grouped_mm_predicate_and_errors() -> None:
    x = torch.randn(4, 16)
    assert moe.grouped_mm_runs(x, torch.randn(2, 8, 16))
    assert not moe.grouped_mm_runs(torch.randn(4, 3), torch.randn(2, 8, 3))  # 12-byte row stride
    assert moe.grouped_mm_runs(torch.randn(4, 16, device="meta"), torch.randn(2, 8, 16, device="meta"))
    block = moe.MoE(moe.MoEConfig(hidden=3, intermediate=5, num_experts=4, top_k=2,
                                  experts_impl="grouped_mm"))
    with pytest.raises(RuntimeError, match="grouped_mm has no kernel"):
        block(torch.randn(2, 3))
    auto = moe.MoE(moe.MoEConfig(hidden=3, intermediate=5, num_experts=4, top_k=2))
    auto.load_state_dict(block.state_dict())
    assert auto(torch.randn(2, 3)).shape == (2, 3)  # auto falls back to the loop
    with pytest.raises(ValueError, match="top_k"):
        moe.MoEConfig(hidden=3, intermediate=5, num_experts=4, top_k=5)
    groups = moe.EPGroups(ep=None, replica=None, ep_size=3, ep_rank=0)
    with pytest.raises(ValueError, match="must divide num_experts"):
        moe.shard_experts(block, groups)


def test_load_balancing_loss_matches_hf() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    torch.manual_seed(2)
    B, S, layers = 3, 5, 3
    logits = [torch.randn(B * S, E, requires_grad=True) for _ in range(layers)]
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, 3:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(logits), E, K, m)
        ref_grads = torch.autograd.grad(ref, logits)
        ours = moe.load_balancing_loss(logits, E, K, m)
        grads = torch.autograd.grad(ours, logits)
        close(ours, ref)
        for a, b in zip(grads, ref_grads):
            close(a, b)
    cfg = moe.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, aux_loss_coef=0.01,
                        z_loss_coef=1e-3)
    lb = load_balancing_loss_func(tuple(logits), E, K, mask)
    # z-loss by the formula, in float64: mean over the unpadded rows of all layers of lse²
    keep = mask.reshape(-1).bool()
    z = torch.cat([l.double().exp().sum(-1).log()[keep] ** 2 for l in logits]).mean()
    close(moe.router_loss(logits, cfg, mask), 0.01 * lb + 1e-3 * z.float())
    close(moe.router_z_loss(logits), torch.cat([l.double().logsumexp(-1) ** 2
                                                for l in logits]).mean().float())


def test_router_logits_once_under_checkpoint() -> None:
    torch.manual_seed(3)
    cfg = moe.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K, aux_loss_coef=0.1)
    model = torch.nn.Sequential(moe.MoE(cfg), moe.MoE(cfg))
    x, g = torch.randn(2, 6, H), torch.randn(2, 6, H)
    grads = []
    for recompute in (False, True):
        model.zero_grad(set_to_none=True)
        with moe.record_router_logits(model) as logits:
            h = x
            for block in model:
                h = ckpt.checkpoint(block, h, use_reentrant=False) if recompute else block(h)
            loss = (h * g).sum() + moe.router_loss(logits, cfg)
            assert len(logits) == 2
            loss.backward()  # the recompute runs the routers again, inside the recorder
            assert len(logits) == 2
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# --- expert parallelism: 4 gloo ranks, ep = 1, 2, 4 (ep = 2, 4 also through the loop experts) ---

EP_RUNS = ((1, "auto"), (2, "auto"), (4, "auto"), (2, "loop"), (4, "loop"))


def ep_data(world: int) -> tuple[moe.MoEConfig, dict, list[torch.Tensor], list[torch.Tensor]]:
    """One block's weights and each rank's own batch: uneven token counts per rank, positive
    inputs and the last two experts starved: at ep = 4 rank 3 receives no row at all."""
    torch.manual_seed(4)
    cfg = moe.MoEConfig(hidden=H, intermediate=I, num_experts=E, top_k=K)
    block = moe.MoE(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    xs = [torch.rand(2, 3 + r, H) + 0.1 for r in range(world)]
    starve_last_experts(block, xs[0], n=2)
    gs = [torch.randn_like(x) for x in xs]
    return cfg, block.state_dict(), xs, gs


@contextlib.contextmanager
def count_host_syncs():
    """Count the Python-level reads of a tensor's value on the host (each a sync on a GPU)."""
    calls = [0]
    names = ("item", "tolist", "__bool__", "__int__", "__float__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def counted(fn):
        def wrapper(self, *args, **kwargs):
            calls[0] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    for n, fn in saved.items():
        setattr(torch.Tensor, n, counted(fn))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def _full_ac_equal(block: moe.MoE, state: dict, groups: moe.EPGroups, x: torch.Tensor, g: torch.Tensor,
                   x_grad: torch.Tensor) -> None:
    """The block as a full-AC layer: no host sync in backward (the recompute included), and the
    gradients of the block run without AC, bit for bit."""
    import ac
    again = moe.MoE(block.cfg)
    again.load_state_dict(state)
    moe.shard_experts(again, groups)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([again])
    ac.apply_ac(model, "full", layers="layers")
    x = x.clone().requires_grad_()
    y = model.layers[0](x)
    with count_host_syncs() as backward_syncs:
        y.backward(g)
    assert backward_syncs[0] == 0
    assert torch.equal(x.grad, x_grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(again.parameters(), block.parameters()))


def _ep_rank(rank: int, world: int) -> list[dict]:
    cfg, state, xs, gs = ep_data(world)
    out = []
    for ep, impl in EP_RUNS:
        groups = moe.ep_groups(ep)
        block = moe.MoE(moe.MoEConfig(**{**cfg.__dict__, "experts_impl": impl}))
        block.load_state_dict(state)
        moe.shard_experts(block, groups)
        x = xs[rank].clone().requires_grad_()
        with count_host_syncs() as forward_syncs:
            y = block(x)
        with count_host_syncs() as backward_syncs:
            y.backward(gs[rank])
        # the docstring's count: one sync in forward (the exchanged counts, or the loop's counts),
        # none at ep = 1 through grouped_mm, none in any backward
        assert (forward_syncs[0], backward_syncs[0]) == (int(ep > 1 or impl == "loop"), 0)
        if ep > 1:  # full AC: its recompute reuses the forward's counts; the gradients bit for bit
            _full_ac_equal(block, state, groups, xs[rank], gs[rank], x.grad)
        group_of = moe.grad_reduce_plan(block, groups)
        for n, p in block.named_parameters():
            dist.all_reduce(p.grad, group=(group_of(n) or (None,))[0])
        if ep == 1:  # degree 1 is a no-op: bit-equal to the block never sharded
            plain = moe.MoE(block.cfg)
            plain.load_state_dict(state)
            assert torch.equal(plain(xs[rank]), y)
        out.append(dict(ep=ep, ep_rank=groups.ep_rank, y=y.detach(), x_grad=x.grad,
                        grads={n: p.grad for n, p in block.named_parameters()}))
    return out


def test_ep_matches_single_process() -> None:
    world = 4
    cfg, state, xs, gs = ep_data(world)
    ref = moe.MoE(cfg)
    ref.load_state_dict(state)
    x = torch.cat([x.reshape(-1, H) for x in xs]).requires_grad_()
    y = ref(x)
    y.backward(torch.cat([g.reshape(-1, H) for g in gs]))
    assert not ref.experts.down_proj.grad[-2:].any()  # the starved experts
    rows = [x.shape[0] * x.shape[1] for x in xs]
    y_ref, xg_ref = y.detach().split(rows), x.grad.split(rows)
    results = run_ranks(_ep_rank, world)
    for run in range(len(EP_RUNS)):
        per_rank = [r[run] for r in results]
        for rank, r in enumerate(per_rank):
            close(r["y"].reshape(-1, H), y_ref[rank])
            close(r["x_grad"].reshape(-1, H), xg_ref[rank])
            local = E // r["ep"]
            for name in ("experts.gate_up_proj", "experts.down_proj"):  # no 2x: equal to ep = 1
                full = dict(ref.named_parameters())[name].grad
                close(r["grads"][name], full[r["ep_rank"] * local:(r["ep_rank"] + 1) * local])
            close(r["grads"]["gate.weight"], ref.gate.weight.grad)
            # the router's gradient is the same on every rank, bit for bit
            assert torch.equal(r["grads"]["gate.weight"], per_rank[0]["grads"]["gate.weight"])


def test_idle_experts_get_zero_gradients_even_from_garbage():
    """moe._ZeroIdle: an expert with no rows gets a zero weight gradient even when the grouped GEMM's
    backward leaves its block uninitialized (pytorch #172439; NaN here). A multiply by the mask
    would keep the NaN; torch.where does not. The used experts' gradients pass unchanged."""
    w = torch.randn(3, 4, 2, requires_grad=True)
    counts = torch.tensor([2, 0, 5])
    garbage = torch.randn(3, 4, 2)
    garbage[1] = float("nan")
    moe._ZeroIdle.apply(w, counts).backward(garbage)
    assert torch.equal(w.grad[1], torch.zeros(4, 2))
    assert torch.equal(w.grad[0], garbage[0]) and torch.equal(w.grad[2], garbage[2])
