"""precision.py against plain PyTorch: torch.optim.AdamW, clip_grad_norm_, and the fp32 run."""
import math

import torch

import model as M
import precision as P
import weights as W

CFG = M.PRESETS["tiny"]


def fresh(seed: int = 1) -> M.Llama:
    return W.materialize(M.build(CFG), "cpu", seed=seed)


def batch(seed: int, rows: int = 4, seq: int = 33) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(seed))


def plain_adamw(m: M.Llama, lr: float) -> torch.optim.AdamW:
    named = list(m.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in named if p.ndim >= 2], "weight_decay": 0.1},
         {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8)


def test_fp32_is_bit_identical_to_plain_adamw():
    ours, ref = fresh(), fresh()
    opt = P.MixedPrecisionOptimizer(ours.named_parameters(), P.OptimConfig(clip=0.0))
    ref_opt = plain_adamw(ref, 3e-4)
    for step in range(5):
        x = batch(step)
        a = ours(x[:, :-1], labels=x[:, 1:])
        a.backward()
        opt.step(3e-4)
        b = ref(x[:, :-1], labels=x[:, 1:])
        b.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert a.item() == b.item()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_clipping_matches_torch_clip_grad_norm():
    """Same gradients, same clip: our fp32 sum-of-squares norm vs torch's norm of per-tensor norms
    (a different summation order, so ≤1e-6 relative rather than bit-exact)."""
    ours, ref = fresh(), fresh()
    x = batch(7)
    ours(x[:, :-1], labels=x[:, 1:]).backward()
    ref(x[:, :-1], labels=x[:, 1:]).backward()
    opt = P.MixedPrecisionOptimizer(ours.named_parameters(), P.OptimConfig(clip=0.05))
    norm = opt.grad_norm(opt._master_grads())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert abs(norm.item() - ref_norm.item()) <= 1e-6 * ref_norm.item()
    assert ref_norm.item() > 0.05  # so the clip below really scales
    ref_opt = plain_adamw(ref, 1e-3)
    ref_opt.step()
    opt.step(1e-3)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-6


def test_bf16_with_fp32_master_tracks_fp32():
    """20 steps: bf16 compute rounds activations to 8 mantissa bits, so the loss curves agree to a
    few 1e-3 relative; without fp32 masters the tiny lr below would be lost to rounding entirely."""
    f32, b16 = fresh(), fresh()
    o32 = P.MixedPrecisionOptimizer(f32.named_parameters(), P.OptimConfig(lr=2e-3))
    o16 = P.MixedPrecisionOptimizer(b16.named_parameters(), P.OptimConfig(lr=2e-3), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in b16.parameters())
    assert all(m.dtype == torch.float32 for m in o16.master)
    x = batch(3)  # the same batch every step: an adversarial curve that must keep falling
    for _ in range(20):
        l32 = f32(x[:, :-1], labels=x[:, 1:])
        l32.backward()
        o32.step(2e-3)
        l16 = b16(x[:, :-1], labels=x[:, 1:])
        l16.backward()
        o16.step(2e-3)
        assert abs(l16.item() - l32.item()) <= 1e-2 * l32.item()
    assert l32.item() < 4.0  # it learned (start ≈ ln 260 = 5.56): the comparison is not vacuous
    # fp32 masters keep an update far below bf16's resolution at 1.0 (2^-8)
    w = torch.nn.Parameter(torch.ones(4, 4))
    tiny = P.MixedPrecisionOptimizer([("w", w)], P.OptimConfig(weight_decay=0.0, clip=0.0), torch.bfloat16)
    for _ in range(3):
        w.grad = torch.ones(4, 4, dtype=torch.bfloat16)
        tiny.step(1e-4)
    assert tiny.master[0].sub(1.0).abs().max().item() > 2e-4 and torch.equal(w, torch.ones_like(w))


def test_micro_batches_equal_one_batch_with_uneven_masks():
    """The sum-of-token-losses / step-target-count rule: 4 micro-batches with very different numbers
    of targets give the gradient of one big batch (≤1e-6: only the fp32 summation order differs).
    The 2024 bug (mean of micro-batch means) would differ by far more — checked too."""
    x = batch(9, rows=4, seq=33)
    labels = x[:, 1:].clone()
    labels[0, :30] = -100  # 2 targets
    labels[1, :] = -100  # none at all
    labels[2, ::2] = -100  # half
    whole, micro = fresh(), fresh()
    whole(x[:, :-1], labels=labels).backward()
    total = P.count_targets(labels)
    losses = []
    for i in range(4):
        s = micro(x[i:i + 1, :-1], labels=labels[i:i + 1], reduction="sum")
        loss = P.normalized_loss(s, total)
        loss.backward()
        losses.append(loss.item())
    ref = whole(x[:, :-1], labels=labels).item()
    assert abs(sum(losses) - ref) <= 1e-6 * ref
    for (n, p), q in zip(whole.named_parameters(), micro.parameters()):
        scale = p.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= 1e-6 * scale + 1e-12, n
    means = [micro(x[i:i + 1, :-1], labels=labels[i:i + 1]).item() for i in (0, 2, 3)]
    assert abs(sum(means) / 3 - ref) > 1e-3  # the wrong rule is measurably wrong here


def test_non_finite_grad_norm_skips_the_step():
    m = fresh()
    opt = P.MixedPrecisionOptimizer(m.named_parameters(), P.OptimConfig())
    before = [p.detach().clone() for p in m.parameters()]
    x = batch(1)
    (m(x[:, :-1], labels=x[:, 1:]) * float("nan")).backward()
    assert math.isnan(opt.step(1e-3))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert all(p.grad is None for p in m.parameters())
    assert not opt.optimizer.state  # AdamW never ran: no moments, step count untouched
