"""Direct preference optimization: chosen and rejected replies, a frozen reference, one loss per pair.

The loss
    A preference pair is one prompt with two replies, the chosen and the rejected one. DPO raises
    the policy's log-probability of the chosen reply, relative to a frozen reference model. It
    lowers the rejected one's the same way. There is no reward model and no sampling:
        loss = −log σ(β · ((π_c − r_c) − (π_r − r_r)))
    π_c and π_r are the policy's summed log-probs of the reply tokens; r_c and r_r the reference's.
    β (--dpo-beta) sets how far the policy may move from the reference. At step 0 the policy is
    the reference. Every margin is then 0, and the loss is exactly ln 2.
    The step loss is Σ pair losses / the step's pairs (all micro-batches, all dp ranks).
    The step's log holds the implicit rewards r̂ = β(π − r) of both replies and their margin. It
    also holds the share of pairs that the policy ranks right (r̂_c > r̂_r).

How it runs
    - Data: `load_pairs` reads JSONL with one pair a line, in TRL's two formats. `arithmetic_pairs`
      is the built-in set: a correct last answer against a wrong one. Only the LAST assistant reply
      of each side is a target.
    - Rows: `PairDataset` packs whole pairs (sft.ffd). Both replies of a pair sit in one row, so
      they always share a micro-batch. With --packing none a pair is two padded rows.
    - Log-probs without (T, V) logits: `DPOLoss` replaces the model's `loss_fn`. It calls the
      layout's own loss per token (chunked, or tp's vocab-parallel one) and sums per document.
    - The reference is the starting policy (--init-from), after a resume too. `precompute_reference`
      runs it once, forward only, in the training layout, before train.py resumes. It costs a third
      of an epoch's compute and 8 bytes a pair, with no second model in memory.
    - Layouts: tp/sp, pp, dp, ZeRO-0..3 and cp, as in training. Under cp (--packing none only) each
      rank sums its share of a row's tokens, and DPOLoss all-reduces the partial sums.

Run
    python train.py --dpo --init-from out/sft --steps 50      # built-in arithmetic pairs
    torchrun --nproc_per_node 4 train.py --dpo --init-from DIR --data pairs.jsonl --tp 2 --zero 2
    torchrun --nproc_per_node 4 train.py --dpo --init-from DIR --packing none --cp 2 --seq-len 1024

Reference
    Rafailov et al. 2023, "Direct Preference Optimization" (eq. 7). TRL's DPOTrainer data formats.

Builds on: sft.py, chat.py, tp.py (under cp only); the trainer's glue: pairing.py, formats.py, feed.py, pp.py
    sft.py: JSONL chats, FFD packing. chat.py: masks. tp.py: f and g. pairing.py: tokenizer, template.
    formats.py: other files. feed.py: batches, the cache. pp.py: the reference pass's forward-only pipeline.

Invariants (tests/test_dpo.py)
    - Policy = reference gives exactly ln 2 (fp32). The loss and the logged rewards equal the
      formula on fixed log-probs (test_formula_and_ln2).
    - Sequence log-probs equal transformers' log_softmax on the same pairs
      (test_sequence_logps_match_transformers).
    - DPOLoss equals textbook_dpo_loss, its full-logits form (test_textbook_equals_production).
    - tp2, pp2, zero2 and dp2 give the single process's losses and rewards within 1e-5
      (test_layouts_match_single_process). With --packing none, so do cp2 and cp2·dp2
      (test_cp_layouts_match_single_process). A resume keeps the reference (test_resume_keeps_the_starting_reference).
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import chat
import sft

Pair = tuple[chat.Conversation, chat.Conversation]  # (chosen chat, rejected chat)
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------- the loss
def dpo_loss(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
             beta: float) -> torch.Tensor:
    """−log σ(β((π_c − r_c) − (π_r − r_r))) per pair. Tensors of summed log-probs, any shape."""
    # Why this formula. RLHF maximizes E[reward] − β·KL(π ‖ π_ref). Its optimum is
    # π*(y) ∝ π_ref(y)·exp(reward(y)/β). So reward(y) = β·log(π*(y)/π_ref(y)) + β·log Z(prompt).
    # Bradley–Terry models a preference as P(chosen ≻ rejected) = σ(reward_c − reward_r).
    # In that difference Z cancels: the reward needs no model of its own.
    # Put the policy π in place of π* and maximize the log-likelihood of the data's preferences.
    # In this file's notation (summed log-probs) log(π(y)/π_ref(y)) is π − r.
    # Let margin = β((π_c − r_c) − (π_r − r_r)). The gradient is −β·σ(−margin)·(∇π_c − ∇π_r):
    # it weighs most the pairs that the policy ranks wrong.
    # logsigmoid, not log(sigmoid): it never overflows at large margins.
    return -F.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))


def textbook_dpo_loss(policy: nn.Module, reference: nn.Module, chosen: tuple[torch.Tensor, torch.Tensor],
                      rejected: tuple[torch.Tensor, torch.Tensor], beta: float) -> torch.Tensor:
    """The mean loss of N pairs as the paper writes it, from full (N, L-1, V) logits.
    chosen and rejected are (ids (N, L), labels (N, L-1)): one reply per row, -100 off the reply.
    DPOLoss below computes the same without logits, on packed rows (tests/test_dpo.py)."""
    def logps(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = model(ids[:, :-1])  # (N, L-1, V)
        lp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]  # (N, L-1)
        return (lp * (labels != IGNORE_INDEX)).sum(-1)  # (N,): Σ over each reply's targets

    with torch.no_grad():  # the reference is frozen
        ref_c, ref_r = logps(reference, *chosen), logps(reference, *rejected)
    return dpo_loss(logps(policy, *chosen), logps(policy, *rejected), ref_c, ref_r, beta).mean()


# Production: the layout's own per-token loss (no logits), summed per document of a packed row.
def sequence_logps(token_logps: torch.Tensor, labels: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The sum of each document's target log-probs. token_logps (B·S,) or (B, S); labels, seq (B, S).
    seq is the row's dpo_seq: 2p + half on pair p's tokens (half 0 chosen, 1 rejected), −1 on none.
    Returns (B, S): [b, j] sums the targets of row b whose dpo_seq is j."""
    B, S = seq.shape
    keep = (labels != IGNORE_INDEX) & (seq >= 0)  # (B, S)
    # no boolean indexing (a nonzero: a host sync): the other positions add 0 into one spare slot
    slot = torch.where(keep, torch.arange(B, device=seq.device)[:, None] * S + seq, B * S)  # (B, S) flat slot
    values = torch.where(keep, token_logps.reshape(B, S), 0.0)  # (B, S)
    sums = token_logps.new_zeros(B * S + 1).index_add(0, slot.flatten(), values.flatten())
    return sums[:B * S].view(B, S)


def pairs_of(seq: torch.Tensor) -> torch.Tensor:
    """(B, S) dpo_seq → (B, S//2) bool: pair p of row b exists. Pairs count 0, 1, … in each row."""
    n = (seq.max(dim=1).values + 1) // 2  # (B,) pairs per row
    return torch.arange(seq.shape[1] // 2, device=seq.device) < n[:, None]


def count_pairs(micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """Pairs in a micro-batch. The step's denominator: train.py's target count under --dpo."""
    return pairs_of(micro["dpo_seq"]).sum()


# The seam: DPOLoss becomes the head's `loss_fn`. A pre-hook hands it the rows' DPO keys.
def _take_keys(loss: DPOLoss, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs = dict(kwargs)
    loss.seq, loss.ref = kwargs.pop("dpo_seq", None), kwargs.pop("dpo_ref", None)
    return args, kwargs


def apply_dpo(chunks: list[nn.Module], beta: float, *, rows_per_pair: int = 1,
              cp_group: dist.ProcessGroup | None) -> DPOLoss:
    """Make each model chunk a DPO one. The chunk holding lm_head computes DPOLoss.
    Every chunk takes dpo_seq and dpo_ref out of its keywords. So pp passes them along as it
    passes position_ids, and the model's forward never sees them.
    Apply it after tp: it wraps tp's loss_fn. rows_per_pair and cp_group are DPOLoss's.
    A run without cp passes its group of one, or None without torch.distributed."""
    with_head = [c for c in chunks if c.lm_head is not None]
    loss = DPOLoss(with_head[0].loss_fn if with_head else None, beta, rows_per_pair=rows_per_pair,
                   cp_group=cp_group)
    for c in chunks:
        if c.lm_head is not None:
            c.loss_fn = loss
        c.register_forward_pre_hook(lambda m, a, k: _take_keys(loss, m, a, k), with_kwargs=True)
    return loss


class DPOLoss:
    """The model's `loss_fn(hidden, weight, labels, reduction)` under DPO.
    `base` is the layout's own loss, e.g. tp's vocab-parallel one. DPOLoss runs it per token, sums
    per document and returns the pair losses. "sum" is what training uses: the step divides by its
    pairs. apply_dpo's hook sets `seq` and `ref`: the micro-batch's dpo_seq and dpo_ref.
    `record` is a list while the reference runs. Each call then appends its sums and returns 0.
    `rows_per_pair` and `cp_group` describe layouts (see the refinement below)."""

    def __init__(self, base: Callable[..., torch.Tensor], beta: float, *, rows_per_pair: int = 1,
                 cp_group: dist.ProcessGroup | None):
        if rows_per_pair not in (1, 2):
            raise ValueError(f"rows_per_pair must be 1 (packed pairs) or 2 (a row per reply), got {rows_per_pair}")
        self.base, self.beta, self.rows_per_pair, self.cp_group = base, beta, rows_per_pair, cp_group
        self.seq: torch.Tensor | None = None
        self.ref: torch.Tensor | None = None
        self.record: list[torch.Tensor] | None = None
        self.sums = torch.zeros(4, dtype=torch.float64)  # the log: Σ r̂_c, Σ r̂_r, pairs with r̂_c > r̂_r, pairs

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 reduction: str = "mean") -> torch.Tensor:
        if self.seq is None:
            raise ValueError("DPO loss without dpo_seq: give the model the PairDataset row's keys")
        # base is −log π(token). dpo_ref holds r of a document on its first token, 0 elsewhere.
        logps = sequence_logps(-self.base(hidden, weight, labels, "none"), labels, self.seq)  # (B, S)
        refs = sequence_logps(self.ref, torch.zeros_like(labels), self.seq)  # (B, S): r on each slot
        sums, seq = self._whole_pairs(torch.stack([logps, refs]))  # (2, B, S): policy, reference
        if self.record is not None:  # the reference pass: keep the sums, train nothing
            self.record.append(sums[0].detach())
            return sums.new_zeros(())
        B, S = seq.shape
        pol, ref = (t[:, :S // 2 * 2].view(B, S // 2, 2) for t in sums)  # (B, S//2, 2): slot 2p + half
        keep = pairs_of(seq)  # (B, S//2)
        losses = dpo_loss(pol[..., 0], pol[..., 1], ref[..., 0], ref[..., 1], self.beta)  # (B, S//2)
        self._log_rewards(pol, ref, keep)
        if reduction == "none":  # (pairs,): a host sync, never on the training path
            return losses[keep]
        total = torch.where(keep, losses, 0.0).sum()  # no boolean indexing, no host sync
        return total if reduction == "sum" else total / keep.sum()

    # --- refinement: layouts that split a pair (a reply per row; cp's shares of a row's tokens)
    def _whole_pairs(self, sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row sums (2, B, S) → the sums of whole pairs, and their dpo_seq.
        rows_per_pair 2 (--packing none): rows 2i and 2i+1 are one pair's chosen and rejected.
        Folding them gives one row of slots. cp_group holds the ranks that share a row's tokens
        (cp.shard_sequence). Their sums are partial, so they are all-reduced over it, with autograd.
        None is the default group, as in torch.distributed. A group of one reduces nothing."""
        seq = self.seq
        B, S = seq.shape
        if self.rows_per_pair == 2:  # slot 0 of row 2i, slot 1 of row 2i+1
            sums = sums.view(2, B // 2, 2, S).sum(2)  # (2, B/2, S): x + 0, exact
            seq = seq.view(B // 2, 2, S).amax(1)  # (B/2, S)
        if dist.is_initialized() and dist.get_world_size(self.cp_group) > 1:
            # g all-reduces the sums, so every rank holds them whole. Every rank's loss reads every
            # rank's partial sums, so f all-reduces the gradient.
            import tp as TP  # here: the loss without cp stays copyable with chat.py and sft.py alone
            sums = TP.reduce_from_region(TP.copy_to_region(sums, self.cp_group), self.cp_group)
        return sums, seq

    # --- refinement: logging the implicit rewards r̂ = β(π − r), with no host sync in the step
    @torch.no_grad()
    def _log_rewards(self, pol: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> None:
        r_c, r_r = (torch.where(keep, self.beta * (pol[..., h] - ref[..., h]), 0.0) for h in (0, 1))  # (B, S//2)
        step = torch.stack([r_c.sum(), r_r.sum(), ((r_c > r_r) & keep).sum(), keep.sum()]).double()  # (4,)
        self.sums = self.sums.to(step.device) + step  # stays on the device: no host read here

    def reduce_log(self, device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The step's reward sums over `group`, on `device`, then cleared: one all-reduce of 4 numbers.
        `group` must hold every rank that computed pair losses (train.py: the whole world).
        tp and cp peers hold the same pairs: they weigh the pair count as they weigh the sums.
        pp stages without the head add zeros. train.py calls this before the optimizer step.
        It reads the result (`stats`) after the step's host sync, so the log adds no sync."""
        t, self.sums = self.sums.to(device), torch.zeros(4, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def stats(sums: torch.Tensor) -> dict[str, float]:
        """The log from reduce_log's sums: the mean chosen and rejected r̂, and their mean margin.
        Also the share of pairs whose chosen r̂ is higher. It is 0 at step 1, where π = r."""
        chosen, rejected, right, pairs = sums.tolist()
        pairs = max(pairs, 1.0)
        return {"reward_chosen": chosen / pairs, "reward_rejected": rejected / pairs,
                "reward_margin": (chosen - rejected) / pairs, "reward_accuracy": right / pairs}


# ---- refinement: the data (preference pairs from JSONL, and whole pairs packed into rows)
def parse_pair(obj: Any) -> Pair:
    """One JSON object → (chosen, rejected) full chats, each ending with an assistant turn.
    TRL's formats: {"chosen": chat, "rejected": chat} holds full chats sharing the prompt.
    {"prompt": chat or text, "chosen": chat or text, "rejected": chat or text} holds the replies
    alone (a text reply is one assistant turn)."""
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        raise ValueError("expected an object with 'chosen' and 'rejected'")
    prompt = obj.get("prompt", [])
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    # TRL's standard format: plain-text replies to a prompt, each one assistant turn
    replies = [[{"role": "assistant", "content": obj[k]}] if isinstance(obj[k], str) else obj[k]
               for k in ("chosen", "rejected")]
    if any(isinstance(obj[k], str) for k in ("chosen", "rejected")) and not prompt:
        raise ValueError("plain-text 'chosen' and 'rejected' need a 'prompt' (TRL's implicit-prompt text "
                         "format holds no chat: split off the prompt)")
    if not isinstance(prompt, list) or not all(isinstance(r, list) for r in replies):
        raise ValueError("'prompt' (a string or turns), 'chosen' and 'rejected' (strings or turns) are needed")
    sides = [sft.parse_conversation({"messages": prompt + r}) for r in replies]
    if any(side[-1]["role"] != "assistant" for side in sides):
        raise ValueError("chosen and rejected must each end with an assistant reply")
    return sides[0], sides[1]


def load_pairs(path: str | Path) -> list[Pair]:
    """Preference pairs from JSONL (parse_pair's formats). A malformed line raises, naming its line."""
    pairs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    pairs.append(parse_pair(json.loads(line)))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not a preference pair: {e}") from None
    if not pairs:
        raise ValueError(f"{path}: no preference pairs")
    return pairs


def arithmetic_pairs(n: int = 1000, seed: int = 0, **kw: Any) -> list[Pair]:
    """sft.arithmetic_chats' training chats as pairs: the correct last answer against a wrong one.
    The wrong one is off by 1 to 10 either way, so never the correct value."""
    rng = random.Random(seed)
    chats, _ = sft.arithmetic_chats(n_train=n, seed=seed, **kw)
    pairs = []
    for c in chats:
        wrong = int(c[-1]["content"]) + rng.choice([-1, 1]) * rng.randint(1, 10)
        pairs.append((c, c[:-1] + [{"role": "assistant", "content": str(wrong)}]))
    return pairs


def tokenize_pair(pair: Pair, tpl: chat.ChatTemplate) -> list[tuple[list[int], list[int]]]:
    """[(ids, shifted labels)] of chosen and rejected. Only the last reply holds targets."""
    out = []
    for turns in pair:
        ids, flags = tpl.encode(turns, True)
        out.append((ids, chat._labels(ids, flags)))
    return out


class PairDataset:
    """Rows of seq_len positions: ds[r] → input_ids, labels, dpo_seq and dpo_ref.
    Each is (S,) for a packed row, or (2, S) for a padded pair. dpo_seq is 2·pair-in-row + half
    per token, −1 on padding. dpo_ref is the reference's sum of a document, on its first token.
    `ref` (pairs, 2) holds those sums of (chosen, rejected), filled by set_reference.
    packing "ffd": each row packs whole pairs (sft.ffd over the pairs' sizes). position_ids restart
    per document. "none": item r is pair r as two rows, chosen then rejected. Each is one document
    padded at its end, with no position_ids. Plain causal attention is then exact, and cp can
    split the rows. --batch-size then counts pairs."""

    def __init__(self, pairs: list[Pair], tpl: chat.ChatTemplate, seq_len: int, packing: str = "ffd"):
        if packing not in ("ffd", "none"):
            raise ValueError(f"DPO packing must be ffd|none, got {packing!r}")
        self.seq_len, self.pad_id, self.packing = seq_len, tpl.pad_id, packing
        self.rows_per_pair = 2 if packing == "none" else 1  # rows of one pair (DPOLoss folds them)
        docs = [tokenize_pair(p, tpl) for p in pairs]
        # A document of L ids takes L-1 positions: the model reads ids[:-1]. A pair needs room for
        # both halves in one row (ffd), or for its longer half (none).
        sizes = [sum(len(ids) - 1 for ids, _ in d) if packing == "ffd" else
                 max(len(ids) - 1 for ids, _ in d) for d in docs]
        self.docs = [d for d, n in zip(docs, sizes) if n <= seq_len]
        self.dropped = len(docs) - len(self.docs)
        if not self.docs:
            raise ValueError(f"no preference pair fits --seq-len {seq_len} ("
                             + ("both replies in one row)" if packing == "ffd" else "each reply in a row)"))
        self.rows = (sft.ffd([n for n in sizes if n <= seq_len], seq_len) if packing == "ffd"
                     else [[k] for k in range(len(self.docs))])
        self.max_id = max(max(ids) for d in self.docs for ids, _ in d)
        self.ref = torch.zeros(len(self.docs), 2)  # (pairs, 2): r_c, r_r

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        if self.packing == "none":
            return self._padded(self.rows[r][0])
        ids, labels, pos, seq, ref = [], [], [], [], []
        for p, k in enumerate(self.rows[r]):
            for half, (d_ids, d_labels) in enumerate(self.docs[k]):
                n = len(d_ids) - 1
                ids += d_ids[:-1]
                labels += d_labels
                pos += range(n)
                seq += [2 * p + half] * n
                ref += [float(self.ref[k, half])] + [0.0] * (n - 1)
        pad = self.seq_len - len(ids)  # the tail: one more document, no targets, no pair
        return {"input_ids": torch.tensor(ids + [self.pad_id] * pad),
                "labels": torch.tensor(labels + [IGNORE_INDEX] * pad),
                "position_ids": torch.tensor(pos + list(range(pad))),
                "dpo_seq": torch.tensor(seq + [-1] * pad), "dpo_ref": torch.tensor(ref + [0.0] * pad)}

    def _padded(self, k: int) -> dict[str, torch.Tensor]:
        """Pair k as two rows (2, S). dpo_seq is the half (0 chosen, 1 rejected) on EVERY position.
        The padding has no targets, so this costs nothing. It lets any cp shard of a row name its
        slot, and count_pairs find one pair per two rows."""
        out: dict[str, list] = {"input_ids": [], "labels": [], "dpo_seq": [], "dpo_ref": []}
        for half, (d_ids, d_labels) in enumerate(self.docs[k]):
            pad = self.seq_len - (len(d_ids) - 1)
            out["input_ids"].append(d_ids[:-1] + [self.pad_id] * pad)
            out["labels"].append(d_labels + [IGNORE_INDEX] * pad)
            out["dpo_seq"].append([half] * self.seq_len)
            out["dpo_ref"].append([float(self.ref[k, half])] + [0.0] * (self.seq_len - 1))
        return {key: torch.tensor(v) for key, v in out.items()}  # (2, S) each

    def set_reference(self, rows: list[int], sums: torch.Tensor) -> None:
        """sums (len(rows), S): the rows' sequence_logps. Pair p of a row has slots 2p and 2p + 1."""
        for r, s in zip(rows, sums.tolist()):
            for p, k in enumerate(self.rows[r]):
                self.ref[k] = torch.tensor(s[2 * p:2 * p + 2])

    def report(self) -> str:
        n = sum(map(len, self.rows))
        dropped = f", {self.dropped} longer than a row dropped" if self.dropped else ""
        if self.packing == "none":
            tokens = sum(len(ids) - 1 for d in self.docs for ids, _ in d)
            return (f"DPO: {n} preference pairs, each two rows of {self.seq_len} (packing none, fill "
                    f"{tokens / (2 * n * self.seq_len):.1%})" + dropped)
        return (f"DPO: {n} preference pairs in {len(self.rows)} rows of {self.seq_len} "
                f"({n / len(self.rows):.1f} pairs/row)" + dropped)

    def check_vocab(self, model_vocab_size: int) -> None:
        if max(self.max_id, self.pad_id) >= model_vocab_size:
            raise ValueError(f"the DPO data holds token id {max(self.max_id, self.pad_id)} but the model's "
                             f"vocab_size is {model_vocab_size}")


# ---- refinement: the trainer's glue (train.py --dpo): data, and the reference in the training layout
def stats_text(s: dict[str, float]) -> str:
    """The step line's DPO part."""
    return (f"reward chosen {s['reward_chosen']:+.3f} rejected {s['reward_rejected']:+.3f} · "
            f"margin {s['reward_margin']:+.3f} · acc {s['reward_accuracy']:.1%}")


def load(args: argparse.Namespace, grid: Any) -> tuple[PairDataset, chat.ChatTemplate, list]:
    """--data's pairs, or the built-in arithmetic ones, tokenized on every rank (no cache yet).
    The built-in pairs are the SFT demo's training chats, whatever --seed."""
    import pairing  # the run's template: the tokenizer's own, or --chat-template builtin
    tpl = pairing.chat_template(args)
    column = getattr(args, "data_column", None)
    if args.data and (column or not str(args.data).endswith(".jsonl")):
        import feed
        import formats  # parquet, JSON, arrow, a folder; the pairs in --data-column
        pairs = formats.parse_all(args.data, lambda r: parse_pair(formats.column(r, column)),
                                  cache_dir=feed.cache_dir(args))[0]
    else:
        pairs = load_pairs(args.data) if args.data else arithmetic_pairs()
    ds = PairDataset(pairs, tpl, args.seq_len, args.packing)
    if grid.rank == 0:
        print(ds.report(), flush=True)
    return ds, tpl, []


def prepare(chunks: list[nn.Module], ds: PairDataset, args: argparse.Namespace, grid: Any) -> DPOLoss:
    """apply_dpo on this rank's chunks, then the reference's sums of every pair."""
    loss = apply_dpo(chunks, args.dpo_beta, rows_per_pair=ds.rows_per_pair, cp_group=grid.cp_group)
    precompute_reference(chunks, loss, ds, args, grid)
    return loss


@torch.no_grad()
def precompute_reference(chunks: list[nn.Module], loss: DPOLoss, ds: PairDataset, args: argparse.Namespace,
                         grid: Any) -> None:
    """The reference's sums of every pair, by the starting policy itself. It runs forward only
    through the training layout's pipeline (pp.forward_only: tp/sp, pp, ZeRO, cp).
    Each dp rank takes its share of each global batch. Its (rows, S/cp) sums are whole after
    DPOLoss's cp all-reduce. They are all-gathered over dp·cp, and cp rank 0's are kept.
    The last stage keeps them. The others hold zeros: they never compute the loss."""
    import feed  # the trainer's batches; imported here so the data and loss above stay copyable alone
    import pp as PP
    fwd = PP.forward_only(PP.SCHEDULES[args.schedule](args.micro_batches, grid.at.pp_rank, args.pp,
                                                      args.virtual_stages))
    (dp_rank, dp_size), n = grid.data, len(ds)
    S = ds.seq_len // grid.cp  # the sums' width: one slot per position of this rank's tokens
    per = args.batch_size // dp_size
    for b in range(math.ceil(n / args.batch_size)):
        rows = [(b * args.batch_size + i) % n for i in range(args.batch_size)]  # the global batch
        micro = feed.get_batch(ds, rows[dp_rank * per:(dp_rank + 1) * per], args.micro_batches, grid)
        loss.record = []
        PP.run_pipeline(chunks, fwd, micro, grid.pp_group, 1, seq_shards=args.tp if args.sp else 1,
                        check_group=grid.pp_check, peer_groups=grid.pp_peers,
                        hidden_size=chunks[0].config.hidden_size)
        mine = torch.cat(loss.record) if loss.record else torch.zeros(per, S, device=grid.device)  # (per, S)
        reps = grid.at.dp  # dp · cp: dp_group's ranks. The cp ranks of a replica hold the same sums.
        if reps > 1:  # gloo gathers into a flat tensor only
            out = mine.new_empty(reps * per * S)
            dist.all_gather_into_tensor(out, mine.flatten().contiguous(), group=grid.dp_group)
            mine = out.view(dp_size, reps // dp_size, per, S)[:, 0].reshape(dp_size * per, S)  # cp rank 0's
        ds.set_reference(rows, mine.cpu())
    loss.record = None
