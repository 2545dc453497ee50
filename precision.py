"""Mixed precision: bf16 compute parameters, fp32 master weights owned by AdamW, clipping, the step.

What it does
    `MixedPrecisionOptimizer` keeps an fp32 master copy of every compute parameter.
    It upcasts the (bf16) gradients into it and clips by the global L2 norm, in fp32.
    Then it runs AdamW on the masters and copies them back into the compute parameters.
    In fp32 mode the masters *are* the parameters.
    Then the step is exactly `torch.optim.AdamW`: bit-identical to a plain loop, fused on CUDA.
    `normalized_loss` is the project's one loss rule.
    The step's loss is the sum of its token losses over its number of target tokens.
    It is never a mean of micro-batch means.
    That mean over-weights micro-batches with few targets (the 2024 gradient-accumulation bug).

Reference
    Micikevicius et al. 2018 (mixed precision training); Loshchilov & Hutter 2019 (AdamW).

Run
    torchrun --nproc_per_node 1 train.py --dtype bf16 --clip 1.0

Invariants
    - AdamW only ever sees fp32 masters. In bf16, 1.0 - 1e-6 == 1.0: small updates would vanish.
    - No whole-model temporary in the step. The norm reads the gradients in slices.
      Each slice holds at most STEP_CHUNK_BYTES of fp32.
      Gradients held in bf16 are upcast and applied chunk by chunk.
      AdamW is elementwise, so chunk by chunk is bit-identical to one call.
      An fp32 gradient is used as it is, in one call.
    - So a step's extra memory is one chunk of fp32 gradients, plus AdamW's own temporaries.
      On CPU the norm's foreach kernels upcast tensor by tensor: one slice of one gradient.
      AdamW's temporaries: none with `fused=True` (CUDA), a few of one parameter on CPU.
      The CPU default is kept: it is the plain loop.
      And unlike CPU's fused kernel, it gives the same bits however ZeRO cuts a parameter.
    - No kernel per parameter on CUDA. The norm is one `torch._foreach_norm` over all slices.
      The clip is one `_foreach_mul_` per chunk. AdamW is one fused kernel per chunk.
      The publish is one `_foreach_copy_`.
      A Python loop per parameter remains for `.grad` (torch.optim's interface).
      The bf16 gradients (`--reduce-dtype bf16`) are also upcast one by one.
    - The grad norm counts every gradient element of the model exactly once.
      Sharded pieces are summed over `norm_groups`: tp, pp, and dp when gradients are dp-sharded.
      A rank whose replica another rank already counts passes `counted(name) = False` for it.
    - A non-finite grad norm skips the whole step. No parameter or optimizer state changes.

The seam zero.py uses (ZeRO must not edit this file). A subclass overrides three methods:
    `_make_master()`   which fp32 tensors AdamW owns: whole params here, flat dp shards in ZeRO.
    `_master_grads()`  their gradients, in the dtype they are held in. step() upcasts them by chunks.
                       Here they are .grad; in ZeRO fp32 main grads or reduce-scattered shards.
    `_publish()`       master → compute params: a copy here, an all-gather in ZeRO.
    It passes its dp group in `norm_groups` when gradients are sharded.
The update-rule seam, `rule=` (an `UpdateRule`), says what steps the masters: AdamW, or muon.py's Muon.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
STEP_CHUNK_BYTES = 64 * 2**20  # fp32 gradient bytes upcast (and squared, for the norm) at a time


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip: float = 1.0  # max global grad norm; 0 disables clipping


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay on matrices (projections, embeddings), not on norms or biases."""
    return param.ndim >= 2


def count_targets(labels: torch.Tensor) -> torch.Tensor:
    """Number of tokens that carry a loss (labels != -100), as a tensor for all_reduce."""
    return (labels != IGNORE_INDEX).sum()


def normalized_loss(loss_sum: torch.Tensor, step_targets: torch.Tensor | int) -> torch.Tensor:
    """A micro-batch's summed token loss over the target count of the whole optimizer step.
    That count covers all micro-batches and all dp ranks.
    So backward of these pieces adds up to the gradient of the global batch's mean token loss.
    That holds whatever the micro-batch and dp split.
    A tensor count stays on its device (no host sync). The quotient has the int's bits."""
    if isinstance(step_targets, torch.Tensor):
        return loss_sum / step_targets.clamp(min=1)
    return loss_sum / max(int(step_targets), 1)


def use_fused_adamw(t: torch.Tensor) -> bool:
    """AdamW's fused kernel on CUDA: one launch per chunk, no temporaries.
    Elsewhere the CPU default loop (module docstring).
    A predicate, so that tests/cuda_contract.py can point it at meta."""
    return t.is_cuda


class UpdateRule(Protocol):
    """The update-rule seam: what turns the clipped fp32 gradients into new fp32 masters.
    `build(opt)` returns an optimizer over opt.master: torch's step(), param_groups, state and defaults.
    Its `state[master]` is what checkpoints save.
    step() sets each of its param groups' "lr", sets the masters' .grad, then calls its step().
    `elementwise`: that step may run chunk by chunk (AdamW). Else it runs once, over every master."""
    elementwise: bool

    def build(self, opt: "MixedPrecisionOptimizer") -> torch.optim.Optimizer: ...


class AdamWRule:
    """The default rule: AdamW, with decay on the matrices only (`decays`)."""
    elementwise = True

    def build(self, opt: "MixedPrecisionOptimizer") -> torch.optim.Optimizer:
        decay = [m for m, n, p in zip(opt.master, opt.names, opt.params) if decays(n, p)]
        rest = [m for m, n, p in zip(opt.master, opt.names, opt.params) if not decays(n, p)]
        fused = bool(opt.master) and use_fused_adamw(opt.master[0])  # one kernel, no temporaries
        cfg = opt.cfg
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)


class MixedPrecisionOptimizer:
    """fp32-master AdamW (or `rule`'s optimizer) over `named_params` (name → compute parameter, each once).

    The parameters must hold their fp32 initial values when this is built.
    The masters are taken from them. Then the parameters are cast to `dtype` in place."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig,
                 dtype: torch.dtype = torch.float32, norm_groups: Iterable[dist.ProcessGroup] = (),
                 counted: Callable[[str], bool] = lambda name: True, rule: UpdateRule | None = None):
        pairs = list(named_params)
        self.names, self.params = [n for n, _ in pairs], [p for _, p in pairs]
        self.cfg, self.dtype = cfg, dtype
        self.norm_groups = list(norm_groups)
        self.counted = [counted(n) for n in self.names]
        self.master = self._make_master()
        for p in self.params:
            p.data = p.data.to(dtype)
        self.rule = AdamWRule() if rule is None else rule
        self.optimizer = self.rule.build(self)

    # ---- the seam (see module docstring) --------------------------------------------------------
    def _make_master(self) -> list[torch.Tensor]:
        if self.dtype == torch.float32:
            return self.params  # exact pass-through: AdamW updates the parameters themselves
        # an fp32 parameter's own storage becomes its master (the parameter then gets a bf16 copy)
        return [p.detach().float().requires_grad_(True) if p.dtype == torch.float32 else
                p.detach().float().clone().requires_grad_(True) for p in self.params]

    def _master_grads(self) -> list[torch.Tensor | None]:
        return [p.grad for p in self.params]

    def _publish(self) -> None:
        if self.master is not self.params:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)  # fp32 → compute dtype, one launch

    # ---- the step ---------------------------------------------------------------------------------
    def grad_norm(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Global L2 norm in fp32. One foreach kernel takes the norms of the counted grads' slices.
        A slice holds at most STEP_CHUNK_BYTES of fp32: no gradient-sized temporary.
        Their squares are summed here, then over norm_groups (as clip_grad_norm_ combines norms)."""
        sq = self._square_sum(grads, self.counted)
        for group in self.norm_groups:
            dist.all_reduce(sq, group=group)
        return sq.sqrt()

    def _square_sum(self, grads: list[torch.Tensor | None], counted: list[bool]) -> torch.Tensor:
        """Σ g² over the counted grads, on this rank: a 0-dim fp32 tensor (see grad_norm)."""
        pieces = [piece for g, c in zip(grads, counted) if g is not None and c
                  for piece in g.reshape(-1).split(STEP_CHUNK_BYTES // 4)]  # views: no copy
        if pieces:
            return torch.stack(torch._foreach_norm(pieces, 2.0, dtype=torch.float32)).square().sum()
        return torch.zeros((), dtype=torch.float32, device=self.master[0].device if self.master else "cpu")

    def _chunks(self, grads: list[torch.Tensor | None]) -> list[list[int]]:
        """Consecutive masters whose gradients, upcast to fp32, take about STEP_CHUNK_BYTES.
        An fp32 gradient costs nothing: it is used in place. All of them fit one chunk."""
        chunks, size = [[]], 0
        for i, g in enumerate(grads):
            copy = 0 if g is None or g.dtype == torch.float32 else 4 * g.numel()
            if chunks[-1] and copy and size + copy > STEP_CHUNK_BYTES:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += copy
        return chunks

    def step(self, lr: float) -> float:
        """Clip, update the masters, publish to the compute params, zero grads.
        Returns the grad norm before clipping. A non-finite norm skips the update.
        The caller decides when to give up."""
        grads = self._master_grads()
        norm = self.grad_norm(grads)
        value = float(norm)
        if math.isfinite(value):
            coef = torch.clamp(self.cfg.clip / (norm + 1e-6), max=1.0) if self.cfg.clip > 0 else None
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            chunks = self._chunks(grads) if self.rule.elementwise else [list(range(len(grads)))]
            for chunk in chunks:  # AdamW steps only the masters that have a .grad
                self._step_chunk([i for i in chunk if grads[i] is not None], grads, coef)
            self._publish()
        self.zero_grad()
        return value

    def _step_chunk(self, chunk: list[int], grads: list[torch.Tensor | None],
                    coef: torch.Tensor | None) -> None:
        """AdamW on the masters of one chunk. Its fp32 gradient copies are locals of this call.
        So they are freed on return, before the next chunk's are made.
        A loop variable would keep one chunk's copies alive beside the next.
        That put two chunks at the step's peak (measured)."""
        gs = [grads[i].float() for i in chunk]  # a copy only if not fp32
        if coef is not None:
            torch._foreach_mul_(gs, coef)
        for i, g in zip(chunk, gs):
            self.master[i].grad = g
        self.optimizer.step()
        for i in chunk:
            self.master[i].grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None
