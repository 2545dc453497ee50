"""GRPO: sampled replies, a verifier's reward, group-normalized advantages, a clipped surrogate.

The algorithm
    Group Relative Policy Optimization drops PPO's value model. The other replies to the same
    prompt serve as the baseline instead.
    1. `rollout` samples G replies per prompt: model.generate, the KV cache, one seed per reply.
    2. A verifier scores each reply. `arithmetic_reward` is an exact match against the gold answer.
       Any `fn(reply_text, gold) -> float` works, named by its import path or its file (`load_verifier`).
    3. `group_advantages` favours the replies that beat their group's mean:
           A_i = (r_i − mean_g r) / (std_g r + ε)      population std of the G rewards, ε = 1e-4
       A group of equal rewards (all right or all wrong) teaches nothing. Its advantages are exactly 0.
    4. `grpo_loss` per reply token t of reply i, with ρ = exp(log π(t) − log π_old(t)):
           ℓ = −min(ρ·A_i, clip(ρ, 1 − ε_clip, 1 + ε_clip)·A_i) + β_KL · (exp(q) − q − 1)
       Here q = log π_ref − log π. The KL term is Schulman's k3 estimator (β_KL = 0 turns it off).
       The step loss is Σ ℓ over the step's reply tokens / their GLOBAL count (all dp ranks).
       So a long reply weighs as much per token as a short one (DAPO's token-level loss).

The trainer (after the refinement banner)
    Each step the policy samples in the training process, so no weights are synced.
    `Trainer.rollout_batch` scores the replies and takes their old log-probs, without grad.
    The loss enters through the model's `loss_fn` seam (GRPOLoss), as dpo.py's does.
    train.py makes μ optimizer updates on each rollout batch (--grpo-updates, default 1).
    The ratio is 1 at the first. From the second on the policy has moved, and the clip acts.
    Layouts: dp, tp and ZeRO-0..2 (cli.py refuses the rest).

Run
    python train.py --sft --export-hf out/sft && python train.py --grpo --init-from out/sft   # the demo
    python train.py --grpo --init-from DIR --grpo-group 8 [--grpo-kl 0.04] [--verifier pkg.mod:fn]
    torchrun --nproc_per_node 4 train.py --grpo --init-from DIR --tp 2 --zero 1 --data prompts.jsonl

Reference
    Shao et al. 2024, "DeepSeekMath" (GRPO, §4.1). Schulman et al. 2017 (PPO's clipped surrogate).
    Schulman 2020, "Approximating KL Divergence" (k3). Yu et al. 2025, "DAPO" (token-level loss).

Builds on: model.py (generate). The glue also uses sft.py, pairing.py, formats.py and feed.py.

Invariants (tests/test_grpo.py)
    - Advantages equal the formula. An all-equal group gives exactly 0 (test_advantages).
    - The loss equals the formula token by token, with and without KL (test_loss_formula).
      A token whose ratio left the clip range on the side its advantage favours gets no
      gradient from the surrogate.
    - Replies are reproducible from the seeds; labels end at the end token (test_rollout_and_reward).
    - tp2 gives the single process's loss and gradients within 1e-5 on fixed rollouts
      (test_tp2_equals_single_process_on_fixed_rollouts). So do train.py's losses, logs and
      parameters at tp2 and dp2·zero1 (test_trainer_layouts_equal_single_process_on_fixed_rollouts).
    - μ = 2 updates equal the same two written out with torch.optim.AdamW
      (test_updates_reuse_the_rollout). A resume keeps the KL reference (test_resume_keeps_the_kl_reference).
    - A short run raises the arithmetic reward (test_short_run_raises_the_arithmetic_reward).
      train.py scores the held-out questions before and after (test_builtin_eval_before_and_after).
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from model import generate

EPS = 1e-4
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------- the loss
def group_advantages(rewards: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """rewards (P, G): G replies per prompt → advantages (P, G), (r − mean) / (std + eps) per group.
    The std is the population one. A group whose rewards are all equal gets exactly 0."""
    # The group mean stands in for a value model's estimate of E[reward | prompt]. Subtracting a
    # baseline leaves the policy gradient unbiased and cuts its variance. The std puts every prompt
    # on one scale.
    r = rewards.float()
    mean = r.mean(dim=1, keepdim=True)  # (P, 1)
    std = r.std(dim=1, correction=0, keepdim=True)  # (P, 1)
    # set to 0, not left to r − mean: that may round to ±1 ulp, and then divide by ε
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)  # (P, 1)
    return torch.where(equal, torch.zeros_like(r), (r - mean) / (std + eps))


@dataclass
class LossStats:
    clip_fraction: torch.Tensor  # share of reply tokens whose ratio left [1 − ε, 1 + ε]
    kl: torch.Tensor  # mean k3 estimate over the reply tokens (0 without a reference)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              total_tokens: torch.Tensor | int, clip_eps: float = 0.2, kl_beta: float = 0.0,
              ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, LossStats]:
    """The clipped token-level surrogate. Returns Σ ℓ / total_tokens and the stats.
    logp, old_logp, ref_logp and mask are (N, T), per reply token. mask is True on reply tokens.
    adv (N,) holds one advantage per reply. total_tokens counts the step's reply tokens on all
    ranks (dp.global_count of mask.sum())."""
    # Why the ratio. The replies were sampled from π_old, so importance sampling gives
    # ∇E_π[A] = E_π_old[ρ·A·∇log π]. That is the gradient of ρ·A, and at ρ = 1 the plain policy gradient.
    # Why the clip. min() takes the more pessimistic of ρ·A and clip(ρ)·A. Once ρ has left
    # [1 − ε, 1 + ε] on the side that A favours, that term is a constant: it has no gradient.
    # So one batch cannot pull the policy far from π_old.
    # Why k3. E_π[exp(q)] = E_π[π_ref/π] = 1, so E_π[exp(q) − q − 1] = E_π[−q] = KL(π ‖ π_ref).
    # Each term is ≥ 0 (exp(x) ≥ 1 + x): lower variance than −q alone.
    if kl_beta and ref_logp is None:
        raise ValueError(f"kl_beta={kl_beta} needs ref_logp (the reference's per-token log-probs)")
    ratio = (logp - old_logp).exp()  # (N, T)
    a = adv[:, None]  # (N, 1): a reply's advantage on each of its tokens
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
    # divided by the step's count, not this batch's: every token weighs the same (as SFT's loss)
    return ((per_token * m).sum() / total_tokens,
            LossStats(clip_fraction=(clipped * m).sum().detach() / n, kl=(kl * m).sum().detach() / n))


def token_logps(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, S) log-prob of each label, 0 where it is -100. The model's own loss with reduction
    "none" gives it: no (T, V) logits, and tp's vocab-parallel loss under tp."""
    return -model(ids, labels=labels, reduction="none").view(labels.shape)


# ----------------------------------------------------------------------------------------- the rollout
@dataclass
class Rollout:
    """One prompt's G replies. ids (G, L + m) hold the prompt (L tokens), then the replies.
    m is the longest reply's length. A row past its end token holds only end tokens.
    labels (G, L + m - 1) align with ids[:, :-1], as model.py expects. The targets are the reply
    tokens up to and including the end token. The rest is -100: the prompt, and after the end."""
    ids: torch.Tensor
    labels: torch.Tensor

    def replies(self) -> list[list[int]]:
        """Each row's targets: one host copy of the labels, no boolean indexing on the device."""
        return [[t for t in row if t != IGNORE_INDEX] for row in self.labels.tolist()]


def reply_seeds(seed: int, prompts: int, group: int) -> list[int]:
    """The sampling seed of each of P·G replies: reply j of prompt p draws with (seed, p, j)."""
    return [hash((seed, p, j)) % 2**63 for p in range(prompts) for j in range(group)]


def rollout(model: torch.nn.Module, prompts: list[list[int]], group: int, max_new_tokens: int, end_id: int,
            seeds: list[int], temperature: float = 1.0, top_k: int | None = None,
            max_rows: int | None = None) -> list[Rollout]:
    """P prompts (token ids, any lengths) → a Rollout of G sampled replies for each.
    One model.generate call per chunk of whole groups, at most max_rows rows (None: one call).
    A chunk's prompts are right-padded, their lengths given. Reply i draws with seeds[i] (P·G of
    them, e.g. reply_seeds). A reply depends on its prompt and seed only, never on its batch.
    So each Rollout equals a call for its prompt alone, whatever the chunks (test_rollout_chunks)."""
    per = len(prompts) if max_rows is None else max(1, max_rows // group)  # prompts a call
    return [ro for c in range(0, len(prompts), per)
            for ro in _rollout(model, prompts[c:c + per], group, max_new_tokens, end_id,
                               seeds[c * group:(c + per) * group], temperature, top_k)]


def _rollout(model: torch.nn.Module, prompts: list[list[int]], group: int, max_new_tokens: int, end_id: int,
             seeds: list[int], temperature: float, top_k: int | None) -> list[Rollout]:
    """rollout's one generate call, for all of `prompts`."""
    # The layout, for prompts of 2 and 3 tokens, G = 1, replies "a b END" and "c END":
    #   ids  p p END     out  p p a b END END     cols  2 3 4     after  F F F
    #        p p p            p p p c END END           3 4 5            F F T
    # out's row b holds its reply from lengths[b] on; cols reads the replies; after marks what
    # follows each end token. A prompt's rows are cut after its longest reply, end token included.
    S = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.tensor([p + [end_id] * (S - len(p)) for p in prompts], device=device)  # (P, S)
    lengths = [len(p) for p in prompts for _ in range(group)]
    out = generate(model, ids.repeat_interleave(group, dim=0), max_new_tokens, end_id, temperature=temperature,
                   top_k=top_k, seeds=seeds, lengths=lengths)  # (P·G, S + n): reply b from lengths[b]
    n = out.shape[1] - S  # the steps decoded
    # reply b starts at its own prompt's length: generate writes it over that row's padding
    cols = torch.tensor(lengths, device=device)[:, None] + torch.arange(n, device=device)  # (P·G, n)
    after = _past_end(out.gather(1, cols), end_id)  # (P·G, n): past each reply's end token
    # each prompt's longest reply, its end token included: one host read for the whole batch
    longest = (~after).sum(1).view(len(prompts), group).amax(1).tolist()  # (P,)
    return [_labeled(rows[:, :len(p) + m], len(p), end_id) for p, m, rows in zip(prompts, longest, out.split(group))]


def _past_end(replies: torch.Tensor, end_id: int) -> torch.Tensor:
    """replies (N, n) → (N, n) bool: True after the first end token. The end token itself is False."""
    ended = (replies == end_id).long().cumsum(1)  # (N, n): ≥ 1 from the end token on
    return torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], dim=1) > 0


def _labeled(ids: torch.Tensor, L: int, end_id: int) -> Rollout:
    """ids (G, L + m): a prompt of L tokens and G replies → their Rollout. The caller cuts the rows
    after the longest reply's end token: the columns past every row's end hold nothing to learn."""
    labels = ids[:, 1:].clone()  # (G, L + m - 1): position t predicts ids[t + 1]
    labels[:, :L - 1] = IGNORE_INDEX
    labels[:, L - 1:][_past_end(ids[:, L:], end_id)] = IGNORE_INDEX
    return Rollout(ids, labels)


# ---- refinement: a row cap for the rollouts' KV cache
ROLLOUT_CACHE_BUDGET = 4 * 2**30  # bytes: the KV cache a rollout call may hold per rank, by default


def cache_bytes(model: torch.nn.Module, rows: int, positions: int) -> int:
    """The KVCache of `rows` rows of `positions` (prompt + new tokens): 2 (k and v) · rows ·
    positions · Σ over the attention layers of this rank's k_proj width (nkv/tp · head_dim) · the
    element size. The cache holds k_proj's outputs, so under tp a rank counts its own heads."""
    ks = [m.k_proj.weight for m in model.modules() if hasattr(m, "k_proj")]
    return 2 * rows * positions * sum(w.shape[0] for w in ks) * ks[0].element_size()


def rollout_rows(model: torch.nn.Module, group: int, positions: int, cap: int = 0,
                 budget: int = ROLLOUT_CACHE_BUDGET) -> int:
    """The rows of one rollout call: `cap` (--grpo-rollout-rows) if given, else the most whole
    groups whose cache_bytes at `positions` fit `budget`. At least one group."""
    if cap:
        return cap
    return max(1, budget // cache_bytes(model, group, positions)) * group


# ---- refinement: the trainer's glue (train.py --grpo): verifiers, prompts, a step's micro-batches
def arithmetic_reward(reply: str, gold: str) -> float:
    """1.0 when the reply is exactly the gold answer (sft.evaluate's check), else 0.0."""
    return float(reply.strip() == gold.strip())


def load_verifier(path: str) -> Callable[[str, str], float]:
    """'package.module:function' or 'path/to/file.py:function' → the function (reply_text, gold) →
    reward. A file is run as a module of its own. Raises naming what is missing."""
    module, _, name = path.rpartition(":")
    if not module or not name:
        raise ValueError(f"verifier {path!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module.endswith(".py"):
            if not os.path.isfile(module):
                raise ValueError(f"verifier {path!r}: the file {module} does not exist")
            spec = importlib.util.spec_from_file_location(f"verifier_{os.path.basename(module)[:-3]}", module)
            found = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(found)
        else:
            found = importlib.import_module(module)
        fn = getattr(found, name)
    except ImportError as e:
        where = "" if module.endswith(".py") else (
            f"; a module is looked up on sys.path: put its folder on PYTHONPATH, or name its file "
            f"(path/to/{module.rpartition('.')[2]}.py:{name})")
        raise ValueError(f"verifier {path!r}: {e}{where}") from None
    except AttributeError as e:
        raise ValueError(f"verifier {path!r}: {e}") from None
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while it loads
        raise ValueError(f"verifier {path!r}: loading {module} raised {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"verifier {path!r} is not callable")
    return fn


@dataclass
class PromptSet:
    """Prompts (token ids, ending with the generation prompt) and the gold answer of each.
    `len` and `check_vocab` serve train.py, as any data set does. The sampler draws prompt indices."""
    prompts: list[list[int]]
    golds: list[str]
    dropped: int = 0  # prompts longer than --seq-len − --grpo-max-new

    def __len__(self) -> int:
        return len(self.prompts)

    def check_vocab(self, model_vocab_size: int) -> None:
        top = max(max(p) for p in self.prompts)
        if top >= model_vocab_size:
            raise ValueError(f"the GRPO prompts hold token id {top} but the model's vocab_size is "
                             f"{model_vocab_size}")


GOLD = ("answer", "solution", "ground_truth")  # the gold answer's field, first found


def parse_prompt(obj: Any, column: str | None = None) -> tuple[list, str]:
    """{"prompt": text or chat turns, "answer": gold} → (turns, gold). TRL's prompt formats: the
    prompt is text or turns; the gold may be "solution" or "ground_truth". `column` names the prompt."""
    key = column or "prompt"
    gold = next((g for g in GOLD if isinstance(obj, dict) and obj.get(g) is not None), None)
    if not isinstance(obj, dict) or key not in obj or gold is None:
        raise ValueError(f"expected an object with {key!r} and a gold answer ({', '.join(map(repr, GOLD))})")
    p = obj[key]
    turns = [{"role": "user", "content": p}] if isinstance(p, str) else p
    if not isinstance(turns, list) or not all(isinstance(t, dict) and "role" in t and "content" in t for t in turns):
        raise ValueError(f"{key!r} must be text or a list of {{role, content}} turns")
    return turns, str(obj[gold])


def load_prompts(path: str, column: str | None = None, cache_dir: Any = None) -> list[tuple[list, str]]:
    """Prompts with their gold answers (parse_prompt) from JSONL, one a line, or any record file or
    folder that formats.py reads."""
    import json
    if column or not str(path).endswith(".jsonl"):
        import formats
        return formats.parse_all(path, lambda r: parse_prompt(r, column), cache_dir=cache_dir)[0]
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(parse_prompt(json.loads(line)))
                except ValueError as e:  # json.JSONDecodeError is one
                    raise ValueError(f"{path}:{n}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def load(args: Any, grid: Any) -> tuple[PromptSet, Any, list]:
    """--data's prompts, or the built-in arithmetic questions (one question each, no follow-ups).
    Also, for train.py's exact-match eval, the built-in set's held-out questions in every phrasing
    (sft.held_out_phrasings; none with --data). The built-in split is the SFT demo's, whatever --seed.
    So no held-out question is ever trained on."""
    import pairing  # the run's template: the tokenizer's own, or --chat-template builtin
    import sft
    tpl = pairing.chat_template(args)
    if args.data:
        import feed
        items, eval_set = load_prompts(args.data, getattr(args, "data_column", None), feed.cache_dir(args)), []
    else:
        chats, _ = sft.arithmetic_chats(n_train=5000, p_follow_up=0.0)
        eval_set = sft.held_out_phrasings()
        items = [(c[:-1], c[-1]["content"]) for c in chats]
    encoded = [(tpl.render(turns, True), gold) for turns, gold in items]
    fits = [(p, g) for p, g in encoded if len(p) + args.grpo_max_new <= args.seq_len]
    if not fits:
        raise ValueError(f"no GRPO prompt fits --seq-len {args.seq_len} with --grpo-max-new "
                         f"{args.grpo_max_new}")
    ds = PromptSet([p for p, _ in fits], [g for _, g in fits], len(encoded) - len(fits))
    if grid.rank == 0:
        print(f"GRPO: {len(ds)} prompts, {args.grpo_group} replies each per step"
              + (f", {ds.dropped} longer than --seq-len − --grpo-max-new dropped" if ds.dropped else ""),
              flush=True)
    return ds, tpl, eval_set


class GRPOLoss:
    """The model's `loss_fn(hidden, weight, labels, reduction)` under GRPO.
    `base` is the layout's own loss (loss.py's chunked cross entropy, or tp's vocab-parallel one).
    GRPOLoss runs it per token, then grpo_loss. "sum" gives Σ ℓ: the pipeline divides by the
    step's global reply-token count. `batch` holds the micro-batch's grpo_old, grpo_adv (and grpo_ref).
    Trainer's pre-hook sets it. Without it (the no-grad log-prob passes) GRPOLoss is `base` itself.
    `sums` (clipped tokens, Σ KL) feed the log."""

    def __init__(self, base: Callable[..., torch.Tensor], clip_eps: float, kl_beta: float):
        self.base, self.clip_eps, self.kl_beta = base, clip_eps, kl_beta
        self.batch: dict[str, torch.Tensor] | None = None
        self.sums = torch.zeros(2, dtype=torch.float64)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 reduction: str = "mean") -> torch.Tensor:
        if self.batch is None:
            return self.base(hidden, weight, labels, reduction)
        if reduction != "sum":
            raise ValueError(f"the GRPO loss is a sum over reply tokens (the pipeline divides), "
                             f"got {reduction!r}")
        logp = -self.base(hidden, weight, labels, "none").view(labels.shape)  # (B, S)
        b, mask = self.batch, labels != IGNORE_INDEX
        # total_tokens 1: this returns Σ ℓ, and the pipeline divides by the step's reply tokens
        loss, stats = grpo_loss(logp, b["grpo_old"], b["grpo_adv"], mask, 1, self.clip_eps, self.kl_beta,
                                b.get("grpo_ref"))
        n = mask.sum().double()  # on the device: the log's one all-reduce reads it (no host sync here)
        self.sums = self.sums.to(logp.device) + torch.stack([stats.clip_fraction, stats.kl]).double() * n
        return loss


KEYS = ("grpo_old", "grpo_adv", "grpo_ref")


class Trainer:
    """One GRPO step's data, and its log (`stats`).
    `rollout_batch` turns the sampler's prompt indices into micro-batches: rollouts, rewards,
    advantages, old and reference log-probs. Build it after tp, since it wraps the model's loss_fn.
    Build it after the optimizer has materialized the parameters, too.
    The reference (--grpo-kl > 0) is a copy of the initial trained parameters, this rank's shards.
    Frozen ones (LoRA's base) never change: the reference shares them, so LoRA copies only its adapters.
    train.py builds it before --resume loads a checkpoint, from complete (gathered) parameters.
    It runs through torch.func.functional_call: no second module."""

    def __init__(self, model: torch.nn.Module, args: Any, tpl: Any, device: torch.device):
        self.model, self.args, self.tpl, self.device = model, args, tpl, device
        self.verifier = load_verifier(args.verifier)
        self.loss = GRPOLoss(model.loss_fn, args.grpo_clip, args.grpo_kl)
        model.loss_fn = self.loss
        model.register_forward_pre_hook(self._take_keys, with_kwargs=True)
        self.ref = ({n: p.detach().clone() if p.requires_grad else p.detach() for n, p in model.named_parameters()}
                    if args.grpo_kl > 0 else None)
        # a row's cache holds at most --seq-len positions: longer prompts were dropped (load)
        self.rows = rollout_rows(model, args.grpo_group, args.seq_len, args.grpo_rollout_rows)
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"GRPO rollouts: up to {self.rows} rows a generate call, a KV cache of at most "
                  f"{cache_bytes(model, self.rows, args.seq_len) / 2**20:,.1f} MiB a rank"
                  + ("" if args.grpo_rollout_rows else " (--grpo-rollout-rows 0: within 4 GiB)"), flush=True)
        # Σr, Σr², replies, right (r >= 1), reply tokens, positions (rows × their length L), and
        # positions × L: attention's FLOPs grow with L, and MFU needs them
        self.local = torch.zeros(7, dtype=torch.float64)

    def _take_keys(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        batch = {k: kwargs.pop(k) for k in KEYS if k in kwargs}
        self.loss.batch = batch or None
        return args, kwargs

    def logps(self, ids: torch.Tensor, labels: torch.Tensor, ref: bool = False) -> torch.Tensor:
        """(B, S) per-token log-probs under the policy now (the old ones) or the reference."""
        if not ref:
            return token_logps(self.model, ids, labels)
        kw = {"labels": labels, "reduction": "none"}
        out = torch.func.functional_call(self.model, self.ref, (ids,), kw)  # (B·S,) token losses
        return -out.view(labels.shape)

    def score(self, ro: Rollout, gold: str) -> tuple[torch.Tensor, str | None]:
        """(G,) rewards: the verifier on each decoded reply, its end token removed, and the first
        failure's description (None if none). A reply cut at --grpo-max-new is scored as it stands.
        A verifier that raises, or returns NaN or a non-number, fails: never a silent 0."""
        end, out = self.tpl.end_id, []
        for r in ro.replies():
            text = self.tpl.decode(r[:-1] if r and r[-1] == end else r)
            problem = None
            try:
                v = self.verifier(text, gold)
                if not isinstance(v, numbers.Real):
                    problem = f"returned {v!r} ({type(v).__name__}), not a number"
                elif math.isnan(v):
                    problem = "returned NaN"
            except Exception as e:  # noqa: BLE001 - the user's code: any error is named, then stops the run
                problem = f"raised {type(e).__name__}: {e}"
            if problem:
                return torch.zeros(len(out)), (f"--verifier {self.args.verifier} {problem} on the reply "
                                               f"{text[:200]!r} (gold {gold!r})")
            out.append(float(v))
        return torch.tensor(out), None

    @torch.no_grad()
    def rollout_batch(self, opt: Any, ds: PromptSet, rows: list[int], step: int,
                      micro_batches: int) -> list[dict[str, torch.Tensor]]:
        """This dp rank's prompts → G scored replies each, as micro-batches of right-padded rows.
        Each holds input_ids, labels, grpo_adv, grpo_old (and grpo_ref). Reply j of prompt r draws
        with the seed of (--seed, step, r, j): the same in every layout. Generate calls of at most
        `rows` rows (whole groups) sample the prompts, whatever their lengths."""
        a, G = self.args, self.args.grpo_group
        opt.finish_gathers()  # ZeRO-1/2: generation reads complete parameters
        seeds = [s for r in rows for s in reply_seeds(hash((a.seed, step, r)) % 2**63, 1, G)]
        ros = rollout(self.model, [ds.prompts[r] for r in rows], G, a.grpo_max_new, self.tpl.end_id, seeds,
                      temperature=a.grpo_temperature, max_rows=self.rows)  # a generate call per chunk
        scored = [self.score(ro, ds.golds[r]) for ro, r in zip(ros, rows)]
        agree_verified(next((p for _, p in scored if p), None), self.device)  # before any rank waits elsewhere
        rewards = torch.stack([t for t, _ in scored])  # (P, G)
        return self.batch(ros, rewards, micro_batches)

    @torch.no_grad()
    def batch(self, ros: list[Rollout], rewards: torch.Tensor,
              micro_batches: int) -> list[dict[str, torch.Tensor]]:
        """Fixed rollouts (P of G replies) and their rewards (P, G) → the step's micro-batches."""
        L = max(ro.labels.shape[1] for ro in ros)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, L - t.shape[1]), value=v)  # noqa: E731
        ids = torch.cat([pad(ro.ids[:, :-1], self.tpl.pad_id) for ro in ros])  # (P·G, L)
        labels = torch.cat([pad(ro.labels, IGNORE_INDEX) for ro in ros])  # (P·G, L)
        adv = group_advantages(rewards).flatten().to(self.device)  # (P·G,)
        mask = labels != IGNORE_INDEX
        r = rewards.flatten().double()
        self.loss.sums = torch.zeros(2, dtype=torch.float64)
        self.local = torch.stack([r.sum(), (r * r).sum(), torch.tensor(float(r.numel())),
                                  (r >= 1).sum().double(), mask.sum().double().cpu(),
                                  torch.tensor(float(ids.numel())), torch.tensor(float(ids.numel() * L))])
        micro = []
        for i, l, g in zip(ids.chunk(micro_batches), labels.chunk(micro_batches), adv.chunk(micro_batches)):
            mb = {"input_ids": i, "labels": l, "grpo_adv": g, "grpo_old": self.logps(i, l)}
            if self.ref is not None:
                mb["grpo_ref"] = self.logps(i, l, ref=True)
            micro.append(mb)
        return micro

    def reduce_log(self, group: Any = None) -> torch.Tensor:
        """The step's log sums over every dp rank, on the device: one all-reduce of 9 numbers.
        A group of one reduces nothing. train.py calls this after the step's last backward.
        It reads the result (`stats`) after the optimizer's host sync, so the log adds no sync."""
        import torch.distributed as dist
        t = torch.cat([self.local.to(self.device), self.loss.sums.to(self.device)])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t

    def stats(self, sums: torch.Tensor) -> dict[str, float]:
        """The step's log from reduce_log's sums.
        - reward mean and std (population, over all replies); accuracy, the share of rewards >= 1;
        - mean reply length in tokens, the end token included;
        - mean KL and clip fraction per reply token, over the step's μ updates;
        - `positions`: the token positions trained on (padded rows, all dp ranks, times μ).
          train.py's tokens/s and MFU count these, not --batch-size × --seq-len;
        - `row_len`: the rows' length, weighted by their positions (each dp rank pads to its own
          longest). Attention's FLOPs per token grow linearly with it.
          So cli.flops_per_token(cfg, row_len) is the step's exact mean."""
        s, s2, n, right, tokens, positions, by_len, clipped, kl = sums.tolist()
        mean, mu = s / n, self.args.grpo_updates  # the loss ran μ times over the step's reply tokens
        return {"reward_mean": mean, "reward_std": max(s2 / n - mean * mean, 0.0) ** 0.5,
                "accuracy": right / n, "reply_len": tokens / n, "kl": kl / max(tokens * mu, 1),
                "clip_fraction": clipped / max(tokens * mu, 1), "positions": positions * mu,
                "row_len": by_len / positions}


class VerifierError(ValueError):
    """The verifier failed on some rank. Every rank raises it with the same message (agree_verified)."""


def agree_verified(problem: str | None, device: torch.device, group: Any = None) -> None:
    """Raise VerifierError on every rank of `group` if the verifier failed on any of them.
    It is the first collective after scoring. A rank whose verifier raised would otherwise leave
    its peers waiting in the next one (NCCL: until the watchdog's timeout). One all-reduce of a
    flag per step; only on a failure, an all_gather_object of the messages, so rank 0 names it."""
    import torch.distributed as dist
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        if problem:
            raise VerifierError(problem)
        return
    flag = torch.tensor([problem is not None], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        msgs: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(msgs, problem, group=group)
        raise VerifierError("; ".join(f"rank {i}: {m}" for i, m in enumerate(msgs) if m))


def stats_text(s: dict[str, float]) -> str:
    """The step line's GRPO part."""
    return (f"reward {s['reward_mean']:.3f} ± {s['reward_std']:.3f} · acc {s['accuracy']:.1%} · "
            f"reply {s['reply_len']:.1f} tok · kl {s['kl']:.4f} · clip {s['clip_fraction']:.1%}")
