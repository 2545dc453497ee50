"""The one-GPU numerical check: attotron's CUDA-only kernel calls against independent references.

What it does
    The CPU suite runs every CUDA branch on the meta device (tests/test_cuda_paths.py): shapes,
    dtypes and arguments, no numbers. This command runs the same calls on one real GPU and compares
    their values, in about a minute:
      cp_flash_block   cp.py's flash block forward + backward (aten._scaled_dot_product_flash_
                       attention and its backward) on strided q/k/v views and a strided chunk of
                       the log-sum-exp, against cp's math path (fp32) on the same inputs
      varlen_gqa       attention.attend on packed documents (varlen_attn, GQA) against one causal
                       SDPA per document, forward and the q/k/v gradients
      rms_norm         ops.rms_norm's CUDA backward (aten._fused_rms_norm_backward) against fp64
                       autograd of the formula
      fp32_gqa         attention.attend in fp32 with GQA (k/v expanded: the efficient kernel)
                       against the fp64 math, and its peak memory against the S² a math
                       fallback would keep
      fp8_linear       fp8.fp8_linear forward + backward (cuBLASLt's FP8 GEMM via torch._scaled_mm)
                       against the same FP8 codes dequantized and multiplied in fp32; its time
                       against bf16 F.linear on the same shape
      pinned_copy      host time of feed.to_device (non_blocking) for feed.host_batch's pinned,
                       contiguous micro-batches, and for the same rows pinned as strided views
                       (the old behaviour: the host waits for the copy)
      decode           model.generate (bf16, GQA, ragged, sampled) with SDPA held to flash and
                       efficient, its attention kernels, host syncs a decode token, tokens/s, and
                       bench_generate's ratio against transformers' generate
    Each check records its error, its tolerance and ok; the file ends with "all_ok". Exit status 1
    if any check fails.

Run
    python -m bench.bench_gpu                      # one GPU: writes bench_gpu.json
    python -m bench.bench_gpu --smoke --out x.json # CPU, tiny sizes: the script's plumbing only

Builds on: attention.py, cp.py, feed.py, fp8.py, grid.py, ops.py — the kernel calls it checks (and their
    CPU paths, for --smoke)

Tolerances
    bf16 kernels against an fp32/fp64 reference on the same (bf16) inputs: 2e-2 relative to the
    largest reference element (bf16 keeps 8 bits: 4e-3 per rounding; a sum of ~S terms rounded once
    at the end stays within a few of them). fp32 kernels (TF32 off): 1e-4. A wrong argument — a
    varlen backward on a dense batch, a strided lse read as contiguous — gives O(1) errors.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
import torch.nn.functional as F

import attention as A
import cp as CP
import feed
import fp8 as FP8
import grid as G
import ops


# decode's models: SmolLM2-135M's shape (GQA 9/3, head_dim 64) at 512 rows, GRPO's default batch
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
TINY_SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _check(name: str, errors: dict[str, float], tol: float, **extra) -> dict:
    worst = max(errors.values())
    return {"check": name, "errors": errors, "tolerance": tol, "ok": bool(worst <= tol), **extra}


def cp_flash_block(device: torch.device, dtype: torch.dtype, B: int, h: int, n: int, d: int) -> dict:
    """One causal and one full block, q/k/v as cp's ring sees them (transposed views), lse a chunk."""
    g = torch.Generator(device).manual_seed(0)
    x = lambda: torch.randn(B, 2 * n, h, d, device=device, dtype=dtype, generator=g).transpose(1, 2)  # noqa: E731
    q, k, v = (t[:, :, n:] for t in (x(), x(), x()))  # (B, h, n, d): strided views
    dout = torch.randn(B, h, n, d, device=device, dtype=dtype, generator=g)
    errors, scale = {}, 1 / math.sqrt(d)
    for causal in (True, False):
        out, lse = CP._block(q, k, v, causal, scale)
        ref_out, ref_lse = CP._math_block(q, k, v, causal, scale)
        merged = torch.cat([lse, lse], dim=2)  # (B, h, 2n) as the ring merges l over both chunks
        got = CP._block_backward(dout, q, k, v, out, merged.split(n, dim=2)[1], causal, scale)  # a strided chunk
        ref = CP._math_block_backward(dout, q, k, v, ref_out, ref_lse, causal, scale)
        tag = "causal" if causal else "full"
        errors[f"{tag}_out"], errors[f"{tag}_lse"] = _rel(out, ref_out), _rel(lse, ref_lse)
        for name, a, b in zip(("dq", "dk", "dv"), got, ref):
            errors[f"{tag}_{name}"] = _rel(a, b)
    kernel = "cpu" if q.device.type == "cpu" else ("cuda" if CP.use_flash(q) else None)  # the fused kernel _block takes
    return _check("cp_flash_block", errors, 2e-2, kernel=kernel)


def varlen_gqa(device: torch.device, dtype: torch.dtype, lengths: list[int], nh: int, nkv: int, d: int) -> dict:
    """Packed documents in one row through attend against one SDPA per document."""
    S = sum(lengths)
    g = torch.Generator(device).manual_seed(1)
    q = torch.randn(1, S, nh, d, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(1, S, nkv, d, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(1, S, nkv, d, device=device, dtype=dtype, generator=g).requires_grad_()
    docs = A.Documents(lengths, (1, S), device)
    dy = torch.randn(1, S, nh, d, device=device, dtype=dtype, generator=g)
    y = A.attend(q, k, v, docs)
    grads = torch.autograd.grad(y, (q, k, v), dy)
    refs, start = [], 0
    for n in lengths:  # the reference: each document alone, causal, in fp32
        part = [t[:, start:start + n].float().transpose(1, 2) for t in (q, k, v)]  # (1, heads, n, d)
        refs.append(F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True).transpose(1, 2))
        start += n
    ref = torch.cat(refs, dim=1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy.float())
    errors = {"out": _rel(y, ref), **{f"d{n}": _rel(a, b) for n, a, b in zip("qkv", grads, ref_grads)}}
    return _check("varlen_gqa", errors, 2e-2, varlen=A.use_varlen(q))


def rms_norm(device: torch.device, dtype: torch.dtype, rows: int, h: int) -> dict:
    g = torch.Generator(device).manual_seed(2)
    x = torch.randn(rows, h, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(h, device=device, dtype=dtype, generator=g)).requires_grad_()
    dy = torch.randn(rows, h, device=device, dtype=dtype, generator=g)
    gx, gw = torch.autograd.grad(ops.rms_norm(x, w, 1e-6), (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    rx, rw = torch.autograd.grad(y64, (x64, w64), dy.double())
    return _check("rms_norm", {"dx": _rel(gx, rx), "dw": _rel(gw, rw)}, 2e-2 if dtype != torch.float32 else 1e-4,
                  fused=ops.use_fused_rms_backward(x))


def fp8_linear(device: torch.device, M: int, K: int, N: int, repeats: int) -> dict:
    """fp8.fp8_linear's y, dL/dx, dL/dW against the same codes dequantized and multiplied in fp32.
    cuBLASLt accumulates in fp32 and rounds once to bf16: the bf16 tolerance of this file.
    A wrong scale or layout gives O(1). Also ms per forward + backward, FP8 against bf16 F.linear."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(M, K, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(N, K, generator=g) * 0.02).to(device, torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, generator=g).to(device, torch.bfloat16)
    y = FP8.fp8_linear(x, w)
    y.backward(dy)
    xq, sx = FP8.quantize(x, FP8.E4M3)
    wq, sw = FP8.quantize(w, FP8.E4M3)
    gq, sg = FP8.quantize(dy, FP8.E5M2)
    deq = lambda q, s: q.float() / s  # noqa: E731
    ref = {"y": deq(xq, sx) @ deq(wq, sw).T, "dx": deq(gq, sg) @ deq(wq, sw), "dw": deq(gq, sg).T @ deq(xq, sx)}
    errors = {k: _rel(v, ref[k]) for k, v in (("y", y), ("dx", x.grad), ("dw", w.grad))}
    out = {}
    for name, fn in (("fp8", lambda: FP8.fp8_linear(x, w)), ("bf16", lambda: F.linear(x, w))):
        for _ in range(3):
            fn().backward(dy)
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn().backward(dy)
        torch.cuda.synchronize() if device.type == "cuda" else None
        out[f"{name}_ms"] = 1e3 * (time.perf_counter() - t0) / repeats
    return _check("fp8_linear", errors, 2e-2, shape=[M, K, N], speedup=out["bf16_ms"] / out["fp8_ms"], **out)


def fp32_gqa(device: torch.device, B: int, S: int, nh: int, nkv: int, d: int) -> dict:
    g = torch.Generator(device).manual_seed(3)
    q = torch.randn(B, S, nh, d, device=device, generator=g).requires_grad_()
    k, v = (torch.randn(B, S, nkv, d, device=device, generator=g).requires_grad_() for _ in range(2))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    y = A.attend(q, k, v, None)
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    y.sum().backward()
    ref = F.scaled_dot_product_attention(*(t.detach().double().transpose(1, 2) for t in (q, k, v)),
                                         is_causal=True, enable_gqa=True).transpose(1, 2)
    s2 = B * nh * S * S * 4  # what the math fallback would keep: fp32 probabilities
    return _check("fp32_gqa", {"out": _rel(y, ref)}, 1e-4, forward_peak_bytes=peak, math_fallback_s2_bytes=s2,
                  below_s2=None if peak is None else bool(peak < s2), expanded=A.expand_kv(q))


class _Rows:
    def __init__(self, S: int):
        self.S = S

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, 32000, (self.S + 1,), generator=torch.Generator().manual_seed(i))


def pinned_copy(device: torch.device, rows: int, S: int, micro: int, repeats: int) -> dict:
    """Host seconds of the prefetcher's copies (feed.to_device) per step's batch: feed's contiguous
    pinned micro-batches, and the same rows pinned as strided views."""
    grid = G.Grid(0, 1, device)
    host = feed.host_batch(_Rows(S), list(range(rows)), micro, grid)
    strided = [{k: v.pin_memory() if device.type == "cuda" else v for k, v in mb.items()}
               for mb in [dict(zip(("input_ids", "labels"), (t[:, :-1], t[:, 1:])))
                          for t in torch.stack([_Rows(S)[i] for i in range(rows)]).chunk(micro)]]
    out = {}
    for name, batch in (("contiguous_pinned", host), ("strided_pinned", strided)):
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            feed.to_device(batch, device)
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out[f"{name}_host_ms"] = 1e3 * sorted(times)[len(times) // 2]
    return {"check": "pinned_copy", "ok": True, "rows": rows, "seq": S, "micro_batches": micro, **out,
            "contiguous": all(v.is_contiguous() for mb in host for v in mb.values() if isinstance(v, torch.Tensor))}


def decode(device: torch.device, dtype: torch.dtype, cfg: dict, B: int, prompt: int, new: int,
           versus_transformers: bool) -> dict:
    """model.generate on a random GQA Llama, ragged prompts, sampled. SDPA restricted to flash and
    efficient: a call that needs math raises, and the check fails. The attention kernels the
    profiler saw; host syncs a decode token (CUDA's sync debug mode, 0 expected); tokens/s. And
    bench_generate's ratio against transformers' generate, when transformers is installed."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import model as M
    import weights as W
    model = W.materialize(M.build(M.LlamaConfig(**cfg)), device).to(dtype)
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(prompt // 4, prompt + 1, (B,), generator=g).tolist()
    ids = torch.randint(3, cfg["vocab_size"], (B, prompt), generator=g).to(device)
    run = lambda n: M.generate(model, ids, n, temperature=1.0, seeds=list(range(B)), lengths=lengths)  # noqa: E731
    out = {"check": "decode", "dtype": str(dtype), "rows": B, "prompt": prompt, "new": new}
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            run(2)
            syncs = {}
            if device.type == "cuda":
                for n in (2, 6):
                    torch.cuda.set_sync_debug_mode("warn")
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        run(n)
                    torch.cuda.set_sync_debug_mode(0)
                    syncs[n] = sum("synchroniz" in str(w.message) for w in caught)
                out["host_syncs_per_decode_token"] = (syncs[6] - syncs[2]) / 4
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    run(3)
                names = {e.key for e in prof.key_averages()}
                out["attention_kernels"] = sorted(n for n in names if any(
                    w in n.lower() for w in ("flash", "fmha", "attention", "efficient")))[:6]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(new)
            if device.type == "cuda":
                torch.cuda.synchronize()
            out["tokens_per_s"] = B * new / (time.perf_counter() - t0)
        out["ok"] = out.get("host_syncs_per_decode_token", 0) == 0
    except RuntimeError as e:  # sdpa_kernel: no fused kernel for a call
        out.update(ok=False, error=str(e).splitlines()[0])
    if versus_transformers:
        try:
            from bench import bench_generate
            out["versus_transformers"] = bench_generate.main(["--device", str(device), "--dtype", "bf16",
                                                             "--batch", "64", "--new", "64", "--random"])
        except ImportError as e:
            out["versus_transformers"] = f"not run: {e}"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_gpu.json", help="where the results go (JSON)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes: checks the script, not the GPU")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench.bench_gpu checks CUDA kernels and needs a GPU (none found); --smoke runs its "
              "plumbing on CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("highest")  # fp32 references in fp32, not TF32 (cli.py's API)
    half = torch.float32 if args.smoke else torch.bfloat16  # (CPU: the CPU kernels, in fp32)
    big = not args.smoke
    results = [
        cp_flash_block(device, half, 2, 8, 512 if big else 16, 128 if big else 16),
        varlen_gqa(device, half, [700, 1, 300, 1024, 23] if big else [5, 1, 10], 16 if big else 4, 4 if big else 2,
                   128 if big else 16),
        rms_norm(device, half, 4096 if big else 8, 4096 if big else 64),
        rms_norm(device, torch.float32, 4096 if big else 8, 4096 if big else 64),
        fp32_gqa(device, 2 if big else 1, 2048 if big else 32, 16 if big else 4, 4 if big else 2, 128 if big else 16),
        fp8_linear(device, 16384 if big else 32, 4096 if big else 64, 4096 if big else 32, 20 if big else 2),
        pinned_copy(device, 16 if big else 4, 4096 if big else 32, 8 if big else 2, 20 if big else 2),
        decode(device, half, SMOLLM2_SHAPE if big else TINY_SHAPE, 512 if big else 3, 256 if big else 6,
               64 if big else 4, versus_transformers=big),
    ]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (smoke)",
              "torch": torch.__version__, "results": results, "all_ok": all(r["ok"] for r in results)}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for r in results:
        print(f"{r['check']:15s} {'ok ' if r['ok'] else 'FAIL'} "
              + " ".join(f"{k}={v:.2e}" for k, v in r.get("errors", {}).items())
              + "".join(f" {k}={v:.3f}" for k, v in r.items() if k.endswith("_ms") or k.endswith("_per_s")))
    print(f"results: {args.out}")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
