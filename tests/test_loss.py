"""The chunked lm_head + cross-entropy (loss.linear_cross_entropy, tp.vocab_parallel_linear_
cross_entropy) against the plain one: F.linear, then F.cross_entropy on fp32 logits.

Tolerances: fp32 1e-6 relative to the largest value (the blocks' log-sum-exp is merged online and
dL/dh is summed block by block: other rounding, measured <= 3e-7); bf16 2e-2 (the logits are the
same bf16 matmul rounded per block; dL/dh adds bf16 block products in fp32 where the plain backward
rounds one matmul: measured <= 4e-3). Memory: the peak of the chunked loss is at most the (T, H)
fp32 gradient of the hidden states, the (V, H) weight gradient and three (T, chunk) fp32 blocks;
the plain loss holds (T, V) fp32 logits and their gradient.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import memory as MEM
from loss import IGNORE_INDEX, cross_entropy, linear_cross_entropy
import tp as T
from dist import run_ranks


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def case(T_: int, H: int, V: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T_ // 2, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, V, (2, T_ // 2), generator=g)
    labels[0, :3] = IGNORE_INDEX  # ignored tokens: no loss, no gradient
    labels[1, 0], labels[1, 1] = 0, V - 1  # the first and last vocabulary row
    return h, w, labels


def plain(h, w, labels, reduction):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = cross_entropy(F.linear(h, w), labels, reduction)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), h.grad, w.grad


def chunked(h, w, labels, reduction, chunk):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, labels, reduction, chunk)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_equals_the_plain_loss(dtype, tol):
    h, w, labels = case(24, 16, 37, dtype)
    for reduction in ("sum", "mean", "none"):
        want = plain(h, w, labels, reduction)
        for chunk in (1, 5, 16, 36, 37, 100):  # one row, uneven blocks, exact fit, more than V
            got = chunked(h, w, labels, reduction, chunk)
            errs = [rel(a, b) for a, b in zip(got, want)]
            assert max(errs) <= tol, (reduction, chunk, errs)
            assert got[1][0, :3].abs().max() == 0  # ignored tokens get no gradient
    with pytest.raises(ValueError, match="reduction must be"):
        linear_cross_entropy(h, w, labels, "avg")


def test_memory_is_one_chunk_not_the_vocabulary():
    h, w, labels = case(512, 32, 4096, torch.float32)
    peaks = {}
    for name, fn in (("chunked", lambda: chunked(h, w, labels, "sum", 64)),
                     ("plain", lambda: plain(h, w, labels, "sum"))):
        gc.collect()
        meter = MEM.PeakMeter("cpu")
        meter.phase("base")
        meter.phase("loss")
        out = fn()
        meter.phase(None)
        meter.settle()
        peaks[name] = meter.peaks["loss"].allocated - meter.peaks["base"].allocated
        meter.close()
        del out
    T_, H, V, c = 512, 32, 4096, 64
    # the inputs' copies and grads (h, w twice), the fp32 (T, H) grad accumulator, 3 blocks, (T,) stats
    bound = 2 * 4 * (T_ * H + V * H) + 4 * T_ * H + 3 * 4 * T_ * c + 64 * T_
    assert peaks["chunked"] <= bound < 2 * 4 * T_ * V <= peaks["plain"], peaks


def _vocab_parallel(rank: int, world: int) -> dict:
    """tp=2 and tp=4 over vocabularies that need padding, one where a rank holds only padding."""
    out = {}
    for tp in (2, 4):
        group = dist.new_group(list(range(tp)))
        if rank >= tp:
            continue
        for V in (37, 5):  # 5 over tp=4: slices of 2, padded to 8, rank 3 holds rows 6-7 only
            h, w, labels = case(12, 8, V, torch.float32, seed=V)
            want = plain(h, w, labels, "sum")
            n = -(-V // tp)
            local = F.pad(w, (0, 0, 0, n * tp - V))[rank * n:(rank + 1) * n].clone().requires_grad_()
            x = h.clone().requires_grad_()
            for sp in (False, True):
                x.grad, local.grad = None, None
                loss = T.vocab_parallel_linear_cross_entropy(x, local, labels, "sum", group=group,
                                                             vocab_size=V, sequence_parallel=sp, chunk=3)
                loss.backward()
                gx = x.grad.clone()
                if sp:  # the final norm's gather would sum dL/dh over tp; here: by hand
                    dist.all_reduce(gx, group=group)
                gw = F.pad(want[2], (0, 0, 0, n * tp - V))[rank * n:(rank + 1) * n]
                pad_only = gw.abs().max() == 0  # a rank holding only padding: its grad must be 0
                out[tp, V, sp] = (rel(loss.detach(), want[0]), rel(gx, want[1]),
                                  local.grad.abs().max().item() if pad_only else rel(local.grad, gw))
    return out


def test_vocab_parallel_equals_the_plain_loss():
    for out in run_ranks(_vocab_parallel, 4):
        for key, errs in out.items():
            assert max(errs) <= 1e-6, (key, errs)
