"""The GPU check: 1B bf16 training tokens/s and MFU on one GPU, as train.py runs it.

What it does
    For the `1b` preset in bf16 at seq 2048 (fp32 masters, fp32 gradient accumulation: train.py's
    defaults, through zero.apply_zero_0_to_2 stage 0), one configuration after another in a fresh model:
      layers  eager | --compile (model.compile_layers)      AC  none | selective | full
    (--fp8-rows: eager and compiled without AC, each in bf16 and with FP8 linears, fp8.py),
    then the same steps through transformers' LlamaForCausalLM (sdpa) with the same weights, batches
    and optimizer. Each row: median step time after warm-up (CUDA-synchronized), tokens/s, MFU =
    tokens/s × cli.flops_per_token / the GPU's dense bf16 peak (cli.GPU_PEAK_TFLOPS or
    --peak-tflops), the allocator's peak allocated and reserved bytes of the steps (stats reset
    after setup), and the first step's loss beside the eager model's (same weights, same batch: the
    rows compute the same thing, to bf16 rounding). Also which SDPA kernel ran, read from the aten
    op the attention dispatched to (a dispatch-mode probe on one layer, outside the timed steps): on
    pretraining rows (plain causal) and on packed rows (attention.Documents: varlen flash on CUDA).
    Configurations run one after another, not alternating as bench.py's rows: 6 resident copies of
    a 1B model with AdamW state would not fit.

Run
    python -m bench.bench_mfu                  # one GPU: ~4-6 min on an H200 (3 compiles)
    torchrun --nproc_per_node 1 -m bench.bench --only mfu
    python -m bench.bench_mfu --smoke          # CPU: the tiny preset, 2 steps per row, one compiled
                                               # row (tests/test_bench.py; test_compile.py does the rest)

Builds on: bench_ctx.py, ac.py, attention.py, cli.py, fp8.py, loss.py, model.py, precision.py, weights.py, zero.py
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ac as AC
import attention as A
import cli
import fp8 as FP8
from loss import cross_entropy
import model as M
import precision as P
import weights as W
import zero as Z
from bench.bench_ctx import Ctx, md_row

CONFIGS = [(False, None), (False, "selective"), (False, "full"), (True, None), (True, "selective"), (True, "full")]
SMOKE = CONFIGS[:3] + [(True, "full")]  # one compile: CPU compile time counts against the test suite
TOL = 2e-2  # bf16 (8-bit mantissa): other kernels and fusions round differently
GRAD_TOL = 5e-2  # bf16 gradients vs transformers, worst parameter (CPU: 4e-3 tiny, 9e-3 small); a wrong kernel: O(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--batch", type=int, default=8, help="sequences per step")
    a("--seq-len", type=int, default=2048)
    a("--steps", type=int, default=8, help="timed steps per row")
    a("--warmup", type=int, default=3, help="untimed steps per row before them (the first compiles)")
    a("--lr", type=float, default=1e-4)
    a("--seed", type=int, default=0)
    a("--peak-tflops", type=float, default=None, help="override the GPU's dense bf16 peak")
    a("--no-hf", action="store_true", help="skip the transformers row")
    a("--fp8-rows", action="store_true", help="only the FP8 comparison: eager and compiled layers "
                                              "without AC, each in bf16 and with fp8.use_fp8 (--fp8)")
    a("--smoke", action="store_true", help="CPU check of this script: tiny preset, seq 64, batch 2, 2 steps")
    a("--out", default=None, help="also write the report there; default: print only")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.seq_len, args.steps, args.warmup = 2, 64, 2, 1
    return args


# ------------------------------------------------------------------------------------- probes
class AttentionOps(TorchDispatchMode):
    """Records the aten ops an attention dispatches to (their names say the kernel family)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name or "varlen" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def sdpa_kernels(cfg: M.LlamaConfig, device: torch.device, seq: int) -> dict[str, str]:
    """Which attention op ran for one bf16 layer with gradients: plain causal rows, and packed rows
    (four documents per row, boundaries from the position ids as feed.get_batch builds them)."""
    model = W.materialize(M.build(dataclasses.replace(cfg, num_hidden_layers=1)), device)
    model.to(torch.bfloat16)
    x = torch.randn(1, seq, cfg.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    q = seq // 4
    packed = torch.cat([torch.arange(n) for n in (q, q, q, seq - 3 * q)])[None].to(device)  # (1, S)
    out = {}
    for name, pos, docs in (("pretraining rows", torch.arange(seq, device=device)[None], None),
                            ("packed rows", packed, A.Documents.from_position_ids(packed))):
        cos, sin = model.model.rotary_emb(pos, torch.bfloat16)
        with AttentionOps() as probe:
            model.model.layers["0"](x, cos, sin, docs)
        out[name] = ", ".join(sorted(set(probe.ops))) or "none recorded"
    return out


# ------------------------------------------------------------------------------------- one row
def run_row(step: Callable[[int], torch.Tensor], steps: int, warmup: int, device: torch.device) -> dict:
    """Warm up, reset the allocator's peaks, time `steps` steps; median ms and the peaks."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    first = float(step(0))
    for i in range(1, warmup):
        step(i)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup, warmup + steps):
        sync()
        t0 = time.perf_counter()
        step(i)
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()) if cuda else (None, None)
    return {"ms": 1e3 * statistics.median(times), "loss": first, "peak": peak}


def batches(cfg: M.LlamaConfig, args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g).to(device)
            for _ in range(4)]


def ours(cfg: M.LlamaConfig, args: argparse.Namespace, device: torch.device, compiled: bool,
         ac: str | None, data: list[torch.Tensor], fp8: bool = False) -> dict:
    """train.py's path: build, FP8 (--fp8), AC, compile, then ZeRO stage 0 (fp32 masters and grads)."""
    model = W.materialize(M.build(cfg), device, seed=args.seed)
    if fp8:
        FP8.use_fp8(model)
    if ac:
        AC.apply_ac(model, ac)
    if compiled:
        M.compile_layers(model)
    opt = Z.apply_zero_0_to_2(model, 0, None, P.OptimConfig(lr=args.lr), torch.bfloat16, reduce_dtype=torch.float32)
    tokens = args.batch * args.seq_len

    def step(i: int) -> torch.Tensor:
        x = data[i % len(data)]
        loss = P.normalized_loss(model(x[:, :-1], labels=x[:, 1:], reduction="sum"), tokens)
        loss.backward()
        opt.step(args.lr)
        return loss.detach()
    try:
        return run_row(step, args.steps, args.warmup, device)
    finally:
        opt.teardown()


def transformers_row(cfg: M.LlamaConfig, args: argparse.Namespace, device: torch.device,
                     data: list[torch.Tensor]) -> dict:
    """The same weights in LlamaForCausalLM (sdpa), bf16 with fp32 masters (precision.py)."""
    import transformers
    weights = W.materialize(M.build(cfg), device, seed=args.seed).state_dict()
    with device:  # initialised on the device (fast), then overwritten with our weights
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig.from_dict(cfg.to_hf()), attn_implementation="sdpa")
    hf.load_state_dict(weights)
    del weights
    opt = P.MixedPrecisionOptimizer(hf.named_parameters(), P.OptimConfig(lr=args.lr), torch.bfloat16)
    tokens = args.batch * args.seq_len

    def step(i: int) -> torch.Tensor:
        x = data[i % len(data)]
        logits = hf(input_ids=x[:, :-1], use_cache=False).logits
        loss = P.normalized_loss(cross_entropy(logits, x[:, 1:], "sum"), tokens)
        loss.backward()
        opt.step(args.lr)
        return loss.detach()
    return run_row(step, args.steps, args.warmup, device)


def gradients_vs_transformers(cfg: M.LlamaConfig, args: argparse.Namespace, device: torch.device,
                              data: list[torch.Tensor]) -> dict:
    """One bf16 forward + backward of our eager model and of LlamaForCausalLM with the same weights on
    one row: the relative L2 difference of the whole gradient and of the worst parameter's. Checks
    the CUDA-only kernels of the backward (the fused RMSNorm backward, varlen) against HF's autograd."""
    import transformers
    ours_m = W.materialize(M.build(cfg), device, seed=args.seed).to(torch.bfloat16)
    with device:
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig.from_dict(cfg.to_hf()), attn_implementation="sdpa")
    hf.load_state_dict(ours_m.state_dict())
    hf.to(torch.bfloat16)
    x = data[0][:1]
    ours_m(x[:, :-1], labels=x[:, 1:], reduction="sum").backward()
    cross_entropy(hf(input_ids=x[:, :-1], use_cache=False).logits, x[:, 1:], "sum").backward()
    hf_grads = dict(hf.named_parameters())
    pairs = [(p.grad.double(), hf_grads[n].grad.double()) for n, p in ours_m.named_parameters()]
    worst = max(float((a - b).norm() / b.norm()) for a, b in pairs)
    total = float(sum((a - b).square().sum() for a, b in pairs).sqrt() / sum(b.square().sum() for _, b in pairs).sqrt())
    return {"total": total, "worst": worst}


def clean(device: torch.device) -> None:
    """Drop the last row's model, optimizer and compiled graphs before the next row is built."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------- the check
def check(args: argparse.Namespace, device: torch.device, say: Callable[[str], None] = print) -> dict:
    """Every row; returns {"rows": [...], "kernels": {...}, "markdown": str}."""
    cfg = M.PRESETS["tiny" if args.smoke else "1b"]
    data = batches(cfg, args, device)
    peak = cli.peak_flops(argparse.Namespace(peak_tflops=args.peak_tflops, dtype="bf16"), device)
    fpt = cli.flops_per_token(cfg, args.seq_len)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    kernels = sdpa_kernels(cfg, device, args.seq_len)
    say(f"[mfu] SDPA kernels: {kernels}")
    grads = None if args.no_hf else gradients_vs_transformers(cfg, args, device, data)
    clean(device)
    say(f"[mfu] bf16 gradients vs transformers (one row): {grads}")
    rows = []
    configs = [(c, None, f) for c in (False, True) for f in (False, True)] if args.fp8_rows else \
        [(c, ac, False) for c, ac in (SMOKE if args.smoke else CONFIGS)]
    plan = [(("compiled" if c else "eager") + (" fp8" if f else ""), ac or "none",
             lambda c=c, ac=ac, f=f: ours(cfg, args, device, c, ac, data, f)) for c, ac, f in configs]
    if not args.no_hf:
        plan.append(("transformers LlamaForCausalLM (sdpa)", "none", lambda: transformers_row(cfg, args, device, data)))
    for layers, ac, run in plan:
        t0 = time.time()
        r = run()
        clean(device)
        tps = args.batch * args.seq_len / r["ms"] * 1e3
        rows.append(dict(layers=layers, ac=ac, ms=r["ms"], tokens_per_s=tps, loss=r["loss"], peak=r["peak"],
                         mfu=tps * fpt / peak if peak else None, wall_s=time.time() - t0))
        say(f"[mfu] {layers} / AC {ac}: {r['ms']:.1f} ms/step, {tps:,.0f} tok/s, MFU "
            f"{rows[-1]['mfu'] or 0:.1%}, loss {r['loss']:.4f} ({time.time() - t0:.0f} s)")
    base = rows[0]["loss"]
    for r in rows:
        r["same"] = abs(r["loss"] - base) <= TOL * abs(base)
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.1f}"  # noqa: E731
    lines = [f"{name}, torch {torch.__version__}; `1b` preset ({cfg.num_params() / 1e9:.2f}B params)"
             if not args.smoke else f"{name}, torch {torch.__version__}; smoke run: `tiny` preset",
             f"bf16, batch {args.batch} x {args.seq_len}, {args.warmup} warm-up + {args.steps} timed steps per row; "
             f"FLOPs/token {fpt / 1e9:.2f} G (cli.flops_per_token); peak "
             + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown (MFU n/a)"), "",
             md_row(["layers", "AC", "ms/step", "tokens/s", "MFU", "peak allocated GiB", "peak reserved GiB",
                     "step-1 loss", f"same as eager (bf16, {TOL:.0e})"]), "|---" * 9 + "|"]
    lines += [md_row([r["layers"], r["ac"], f"{r['ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['mfu']:.1%}" if r["mfu"] else "n/a", gib(r["peak"][0]), gib(r["peak"][1]),
                      f"{r['loss']:.4f}", "yes" if r["same"] else "NO"]) for r in rows]
    lines += ["", md_row(["rows", "attention op (SDPA kernel)"]), "|---|---|"]
    lines += [md_row([k, f"`{v}`"]) for k, v in kernels.items()]
    if grads:
        lines += ["", f"bf16 gradients of one row vs transformers (same weights): relative L2 difference "
                      f"{grads['total']:.1e} over the model, {grads['worst']:.1e} for the worst parameter: "
                      + (f"same (<= {GRAD_TOL:.0e})" if grads["worst"] <= GRAD_TOL else "DIFFERENT")]
    return {"rows": rows, "kernels": kernels, "grads": grads, "markdown": "\n".join(lines)}


def sec_mfu(ctx: Ctx) -> None:
    """bench.py's mfu section: the check on rank 0's GPU (skipped without CUDA: see --smoke)."""
    title = "1B single-GPU bf16 tokens/s and MFU (bench_mfu.py)"
    if ctx.device.type != "cuda":
        ctx.tables[title] = ["skipped (no CUDA): `python -m bench.bench_mfu --smoke` checks the script on CPU"]
    elif ctx.rank == 0:
        args = parse_args(["--batch", str(ctx.args.mfu_batch), "--seq-len", str(ctx.args.mfu_seq_len),
                           "--seed", str(ctx.args.seed)])
        ctx.tables[title] = check(args, ctx.device)["markdown"].split("\n")
    torch.distributed.barrier()


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        raise SystemExit("bench_mfu.py needs a GPU (CUDA); `--smoke` runs the tiny preset on CPU")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    t0 = time.time()
    out = check(args, device)
    command = " ".join(sys.argv[1:] if argv is None else argv)
    text = f"# attotron GPU check\n\n`python -m bench.bench_mfu {command}` ({time.time() - t0:.0f} s)\n\n" \
           + out["markdown"] + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text, flush=True)
    return out


if __name__ == "__main__":
    main()
