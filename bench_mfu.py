"""bench.py's CUDA-only section: 1B single-GPU bf16 tokens/s and MFU, model.py vs transformers' Llama.

What it does
    Both models hold the same weights (the 1B preset from the seed) and train on the same random
    batches with bf16 compute and fp32 masters (precision.MixedPrecisionOptimizer), steps alternating
    as everywhere in bench.py. MFU = tokens/s × FLOPs/token (train.flops_per_token: 6N + 12·L·H·Q·T)
    / the H100/H200 dense bf16 peak. Without CUDA the table says "skipped (no CUDA)".

Run
    torchrun --nproc_per_node 1 bench.py --only mfu --mfu-batch 4 --mfu-seq-len 2048

Builds on: bench.py, model.py, precision.py, train.py, weights.py
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

import model as M
import precision as P
import train
import weights as W

if TYPE_CHECKING:  # bench.py imports this file and passes its Ctx in
    from bench import Ctx, Side

PEAK_FLOPS = 989e12  # H100/H200 dense bf16


def sec_mfu(ctx: Ctx) -> None:
    """1B config, one GPU, bf16 compute with fp32 masters on both sides: model.py vs transformers."""
    title = "1B single-GPU bf16 tokens/s and MFU (989 TFLOP/s peak; FLOPs/token = 6N + 12·L·H·Q·T)"
    if ctx.device.type != "cuda":
        ctx.tables[title] = ["skipped (no CUDA)"]
    elif ctx.rank == 0:
        import transformers
        cfg, S, b = M.PRESETS["1b"], ctx.args.mfu_seq_len, ctx.args.mfu_batch
        ours = W.materialize(M.build(cfg), ctx.device, seed=ctx.args.seed)
        with ctx.device:  # initialised on the GPU (fast), then overwritten with our weights
            hf = transformers.AutoModelForCausalLM.from_config(
                transformers.LlamaConfig.from_dict(cfg.to_hf()), attn_implementation="sdpa")
        hf.load_state_dict(ours.state_dict())
        g = torch.Generator().manual_seed(ctx.args.seed)
        xs = [torch.randint(0, cfg.vocab_size, (b, S + 1), generator=g).to(ctx.device) for _ in range(4)]

        def run(model: torch.nn.Module, loss_sum: Callable) -> Side:
            opt = P.MixedPrecisionOptimizer(model.named_parameters(), ctx.ocfg, torch.bfloat16)

            def step(i: int) -> tuple[torch.Tensor, float]:
                x = xs[i % len(xs)]
                loss = P.normalized_loss(loss_sum(x[:, :-1], x[:, 1:]), b * S)
                loss.backward()
                return loss.detach(), opt.step(ctx.args.lr)
            return step
        torch.cuda.reset_peak_memory_stats()
        r = ctx.race({"ours": run(ours, lambda x, y: ours(x, labels=y, reduction="sum")),
                      "hf": run(hf, lambda x, y: M.cross_entropy(hf(input_ids=x, use_cache=False).logits,
                                                                 y, "sum"))}, distributed=False)
        # bf16 (8-bit mantissa): the two models round in different kernels and orders
        ctx.add_row("1b bf16", "model.py (1 GPU)", "transformers LlamaForCausalLM (sdpa)",
                    r["ours"], r["hf"], 2e-2)
        tps = {k: b * S / r[k][0] * 1e3 for k in r}
        fpt = train.flops_per_token(cfg, S)
        ctx.table(title, ["model", "ms/step", "tokens/s", "MFU"],
                  [[name, f"{r[k][0]:.0f}", f"{tps[k]:,.0f}", f"{tps[k] * fpt / PEAK_FLOPS:.1%}"]
                   for k, name in (("ours", "attotron model.py"), ("hf", "transformers LlamaForCausalLM"))],
                  note=f"{torch.cuda.get_device_name()}, batch {b} x {S}, {cfg.num_params() / 1e9:.2f}B "
                       f"params, peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB (both models "
                       f"resident)")
    dist.barrier()
