"""The user's path: a small set of their own chats, --epochs, held-out evaluation, trackers, --help.

- --epochs N: the run counts ceil(N × steps per epoch) steps (the sampler's epoch: every row once,
  the last batch wrapped); each record holds its epoch, the log line shows it; with --steps it is
  refused.
- SFT on 10 short chats with the defaults: --seq-len shrinks from 1024 to the longest chat's power
  of two and --batch-size to the rows there are, each said in the log; a flag the user gave stays.
  A default warm-up longer than half an --epochs run shrinks to a tenth of it, said in the log.
- --log-to tensorboard: its scalars equal the JSONL's (tensorboard's own reader); a tracker whose
  package is missing (wandb here), an unknown one, or one without --metrics is refused by name.
- `python train.py --help` and a mistyped flag import no torch (python -X importtime lists every
  import), and `python bench/bench_theory.py --help` runs by path.
- Held-out evaluation on the user's data, each number against transformers: SFT's validation loss
  and --sample-prompts' greedy replies, GRPO's held-out reward, DPO's held-out implicit rewards.
"""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

import cli
import model as M
import pp_schedules
import sft
from dist import run_ranks
from test_faults import _run


def chats_file(tmp_path, n: int):
    chats, _ = sft.arithmetic_chats(n_train=n, n_eval=1, seed=4)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return path


def test_epochs_and_sft_defaults_fit_a_small_set(tmp_path, capfd):
    """10 chats: they fill fewer rows than a default batch holds."""
    data, m = chats_file(tmp_path, 10), tmp_path / "m.jsonl"
    assert run_ranks(_run, 1, ["--sft", "--data", str(data), "--epochs", "3", "--metrics", str(m)]) == [0]
    out = capfd.readouterr().out
    longest = int(re.search(r"--seq-len (\d+), not the default 1024: the longest chat has (\d+) tokens", out).group(2))
    seq = max(64, 1 << (longest - 1).bit_length())
    rows, got_seq = map(int, re.search(r"data (\d+) sequences of (\d+)", out).groups())
    assert got_seq == seq and rows < 16
    assert f"--batch-size {rows}, not the default 16: the data has {rows} rows" in out
    records = [json.loads(line) for line in m.read_text().splitlines()]
    assert len(records) == 3  # one step an epoch: every row once
    assert [r["epoch"] for r in records] == [1.0, 2.0, 3.0]
    assert "step 3/3 · loss" in out and "epoch 3.00/3" in out
    # the default warm-up of 10 would hold a 3-step run below --lr: it shrinks to a tenth of the run
    assert "--warmup 0, not the default 10: the run has 3 steps (give --warmup to choose)" in out
    assert records[0]["lr"] == 2e-4  # step 1 at the peak, the cosine's start


def test_epochs_count_steps_and_user_flags_stay(tmp_path, capfd):
    """--batch-size 4 given: kept; 50 chats at seq-len 64 in R rows give ceil(R/4) steps an epoch;
    --epochs 1.5 runs ceil(1.5 × that)."""
    data, m = chats_file(tmp_path, 50), tmp_path / "m.jsonl"
    assert run_ranks(_run, 1, ["--sft", "--data", str(data), "--epochs", "1.5", "--batch-size", "4",
                               "--seq-len", "64", "--metrics", str(m), "--warmup", "1"]) == [0]
    out = capfd.readouterr().out
    assert "not the default" not in out
    rows = int(re.search(r"data (\d+) sequences of 64", out).group(1))
    per_epoch = math.ceil(rows / 4)
    records = [json.loads(line) for line in m.read_text().splitlines()]
    assert len(records) == math.ceil(1.5 * per_epoch)
    assert records[-1]["epoch"] == len(records) / per_epoch
    assert run_ranks(_run, 1, ["--sft", "--data", str(data), "--epochs", "2", "--steps", "3"]) == [2]
    assert "--epochs 2 and --steps 3 both set the run's length: give one" in capfd.readouterr().err


ROOT = Path(__file__).resolve().parents[1]


def test_help_imports_no_torch():
    for flags, rc, shown in ((["--help"], 0, "--epochs EPOCHS"), (["--bogus"], 2, "unrecognized arguments")):
        run = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / "train.py"), *flags],
                             capture_output=True, text=True, timeout=120)
        imported = [line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line]
        assert run.returncode == rc and shown in run.stdout + run.stderr, run.stderr[-2000:]
        assert "cli" in imported and not [m for m in imported if m.split(".")[0] == "torch"]
    assert cli.PRESETS == tuple(sorted(M.PRESETS)) and "1f1b" in pp_schedules.SCHEDULES
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_theory.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--zero" in run.stdout, run.stderr


def test_log_to_tensorboard_equals_the_jsonl_and_missing_trackers_are_refused(tmp_path, capfd, monkeypatch):
    """TensorBoard's scalars, read back with its own EventAccumulator, are the JSONL's numbers in
    float32 (its storage). W&B, when installed, runs offline. A missing package, an unknown tracker
    and --log-to without --metrics are refused by name."""
    import trackers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    (tmp_path / "corpus.txt").write_text("".join(p.read_text() for p in sorted(ROOT.glob("*.py")))[:20_000])
    m = tmp_path / "run.jsonl"
    base = ["--data", str(tmp_path / "corpus.txt"), "--steps", "3", "--seq-len", "32", "--batch-size", "4",
            "--metrics", str(m)]
    wandb = not trackers.missing(["wandb"])
    monkeypatch.setenv("WANDB_MODE", "offline")  # the forked rank inherits it
    assert run_ranks(_run, 1, [*base, "--log-to", "tensorboard,wandb" if wandb else "tensorboard"]) == [0]
    records = [json.loads(line) for line in m.read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run.tensorboard"))
    events.Reload()
    for key in ("loss", "grad_norm", "lr", "epoch"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["step"], float(np.float32(r[key]))) for r in records], key
    if wandb:
        assert list((tmp_path / "wandb").glob("offline-run-*"))
    else:
        assert run_ranks(_run, 1, [*base, "--log-to", "wandb"]) == [2]
        assert "--log-to wandb: the wandb package is not installed (pip install wandb)" in capfd.readouterr().err
    assert run_ranks(_run, 1, [*base, "--log-to", "mlflow"]) == [2]
    assert "--log-to mlflow: unknown; choose from tensorboard, wandb" in capfd.readouterr().err
    assert run_ranks(_run, 1, [*base[:-2], "--log-to", "tensorboard"]) == [2]
    assert "--log-to needs --metrics FILE.jsonl" in capfd.readouterr().err


def test_sft_holds_out_chats_for_a_validation_loss(tmp_path, capfd):
    """50 chats, the defaults: 5 held out (1% would be none), spread over the file; --eval-every 2
    prints their loss at steps 2 and 4. --lr 0 keeps the initial weights, so the last one equals
    transformers' loss on the held-out chats (one per row, assistant tokens only), 1e-5, and each
    --sample-prompts reply is transformers' greedy generate on the rendered user turn. --dpo
    with --eval-every on the built-in pairs is refused by name: it holds none out."""
    import torch
    from transformers import LlamaForCausalLM

    import data
    import feed
    import weights as W
    cfg = M.PRESETS["tiny"]
    W.save_hf(dict(W.materialize(M.build(cfg), "cpu", seed=3).named_parameters()), cfg, tmp_path / "init")
    chats = chats_file(tmp_path, 50)
    m, prompts = tmp_path / "m.jsonl", tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 2?\n\nWhat is 40 + 2?\n")
    assert run_ranks(_run, 1, ["--sft", "--init-from", str(tmp_path / "init"), "--data", str(chats),
                               "--packing", "none", "--steps", "4", "--eval-every", "2", "--lr", "0",
                               "--metrics", str(m), "--sample-prompts", str(prompts)]) == [0]
    out = capfd.readouterr().out
    assert "held out 5 of 50 samples for the validation loss (the post-training default" in out
    assert "eval step 2: val loss" in out and "eval step 4: val loss" in out
    got = [json.loads(line)["val_loss"] for line in m.read_text().splitlines() if "val_loss" in line]
    args = cli.parse_args(["--sft", "--data", str(chats)])
    held, _ = feed.held_out_chats(args, 50)
    convs = [json.loads(line)["messages"] for line in chats.read_text().splitlines()]
    tpl = sft.chat_template(data.load_tokenizer(None))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "init").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in held.nonzero()[0]:
            (ids, labels), = sft.tokenize_samples(convs[i], tpl)[0]
            logits = hf(torch.tensor([ids[:-1]])).logits[0]
            lab = torch.tensor(labels)
            total += torch.nn.functional.cross_entropy(logits, lab, ignore_index=-100, reduction="sum").item()
            count += int((lab != -100).sum())
    assert len(got) == 2 and got[0] == got[1]
    samples = [json.loads(line)["samples"] for line in m.read_text().splitlines() if "samples" in line]
    for k, text in enumerate(("What is 2 + 2?", "What is 40 + 2?")):
        ids = tpl.render([{"role": "user", "content": text}], True)
        want = hf.generate(torch.tensor([ids]), max_new_tokens=feed.SAMPLE_TOKENS, do_sample=False,
                           eos_token_id=tpl.end_id, pad_token_id=tpl.end_id)[0, len(ids):].tolist()
        want = tpl.decode(want[:want.index(tpl.end_id)] if tpl.end_id in want else want)
        assert samples == [[samples[0][0], samples[0][1]]] * 2 and samples[0][k] == want, (samples, want)
        assert f"sample step 4: {text!r} → {want!r}" in out
    assert any(samples[0])  # not vacuous: the replies hold text
    assert abs(got[-1] - total / count) <= 1e-5 * total / count, (got, total / count)
    assert run_ranks(_run, 1, ["--dpo", "--init-from", str(tmp_path / "init"), "--eval-every", "2"]) == [2]
    assert "--eval-every 2 with --dpo on the built-in pairs: they hold none out" in capfd.readouterr().err


def length_reward(reply: str, gold: str) -> float:
    """A verifier with partial credit, so that a random model's held-out reward is not 0."""
    return len(reply) / 100


def test_grpo_holds_out_prompts_for_a_reward(tmp_path, capfd):
    """--grpo --data with 50 prompts: 5 held out; --lr 0 keeps the initial weights, so the held-out
    reward at each evaluation is the verifier's mean over transformers' greedy replies to them."""
    import torch
    from transformers import LlamaForCausalLM

    import data
    import feed
    import weights as W
    cfg = M.PRESETS["tiny"]
    W.save_hf(dict(W.materialize(M.build(cfg), "cpu", seed=3).named_parameters()), cfg, tmp_path / "init")
    items = [{"prompt": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(50)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    m = tmp_path / "m.jsonl"
    assert run_ranks(_run, 1, ["--grpo", "--init-from", str(tmp_path / "init"), "--data", str(tmp_path / "p.jsonl"),
                               "--steps", "2", "--eval-every", "1", "--lr", "0", "--batch-size", "2",
                               "--grpo-group", "2", "--verifier", "test_small_sets:length_reward",
                               "--metrics", str(m)]) == [0]
    out = capfd.readouterr().out
    assert "held out 5 of 50 prompts for the held-out reward" in out and "eval step 2: held-out reward" in out
    got = [json.loads(line)["val_reward"] for line in m.read_text().splitlines() if "val_reward" in line]
    held, _ = feed.held_out_chats(cli.parse_args(["--grpo", "--data", "x"]), 50)
    tpl = sft.chat_template(data.load_tokenizer(None))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "init").eval()
    rewards = []
    for i in held.nonzero()[0]:
        ids = tpl.render([{"role": "user", "content": items[i]["prompt"]}], True)
        new = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tpl.end_id,
                          pad_token_id=tpl.end_id)[0, len(ids):].tolist()
        rewards.append(length_reward(tpl.decode(new[:new.index(tpl.end_id)] if tpl.end_id in new else new), ""))
    assert got == [sum(rewards) / len(rewards)] * 2 and got[0] > 0, (got, rewards)


def test_dpo_holds_out_pairs_for_reward_accuracy(tmp_path, capfd):
    """--dpo --data with 50 pairs: 5 held out; after 2 steps the held-out implicit rewards equal the
    textbook's: β(log π − log π_ref) of each reply, π the export and π_ref the start, by
    transformers (the margin within 1e-5 of β·log π_ref: it is a difference of such sums; the
    accuracy exact)."""
    import torch
    from transformers import LlamaForCausalLM

    import data
    import dpo
    import feed
    import weights as W
    cfg = M.PRESETS["tiny"]
    W.save_hf(dict(W.materialize(M.build(cfg), "cpu", seed=3).named_parameters()), cfg, tmp_path / "init")
    pairs = dpo.arithmetic_pairs(50, seed=5)
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"chosen": c, "rejected": r}) + "\n" for c, r in pairs))
    m = tmp_path / "m.jsonl"
    assert run_ranks(_run, 1, ["--dpo", "--init-from", str(tmp_path / "init"), "--data", str(tmp_path / "pairs.jsonl"),
                               "--steps", "2", "--lr", "1e-2", "--warmup", "0", "--batch-size", "4",
                               "--seq-len", "512", "--metrics", str(m), "--export-hf", str(tmp_path / "out")]) == [0]
    out = capfd.readouterr().out
    assert "held out 5 of 50 pairs for the held-out reward accuracy" in out and "eval step 2: held-out reward" in out
    got = json.loads(m.read_text().splitlines()[-1])
    held, _ = feed.held_out_chats(cli.parse_args(["--dpo", "--data", "x"]), 50)
    tpl = sft.chat_template(data.load_tokenizer(None))
    models = [LlamaForCausalLM.from_pretrained(tmp_path / d).eval() for d in ("out", "init")]
    rewards, scale = [], 0.0
    with torch.no_grad():
        for i in held.nonzero()[0]:
            r = []
            for ids, labels in dpo.tokenize_pair(pairs[i], tpl):
                lab = torch.tensor(labels)
                logps = [-torch.nn.functional.cross_entropy(mdl(torch.tensor([ids[:-1]])).logits[0], lab,
                                                            ignore_index=-100, reduction="sum") for mdl in models]
                r.append(0.1 * (logps[0] - logps[1]).item())
                scale = max(scale, 0.1 * abs(logps[1].item()))
            rewards.append(r)
    margin = sum(c - r for c, r in rewards) / len(rewards)
    assert got["val_reward_accuracy"] == sum(c > r for c, r in rewards) / len(rewards)
    # the margin is a difference of fp32 sums of whole replies' log-probs: 1e-5 of those sums bounds it
    assert abs(got["val_reward_margin"] - margin) <= 1e-5 * scale and margin != 0, (got, margin, scale)
