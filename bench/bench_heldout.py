"""Two exports of the built-in arithmetic demo, compared question by question on its held-out set.

What it does
    For each held-out question of `sft.held_out_phrasings` (100 by default, 15 phrasings each) it
    measures, for each model:
      - greedy exact match over the question's 15 prompts (feed.evaluate, as train.py's eval);
      - the expected reward: the mean probability of the gold reply and its end token, computed
        exactly (one forward a prompt, grpo.token_logps), no sampling. At temperature 1 this is what
        a sampled exact match estimates.
    Then the paired difference B − A over the questions: its mean, its standard error, and how many
    questions went up, down or stayed. Paired, because both models answer the same questions: the
    questions' spread in difficulty cancels.

Why
    A greedy eval of 100 questions moves in coarse steps, and one run's before/after totals cannot
    say whether a change is more than noise. docs/post-training.md quotes this script's output.

Run
    python -m bench.bench_heldout out/sft out/grpo
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run by path: import the library from the root
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch

import data
import grpo
import sft
import weights
from feed import evaluate

PHRASINGS = len(sft.SYSTEM_PROMPTS) * len(sft.QUESTIONS)  # prompts a question: 15


@torch.no_grad()
def expected_reward(model: torch.nn.Module, chats: list[sft.Conversation], tpl: sft.ChatTemplate,
                    tok: data.ByteTokenizer) -> list[float]:
    """P(gold reply + end token | prompt) for each single-turn chat, exactly."""
    out = []
    for c in chats:
        prompt, gold = tpl.render(c[:-1], True), tok.encode(c[-1]["content"]) + [tpl.end_id]
        ids = torch.tensor([prompt + gold])  # (1, S)
        labels = ids[:, 1:].clone()  # (1, S - 1): position t predicts ids[t + 1]
        labels[:, :len(prompt) - 1] = -100  # only the reply is scored
        out.append(grpo.token_logps(model, ids[:, :-1], labels).sum().exp().item())
    return out


def per_question(model: torch.nn.Module, chats: list[sft.Conversation], tpl: sft.ChatTemplate,
                 tok: data.ByteTokenizer) -> tuple[list[float], list[float]]:
    """(greedy exact match, expected reward) of each question: the mean over its PHRASINGS prompts."""
    blocks = [chats[i:i + PHRASINGS] for i in range(0, len(chats), PHRASINGS)]
    greedy = [evaluate(model, None, b, template=tpl) for b in blocks]
    reward = [statistics.mean(expected_reward(model, b, tpl, tok)) for b in blocks]
    return greedy, reward


def paired(a: list[float], b: list[float]) -> str:
    """Mean of b − a ± its standard error, and the questions up, down and equal."""
    d = [y - x for x, y in zip(a, b)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return (f"{statistics.mean(d):+.4f} ± {se:.4f} (s.e.), {sum(x > 0 for x in d)} questions up, "
            f"{sum(x < 0 for x in d)} down, {sum(x == 0 for x in d)} equal")


def main(argv: list[str] | None = None) -> dict[str, tuple[list[float], list[float]]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("exports", nargs="+", help="HF folders (train.py --export-hf); two are compared")
    p.add_argument("--questions", type=int, default=None, help="only the first N held-out questions")
    p.add_argument("--seed", type=int, default=0, help="the built-in set's seed (train.py --seed)")
    args = p.parse_args(argv)
    if args.questions is not None and args.questions < 1:
        p.error(f"--questions {args.questions}: at least one question")
    tok = data.ByteTokenizer()  # the built-in demo's
    tpl = sft.chat_template(tok)
    chats = sft.held_out_phrasings(seed=args.seed)[:None if args.questions is None else args.questions * PHRASINGS]
    results = {}
    for d in args.exports:
        results[d] = per_question(weights.load_hf(d), chats, tpl, tok)
        g, r = results[d]
        print(f"{d}: greedy exact match {statistics.mean(g):.1%}, expected reward {statistics.mean(r):.4f} "
              f"({len(g)} questions × {PHRASINGS} phrasings)")
    if len(args.exports) == 2:
        (ga, ra), (gb, rb) = results.values()
        print(f"greedy exact match, paired: {paired(ga, gb)}")
        print(f"expected reward, paired: {paired(ra, rb)}")
    return results


if __name__ == "__main__":
    main()
