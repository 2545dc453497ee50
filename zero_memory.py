"""ZeRO's memory account: what a rank holds between steps, and the most it may add at its peak.

What it does
    `formula_bytes(stage, psi, n)` is the ZeRO table: bytes per rank between steps.
    `persistent_bytes(opt)` reads the same numbers from the tensors a step object holds.
    `peak_extras(opt)` gives the most a phase may add to that state and the activations.
    Tests and bench/bench_theory.py check measured peaks against them.
    After a banner: the same table when zero.py's parameter groups split the state.

The core idea
    Mixed-precision AdamW holds 16 bytes a parameter.
    That is bf16 params and grads, and the fp32 master, m and v.
    Each ZeRO stage divides more of it by the dp size N.
    Between steps that is the whole state. At the peak, in-flight buffers come on top.
    The derivation of every term: docs/memory.md.

Reference
    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".

Run
    torchrun --nproc_per_node 4 -m bench.bench --only pp,memory      # the measured peaks
    python -m bench.bench_theory --model 1b --dp 8 --zero 3 --ac     # one rank of dp=8, fake process group

Invariants
    - persistent_bytes equals formula_bytes up to the padding.
      Test: tests/test_zero.py::test_zero_dp4_memory_and_tp2_dp2.
    - peak − activations ≤ formula_bytes + peak_extras, per phase.
      Test: tests/test_memory.py::test_zero_peaks_dp2.
    - The banner's table has its own tests, named there.

Builds on: zero.py (its step objects), precision.py (the step's chunk size)
"""
from __future__ import annotations

from typing import Iterable

import torch

import precision as P
from zero import DataParallelOptimizer


def formula_bytes(stage: int, psi: int, n: int) -> float:
    """The ZeRO table (docs/memory.md): bytes per rank between steps.
    Ψ = psi parameters over N = n ranks. bf16 params and grads; fp32 master, Adam m and v."""
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]


def persistent_bytes(opt: DataParallelOptimizer) -> dict[str, int]:
    """Bytes this rank holds for params, grads, fp32 master, Adam m and v, read from the tensors.
    Each storage counts once, in the first category holding it.
    (An fp32 master that IS the param counts as params.) A freed stage-3 unit counts 0.
    Call it between finish() and step() to see the grads."""
    seen: set[int] = set()

    def total(tensors: Iterable[torch.Tensor | None]) -> int:
        storages = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in tensors if t is not None)}
        new = {ptr: n for ptr, n in storages.items() if n and ptr not in seen}
        seen.update(new)
        return sum(new.values())

    state = [opt.optimizer.state.get(m, {}) for m in opt.master]
    return {"params": total([*opt.params, *getattr(opt, "param_shards", [])]),
            "grads": total([p.grad for p in opt.params] + getattr(opt.sync, "grad_shards", [])
                           + opt.sync.main),
            "master": total(opt.master),
            "adam_m": total(s.get("exp_avg") for s in state),
            "adam_v": total(s.get("exp_avg_sq") for s in state)}


def peak_extras(opt: DataParallelOptimizer) -> dict[str, int]:
    """The extras of docs/memory.md#at-the-peak-the-extras, in bytes.
    They come from this rank's own buckets (or units) and master pieces.
    Per phase ("forward", "backward", "step"): the most it may hold beyond the table and the activations.
    A test or benchmark checks a measured peak against them."""
    c, r = opt.dtype.itemsize, (opt.reduce_dtype or opt.dtype).itemsize
    k, n, stage3 = opt.inflight, opt.world, opt.stage == 3  # a zero3.Zero3Optimizer
    bucket = max((b.size for b in opt.sync.buckets), default=0)  # elements; a unit at stage 3
    piece = max((m.numel() for m in opt.master), default=0)
    gloo = opt.device.type == "cpu"  # gloo stages every collective through a full-size buffer
    small = 8 * len(opt.master) + 1024  # Adam's step counters, scalars
    units = (opt.prefetch + 1) * bucket * c + gloo * opt.prefetch * bucket * c if stage3 else 0
    grads = (k + 2) * bucket * r + k * (bucket // max(n, 1)) * r + gloo * k * bucket * r
    chunk = 4 * max(P.STEP_CHUNK_BYTES // 4, piece) + 12 * piece  # fp32 grads, AdamW's temporaries
    gathers = gloo * k * bucket * c if opt.stage in (1, 2) else 0  # in place: gloo's staging only
    pending = grads - 2 * bucket * r if getattr(opt, "per_micro_batch", False) else 0  # in flight still
    return {"forward": small + units + pending + gathers,
            "backward": small + units + bucket * c * stage3 + grads, "step": small + chunk}


# ---- refinement: the table when zero.py's parameter → group seam splits the state (expert parallelism)
def ep_formula_bytes(stage: int, dense: int, experts: int, n: int, ep: int) -> float:
    """The ZeRO table for a rank of an MoE model at expert parallelism ep, bytes between steps.
    dense: the parameters every rank of the ZeRO group holds, routers included.
    experts: the expert parameters before the ep split (moe.expert_parameters, all E experts).
    n: the ZeRO group's size (dp·cp). A rank holds experts/ep of them.
    ZeRO shards their state over the n/ep ranks holding the same experts.
    At ep = 1 this is formula_bytes of dense + experts over n.
    Tests: tests/test_moe_acct.py::test_ep_memory_formula (hand counts at ep 2 and 4) and
    tests/test_moe_acct.py::test_ep_memory_formula_equals_the_optimizer_state (train.py's optimizer)."""
    if ep < 1 or n % ep or experts % ep:
        raise ValueError(f"ep={ep} must divide the ZeRO group's {n} ranks and the {experts} expert parameters")
    return formula_bytes(stage, dense, n) + formula_bytes(stage, experts // ep, n // ep)


# ---- refinement: ZeRO-Offload's split of the state, and FP8's gather (formulas: docs/fp8.md)
def offload_formula_bytes(stage: int, psi: int, n: int) -> tuple[float, float]:
    """(GPU, host) bytes per rank between steps when the fp32 master, Adam's m and v and the
    step move to the host (ZeRO-Offload, Ren et al. 2021) at ZeRO stage 1 or 2 over n ranks.
    GPU: bf16 params (2Ψ) and bf16 grads, whole at stage 1 (2Ψ), sharded at stage 2 (2Ψ/N).
    Host: the fp32 master, m and v (12Ψ/N) and the fp32 gradient pieces the step reads (4Ψ/N).
    Test: tests/test_fp8.py::test_8b_offload_and_fp8_gather_formulas."""
    if stage not in (1, 2):
        raise ValueError(f"offload goes with ZeRO stage 1 or 2, got {stage}")
    return 2 * psi + (2 * psi if stage == 1 else 2 * psi / n), 16 * psi / n


def fp8_gather_bytes(psi: int, linear: int, tensors: int, n: int) -> tuple[float, float]:
    """(bf16, FP8) bytes one rank receives when ZeRO-3 all-gathers the whole model once.
    psi parameters in all; `linear` of them in FP8 linears, in `tensors` weight tensors.
    An FP8 gather moves 1 byte per linear weight and one fp32 scale per tensor; the rest stays bf16.
    Test: the same."""
    share = (n - 1) / n  # the pieces that come from the other ranks
    return 2 * psi * share, (2 * (psi - linear) + linear + 4 * tensors) * share

# ---- refinement: a frozen base (lora.py, qlora.py)
# The optimizer holds only the trained parameters (the adapters): the ZeRO table applies to them.
# The frozen base has no gradient, no master and no optimizer state: only its compute copy.
# That copy is whole on every dp rank at stages 0-2. Stage 3 shards it too (zero3.py).
def lora_formula_bytes(stage: int, trained: int, frozen: int, n: int, frozen_bytes: float = 2.0) -> float:
    """Bytes per rank between steps with a frozen base. trained: the adapters' parameters on this
    rank; frozen: the base's. frozen_bytes: bytes per frozen parameter (2 in bf16, 4 in fp32; NF4:
    `nf4_bytes_per_param`). Stage 3 divides the frozen term by n as well.
    Test: tests/test_lora.py::test_memory_formula_with_a_frozen_base."""
    return formula_bytes(stage, trained, n) + frozen_bytes * frozen / (n if stage == 3 else 1)


def nf4_bytes_per_param(block: int = 64, scale_block: int = 256) -> float:
    """QLoRA's storage: a 4-bit code, an 8-bit scale code per block, an fp32 scale per block of
    scales (plus one fp32 mean per weight, not counted): 0.5 + 1/64 + 4/16384 ≈ 0.5159 bytes."""
    return 0.5 + 1 / block + 4 / (block * scale_block)


def frozen_bytes(model: torch.nn.Module, opt: DataParallelOptimizer | None = None) -> int:
    """The meter's side: bytes of the frozen tensors this rank holds, read from their storages.
    Each storage counts once. A frozen parameter counts its own (a freed stage-3 unit: 0).
    NF4's codes and scales are frozen parameters too (qlora.py). So are a stage-3 optimizer's frozen shards."""
    tensors = [p for p in model.parameters() if not p.requires_grad] + list(getattr(opt, "frozen_shards", []))
    tensors = [t for t in tensors if not t.is_meta]  # a meta parameter holds nothing yet (ZeRO-3's build)
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
