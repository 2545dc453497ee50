"""The loss without (T, V) logits: lm_head and the token cross-entropy, vocabulary block by block.

What it does
    `linear_cross_entropy(hidden, weight, labels, reduction)` is model.py's default `loss_fn`.
    It is hidden @ weight.T and the fp32 cross-entropy (-100 ignored), in one autograd node.
    That node never makes the (T, V) logits. It cuts the vocabulary into blocks of `chunk` rows.
    Forward merges the blocks per token, as flash attention merges keys (`chunk_stats`).
    It keeps a running max, the sum of exps rescaled to it, and the target's logit.
    Only one (T, chunk) block of fp32 logits lives at a time.
    Backward (`chunk_grads`) recomputes each block: dL/dlogits = (softmax − one-hot)·g.
    It turns that at once into the block's share of dL/dh and its rows of dL/dW.

Vocab-parallel (tp.py's loss_fn)
    A rank holds rows [start, start + n) of the padded head and runs the same blocks over them.
    Padding rows (ids >= vocab_size) get -inf: they carry no mass.
    `VocabParallelLinearCrossEntropy` then merges the ranks as the blocks were merged.
    That takes three all-reduces of (T,): the max, the rescaled sum of exps, the target logit.
    Backward recomputes the rank's blocks with no communication.
    tp.py sums the partial dL/dh over tp (copy_to_region, or sp's reduce-scatter).
    `cross_entropy` and `vocab_parallel_cross_entropy` take logits that a caller already holds.

Why
    (T, V) fp32 logits are the largest activation of a Llama step: 4·V bytes per token.
    At V = 128256 (the `1b` preset) that is 501 KiB; the fp32 hidden state (H = 2048) is 8 KiB.
    The plain loss holds the logits and their gradient at once.
    Here the peak is the fp32 (T, H) gradient of the hidden states, the (V, H) weight gradient,
    and three (T, chunk) fp32 blocks. By default a block is as large as the fp32 hidden states.
    tests/test_loss.py measures the peak under that bound, and the plain loss above 2·4·T·V bytes.
    The price: backward recomputes the blocks, one more head matmul per pass.

Reference
    Milakov & Gimelshein 2018, "Online normalizer calculation for softmax" (the merge). Wijmans
    et al. 2024, "Cut Your Losses". Shoeybi et al. 2019, "Megatron-LM" (the vocab-parallel loss).

Run
    torchrun --nproc_per_node 1 train.py --model tiny --steps 20
    torchrun --nproc_per_node 2 train.py --model tiny --tp 2 --steps 20   # vocab-parallel

Builds on: ops.py (wanted_grads)

Invariants (tests/test_loss.py)
    - Labels are already shifted (labels[t] is the token after input[t]). -100 counts nothing.
    - Reductions: 'sum' (training; precision.normalized_loss divides), 'mean' over targets, 'none'.
    - Rounding follows the unchunked loss. A block's logits are the matmul upcast to fp32 (as HF).
      dL/dh is summed in fp32 and rounded once. dL/dW's rows are one matmul over all tokens.
      So fp32 equals F.linear + F.cross_entropy within 1e-6.
    - Backward computes only what `ops.wanted_grads` says the engine will use.
      pp.py's zero-bubble split runs B (dL/dh) now and W (dL/dW) later; each pass recomputes.
      The last stage then holds no (T, V) gradient, and no block, from B to W.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ops import wanted_grads

IGNORE_INDEX = -100
Group = dist.ProcessGroup | None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Token cross-entropy of given logits in fp32, ignoring -100.

    It is for callers that hold logits. The model's own loss, `linear_cross_entropy`, never makes them."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


def block_logits(h: torch.Tensor, weight: torch.Tensor, v0: int, chunk: int, start: int = 0,
                 vocab_size: int | None = None) -> torch.Tensor:
    """fp32 logits of vocabulary rows [v0, v0 + chunk) of `weight` for tokens h (T, H): (T, c).

    The rows hold global ids start + v0 onward. Ids >= vocab_size are tp.py's padding: -inf."""
    z = F.linear(h, weight[v0:v0 + chunk]).float()  # (T, c) in the compute dtype, then fp32 (as HF)
    if vocab_size is not None and start + v0 + z.shape[1] > vocab_size:
        z[:, max(vocab_size - start - v0, 0):] = float("-inf")
    return z


def chunk_stats(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, start: int = 0,
                vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token, over this weight's vocabulary: (m, s, target logit), each fp32 (T,).

    m is the max logit and s the sum of exp(logit − m): an online log-sum-exp, block by block.
    The target's logit is 0 where the target is not in this weight's rows.
    One (T, chunk) block of logits lives at a time."""
    T, c0 = h.shape[0], min(chunk, weight.shape[0])
    m = torch.full((T,), float("-inf"), device=h.device)
    s = torch.zeros(T, device=h.device)
    target = torch.zeros(T, device=h.device)
    for v0 in range(0, weight.shape[0], c0):
        z = block_logits(h, weight, v0, c0, start, vocab_size)  # (T, c)
        col = labels - (start + v0)  # (T,) the target's column in this block, if it is here
        here = (col >= 0) & (col < z.shape[1])
        target += z.gather(1, col.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1).masked_fill(~here, 0.0)
        new = torch.maximum(m, z.max(dim=-1).values)  # (T,)
        safe = new.nan_to_num(neginf=0.0)  # a row that met only padding so far: -inf - -inf is nan
        s = s * torch.exp(m - safe) + z.sub_(safe[:, None]).exp_().sum(dim=-1)
        m = new
    return m, s, target


def chunk_grads(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
                g: torch.Tensor, chunk: int, start: int = 0, vocab_size: int | None = None,
                want: tuple[bool, bool] = (True, True)) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Backward of loss_t = lse_t − logit_t(target), scaled by g (T,).

    Each block's logits are recomputed, and dL/dlogits = (softmax − one-hot)·g.
    Returns dL/dh (T, H), summed in fp32 over the blocks, and dL/dweight (n, H).
    Each block's rows of dL/dweight are one matmul over all tokens, rounded once.
    Each is computed only if `want`ed. A pipeline's B pass wants dL/dh; its W pass wants dL/dW."""
    c0 = min(chunk, weight.shape[0])
    gh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if want[0] else None  # (T, H)
    gw = torch.empty_like(weight) if want[1] else None  # (n, H)
    for v0 in range(0, weight.shape[0], c0):
        z = block_logits(h, weight, v0, c0, start, vocab_size)  # (T, c)
        z.sub_(lse[:, None]).exp_().mul_(g[:, None])  # softmax · g (padding: 0)
        col = labels - (start + v0)
        here = (col >= 0) & (col < z.shape[1])
        z.scatter_add_(1, col.clamp(0, z.shape[1] - 1)[:, None], (-g).masked_fill(~here, 0.0)[:, None])
        dz = z.to(h.dtype)  # (T, c)
        if gw is not None:
            torch.mm(dz.t(), h, out=gw[v0:v0 + z.shape[1]])  # (c, H)
        if gh is not None:
            gh += dz @ weight[v0:v0 + z.shape[1]]  # (T, H)
    return gh, gw


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of h @ weight.T over the whole vocabulary: (T, H) → (T,).

    It holds (T, chunk) blocks of fp32 logits only. Backward recomputes each block.
    That costs one more head matmul per pass. A zero-bubble pipeline's B and W each pay it."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
        m, s, target = chunk_stats(h, weight, labels, chunk)
        lse = m + s.log()  # (T,) log Σ exp(logits)
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.chunk = chunk
        return (lse - target).masked_fill(labels == IGNORE_INDEX, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
        h, weight, labels, lse = ctx.saved_tensors
        g = grad_loss.float().masked_fill(labels == IGNORE_INDEX, 0.0)  # (T,) ignored: no gradient
        gh, gw = chunk_grads(h, weight, labels, lse, g, ctx.chunk, want=wanted_grads(ctx, 2))
        return None if gh is None else gh.to(h.dtype), gw, None, None


def reduce_loss(loss: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    """Per-token losses (T,) → 'none' (T,), 'sum', or 'mean' over the targets.

    Training uses 'sum': precision.normalized_loss divides by the step's target count."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / (labels != IGNORE_INDEX).sum()


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         reduction: str = "mean", chunk: int | None = None) -> torch.Tensor:
    """lm_head and the token cross-entropy in fp32 (-100 ignored), without (T, V) logits.

    hidden is (..., H), weight (V, H), and labels (...) are aligned with hidden.
    The vocabulary is cut into blocks of `chunk` rows. The default is the hidden size.
    Then a block of fp32 logits is as large as the fp32 hidden states.
    Why cut the vocabulary, not the tokens? Each block's weight gradient is then one matmul.
    It is rounded once, as in the unchunked loss. Token chunks would add up bf16 gradients."""
    H = hidden.shape[-1]
    loss = LinearCrossEntropy.apply(hidden.reshape(-1, H), weight, labels.reshape(-1), chunk or H)
    return reduce_loss(loss, labels, reduction)


# --------------------------------------------------------------------------------- vocab-parallel
class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of vocab-sharded logits: (T, n) → (T,).

    Forward all-reduces three numbers per token: the row max, the target logit, the sum of exps.
    Backward is softmax − one-hot on this rank's slice, with no communication."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group: Group,
                vocab_size: int) -> torch.Tensor:
        n = logits.shape[-1]
        start = dist.get_rank(group) * n  # this rank's vocab columns: [start, start+n)
        cols = torch.arange(start, start + n, device=logits.device)
        x = logits.float().masked_fill(cols >= vocab_size, float("-inf"))  # (T, n) padding: no mass
        row_max = x.max(dim=-1).values  # (T,)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x -= row_max[:, None]  # (T, n) shifted logits, all <= 0: exp cannot overflow
        target = labels - start  # (T,) column of the target, if this rank holds it (-100 never does)
        mine = (target >= 0) & (target < n)
        target = target.masked_fill(~mine, 0)
        target_logit = x.gather(1, target[:, None]).squeeze(1).masked_fill(~mine, 0.0)  # (T,)
        dist.all_reduce(target_logit, group=group)  # only the owning rank adds a nonzero value
        x.exp_()  # (T, n)
        sum_exp = x.sum(dim=-1)  # (T,)
        dist.all_reduce(sum_exp, group=group)
        valid = labels != IGNORE_INDEX
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)  # (T,) log Σexp − target
        x /= sum_exp[:, None]  # (T, n) softmax slice: all backward needs
        ctx.save_for_backward(x, target, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, target, mine, valid = ctx.saved_tensors
        g = grad_loss.float() * valid  # (T,) ignored tokens get no gradient
        grad = softmax * g[:, None]  # (T, n)
        grad.scatter_add_(1, target[:, None], (-g * mine)[:, None])  # − one-hot, on the owning rank
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                                 *, group: Group, vocab_size: int) -> torch.Tensor:
    """`cross_entropy` for logits (..., n) split over the vocab, for callers that hold them.

    The model's own loss never makes them (tp.vocab_parallel_linear_cross_entropy).
    fp32, -100 ignored. reduction: 'sum' (training), 'mean' or 'none'."""
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    loss = VocabParallelCrossEntropy.apply(logits.flatten(0, -2), labels.flatten(), group, vocab_size)
    return reduce_loss(loss, labels, reduction)


class VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of h @ W_r.T: (T, H) → (T,).

    W_r (n, H) is this rank's rows of the padded head. Each rank merges its blocks (chunk_stats).
    Then three all-reduces of (T,) merge the ranks: the max, the rescaled sum of exps, the target logit.
    Backward recomputes this rank's blocks (chunk_grads). It returns dL/dW_r and a partial dL/dh.
    The caller sums that dL/dh over tp."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group: Group,
                vocab_size: int, chunk: int) -> torch.Tensor:
        start = dist.get_rank(group) * weight.shape[0]  # this rank's global vocab ids start here
        m, s, target = chunk_stats(h, weight, labels, chunk, start, vocab_size)  # (T,) each
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        s *= torch.exp(m - top)  # a rank holding only padding has m = -inf: adds 0
        dist.all_reduce(s, group=group)
        dist.all_reduce(target, group=group)  # only the owning rank adds a nonzero value
        lse = top + s.log()  # (T,)
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.chunk, ctx.start, ctx.vocab_size = chunk, start, vocab_size
        return (lse - target).masked_fill(labels == IGNORE_INDEX, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple:
        h, weight, labels, lse = ctx.saved_tensors
        g = grad_loss.float().masked_fill(labels == IGNORE_INDEX, 0.0)
        gh, gw = chunk_grads(h, weight, labels, lse, g, ctx.chunk, ctx.start, ctx.vocab_size,
                             want=wanted_grads(ctx, 2))
        return None if gh is None else gh.to(h.dtype), gw, None, None, None, None
