"""attotron's trainer flags, and the numbers they imply. Each flag is parsed and given its
layout-dependent default. Then all are checked against the config and world size, before heavy work.

What it does
    parse_args       every flag of train.py. Defaults that depend on another flag (--seq-len, --lr
                     with --sft) are filled in with `is None`, so a user's 0 reaches validate.
    validate         every check that needs no heavy work, all reported at once as a list of
                     messages. It reads no data, builds no model and uses only the default group.
                     It checks the layout against the world size (tp, cp, pp, ep, micro-batches).
                     It checks each feature's rules, flag ranges and NaNs, and every output path.
                     A run must not train for hours, then fail to write.
    virtual_stages, micro_batches, layer_ranges
                     the pipeline's shape as the flags give it. The defaults come from
                     pp.default_microbatches and pp.partition (with the head's cost).
    lr_at            the schedule: linear warm-up to --lr, cosine decay to --min-lr.
    device_defaults  --dtype auto per device: bf16 on CUDA, fp32 on CPU (TF32 matmuls on CUDA).
    flops_per_token, active_params, peak_flops, GPU_PEAK_TFLOPS
                     the logged MFU's FLOPs per token (PaLM's convention) and the device's dense
                     peak. A mixture of experts counts the k of E experts a token reads.

How train.py uses it
    train.configure calls parse_args, then grid.setup: validate needs the world size. Then come
    device_defaults and validate, whose messages go to grid.fail together. virtual_stages and
    micro_batches are stored back into args. layer_ranges splits the model (pp.split_stage,
    pp.stage_chunks). lr_at gives each step's lr. plan_resume uses it to compare a checkpoint's
    schedule with this run's.

Run
    python train.py --help                              # every flag, with its default
    torchrun --nproc_per_node 4 train.py --pp 3         # refused at once: 4 is not divisible by 3

Invariants
    - Nothing here reads data, builds a model or runs a collective. Every rank runs the same
      cheap checks first, so a bad command line costs seconds, not a data preparation.
    - validate returns messages and raises nothing: the user sees every problem at once.
    - A flag's 0 is a value to check, never "use the default" (LESSONS 19).
    - The flags parse before torch loads: each function imports the siblings it calls. So
      `train.py --help` answers in under a second (tests/test_small_sets.py).

Builds on: deepseek.py, grid.py, grpo.py, lora.py, model.py, pp.py, pp_schedules.py, sft.py, tp.py,
trackers.py, weights.py
    grid.py gives a Grid's world size; grpo.py checks its verifier.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pp_schedules import SCHEDULES  # torch-free

if TYPE_CHECKING:  # the annotations' names. Each function imports what it calls: the flags parse before torch loads
    import torch

    import grid as G
    import model as M

PRESETS = ("1b", "8b", "dsv3-small", "dsv3-tiny", "small", "tiny")  # model.PRESETS' names, for --help without torch (tests/test_small_sets.py)


# ------------------------------------------------------------------------------------------ flags
class HelpWithDefaults(argparse.HelpFormatter):
    """Show a flag's default in --help when it has a meaningful one (not None / off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`, not `in`: 0 == False, and a default of 0 is meaningful (--save-every 0, --clip 0)
        off = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if not off and "default" not in text:
            text += " (default: %(default)s)"
        return text


# what --help says first: train.py's docstring's first line (the program --help describes is train.py)
DESCRIPTION = "attotron's trainer: flags, process grid, composition in a fixed order, loop, logging."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=HelpWithDefaults)
    a = p.add_argument
    a("--model", default=None, metavar="{" + ",".join(PRESETS) + "}",
      help="preset for random init (default: tiny; not with --init-from, whose config.json is the model)")
    a("--init-from", default=None, help="HF model dir (config.json + safetensors) to start from")
    a("--data", default=None, help="prepared data dir, or a .txt/.jsonl/folder to prepare; "
                                   "default: the Python stdlib sources, byte-tokenized")
    a("--tokenizer", default=None, help="local HF tokenizer dir used to prepare --data (default: --init-from's "
                                        "own when it has one, else bytes; with a preset, sizes its vocab)")
    a("--chat-template", default=None, choices=["builtin"],
      help="--sft/--dpo/--grpo: render chats with attotron's built-in template (a tokenizer without a "
           "chat_template is refused otherwise)")
    a("--allow-random-init", action="store_true", help="--dpo/--grpo without --init-from: train a random model")
    a("--overwrite", action="store_true", help="--export-hf into a folder that already holds files: replace them")
    a("--data-column", default=None, help="the column of --data (parquet, JSON, arrow, JSONL) holding the text, "
                                          "messages, pairs or prompts (default: by the mode's names)")
    a("--cache-dir", default=None, help="where prepared data and tokenized chats are cached (default "
                                        "~/.cache/attotron; on multi-node runs, storage every node shares)")
    a("--val-fraction", type=float, default=None,
      help="share of the documents held out (whole documents, spread over the corpus) when --data "
           "is prepared: the split of the validation loss (default 0.01; --sft/--dpo/--grpo --data: "
           "at least min(5, a tenth) of the chats, pairs or prompts)")
    a("--seq-len", type=int, default=None, help="tokens per training sequence (default 256; 1024 with --sft "
                                                "and --data, fewer when the longest chat is shorter)")
    a("--batch-size", type=int, default=None, help="global sequences per optimizer step (default 16, at most "
                                                   "the rows --sft --data fills; with --grpo prompts, 64)")
    a("--micro-batches", type=int, default=None,
      help="gradient-accumulation micro-batches per dp rank (default 1; with --pp: 4·pp for gpipe/1f1b, "
           "2·pp for interleaved/zb, or the largest divisor of the dp rank's rows below that)")
    a("--steps", type=int, default=None, help="optimizer steps (default 50; 1000 for the built-in --sft demo, "
                                              "100 for --grpo on the built-in questions)")
    a("--epochs", type=float, default=None, help="passes over the training set, instead of --steps (may be "
                                                 "fractional): steps = ceil(epochs × steps per epoch)")
    a("--lr", type=float, default=None, help="peak learning rate (default 1e-3; 2e-4 with --sft/--dpo/--grpo: "
                                              "post-training wants a lower rate than pretraining; 3e-3 for "
                                              "the built-in --sft demo, which trains from scratch)")
    a("--min-lr", type=float, default=None, help="final learning rate of the cosine decay (default lr/10; "
                                                 "lr with --grpo: constant after the warm-up)")
    a("--warmup", type=int, default=None, help="linear warm-up steps (default 10; with --epochs, a tenth of "
                                                "a run shorter than 20 steps)")
    a("--weight-decay", type=float, default=0.1, help="AdamW decay on matrices (not norms/biases)")
    a("--clip", type=float, default=1.0, help="max global grad norm (0 = off)")
    a("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
      help="compute dtype, masters stay fp32 (auto: bf16 on CUDA, fp32 on CPU; fp32 on CUDA uses TF32)")
    a("--seed", type=int, default=0, help="init and data-order seed")
    a("--metrics", default=None, help="JSONL file: one object per step (rank 0)")
    a("--log-to", default=None, type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
      help="also log each record to tensorboard and/or wandb, comma-separated (beside --metrics: "
           "<metrics>.tensorboard/, wandb/; set WANDB_MODE=offline without a network)")
    a("--export-hf", default=None, help="write an HF-loadable model dir here at the end")
    a("--save", default=None, help="checkpoint dir (step_XXXXXXXX/ folders: safetensors + JSON)")
    a("--save-every", type=int, default=0, help="save every N steps (0: only after the last step)")
    a("--resume", default=None, help="a checkpoint folder, or 'auto' = the newest complete one in --save "
                                     "(any layout can resume any other)")
    a("--keep", type=int, default=3, help="complete checkpoints kept in --save")
    a("--skip-checksums", action="store_true", help="resume without the crc32 check of the checkpoint's "
                                                    "files (one more read of them; sizes are still checked)")
    a("--log-every", type=int, default=1, help="print a log line every N steps")
    a("--eval-every", type=int, default=0,
      help="evaluate every N steps and after the last (0: only after the last): the validation loss "
           "on the held-out split; with --sft, exact-match accuracy on the built-in held-out chats")
    a("--sample-prompts", default=None, help="a text file, one prompt a line: each one's greedy reply is "
                                              "printed at every evaluation (chat modes: a user turn)")
    a("--eval-batches", type=int, default=None,
      help="global batches of the held-out split per validation loss (default 10, fewer when the "
           "split is smaller)")
    # supervised fine-tuning
    a("--sft", action="store_true", help="SFT on chat JSONL (--data) or the built-in arithmetic chats")
    a("--packing", default="ffd", choices=["ffd", "none"],
      help="--sft: FFD-pack conversations or one per row; --dpo: FFD-pack pairs or one reply's chat "
           "per row (a pair is two rows; --batch-size counts pairs; what --cp needs)")
    a("--overlong", default="truncate", choices=["truncate", "drop"],
      help="--sft: what to do with conversations longer than --seq-len (counted and reported)")
    a("--skip-bad", action="store_true", help="--sft: skip and count malformed JSONL lines")
    a("--reply-end", default=None, help="--sft: the token that ends an assistant reply (default: detected "
                                        "from the chat template, e.g. <|eot_id|>; the built-in one: eos)")
    # preference optimization
    a("--dpo", action="store_true", help="DPO on preference-pair JSONL (--data) or the built-in arithmetic "
                                         "pairs; the reference is the starting model (--init-from)")
    a("--dpo-beta", type=float, default=None, help="--dpo: β of the loss (default 0.1)")
    # reinforcement learning with a verifiable reward (grpo.py)
    a("--grpo", action="store_true", help="GRPO on prompt JSONL ({prompt, answer}: --data) or the built-in "
                                          "arithmetic questions; start from a model that can answer (--init-from)")
    a("--grpo-group", type=int, default=None, help="--grpo: replies sampled per prompt, G (default 8)")
    a("--grpo-clip", type=float, default=None, help="--grpo: ε of the clipped ratio (default 0.2)")
    a("--grpo-kl", type=float, default=None, help="--grpo: β of the k3 KL to the initial model; > 0 holds a "
                                                  "copy of the initial weights (default 0: off)")
    a("--grpo-temperature", type=float, default=None, help="--grpo: sampling temperature (default 1.0)")
    a("--grpo-max-new", type=int, default=None, help="--grpo: reply tokens at most (default 8)")
    a("--grpo-updates", type=int, default=None, help="--grpo: optimizer updates per rollout batch, DeepSeekMath's "
                                                     "μ (default 1); from the second the ratio leaves 1 and the "
                                                     "clip acts")
    a("--grpo-rollout-rows", type=int, default=None, help="--grpo: rows (replies) per generate call, whole "
      "groups; 0: as many as keep the KV cache within 4 GiB a rank (default 0)")
    a("--verifier", default=None, help="--grpo: the reward, 'package.module:function' or 'path/file.py:function' "
                                       "of (reply, gold) → float (default grpo:arithmetic_reward, exact match)")
    a("--timeout", type=float, default=600.0,
      help="seconds a collective may wait before the run stops with a message naming the stage")
    a("--io-timeout", type=float, default=3600.0,
      help="seconds ranks wait for each other around checkpoint and export I/O (a gloo group of its "
           "own: writing 12 bytes/param per rank can outlast --timeout)")
    a("--max-bad-steps", type=int, default=3,
      help="abort after this many consecutive steps with a non-finite loss or grad norm (each skipped)")
    # parallelism: world = tp · dp · pp, dp is what is left
    a("--tp", type=int, default=1, help="tensor-parallel degree (innermost in the grid)")
    a("--cp", type=int, default=1, help="context-parallel degree: each rank holds seq-len/cp tokens of "
                                        "every row, attention runs as a ring (cp.py)")
    a("--sp", action="store_true", help="sequence parallelism with --tp: norms and residuals hold "
                                        "seq-len/tp tokens per rank (Megatron)")
    a("--pp", type=int, default=1, help="pipeline stages")
    a("--ep", type=int, default=1, help="expert-parallel degree (an MoE model): each rank holds 1/ep of "
                                        "every layer's experts, tokens travel by all-to-all; ep ranks are "
                                        "taken from the dp·cp ranks (ep divides them)")
    a("--pp-layers", default=None, help="layers per (virtual) stage, e.g. 3,3,2 (default: balanced, the "
                                        "last stage's lm_head + loss counted as layers by their FLOPs)")
    a("--schedule", default="1f1b", choices=sorted(SCHEDULES), help="pipeline schedule")
    a("--virtual-stages", type=int, default=None,
      help="model chunks per pp rank for interleaved / zb (default: 2 for interleaved, else 1)")
    a("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the dp group")
    a("--bucket-mb", type=float, default=25.0, help="gradient bucket size for dp / ZeRO-1/2 (MB)")
    a("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
      help="dtype of gradient accumulation over micro-batches and of dp/ZeRO reductions; bf16 halves "
           "their bytes but loses precision (docs/benchmarks.md: measured error)")
    a("--prefetch", type=int, default=1, help="ZeRO-3: units all-gathered ahead of use")
    a("--ac", action="store_true", help="activation checkpointing (selective unless --ac-mode)")
    a("--ac-mode", default=None, choices=["full", "selective"], help="implies --ac")
    a("--ac-every", type=int, default=1, help="checkpoint layers whose global index is a multiple of k")
    a("--compile", action="store_true", help="torch.compile each decoder layer (hooks, pipeline "
                                             "executor, embedding and head stay eager)")
    a("--fp8", action="store_true", help="the decoder layers' linears multiply in FP8 (fp8.py: tensorwise "
                                         "dynamic scales, e4m3 forward, e5m2 gradients; embedding, head, "
                                         "norms and routers stay bf16)")
    a("--offload", action="store_true", help="ZeRO-Offload with --zero 1/2: fp32 masters, Adam's m and v "
                                             "and the step on the host (offload.py)")
    a("--peak-tflops", type=float, default=None,
      help="the accelerator's dense peak TFLOP/s for MFU (default: from the GPU's name, GPU_PEAK_TFLOPS)")
    # the update rule (muon.py); --lr, --weight-decay stay AdamW's
    a("--optimizer", default="adamw", choices=["adamw", "muon"],
      help="muon: Muon for the hidden matrices, AdamW for the embedding, head, norms and biases")
    a("--muon-lr", type=float, default=None, help="--optimizer muon: Muon's peak lr, scheduled as --lr "
                                                  "is (default 0.02)")
    a("--muon-weight-decay", type=float, default=None, help="--optimizer muon: Muon's decoupled decay "
                                                            "(default 0)")
    add_lora_flags(a)
    args = p.parse_args(argv)
    import model as M  # after parsing: --help and a mistyped flag answer before torch loads
    import sft
    if args.model is not None and args.model not in M.PRESETS:  # argparse's own words for a bad choice
        p.error(f"argument --model: invalid choice: {args.model!r} (choose from {', '.join(sorted(M.PRESETS))})")
    # `is None`, never `or`: a user's 0 must reach validate, not turn into the default
    # the built-in --sft demo trains the tiny model from scratch on short chats: short rows, a
    # pretraining lr, more steps; --grpo on the built-in questions starts from it (docs/post-training.md:
    # what each reaches)
    demo = args.sft and args.data is None and args.init_from is None
    # SFT on the user's chats: the defaults a small set shrinks to fit (feed.fit_small_set logs it)
    fits = args.sft and args.data
    args.fit_to_data = [f for f in ("seq_len", "batch_size") if fits and getattr(args, f) is None]
    if args.val_fraction is None:
        args.val_fraction = 0.01
        args.fit_to_data += ["val_fraction"] if args.data and (args.sft or args.dpo or args.grpo) else []
    if args.warmup is None:  # --epochs: the run's length is known once the data is (fit_warmup)
        args.warmup = 10
        args.fit_to_data += ["warmup"] if args.epochs is not None else []
    rl_demo = args.grpo and args.data is None
    if args.seq_len is None:
        args.seq_len = sft.DEFAULT_SEQ_LEN if (args.sft or args.dpo) and not demo else 256
    if args.lr is None:
        args.lr = 3e-3 if demo else 2e-4 if args.sft or args.dpo or args.grpo else 1e-3
    if args.steps is None and args.epochs is None:  # --epochs: train.load_data counts the steps
        args.steps = 1000 if demo else 100 if rl_demo else 50
    if args.batch_size is None:  # GRPO's gradient is one reward a reply: more prompts a step, less noise
        args.batch_size = 64 if args.grpo else 16
    if args.dpo and args.dpo_beta is None:
        args.dpo_beta = 0.1
    if args.grpo:  # `is None`: a user's 0 reaches validate_grpo
        for flag, value in GRPO_DEFAULTS.items():
            if getattr(args, flag) is None:
                setattr(args, flag, value)
    if args.model is None and args.init_from is None:
        args.model = "tiny"
    if args.optimizer == "muon":
        args.muon_lr = 0.02 if args.muon_lr is None else args.muon_lr
        args.muon_weight_decay = 0.0 if args.muon_weight_decay is None else args.muon_weight_decay
    if args.min_lr is None:  # GRPO: constant after the warm-up (its prompts are drawn anew, no epoch ends)
        args.min_lr = args.lr if args.grpo else args.lr / 10
    return args


# ------------------------------------------------------------------------------------------ checks
def validate(args: argparse.Namespace, cfg: M.LlamaConfig, grid: G.Grid) -> list[str]:
    """Every check that needs no heavy work, all reported at once."""
    import deepseek as DS
    import pp as PP
    import tp as TP
    import weights as W
    errors = []
    if args.model is not None and args.init_from is not None:
        errors.append(f"--model {args.model} with --init-from: the model is --init-from's config.json; "
                      f"drop --model")
    for flag in ("seq_len", "batch_size", "micro_batches", "steps"):
        if getattr(args, flag) is not None and getattr(args, flag) < (0 if flag == "steps" else 1):
            errors.append(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.seq_len > cfg.max_position_embeddings:
        errors.append(f"--seq-len {args.seq_len} > the model's max_position_embeddings {cfg.max_position_embeddings}"
                      + seq_len_fix(args, cfg))
    if args.tp < 1 or args.pp < 1 or args.cp < 1 or grid.world % (args.tp * args.cp * args.pp):
        errors.append(f"world size {grid.world} is not divisible by --tp {args.tp} × --cp {args.cp} × "
                      f"--pp {args.pp}")
        return errors
    dp_size = grid.world // (args.tp * args.cp * args.pp)
    errors += validate_cp(args, cfg)
    try:
        TP.tp_validate(cfg, args.tp, seq_len=args.seq_len if args.sp else None)
    except ValueError as e:
        errors.append(str(e))
    errors += validate_pipeline(args, cfg)
    if grid.device.type == "cuda" and (queues := PP.connections_problem(args.pp, virtual_stages(args), os.environ)):
        errors.append(queues)
    errors += validate_moe(args, cfg)
    errors += DS.refusals(args, cfg)  # deepseek_v3's flags not built or not tested
    errors += validate_ep(args, cfg, dp_size * args.cp)
    micro = micro_batches(args, grid.world)
    if micro >= 1 and args.batch_size % (dp_size * micro):
        errors.append(f"--batch-size {args.batch_size} is not divisible by dp size {dp_size} × "
                      f"--micro-batches {micro}")
    elif micro >= 1 and args.fp8 and grid.device.type == "cuda" and \
            (args.batch_size // (dp_size * micro) * args.seq_len // args.cp) % 16:
        errors.append("--fp8 on CUDA: each matmul's tokens (rows per micro-batch × --seq-len / --cp) must be "
                      "a multiple of 16 (cuBLASLt's FP8 GEMM: dL/dW sums over them)")
    if args.ac_every < 1 or (args.ac_every != 1 and not (args.ac or args.ac_mode)):
        errors.append(f"--ac-every {args.ac_every} needs to be >= 1 and goes with --ac / --ac-mode")
    if args.sft and (args.pp > 1 or args.sp) and not args.data:
        errors.append("the built-in SFT eval generates with the whole model at any length: use --pp 1 "
                      "and no --sp with --sft (or give --data, which has no eval set)")
    if (args.overlong != "truncate" or args.skip_bad or args.reply_end is not None) and not args.sft:
        errors.append("--overlong / --skip-bad / --reply-end go with --sft")
    if args.packing != "ffd" and not (args.sft or args.dpo):
        errors.append("--packing goes with --sft or --dpo")
    if args.sft and args.eval_batches is not None:
        errors.append("--eval-batches sizes the validation loss of pretraining; --sft evaluates "
                      "exact-match accuracy on its built-in held-out chats")
    errors += validate_dpo(args)
    errors += validate_grpo(args)
    errors += validate_lora(args, cfg)
    if args.eval_every and args.dpo and not args.data:
        errors.append(f"--eval-every {args.eval_every} with --dpo on the built-in pairs: they hold none out "
                      f"(--dpo --data holds some of yours out); drop --eval-every")
    if args.sample_prompts and (args.pp > 1 or args.cp > 1 or args.sp):
        errors.append("--sample-prompts generates with the whole model and whole sequences: use --pp 1, "
                      "--cp 1 and no --sp")
    if args.sample_prompts and not Path(args.sample_prompts).is_file():
        errors.append(f"--sample-prompts {args.sample_prompts}: no such file (one prompt a line)")
    if args.epochs is not None and args.steps is not None:
        errors.append(f"--epochs {args.epochs:g} and --steps {args.steps} both set the run's length: give one")
    if args.epochs is not None and not (math.isfinite(args.epochs) and args.epochs > 0):
        errors.append(f"--epochs must be a positive number of passes over the data, got {args.epochs}")
    if args.resume == "auto" and not args.save:
        errors.append("--resume auto needs --save DIR (where to look)")
    if args.save_every < 0 or args.keep < 1:
        errors.append(f"need --save-every >= 0 and --keep >= 1, got {args.save_every} and {args.keep}")
    if args.io_timeout <= 0:
        errors.append(f"--io-timeout must be > 0 seconds, got {args.io_timeout}")
    if args.export_hf and (problem := W.export_problem(args.export_hf)):
        errors.append(f"--export-hf: {problem}")
    elif args.export_hf and not args.overwrite and Path(args.export_hf).is_dir() and any(
            Path(args.export_hf).iterdir()):
        errors.append(f"--export-hf {args.export_hf} already holds a model (or other files): pass --overwrite to "
                      f"replace it, or name a new folder")
    if args.data_column is not None and args.data is None:
        errors.append("--data-column names a column of --data: give --data")
    if args.bucket_mb <= 0 or args.prefetch < 0 or args.max_bad_steps < 1:
        errors.append("--bucket-mb must be > 0, --prefetch >= 0, --max-bad-steps >= 1")
    if args.warmup < 0 or args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        errors.append(f"need 0 <= --min-lr <= --lr and --warmup >= 0 (got lr {args.lr}, "
                      f"min-lr {args.min_lr}, warmup {args.warmup})")
    return errors + validate_more(args) + validate_muon(args)


def validate_muon(args: argparse.Namespace) -> list[str]:
    """--optimizer muon's flags, and the flags it does not combine with (docs/running.md's matrix)."""
    if args.optimizer != "muon":
        given = [f for f in ("muon_lr", "muon_weight_decay") if getattr(args, f) is not None]
        return [f"--{given[0].replace('_', '-')} goes with --optimizer muon"] if given else []
    errors = []
    if not (math.isfinite(args.muon_lr) and args.muon_lr >= 0):
        errors.append(f"--muon-lr must be a finite number >= 0, got {args.muon_lr}")
    if not (math.isfinite(args.muon_weight_decay) and args.muon_weight_decay >= 0):
        errors.append(f"--muon-weight-decay must be a finite number >= 0, got {args.muon_weight_decay}")
    why = {"lora": "the adapters' rank-r factors are not Muon's hidden matrices; LoRA trains with AdamW",
           "fp8": "not built together: no test compares Muon's step under fp8 matmuls with one process",
           "offload": "the offloaded step is AdamW's, on the CPU; Muon's owners exchange pieces on the device"}
    for flag, reason in why.items():  # flags other files add: refused by name wherever they exist
        if getattr(args, flag, None):
            errors.append(f"--optimizer muon with --{flag}: {reason}. Use --optimizer adamw")
    return errors


def validate_more(args: argparse.Namespace) -> list[str]:
    """The flags whose 0, negative or NaN value would otherwise pass silently or crash late. Also
    every output path: a run must not train for hours, then fail to write its result."""
    errors = []
    floats = ("lr", "min_lr", "weight_decay", "clip", "bucket_mb", "timeout", "io_timeout", "val_fraction")
    nan = [f"--{f.replace('_', '-')} {getattr(args, f)}" for f in floats
           if not math.isfinite(getattr(args, f))]
    if nan:
        errors.append(f"need finite numbers, got {', '.join(nan)}")
    if args.weight_decay < 0 or args.clip < 0:
        errors.append(f"--weight-decay and --clip must be >= 0 (--clip 0 turns clipping off), got "
                      f"{args.weight_decay} and {args.clip}")
    if not args.timeout > 0:
        errors.append(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.log_every < 1 or args.eval_every < 0 or (args.eval_batches is not None and args.eval_batches < 1):
        errors.append(f"need --log-every >= 1, --eval-every >= 0 and --eval-batches >= 1, got "
                      f"{args.log_every}, {args.eval_every} and {args.eval_batches}")
    if not 0 <= args.val_fraction < 1:
        errors.append(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.sp and args.tp < 2:
        errors.append("--sp splits each sequence over the tp ranks: it needs --tp > 1")
    errors += validate_log_to(args)
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        errors.append(f"--peak-tflops must be a positive number, got {args.peak_tflops}")
    untested = [f"--{f}" for f in ("lora", "qlora") if getattr(args, f, None)]
    if getattr(args, "optimizer", None) == "muon":
        untested.append("--optimizer muon")
    untested += [f"--{f}" for f in ("sft", "dpo", "grpo") if getattr(args, f)]  # they generate: 1 token a row
    if args.fp8 and untested:
        errors.append(f"--fp8 with {' / '.join(untested)} is not tested: drop one (docs/running.md)")
    if args.offload and (args.zero not in (1, 2) or args.fp8 or untested or args.save or args.resume):
        errors.append("--offload goes with --zero 1 or 2 and pretraining; with --fp8, --save, --resume and "
                      "the post-training modes it is not tested (docs/running.md)")
    return errors + check_outputs(args)


def validate_moe(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[str]:
    """A mixture of experts (model.MOE_FAMILIES) trains at dp with ZeRO-0..3, tp and sp, every pp
    schedule, cp, AC, --compile and --sft. Under tp each rank holds every expert whole. The layouts
    not built yet are refused by name (docs/moe.md)."""
    if not cfg.num_experts:
        return []
    what = f"with an MoE model ({cfg.model_type}, {cfg.num_experts} experts): not yet"
    why = {"--sft --sp": (args.sft and args.sp and cfg.output_router_logits,
                          "a tp rank routes its S/tp tokens and the padding mask is not split with them "
                          "(output_router_logits is true)")}
    return [f"{flag} {what} ({reason})" for flag, (bad, reason) in why.items() if bad]


def validate_ep(args: argparse.Namespace, cfg: M.LlamaConfig, data_ranks: int) -> list[str]:
    """--ep: the experts of every sparse layer split evenly over ep of the dp·cp ranks (moe.py)."""
    if args.ep == 1:
        return []
    if args.ep < 1:
        return [f"--ep must be >= 1, got {args.ep}"]
    errors = []
    if not cfg.num_experts:
        errors.append(f"--ep {args.ep} needs a mixture-of-experts model (mixtral, qwen3_moe, olmoe); "
                      f"{cfg.model_type} has no experts")
    elif cfg.num_experts % args.ep:
        errors.append(f"--ep {args.ep} must divide num_experts={cfg.num_experts} (each rank holds E/ep experts)")
    if args.grpo:
        errors.append(f"--ep {args.ep} with --grpo: each dp rank decodes its own prompts for as many steps as "
                      f"they need, but every forward's all-to-all needs all ep ranks (not built); use --ep 1")
    if data_ranks % args.ep:
        errors.append(f"--ep {args.ep} must divide the {data_ranks} dp·cp ranks (world / (--tp {args.tp} × "
                      f"--pp {args.pp})): the ep ranks are taken from them")
    return errors


def seq_len_fix(args: argparse.Namespace, cfg: M.LlamaConfig) -> str:
    """What to change when --seq-len exceeds the model's positions: the sequence, or the model."""
    import model as M
    longer = [f"--model {n} ({M.PRESETS[n].max_position_embeddings})" for n in PRESETS
              if M.PRESETS[n].max_position_embeddings >= args.seq_len]
    model = f"--init-from {args.init_from}" if args.init_from else f"--model {args.model}"
    return (f" ({model}): use --seq-len {cfg.max_position_embeddings} or less"
            + (f", or a model with more positions: {' or '.join(longer)}" if longer and not args.init_from
               else ", or a model with more positions (--init-from DIR)"))


def validate_log_to(args: argparse.Namespace) -> list[str]:
    """--log-to: known trackers, their packages installed, and --metrics, which they sit beside."""
    if not args.log_to:
        return []
    import trackers
    unknown = [t for t in args.log_to if t not in trackers.PACKAGES]
    if unknown:
        return [f"--log-to {','.join(unknown)}: unknown; choose from {', '.join(trackers.PACKAGES)}"]
    errors = [f"--log-to {t}: the {trackers.PACKAGES[t]} package is not installed (pip install "
              f"{trackers.PACKAGES[t]}), or drop {t} from --log-to" for t in trackers.missing(args.log_to)]
    if not args.metrics:
        errors.append("--log-to needs --metrics FILE.jsonl: the trackers write beside it")
    return errors


def check_outputs(args: argparse.Namespace) -> list[str]:
    """--save and --export-hf are folders, created as needed. --metrics is a file in an existing
    folder. Each must be creatable and writable, and no two may be the same."""
    errors, seen = [], {}
    for flag, path, folder in (("--save", args.save, True), ("--export-hf", args.export_hf, True),
                               ("--metrics", args.metrics, False)):
        if path is None:
            continue
        p = Path(path).resolve()
        if p in seen:
            errors.append(f"{flag} and {seen[p]} are the same path {path}")
        seen[p] = flag
        if folder:
            nearest = next(q for q in (p, *p.parents) if q.exists())  # the root always exists
            if p.exists() and not p.is_dir():
                errors.append(f"{flag} {path} is a file; it must be a folder (or not exist yet)")
            elif not nearest.is_dir():
                errors.append(f"{flag} {path} cannot be created: {nearest} is a file")
            elif not os.access(nearest, os.W_OK):
                errors.append(f"{flag} {path}: {nearest} is not writable")
        elif p.is_dir():
            errors.append(f"{flag} {path} is a folder; it must be a file")
        elif not p.parent.is_dir():
            errors.append(f"{flag} {path}: its folder {p.parent} does not exist")
        elif not os.access(p.parent, os.W_OK) or p.exists() and not os.access(p, os.W_OK):
            errors.append(f"{flag} {path}: it or its folder is not writable")  # replaced by rename
    return errors


def virtual_stages(args: argparse.Namespace) -> int:
    if args.virtual_stages is not None:  # (not `or`: 0 is an error to report, not a default)
        return args.virtual_stages
    return 2 if args.schedule == "interleaved" else 1


def micro_batches(args: argparse.Namespace, world: int) -> int:
    """--micro-batches, or pp.default_microbatches for this layout (a divisor of the dp rank's rows)."""
    if args.micro_batches is not None:
        return args.micro_batches
    dp_size = max(world // max(args.tp * args.cp * args.pp, 1), 1)
    rows = args.batch_size // dp_size if args.batch_size >= dp_size else 1
    import pp as PP
    return PP.default_microbatches(args.schedule, max(args.pp, 1), max(rows, 1))


def layer_ranges(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[range]:
    """Layers of each virtual stage (pp · v of them): --pp-layers, or balanced with the head's cost."""
    import pp as PP
    return PP.partition(cfg.num_hidden_layers, args.pp * virtual_stages(args), parse_layers(args.pp_layers),
                        head=PP.head_cost(cfg, args.seq_len))


def validate_dpo(args: argparse.Namespace) -> list[str]:
    """--dpo's flags (dpo.py)."""
    errors = []
    if args.dpo_beta is not None and not args.dpo:
        errors.append("--dpo-beta goes with --dpo")
    if not args.dpo:
        return errors
    if not args.dpo_beta > 0:
        errors.append(f"--dpo-beta must be > 0, got {args.dpo_beta}")
    if args.sft:
        errors.append("--dpo and --sft are two trainings: choose one (DPO usually starts from an SFT "
                      "model: --init-from its export)")
    if args.cp > 1 and args.packing != "none":
        errors.append("--cp with --dpo needs --packing none: a packed row holds several documents, which "
                      "cp's ring attention cannot mask; --packing none gives each reply's chat a row of "
                      "its own (a pair is two rows, and --batch-size counts pairs)")
    return errors


GRPO_DEFAULTS = {"grpo_group": 8, "grpo_clip": 0.2, "grpo_kl": 0.0, "grpo_temperature": 1.0, "grpo_max_new": 8,
                 "grpo_updates": 1, "verifier": "grpo:arithmetic_reward", "grpo_rollout_rows": 0}


def validate_grpo(args: argparse.Namespace) -> list[str]:
    """--grpo's flags (grpo.py). Generation runs in the training process, on whole parameters and
    whole sequences. Layouts where a rank lacks either are refused."""
    errors = []
    given = [f"--{f.replace('_', '-')}" for f in GRPO_DEFAULTS if getattr(args, f) is not None]
    if given and not args.grpo:
        errors.append(f"{' / '.join(given)} go with --grpo")
    if not args.grpo:
        return errors
    if args.sft or args.dpo:
        errors.append("--grpo with --sft / --dpo: they are separate trainings; choose one (GRPO usually starts "
                      "from an SFT model: --init-from its export)")
    if args.zero == 3:
        errors.append("--zero 3 with --grpo: generation needs whole parameters at every decode step (not built); "
                      "use --zero 2")
    if args.pp > 1:
        errors.append("--pp with --grpo: generation runs the whole model on each rank (not built); use --pp 1")
    if args.cp > 1:
        errors.append("--cp with --grpo: generation decodes whole sequences, which cp splits; use --cp 1")
    if args.sp:
        errors.append("--sp with --grpo: a decode step's one token cannot be split over the tp ranks; drop --sp")
    if args.grpo_group < 2:
        errors.append(f"--grpo-group must be >= 2 (a group of one has advantage 0), got {args.grpo_group}")
    for flag in ("grpo_max_new", "grpo_updates"):
        if getattr(args, flag) < 1:
            errors.append(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("grpo_clip", "grpo_temperature"):
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) > 0):
            errors.append(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.grpo_rollout_rows and args.grpo_rollout_rows < args.grpo_group:
        errors.append(f"--grpo-rollout-rows must be 0 (auto) or >= --grpo-group {args.grpo_group} (a call "
                      f"samples whole groups), got {args.grpo_rollout_rows}")
    if not (math.isfinite(args.grpo_kl) and args.grpo_kl >= 0):
        errors.append(f"--grpo-kl must be >= 0, got {args.grpo_kl}")
    try:
        import grpo
        grpo.load_verifier(args.verifier)
    except ValueError as e:
        errors.append(f"--verifier: {e}")
    return errors


def validate_cp(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[str]:
    """Context parallelism: zigzag chunks of equal length, no packed documents, no sliding window
    shorter than the sequence."""
    errors = []
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        errors.append(f"--cp {args.cp}: --seq-len {args.seq_len} must be a multiple of 2·cp = {2 * args.cp} "
                      f"(each rank holds two of 2·cp equal chunks)")
    if args.cp > 1 and args.sp and args.seq_len // args.cp % args.tp:
        errors.append(f"--cp {args.cp} with --sp: each rank's seq-len/cp = {args.seq_len // args.cp} tokens "
                      f"must split into --tp {args.tp} equal shards")
    windows = {cfg.window(i) for i in range(cfg.num_hidden_layers)} - {None}
    if args.cp > 1 and windows and min(windows) < args.seq_len:
        errors.append(f"--cp {args.cp} with sliding_window={min(windows)} < --seq-len {args.seq_len}: the "
                      f"ring's block masks are causal only; use --cp 1 (or --seq-len <= the window)")
    if args.cp > 1 and args.sft:
        errors.append("--cp with --sft: SFT rows are packed documents (and the eval generates whole "
                      "sequences), which context parallelism does not support; use --cp 1")
    return errors


def validate_pipeline(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[str]:
    """Schedule, virtual stages and layer split (the pipeline part of validate)."""
    errors, v = [], virtual_stages(args)
    if v < 1 or (v > 1 and (args.schedule not in ("interleaved", "zb") or args.pp < 2)):
        errors.append(f"--virtual-stages {v} needs >= 1, and more than 1 goes with --schedule interleaved "
                      f"or zb and --pp >= 2")
    elif args.schedule == "interleaved" and v < 2:  # (v = 1 would silently be 1f1b)
        errors.append("--schedule interleaved needs --virtual-stages >= 2 (1 is --schedule 1f1b)")
    else:
        try:
            layer_ranges(args, cfg)
        except ValueError as e:
            errors.append(str(e))
    if args.schedule == "zb" and (args.ac or args.ac_mode):
        errors.append("--schedule zb with --ac: each W would recompute the checkpointed layers again; use "
                      "--schedule interleaved (or 1f1b) with --ac")
    if args.compile and args.schedule == "zb":
        errors.append("--compile with --schedule zb: a compiled layer's backward is one autograd node, so "
                      "the B/W split would run it twice; use --schedule interleaved (or 1f1b) with --compile")
    return errors


def parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--pp-layers {text!r}: expected comma-separated integers like 3,3,2") from None


def steps_for_epochs(args: argparse.Namespace, steps_per_epoch: int) -> int:
    """--epochs as optimizer steps, once the data set's size is known (train.load_data)."""
    return max(1, math.ceil(args.epochs * steps_per_epoch - 1e-9))  # 3 × 7 steps is 21, not 22


def fit_warmup(args: argparse.Namespace) -> str:
    """A default warm-up longer than half an --epochs run would hold the lr below --lr for most of it.
    It shrinks to a tenth of the run. Returns the log's note ('' when nothing changed)."""
    if "warmup" not in args.fit_to_data or 2 * args.warmup <= args.steps:
        return ""
    default, args.warmup = args.warmup, args.steps // 10
    return (f"  --warmup {args.warmup}, not the default {default}: the run has {args.steps} steps "
            f"(give --warmup to choose)")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to --lr, then cosine decay to --min-lr at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))


# ------------------------------------------------------------------------------------------ device
def flops_per_token(cfg: M.LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token, the usual convention (PaLM, Appendix B; Megatron, torchtitan).
    Forward and backward matmuls cost 6N, N the parameters a token's matmuls read (`active_params`).
    Attention's two matmuls add 12·L·H·Q·T: H heads of Q dims over T tokens. They count the full
    T×T, the causally masked half too, as those references do. So MFUs compare.
    MLA (deepseek_v3): Q is the mean of the q·k and v head dims (QKᵀ and PV differ), v unpadded."""
    q = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) / 2 if cfg.kv_lora_rank else cfg.head_dim
    return 6 * active_params(cfg) + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * q * seq_len


def active_params(cfg: M.LlamaConfig) -> int:
    """The parameters one token's matmuls read. That is every parameter but an untied input
    embedding, a lookup with no FLOPs. A tied matrix counts once, as lm_head. Of a sparse layer's
    experts, only the k of E its router picks count: k·3·H·I of E·3·H·I. The router's (E, H)
    reads whole. A dense model counts every parameter."""
    import model as M
    n = 0
    for name, shape in M.global_shapes(cfg).items():
        size = math.prod(shape)
        n += size // cfg.num_experts * cfg.num_experts_per_tok if ".mlp.experts." in name else size
    return n - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)


# Dense (no sparsity) peak TFLOP/s (bf16, tf32) by GPU name, as torch.cuda.get_device_name reports it.
# Names look like "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GB200". A key matches
# whole words of the name: "L4" is not "NVIDIA L40", nor "B200" "NVIDIA GB200". The longest matching
# key wins, so "H100 PCIe" beats "H100" (`gpu_peak`).
GPU_PEAK_TFLOPS = {
    "A100": (312, 156), "A800": (312, 156), "H100 PCIe": (756, 378), "H100 NVL": (835, 418),
    "H100": (989, 495), "H800 PCIe": (756, 378), "H800": (989, 495), "GH200": (989, 495),
    "H200 NVL": (835, 418), "H200": (989, 495), "B200": (2250, 1100), "GB200": (2500, 1250),
    "L40S": (362, 183), "L40": (181, 90), "L4": (121, 60), "MI300X": (1307, 654),
}


def gpu_peak(name: str) -> tuple[float, float] | None:
    """(bf16, tf32) dense peak TFLOP/s of the GPU called `name`, or None if not in GPU_PEAK_TFLOPS."""
    words = re.findall(r"[a-z0-9]+", name.lower())  # "NVIDIA A100-SXM4-80GB" → nvidia a100 sxm4 80gb
    found = [k for k in GPU_PEAK_TFLOPS if any(words[i:i + len(k.split())] == k.lower().split()
                                                 for i in range(len(words)))]
    return GPU_PEAK_TFLOPS[max(found, key=len)] if found else None


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    """--peak-tflops, or the GPU's dense peak for the compute dtype (bf16, or tf32 for fp32 on CUDA).
    None where unknown (CPU, a GPU not in GPU_PEAK_TFLOPS): the log then shows no MFU."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    import torch
    found = gpu_peak(torch.cuda.get_device_name(device))
    return None if found is None else found[args.dtype != "bf16"] * 1e12


def device_defaults(args: argparse.Namespace, device: torch.device) -> str:
    """--dtype auto becomes bf16 on CUDA, fp32 on CPU. fp32 on CUDA turns TF32 matmuls on: 10-bit
    mantissa inputs, fp32 accumulation, ~8x the fp32 rate. Returns what to say in the log."""
    if args.dtype == "auto":
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    if device.type == "cuda" and args.dtype == "fp32":
        # The legacy setter is the one API every reader agrees with. It sets the new per-backend
        # state too: cuda.matmul.fp32_precision reads "tf32". Setting only the new one makes each
        # legacy reader raise "mix of the legacy and new APIs". Those readers include
        # torch.get_float32_matmul_precision and torch._C._get_cublas_allow_tf32 (torch._dynamo's).
        # cuDNN (convolutions only) keeps its default, TF32 on.
        import torch
        torch.set_float32_matmul_precision("high")
        return "fp32 with TF32 matmuls"
    return args.dtype


# ------------------------------------------------------------------------------------------ LoRA
def add_lora_flags(a) -> None:
    """lora.py's flags (docs/lora.md)."""
    a("--lora", type=int, default=0, help="LoRA rank r: freeze the model, train rank-r adapters (0: off)")
    a("--lora-alpha", type=float, default=None, help="--lora: alpha; the adapters' scale is alpha / r "
                                                      "(default: r, scale 1)")
    a("--lora-dropout", type=float, default=0.0, help="--lora: dropout on the adapters' input")
    a("--lora-targets", default=",".join(LORA_TARGETS),
      help="--lora: comma-separated module names to adapt (default: every attention and MLP projection)")
    a("--qlora", action="store_true", help="--lora: the frozen base of the adapted layers in NF4 with "
                                           "double-quantized scales (qlora.py)")
    a("--export-adapter", default=None, help="--lora: write the adapters here at the end, in PEFT's format "
                                             "(peft.PeftModel.from_pretrained loads it)")
    a("--init-adapter", default=None, help="--lora: start from this PEFT LoRA adapter folder (its r, alpha "
                                           "and targets must match the flags)")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # lora.DEFAULT_TARGETS


def validate_lora(args: argparse.Namespace, cfg: M.LlamaConfig) -> list[str]:
    """--lora and its flags; what it does not combine with yet, by name (docs/running.md)."""
    errors = []
    given = [f for f, v in (("--lora-alpha", args.lora_alpha), ("--lora-dropout", args.lora_dropout or None),
                            ("--lora-targets", args.lora_targets != ",".join(LORA_TARGETS) or None))
             if v is not None]
    given += [f for f, v in (("--export-adapter", args.export_adapter), ("--init-adapter", args.init_adapter),
                             ("--qlora", args.qlora)) if v]
    if not args.lora:
        return [f"{' / '.join(given)} go with --lora R"] if given else []
    if args.lora < 0:
        errors.append(f"--lora must be a rank >= 1, got {args.lora}")
    if not 0 <= args.lora_dropout < 1:
        errors.append(f"--lora-dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lora_alpha is not None and not (math.isfinite(args.lora_alpha) and args.lora_alpha > 0):
        errors.append(f"--lora-alpha must be > 0, got {args.lora_alpha}")
    targets = [t for t in args.lora_targets.split(",") if t]
    if not targets or set(targets) - set(LORA_TARGETS):
        errors.append(f"--lora-targets {args.lora_targets!r}: choose from {', '.join(LORA_TARGETS)}")
    if cfg.num_experts:
        errors.append("--lora with a mixture-of-experts model: adapters on the experts are not built")
    if args.init_adapter:
        errors += check_init_adapter(args, targets)
    if args.export_adapter and Path(args.export_adapter).is_file():
        errors.append(f"--export-adapter {args.export_adapter} is a file; it must be a folder (or not exist yet)")
    if args.qlora and args.export_hf:
        errors.append("--qlora with --export-hf: the merged model would need the NF4 base requantized (not "
                      "built); use --export-adapter DIR")
    for flag in ("fp8", "offload"):
        if getattr(args, flag, None):
            errors.append(f"--lora with --{flag}: not built (docs/running.md)")
    if getattr(args, "optimizer", "adamw") not in ("adamw", None):
        errors.append(f"--lora with --optimizer {args.optimizer}: not built (docs/running.md)")
    return errors


def check_init_adapter(args: argparse.Namespace, targets: list[str]) -> list[str]:
    """--init-adapter: a PEFT LoRA folder whose r, alpha and targets are the flags'."""
    import lora
    try:
        got, _ = lora.load_peft(args.init_adapter)
    except (OSError, ValueError, KeyError) as e:
        return [f"--init-adapter {args.init_adapter}: {e}"]
    alpha = args.lora if args.lora_alpha is None else args.lora_alpha
    bad = [f"{what} {mine} but the adapter's {theirs}" for what, mine, theirs in (
        ("--lora", args.lora, got.rank), ("--lora-alpha", alpha, got.alpha),
        ("--lora-targets", sorted(targets), sorted(got.targets))) if mine != theirs]
    return [f"--init-adapter {args.init_adapter}: {'; '.join(bad)}"] if bad else []
