"""The CUDA / NCCL contract: attotron's GPU-only branches run on a CPU-only machine.

What it does
    No GPU runs in CI, yet a GPU node is where a wrong argument to a kernel would crash, block or
    — worse — train silently wrong. Three pieces make those branches executable here:
      on_meta(monkeypatch)  points the library's kernel predicates (attention.use_varlen /
                            expand_kv / fold_gqa, cp.use_flash, ops.use_fused_rms_backward,
                            precision.use_fused_adamw, feed.pin_batches) at the meta device: the
                            CUDA branch runs, with real autograd, on meta tensors, whose kernels
                            check shapes, dtypes and output arity (LESSONS 27: FakeTensorMode on
                            "cuda" aborts in autograd on a CPU build)
      fake_world(rank, n)   torch's fake process group for cpu and meta tensors: one rank of an
                            n-rank world in this process, every collective a no-op.
                            dist.all_to_all_single there refuses splits that are not host ints.
      Contract()            a TorchDispatchMode (+ a TorchFunctionMode for SDPA's backend choice)
                            asserting what the real CUDA kernels and ProcessGroupNCCL require and
                            meta kernels or the fake group skip. Each rule names the torch source
                            file and function it comes from. `contract.seen` counts the checked
                            calls, so a test can prove that a branch ran at all. `contract.syncs`
                            counts host syncs at the dispatcher (HOST_SYNCS, device→host copies).
                            `contract.sdpa` lists each SDPA call's kernel and the k/v it reads.
                            Contract(host_reads=f): what a meta → host copy reads (meta holds no
                            values), e.g. the counts a test's routing gives.
    The fake group answers nothing, so all-gathers on the host (pp.py's step check) would read
    garbage: the contract fills a CPU all-gather's output as if every peer had sent this rank's
    input (symmetric peers), which is what a correct layout sends.

Reference
    torch.testing._internal.distributed.fake_pg (FakeStore, the "fake" backend);
    torch.utils._python_dispatch.TorchDispatchMode. Rules: see each `_rule_*` below.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

aten, c10d, fc = torch.ops.aten, torch.ops.c10d, torch.ops._c10d_functional
HALF = (torch.float16, torch.bfloat16)


class ContractError(AssertionError):
    """A call that the real CUDA kernel or ProcessGroupNCCL would reject, or run wrongly."""


def _need(ok: bool, rule: str, what: str) -> None:
    if not ok:
        raise ContractError(f"{rule}: {what}")


# ------------------------------------------------------------------------------------- the device
def on_meta(monkeypatch: Any) -> None:
    """Point every kernel predicate of the library at the meta device (CUDA's stand-in)."""
    import attention
    import cp
    import feed
    import ops
    import precision
    monkeypatch.setattr(attention, "use_varlen", lambda q: q.device.type == "meta" and q.dtype in HALF)
    monkeypatch.setattr(attention, "expand_kv", lambda q: q.device.type == "meta" and q.dtype == torch.float32)
    monkeypatch.setattr(attention, "fold_gqa", lambda q: q.device.type == "meta")
    monkeypatch.setattr(cp, "use_flash", lambda q: q.device.type == "meta" and q.dtype in HALF)
    monkeypatch.setattr(ops, "use_fused_rms_backward", lambda x: x.device.type == "meta")
    monkeypatch.setattr(precision, "use_fused_adamw", lambda t: t.device.type == "meta")
    monkeypatch.setattr(feed, "pin_batches", lambda device: device.type == "meta")
    # torch.optim refuses fused=True off its device list (optimizer.py _device_dtype_check_for_fused);
    # the fused AdamW kernel has a meta implementation (_meta_registrations.py, _fused_adamw_)
    import torch.optim.optimizer as optimizer
    devices = optimizer._get_fused_kernels_supported_devices
    monkeypatch.setattr(optimizer, "_get_fused_kernels_supported_devices", lambda: [*devices(), "meta"])


@contextlib.contextmanager
def fake_world(rank: int, world: int, monkeypatch: Any) -> Iterator[None]:
    """This process as rank `rank` of `world` on torch's fake group (cpu and meta tensors).
    new_group(backend="gloo") (the host-side groups) becomes a fake group too."""
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda *a, backend=None, **k: new_group(*a, **k))
    monkeypatch.setattr(dist, "all_to_all_single", _host_int_splits(dist.all_to_all_single))
    try:
        yield
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------- the rules
def _group_size(args: tuple, kwargs: dict) -> int:
    for a in (*args, *kwargs.values()):
        if isinstance(a, dist.ProcessGroup):
            return a.size()
        if isinstance(a, torch.ScriptObject):  # the dispatcher passes the group boxed
            try:
                return dist.ProcessGroup.unbox(a).size()
            except (RuntimeError, TypeError):
                continue
    raise ContractError(f"no process group among the arguments {args}")


def _dense_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rule: str) -> None:
    # aten/src/ATen/native/transformers/cuda/sdp_utils.cpp can_use_flash_attention, whose filters
    # the flash entry points assume: check_dtypes_flash_attention (fp16/bf16),
    # check_head_dim_size_flash (q, k, v the same last dim, <= 256), and sdp_utils_cpp.h
    # check_last_dim_stride_equals_1_dense; flash_attn/flash_api.cpp mha_fwd/mha_bwd CHECK_DEVICE
    _need(all(t.dtype in HALF and t.dtype == q.dtype for t in (q, k, v)), rule,
          f"flash takes fp16/bf16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _need(q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256, rule,
          f"flash needs one head_dim <= 256, got {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    _need(all(t.stride(-1) == 1 for t in (q, k, v)), rule,
          f"flash needs last-dim stride 1, got {[t.stride() for t in (q, k, v)]}")
    _need(q.device == k.device == v.device, rule, "q, k, v on one device")


def _rule_flash_forward(args: tuple, kwargs: dict) -> None:
    q, k, v = args[:3]
    _dense_flash(q, k, v, "aten._scaled_dot_product_flash_attention")


def _rule_flash_backward(args: tuple, kwargs: dict) -> None:
    # aten/src/ATen/native/transformers/cuda/attention_backward.cu _flash_attention_backward:
    # `if (cumulative_sequence_length_q.defined())` runs mha_varlen_bwd — a defined cum_seq, even
    # empty, selects the varlen kernel for what is a dense (B, h, n, d) batch; grad_out and out are
    # made contiguous there, logsumexp is not: flash_api.cpp mha_bwd reads softmax_lse through its
    # data pointer as (B, h, n) contiguous (a strided view gives wrong dq/dk/dv, no error)
    rule = "aten._scaled_dot_product_flash_attention_backward"
    dout, q, k, v, out, lse, cum_q, cum_k = args[:8]
    _dense_flash(q, k, v, rule)
    _need(cum_q is None and cum_k is None, rule,
          "dense (B, h, n, d) inputs need cum_seq_q/k None: a defined tensor (even empty) selects "
          "the varlen backward")
    _need(lse.is_contiguous() and tuple(lse.shape) == tuple(q.shape[:3]) and lse.dtype == torch.float32,
          rule, f"logsumexp must be a contiguous fp32 (B, h, n), got {tuple(lse.shape)} strides "
                f"{lse.stride()} {lse.dtype}")


def _rule_varlen(args: tuple, kwargs: dict) -> None:
    # torch/nn/attention/varlen.py _varlen_attn → aten._flash_attention_forward →
    # flash_attn/flash_api.cpp mha_varlen_fwd: cu_seqlens int32 (TORCH_CHECK dtype kInt32),
    # CHECK_DEVICE and CHECK_CONTIGUOUS; max_seqlen_q/k are host ints (the schema's SymInt: a
    # tensor there would be a device→host sync per call); q (total, h, d) fp16/bf16, stride(-1) 1
    rule = "torch_attn._varlen_attn"
    q, k, v, cu_q, cu_k, max_q, max_k = args[:7]
    _need(q.dim() == 3 and q.dtype in HALF and all(t.stride(-1) == 1 for t in (q, k, v)), rule,
          f"q, k, v (total, heads, hd) fp16/bf16 with last-dim stride 1, got {q.shape} {q.dtype}")
    for name, cu in (("cu_seq_q", cu_q), ("cu_seq_k", cu_k)):
        _need(cu is not None and cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device,
              rule, f"{name} must be int32, contiguous, on q's device {q.device}, got "
                    f"{None if cu is None else (cu.dtype, cu.device, cu.stride())}")
    _need(all(type(m) is int for m in (max_q, max_k)), rule,
          f"max_q/max_k must be host ints, got {type(max_q).__name__}, {type(max_k).__name__}")
    _need(cu_q.shape[0] >= 2 and q.shape[0] == k.shape[0], rule, "cu_seqlens (D+1,) over q's tokens")


def _rule_varlen_backward(args: tuple, kwargs: dict) -> None:
    # torch/nn/attention/varlen.py _varlen_attn_backward → aten._flash_attention_backward with the
    # forward's cu_seqlens (defined: attention_backward.cu takes mha_varlen_bwd, as it must here)
    # and its lse, (heads, total) fp32, read as contiguous by flash_api.cpp mha_varlen_bwd
    rule = "torch_attn._varlen_attn_backward"
    dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k = args[:10]
    _rule_varlen((q, k, v, cu_q, cu_k, max_q, max_k), kwargs)
    _need(lse.is_contiguous() and lse.dtype == torch.float32, rule,
          f"lse must be contiguous fp32, got strides {lse.stride()} {lse.dtype}")


def _rule_rms_backward(args: tuple, kwargs: dict) -> None:
    # aten/src/ATen/native/layer_norm.cpp _fused_rms_norm_backward (the CUDA kernel in
    # cuda/layer_norm_kernel.cu): grad_out shaped as input, rstd the fp32 (acc type) per-row
    # statistic the forward returned, weight the normalized shape, one output mask per gradient
    rule = "aten._fused_rms_norm_backward"
    grad, x, shape, rstd, weight, mask = args[:6]
    h = x.shape[-len(shape):]
    _need(grad.shape == x.shape and grad.dtype == x.dtype, rule, f"grad {grad.shape} vs input {x.shape}")
    _need(rstd.dtype == torch.float32 and rstd.numel() * h.numel() == x.numel(), rule,
          f"rstd must be fp32 with one value per row, got {rstd.dtype} {tuple(rstd.shape)}")
    _need(weight is not None and tuple(weight.shape) == tuple(h) and len(mask) == 2, rule,
          f"weight {None if weight is None else tuple(weight.shape)} must be {tuple(h)}; mask [dx, dw]")


def _rule_grouped_mm(args: tuple, kwargs: dict) -> None:
    """aten/src/ATen/native/cuda/GroupedBlas.cpp _grouped_mm_cuda: the fused kernel runs on sm90 and
    sm100 only (moe.grouped_mm_runs decides; elsewhere it would copy offs to the host and loop).
    It takes bf16 operands, int32 offsets of one end per group, and 16-byte aligned strides."""
    a, b = args[0], args[1]
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    _need(a.dtype == b.dtype == torch.bfloat16, "GroupedBlas.cpp _grouped_mm_cuda", f"bf16 operands, got "
          f"{a.dtype} and {b.dtype}")
    _need(offs is not None and offs.dtype == torch.int32 and offs.dim() == 1, "GroupedBlas.cpp _grouped_mm_cuda",
          f"int32 1-D offsets, got {None if offs is None else (offs.dtype, tuple(offs.shape))}")
    groups = b.shape[0] if b.dim() == 3 else a.shape[0] if a.dim() == 3 else offs.shape[0]
    _need(offs.shape[0] == groups, "GroupedBlas.cpp _grouped_mm_cuda", f"one offset per group: {groups} groups, "
          f"{offs.shape[0]} offsets")
    for t in (a, b):
        _need(all(st == 1 or (st * t.element_size()) % 16 == 0 for st in t.stride()),
              "GroupedBlas.cpp check_valid_strides_and_return_transposed", f"16-byte aligned strides, got "
              f"{t.stride()} for {tuple(t.shape)} {t.dtype}")


def _rule_fused_adamw(args: tuple, kwargs: dict) -> None:
    # aten/src/ATen/native/cuda/FusedAdamWKernel.cu _fused_adamw_kernel_cuda_ →
    # ForeachUtils.h check_fast_path_restrictions: params, grads, exp_avgs, exp_avg_sqs one device,
    # one dtype per list position, the same sizes and strides; state_steps fp32 on that device
    rule = "aten._fused_adamw_"
    params, grads, m, v, _, steps = args[:6]
    for lists in zip(params, grads, m, v):
        _need(all(t.device == lists[0].device and t.shape == lists[0].shape and t.stride() == lists[0].stride()
                  for t in lists), rule, "param, grad, exp_avg, exp_avg_sq: one device, shape, strides")
    _need(all(s.dtype == torch.float32 and s.device == p.device for s, p in zip(steps, params)), rule,
          "state_steps fp32 on the params' device (fused AdamW keeps its step there)")


CAPABILITY = (9, 0)  # the stand-in GPU's compute capability (H100/H200); a test may lower it
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _rule_scaled_mm(args: tuple, kwargs: dict) -> None:
    # aten/src/ATen/native/cuda/Blas.cpp _scaled_mm_out_cuda: compute capability 8.9 or 9.0+
    # (cuBLASLt's FP8 GEMM); 2-D operands; mat1's trailing dim and both of mat2's dims divisible by
    # 16; mat1 row-major and mat2 column-major (cuBLASLt's "TN" layout, the only one for FP8);
    # not two e5m2 operands; tensorwise scales: one fp32 value each; out_dtype bf16/fp16/fp32/fp8
    rule = "aten._scaled_mm (Blas.cpp)"
    a, b, sa, sb = args[:4]
    out = kwargs.get("out_dtype", args[6] if len(args) > 6 else None) or a.dtype
    _need(CAPABILITY >= (8, 9), rule, f"FP8 GEMMs need sm89 or newer, this GPU is sm{CAPABILITY[0]}{CAPABILITY[1]}")
    _need(a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0], rule, f"shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    _need(a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0, rule,
          f"dims must be multiples of 16, got {tuple(a.shape)} @ {tuple(b.shape)}")
    _need(a.stride(1) == 1 and b.stride(0) == 1, rule,
          f"mat1 row-major and mat2 column-major, got strides {a.stride()} and {b.stride()}")
    _need(a.dtype in FP8 and b.dtype in FP8 and (a.dtype, b.dtype) != (torch.float8_e5m2,) * 2, rule,
          f"operands {a.dtype} and {b.dtype}")
    _need(all(s.dtype == torch.float32 and s.numel() == 1 for s in (sa, sb)), rule,
          f"tensorwise scales are one fp32 value each, got {sa.dtype} {tuple(sa.shape)}, {sb.dtype} {tuple(sb.shape)}")
    _need(out in (torch.bfloat16, torch.float16, torch.float32, *FP8), rule, f"out_dtype {out}")


def _rule_collective(name: str, inp: Callable, out: Callable, ratio: int) -> Callable:
    # torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp: allreduce / broadcast / send / recv call
    # check_gpu_single_tensor ("Tensors must be contiguous"); _allgather_base and
    # _reduce_scatter_base check "output tensor size must be equal to world_size times input
    # tensor size" (and its inverse) and contiguity; the functional collectives
    # (torch/csrc/distributed/c10d/Functional.cpp) call these same entry points
    def rule(args: tuple, kwargs: dict) -> None:
        tensors = [t for t in (*inp(args), *out(args)) if isinstance(t, torch.Tensor)]
        _need(all(t.is_contiguous() for t in tensors), f"c10d {name}",
              f"NCCL needs contiguous tensors, got strides {[t.stride() for t in tensors]}")
        if ratio:
            world = _group_size(args, kwargs) if ratio == -1 else args[ratio]
            n_in, n_out = sum(t.numel() for t in inp(args)), sum(t.numel() for t in out(args))
            big, small = (n_out, n_in) if name.startswith("allgather") else (n_in, n_out)
            _need(big == world * small, f"c10d {name}",
                  f"sizes must be world × shard: {big} vs {world} × {small}")
    return rule


def _rule_allgather_list(args: tuple, kwargs: dict) -> None:
    # ProcessGroupNCCL.cpp ProcessGroupNCCL::allgather: check_gpu_single_tensor(input) (contiguous),
    # one output tensor per rank, each of the input's size ("Tensor list must be nonempty", the
    # equal-size fast path, else an all-gather per tensor through a flat buffer)
    outputs, inputs = args[0], args[1]
    world = _group_size(args, kwargs)
    for outs, inp in zip(outputs, inputs):
        _need(len(outs) == world and all(o.numel() == inp.numel() for o in outs), "c10d allgather",
              f"{len(outs)} outputs of {[o.numel() for o in outs]} for a world of {world} × {inp.numel()}")
        _need(inp.is_contiguous() and all(o.is_contiguous() for o in outs), "c10d allgather",
              "NCCL needs contiguous tensors")


def _rule_alltoall_base(args: tuple, kwargs: dict) -> None:
    # ProcessGroupNCCL.cpp ProcessGroupNCCL::alltoall_base: check_gpu_single_tensor on output and
    # input (contiguous); c10d::checkSplitSizes (Utils.hpp): without splits dim 0 divides by the
    # world, with them one split per rank, summing to dim 0. NCCL sends and receives in one
    # datatype, the input's (getNcclDataType(input.scalar_type())): an output of another dtype
    # would be filled with reinterpreted bytes. Peers run the same code (symmetric peers), so
    # one dtype here is one dtype on every rank.
    out, inp, _, out_splits, in_splits = args[:5]
    world = _group_size(args, kwargs)
    _need(out.dtype == inp.dtype, "c10d alltoall_base", f"one dtype on every rank and both sides, got input "
          f"{inp.dtype}, output {out.dtype}")
    for t, splits in ((out, out_splits), (inp, in_splits)):
        _need(t.is_contiguous(), "c10d alltoall_base", f"NCCL needs contiguous tensors, got {t.stride()}")
        ok = len(splits) == world and sum(splits) == t.size(0) if splits else t.size(0) % world == 0
        _need(ok, "c10d alltoall_base", f"splits {list(splits)} must be one per rank of {world}, summing to {t.size(0)}")


def _host_int_splits(all_to_all_single: Callable) -> Callable:
    """dist.all_to_all_single, refusing split sizes that are not host ints. The op's schema takes
    int[] (c10d::alltoall_base_). A tensor there is read element by element, each read a host
    sync; the dispatcher sees only the ints. So this rule sits above it, at the Python call."""
    def checked(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                input_split_sizes: Any = None, *args: Any, **kwargs: Any) -> Any:
        for name, splits in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
            if splits is not None and not (isinstance(splits, (list, tuple)) and all(type(n) is int for n in splits)):
                raise ContractError(f"c10d all_to_all_single: {name} must be a list of host ints, got "
                                    f"{type(splits).__name__} of {sorted({type(n).__name__ for n in splits})}: "
                                    "a tensor is a host sync per split")
        return all_to_all_single(output, input, output_split_sizes, input_split_sizes, *args, **kwargs)
    return checked


def _flat(x: Any) -> list:
    return [t for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]


RULES: dict[Any, Callable[[tuple, dict], None]] = {
    aten._scaled_dot_product_flash_attention.default: _rule_flash_forward,
    aten._scaled_dot_product_flash_attention_backward.default: _rule_flash_backward,
    aten._fused_rms_norm_backward.default: _rule_rms_backward,
    aten._grouped_mm.default: _rule_grouped_mm,
    aten._fused_adamw_.default: _rule_fused_adamw,
    aten._fused_adamw_.tensor_lr: _rule_fused_adamw,
    aten._scaled_mm.default: _rule_scaled_mm,
    c10d.allreduce_.default: _rule_collective("allreduce", lambda a: _flat(a[0]), lambda a: [], 0),
    c10d.broadcast_.default: _rule_collective("broadcast", lambda a: _flat(a[0]), lambda a: [], 0),
    c10d.send.default: _rule_collective("send", lambda a: _flat(a[0]), lambda a: [], 0),
    c10d.recv_.default: _rule_collective("recv", lambda a: [], lambda a: _flat(a[0]), 0),
    c10d.allgather_.default: _rule_allgather_list,
    c10d.alltoall_base_.default: _rule_alltoall_base,
    c10d._allgather_base_.default: _rule_collective("allgather_base", lambda a: _flat(a[1]),
                                                    lambda a: _flat(a[0]), -1),
    c10d._reduce_scatter_base_.default: _rule_collective("reduce_scatter_base", lambda a: _flat(a[1]),
                                                         lambda a: _flat(a[0]), -1),
    fc.all_reduce.default: _rule_collective("all_reduce", lambda a: _flat(a[0]), lambda a: [], 0),
    fc.all_gather_into_tensor.default: _rule_collective("allgather_into_tensor", lambda a: _flat(a[0]),
                                                        lambda a: [], 0),
    fc.reduce_scatter_tensor.default: _rule_collective("reduce_scatter_tensor", lambda a: _flat(a[0]),
                                                       lambda a: [], 0),
}
VARLEN = {"torch_attn::_varlen_attn": _rule_varlen, "torch_attn::_varlen_attn_backward": _rule_varlen_backward}
# collectives that move no data of their own (waits, barriers, autograd wrappers)
UNCHECKED = {"_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd", "c10d::barrier",
             "c10d::monitored_barrier_"}


# Ops that make the host wait for the device, seen at the dispatcher, so C++-internal ones count too:
# a scalar read (.item(), bool(t), an int() of a tensor), nonzero (boolean indexing, masked_select's
# size), equal/is_nonzero (a bool answer). Plus copies from the device into host memory.
HOST_SYNCS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default, aten.equal.default}


def _host_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in HOST_SYNCS:
        return True
    if func is aten._to_copy.default and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta":
        return kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu"
    return (func is aten.copy_.default and args[0].device.type == "cpu"
            and isinstance(args[1], torch.Tensor) and args[1].device.type == "meta")


class _SDPAChoice(TorchFunctionMode):
    """SDPA's backend choice for the stand-in device (meta always runs SDPA's math here). On CUDA,
    aten/src/ATen/native/transformers/cuda/sdp_utils.cpp select_sdp_backend tries flash
    (can_use_flash_attention: fp16/bf16, head_dim <= 256, no attn_mask; GQA supported), then
    memory-efficient (can_use_mem_efficient_attention: fp32 too, head_dim % 4 == 0; enable_gqa with
    fewer kv heads rejected in torch 2.13 — its include/ATen/native/transformers/sdp_utils_cpp.h
    check_batch_size_and_num_heads_dense predates pytorch PR 191085, which adds GQA there), then
    math — which saves (B, h, S, S) probabilities per call: refused here."""

    def __init__(self, contract: "Contract"):
        super().__init__()
        self.contract = contract

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args[0].device.type == "meta":
            q, k, v = args[:3]
            mask, gqa = kwargs.get("attn_mask"), kwargs.get("enable_gqa", False)
            same = q.shape[-1] == k.shape[-1] == v.shape[-1] and all(t.stride(-1) == 1 for t in (q, k, v))
            flash = q.dtype in HALF and mask is None and same and q.shape[-1] <= 256
            efficient = same and q.shape[-1] % 4 == 0 and not (gqa and k.shape[-3] != q.shape[-3])
            _need(flash or efficient, "sdp_utils.cpp select_sdp_backend",
                  f"no fused kernel for q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, enable_gqa {gqa}, "
                  f"mask {mask is not None}: the math fallback saves (B, h, S, S) per call")
            kernel = "sdpa flash" if flash else "sdpa efficient"
            self.contract.seen[kernel] += 1
            # what the kernel reads of k and v: their own bytes, and whose view they are (a cache's,
            # or a copy's: an expansion of k/v to the query heads is a fresh tensor)
            base = k._base if k._base is not None else k
            self.contract.sdpa.append({"kernel": kernel, "q": tuple(q.shape), "k": tuple(k.shape),
                                       "k_base": tuple(base.shape), "mask": mask is not None,
                                       "kv_bytes": sum(t.numel() * t.element_size() for t in (k, v))})
        return func(*args, **kwargs)


class Contract(TorchDispatchMode):
    """Assert the CUDA kernels' and ProcessGroupNCCL's preconditions on every call (module docstring).
    Also emulates pinned memory on this CPU build, as aten/src/ATen/native/Memory.cpp _pin_memory
    makes it: same sizes AND strides (a strided tensor stays strided), and checks the non_blocking
    host→device copies: aten/src/ATen/native/cuda/Copy.cu copy_kernel_cuda runs a truly
    asynchronous cudaMemcpyAsync only from pinned memory into a same-layout destination;
    a non-contiguous source is first copied into a pageable contiguous temporary (copy_requires_
    temporaries), whose copy blocks the host."""

    def __init__(self, host_values: bool = False,
                 host_reads: Callable[[torch.Size, torch.dtype], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.seen: Counter = Counter()
        self.syncs: Counter = Counter()  # host syncs by op (HOST_SYNCS, device→host copies)
        self.sdpa: list[dict] = []  # each SDPA call: kernel, q/k shapes, k's base shape, k/v bytes
        self.host_values = host_values  # a meta scalar read answers 0 (False) instead of raising
        # the values a device → host copy of a meta tensor reads (meta holds none; default: garbage)
        self.host_reads = host_reads
        self.pinned: set[int] = set()  # data_ptr of the emulated pinned blocks
        self._keep: list[torch.Tensor] = []  # keeps those blocks alive (their pointers unique)

    def __enter__(self):
        self._sdpa = _SDPAChoice(self)
        self._sdpa.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._sdpa.__exit__(*exc)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _host_sync(func, args, kwargs):
            self.seen["host sync"] += 1
            self.syncs[func.name()] += 1
            if self.host_values and func is aten._local_scalar_dense.default and args[0].device.type == "meta":
                return 0
        if func is aten._pin_memory.default:
            x = args[0]
            pinned = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
            self.pinned.add(pinned.untyped_storage().data_ptr())
            self._keep.append(pinned)
            self.seen["pin_memory"] += 1
            return pinned
        if func is aten.is_pinned.default:
            return args[0].untyped_storage().data_ptr() in self.pinned
        if func is aten._to_copy.default and kwargs.get("non_blocking") and args[0].device.type == "cpu" \
                and kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            x = args[0]
            _need(x.untyped_storage().data_ptr() in self.pinned and x.is_contiguous(),
                  "Copy.cu copy_kernel_cuda (non_blocking host→device)",
                  f"the source must be pinned and contiguous, got pinned "
                  f"{x.untyped_storage().data_ptr() in self.pinned}, shape {tuple(x.shape)} strides "
                  f"{x.stride()}: the copy goes through a pageable temporary and blocks the host")
            self.seen["non_blocking copy"] += 1
        if func is aten._to_copy.default and args[0].device.type == "meta" \
                and torch.device(kwargs.get("device") or "meta").type == "cpu":
            # device → host: meta has no values to read; the host gets uninitialized memory of that layout
            self.seen["device→host copy"] += 1
            dtype = kwargs.get("dtype") or args[0].dtype
            if self.host_reads is not None:
                return self.host_reads(args[0].shape, dtype)
            return torch.empty_strided(args[0].shape, args[0].stride(), dtype=dtype)
        if func is aten.copy_.default and args[0].device.type != args[1].device.type:
            # Copy.cu copy_kernel_cuda: a non_blocking copy between host and device is async only with
            # pinned, contiguous host memory (else a pageable temporary, and the host waits)
            dst, src = args[0], args[1]
            host = dst if dst.device.type == "cpu" else src
            if args[2] if len(args) > 2 else kwargs.get("non_blocking", False):
                _need(host.untyped_storage().data_ptr() in self.pinned and host.is_contiguous(),
                      "Copy.cu copy_kernel_cuda (non_blocking copy_)",
                      f"the host side must be pinned and contiguous, got shape {tuple(host.shape)} "
                      f"strides {host.stride()}: the copy goes through a pageable temporary")
                self.seen["non_blocking copy"] += 1
            else:
                self.seen["blocking copy"] += 1
            if dst.device.type == "cpu":
                return dst  # device → host: meta has no values to copy out
        rule = RULES.get(func) or VARLEN.get(func.name())
        if rule is not None:
            rule(args, kwargs)
            self.seen[str(func.name())] += 1
        elif func.namespace in ("c10d", "_c10d_functional") and func.name() not in UNCHECKED:
            raise ContractError(f"{func.name()}: a collective without a contract rule (add one)")
        out = func(*args, **kwargs)
        if func is c10d._allgather_base_.default and args[0].device.type == "cpu":
            # symmetric peers: every rank sent what this one did (the fake group sends nothing)
            args[0].copy_(args[1].reshape(-1).repeat(args[0].numel() // max(args[1].numel(), 1)).view_as(args[0]))
        return out
