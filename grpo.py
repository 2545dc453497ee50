"""GRPO's parts: G sampled replies per prompt, a verifier's reward, group-normalized advantages, the
clipped token-level surrogate. (The training loop, `train.py --grpo`, is not built yet:
docs/post-training.md.)

What it does
    Group Relative Policy Optimization replaces PPO's value model by the other replies to the same
    prompt: sample G replies per prompt (`rollout`, model.generate with the KV cache and one seed per
    reply), score each with a verifier (`arithmetic_reward`: exact match of the reply against the
    gold answer; or any `fn(reply_text, gold) -> float` named by its import path, `load_verifier`),
    and push up the replies that beat their group's mean:
        A_i = (r_i − mean_g r) / (std_g r + ε)       std over the group's G rewards, population
                                                     (correction 0), ε = 1e-4
    A group whose rewards are all equal (all right or all wrong) teaches nothing: its advantages are
    exactly 0 (set so, not left to r − mean, which may round to ±1 ulp), never NaN.
    The loss per reply token t of reply i, with ρ = exp(log π(t) − log π_old(t)):
        ℓ = −min(ρ·A_i, clip(ρ, 1 − ε_clip, 1 + ε_clip)·A_i) + β_KL · (exp(q) − q − 1)
    with q = log π_ref − log π
    (the KL term: Schulman's k3 estimator, ≥ 0, unbiased for KL(π‖π_ref); β_KL = 0: off). The step
    loss is Σ ℓ over every reply token of the step / the GLOBAL count of reply tokens (all dp ranks),
    as the SFT loss is normalized (precision.normalized_loss), so a long reply does not weigh less
    per token than a short one (DAPO's token-level normalization, not GRPO's per-reply mean).

Reference
    Shao et al. 2024, "DeepSeekMath" (GRPO, §4.1); Schulman et al. 2017 (PPO's clipped surrogate);
    Schulman 2020, "Approximating KL Divergence" (k3); Yu et al. 2025, "DAPO" (token-level loss).

Run
    (the trainer is not built yet; the parts are used as in tests/test_grpo.py)

Builds on: model.py (generate: the KV cache and per-sample seeds)

Invariants
    - Advantages equal the formula; an all-equal group gives exactly 0 (tests/test_grpo.py::
      test_advantages).
    - The loss equals the formula token by token, with and without KL (tests/test_grpo.py::
      test_loss_formula); tokens outside the clip range get no gradient from the surrogate.
    - rollout draws G replies per prompt, reproducible from the seed, reply masks ending at the end
      token (tests/test_grpo.py::test_rollout_and_reward).
    - At tp2 the loss and gradients on fixed rollouts equal the single process's within 1e-5
      (tests/test_grpo.py::test_tp2_equals_single_process_on_fixed_rollouts).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from model import generate

EPS = 1e-4
IGNORE_INDEX = -100


def group_advantages(rewards: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """rewards (P, G): G replies per prompt → advantages (P, G), (r − mean) / (std + eps) within each
    group (population std); exactly 0 in a group whose rewards are all equal."""
    r = rewards.float()
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    std = r.std(dim=1, correction=0, keepdim=True)  # (P, 1)
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, torch.zeros_like(r), (r - mean) / (std + eps))


@dataclass
class LossStats:
    clip_fraction: torch.Tensor  # share of reply tokens whose ratio left [1 − ε, 1 + ε]
    kl: torch.Tensor  # mean k3 estimate over the reply tokens (0 without a reference)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              total_tokens: torch.Tensor | int, clip_eps: float = 0.2, kl_beta: float = 0.0,
              ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
    """The clipped token-level surrogate. logp, old_logp, ref_logp, mask: (N, T) per reply token
    (mask True on reply tokens); adv (N,) one advantage per reply; total_tokens: reply tokens of the
    whole step over all ranks (dp.global_count of mask.sum()). Returns Σ ℓ / total_tokens and stats."""
    if kl_beta and ref_logp is None:
        raise ValueError(f"kl_beta={kl_beta} needs ref_logp (the reference's per-token log-probs)")
    ratio = (logp - old_logp).exp()  # (N, T)
    a = adv[:, None]  # (N, 1)
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        q = ref_logp - logp
        kl = q.exp() - q - 1  # (N, T), >= 0
        per_token = per_token + kl_beta * kl
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1)
    clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps)).to(logp.dtype)
    return ((per_token * m).sum() / total_tokens,
            LossStats(clip_fraction=(clipped * m).sum().detach() / n, kl=(kl * m).sum().detach() / n))


def token_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, S) log-prob of each label under the model (0 where -100): the model's own loss with
    reduction "none" (no (T, V) logits; tp's vocab-parallel loss under tp)."""
    return -model(ids, labels=labels, reduction="none").view(labels.shape)


# ----------------------------------------------------------------------------------------- rollouts
@dataclass
class Rollout:
    """G replies per prompt of one prompt length. ids (N, S + n) prompt and reply, N = P·G, group
    after group; labels (N, S + n - 1) aligned with ids[:, :-1] (model.py's convention), the reply
    tokens up to and including the end token as targets, -100 elsewhere (the prompt, after the end)."""
    ids: torch.Tensor
    labels: torch.Tensor
    prompt_len: int

    def replies(self) -> list[list[int]]:
        keep = self.labels != IGNORE_INDEX  # (N, S + n - 1)
        return [row[k].tolist() for row, k in zip(self.labels, keep)]


def rollout(model: torch.nn.Module, prompts: torch.Tensor, group: int, max_new_tokens: int, end_id: int,
            seed: int, temperature: float = 1.0, top_k: int | None = None) -> Rollout:
    """prompts (P, S) of one length → P·G sampled replies (model.generate with the KV cache); reply
    j of prompt p draws with seed (seed, p, j), so a reply never depends on the batch it is in."""
    P, S = prompts.shape
    seeds = [hash((seed, p, j)) % 2**63 for p in range(P) for j in range(group)]
    out = generate(model, prompts.repeat_interleave(group, dim=0), max_new_tokens, end_id,
                   temperature=temperature, top_k=top_k, seeds=seeds)  # (P·G, S + n)
    labels = out[:, 1:].clone()  # (N, S + n - 1): position t predicts out[t + 1]
    labels[:, :S - 1] = IGNORE_INDEX
    ended = (out[:, S:] == end_id).long().cumsum(1)  # (N, n): ≥ 1 from the end token on
    after = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1) > 0  # (N, n) past the end
    labels[:, S - 1:][after] = IGNORE_INDEX
    return Rollout(out, labels, S)


def arithmetic_reward(reply: str, gold: str) -> float:
    """1.0 when the reply is exactly the gold answer (sft.evaluate's check), else 0.0."""
    return float(reply.strip() == gold.strip())


def load_verifier(path: str) -> Callable[[str, str], float]:
    """'package.module:function' → the function (reply_text, gold) → reward; raises naming what is
    missing."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"verifier {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"verifier {path!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"verifier {path!r} is not callable")
    return fn
