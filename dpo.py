"""Direct preference optimization: chosen and rejected replies, a frozen reference, one loss per pair.

What it does
    A preference pair is one prompt with two replies, the chosen and the rejected. DPO raises the
    policy's log-probability of the chosen reply relative to a frozen reference model and lowers the
    rejected one's, with no reward model and no sampling:
        loss = −log σ(β · ((π_c − r_c) − (π_r − r_r)))
    π_c, π_r: the policy's summed log-probs of the reply tokens; r_c, r_r: the reference's; β (--dpo-beta)
    sets how far the policy may move from the reference. At step 0 the policy is the reference: every
    margin is 0 and the loss is exactly ln 2.
    1. Data: `load_pairs` reads JSONL, one pair a line: {"chosen": chat, "rejected": chat} (full chats
       that share the prompt turns) or {"prompt": chat or text, "chosen": chat, "rejected": chat} (the
       replies alone). `arithmetic_pairs` is the built-in set: sft.arithmetic_chats' correct last answer
       against a wrong one. chat.py's template masks only the LAST assistant reply of each side
       (encode(..., last only)): earlier turns are the prompt.
    2. Rows: `PairDataset` packs PAIRS (first-fit-decreasing, sft.ffd): both halves of a pair are two
       documents of one row, so they are always in one micro-batch on one dp rank. Each row carries
       `dpo_seq` (per token: 2·pair-in-row + half, −1 for padding) and `dpo_ref` (the reference's sum
       of a document, on its first token, 0 elsewhere). --packing none: a pair is two rows (chosen,
       rejected), each one document padded at its end, one dataset item: still one micro-batch.
    3. Log-probs without (T, V) logits: `DPOLoss` replaces the model's `loss_fn` seam; it calls the
       layout's own loss (loss.py's chunked cross entropy, or tp's vocab-parallel one) with
       reduction="none", negates it, and sums per document (`sequence_logps`). A forward pre-hook
       (`apply_dpo`) takes dpo_seq/dpo_ref out of the model's keywords, so pp.run_pipeline passes
       them as it passes position_ids.
    4. The reference is the starting policy (--init-from), run ONCE before training over every row
       in the training layout (`precompute_reference`: the forward-only pipeline of tp/sp, pp and
       ZeRO; each dp rank its share of the rows, the sums all-gathered over dp). Cost: one forward per
       row (about a third of one epoch's training compute), and 8 bytes per pair (two fp32 sums) on
       every rank — no second model in memory.
    5. Under cp (--packing none: the ring masks no documents, and a document then padding needs
       none) each cp rank holds its zigzag share of a row's tokens, so its per-document sums are
       partial: DPOLoss all-reduces them over the cp group, tp's g then f (forward and backward a sum).
    The step loss = Σ pair losses / pairs of the whole step (all micro-batches, all dp ranks; every
    cp rank counts its replica's pairs and holds their whole losses, so each weighs 1/cp).
    The step's log (`DPOLoss.stats`): the implicit rewards r̂ = β(π − r) of the chosen and rejected
    replies, their margin, and the share of pairs the policy ranks right (r̂_c > r̂_r).
    Layouts: tp/sp, pp (the loss on the last stage), dp, ZeRO-0..3 and cp as in training; packed
    rows under cp are refused (cli.py).

Run
    python train.py --dpo --steps 50                          # built-in arithmetic pairs
    torchrun --nproc_per_node 4 train.py --dpo --init-from DIR --data pairs.jsonl --tp 2 --zero 2
    torchrun --nproc_per_node 4 train.py --dpo --init-from DIR --packing none --cp 2 --seq-len 1024

Reference
    Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward
    Model" (eq. 7); the data formats of TRL's DPOTrainer (explicit and implicit prompt).

Builds on: sft.py, chat.py, tp.py (under cp only), and (the trainer's glue only) data.py, feed.py, pp.py
    sft.py: JSONL chats, the arithmetic set, FFD packing; chat.py: templates and masks; tp.py: its
    f and g (copy_to_region, reduce_from_region), the cp all-reduce with autograd; the glue:
    the tokenizer (data.py), batches (feed.py), the forward-only pipeline of the training layout
    for the reference (pp.py)

Invariants
    - Policy = reference gives a loss of exactly ln 2 (fp32), and the loss is the formula on fixed
      log-probs (tests/test_dpo.py::test_formula_and_ln2).
    - sequence log-probs equal transformers' (log_softmax of its logits) on the same packed pairs
      (tests/test_dpo.py::test_sequence_logps_match_transformers).
    - tp2, pp2, zero2 and dp2 give the single process's losses within 1e-5 (tests/test_dpo.py::
      test_layouts_match_single_process); with --packing none, so do cp2 and cp2·dp2
      (test_cp_layouts_match_single_process). The logged rewards too, and they equal the formula on
      fixed log-probs (test_formula_and_ln2).
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


# ----------------------------------------------------------------------------------------- data
def parse_pair(obj: Any) -> Pair:
    """One JSON object → (chosen, rejected) full chats, each ending with an assistant turn."""
    if not isinstance(obj, dict) or "chosen" not in obj or "rejected" not in obj:
        raise ValueError("expected an object with 'chosen' and 'rejected'")
    prompt = obj.get("prompt", [])
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(prompt, list) or not all(isinstance(obj[k], list) for k in ("chosen", "rejected")):
        raise ValueError("'prompt' (a string or turns), 'chosen' and 'rejected' (turns) must be lists")
    sides = [sft.parse_conversation({"messages": prompt + obj[k]}) for k in ("chosen", "rejected")]
    if any(side[-1]["role"] != "assistant" for side in sides):
        raise ValueError("chosen and rejected must each end with an assistant reply")
    return sides[0], sides[1]


def load_pairs(path: str | Path) -> list[Pair]:
    """Preference pairs from JSONL; a malformed line raises naming the file and line."""
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
    """sft.arithmetic_chats' training chats as pairs: the correct last answer against a wrong one
    (off by 1 to 10 either way, never the correct value)."""
    rng = random.Random(seed)
    chats, _ = sft.arithmetic_chats(n_train=n, seed=seed, **kw)
    pairs = []
    for c in chats:
        wrong = int(c[-1]["content"]) + rng.choice([-1, 1]) * rng.randint(1, 10)
        pairs.append((c, c[:-1] + [{"role": "assistant", "content": str(wrong)}]))
    return pairs


def tokenize_pair(pair: Pair, tpl: chat.ChatTemplate) -> list[tuple[list[int], list[int]]]:
    """[(ids, shifted labels)] of chosen and rejected: targets on the last reply only."""
    out = []
    for turns in pair:
        ids, flags = tpl.encode(turns, True)
        out.append((ids, chat._labels(ids, flags)))
    return out


class PairDataset:
    """Rows of seq_len positions: ds[r] → input_ids, labels, dpo_seq and dpo_ref, (S,) each for a
    packed row, (2, S) for a padded pair. `ref` (pairs, 2) holds the reference's sums of (chosen,
    rejected), filled by set_reference.
    packing "ffd": each row packs whole pairs (sft.ffd over the pairs' sizes), with position_ids
    restarting per document. "none": item r is pair r as two rows, chosen then rejected, each one
    document padded at its end (no position_ids: 0..S-1), so plain causal attention is exact and
    the rows can be split over cp ranks; --batch-size then counts pairs."""

    def __init__(self, pairs: list[Pair], tpl: chat.ChatTemplate, seq_len: int, packing: str = "ffd"):
        if packing not in ("ffd", "none"):
            raise ValueError(f"DPO packing must be ffd|none, got {packing!r}")
        self.seq_len, self.pad_id, self.packing = seq_len, tpl.pad_id, packing
        self.rows_per_pair = 2 if packing == "none" else 1  # rows of one pair (DPOLoss folds them)
        docs = [tokenize_pair(p, tpl) for p in pairs]
        # a document of L ids takes L-1 positions (the model reads ids[:-1]); a pair, both of its halves
        # in one row (ffd), or each half a row of its own (none)
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
        """Pair k as two rows (2, S). dpo_seq is the half (0 chosen, 1 rejected) on EVERY position,
        the padding included (it has no targets): so any cp shard of a row still names its slot,
        and count_pairs finds one pair per two rows."""
        out: dict[str, list] = {"input_ids": [], "labels": [], "dpo_seq": [], "dpo_ref": []}
        for half, (d_ids, d_labels) in enumerate(self.docs[k]):
            pad = self.seq_len - (len(d_ids) - 1)
            out["input_ids"].append(d_ids[:-1] + [self.pad_id] * pad)
            out["labels"].append(d_labels + [IGNORE_INDEX] * pad)
            out["dpo_seq"].append([half] * self.seq_len)
            out["dpo_ref"].append([float(self.ref[k, half])] + [0.0] * (self.seq_len - 1))
        return {key: torch.tensor(v) for key, v in out.items()}  # (2, S) each

    def set_reference(self, rows: list[int], sums: torch.Tensor) -> None:
        """sums (len(rows), S): sequence_logps of those rows, slot 2p + half for pair p of the row."""
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


# ----------------------------------------------------------------------------------------- the loss
def sequence_logps(token_logps: torch.Tensor, labels: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """Per-document sums of the target tokens' log-probs: token_logps (B·S,) or (B, S), labels and
    seq (B, S) → (B, S): [b, j] sums the targets of row b whose dpo_seq is j (slot 2p + half)."""
    B, S = seq.shape
    keep = (labels != IGNORE_INDEX) & (seq >= 0)  # (B, S)
    slot = (torch.arange(B, device=seq.device)[:, None] * S + seq)[keep]  # (targets,) flat slot
    sums = token_logps.new_zeros(B * S).index_add(0, slot, token_logps.reshape(B, S)[keep])
    return sums.view(B, S)


def dpo_loss(pi_c: torch.Tensor, pi_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor,
             beta: float) -> torch.Tensor:
    """−log σ(β((π_c − r_c) − (π_r − r_r))) per pair (logsigmoid: no overflow at large margins)."""
    return -F.logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))


def pairs_of(seq: torch.Tensor) -> torch.Tensor:
    """(B, S) dpo_seq → (B, S//2) bool: pair p of row b exists (pairs are numbered 0.. per row)."""
    n = (seq.max(dim=1).values + 1) // 2  # (B,) pairs per row
    return torch.arange(seq.shape[1] // 2, device=seq.device) < n[:, None]


def count_pairs(micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """Pairs in a micro-batch: the step's denominator (train.py's target count under --dpo)."""
    return pairs_of(micro["dpo_seq"]).sum()


class DPOLoss:
    """The model's `loss_fn(hidden, weight, labels, reduction)` under DPO: the layout's own loss
    (`base`, e.g. tp's vocab-parallel one) per token, summed per document, and the pair loss
    ("sum": Σ over pairs, what training divides by the step's pair count; "mean"; "none": per pair).
    `seq` and `ref` are the current micro-batch's dpo_seq and dpo_ref (set by apply_dpo's hook).
    `rows_per_pair` 2 (packing none): rows 2i and 2i+1 are one pair's chosen and rejected, folded
    into one row of slots before the loss. `cp_group`: the ranks that each hold a share of the rows'
    tokens (cp.shard_sequence); their per-document sums are partial and are all-reduced over it, with
    autograd (None is the default group, as in torch.distributed; a group of one reduces nothing).
    `record`: a list while the reference is computed: each call appends its sums (B, S), returns 0."""

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
        logps = sequence_logps(-self.base(hidden, weight, labels, "none"), labels, self.seq)  # (B, S)
        refs = sequence_logps(self.ref, torch.zeros_like(labels), self.seq)  # (B, S): r on each slot
        sums, seq = torch.stack([logps, refs]), self.seq  # (2, B, S): policy, reference
        B, S = seq.shape
        if self.rows_per_pair == 2:  # a reply per row: slot 0 of row 2i, slot 1 of row 2i+1
            sums = sums.view(2, B // 2, 2, S).sum(2)  # (2, B/2, S): x + 0, exact
            seq, B = seq.view(B // 2, 2, S).amax(1), B // 2  # (B/2, S)
        if dist.is_initialized() and dist.get_world_size(self.cp_group) > 1:
            # each cp rank summed its own tokens: g all-reduces them (the whole sums on every rank);
            # f all-reduces the gradient, since every rank's loss reads every rank's partial sums
            import tp as TP  # here: the loss without cp stays copyable with chat.py and sft.py alone
            sums = TP.reduce_from_region(TP.copy_to_region(sums, self.cp_group), self.cp_group)
        if self.record is not None:
            self.record.append(sums[0].detach())
            return sums.new_zeros(())
        pol, ref = (t[:, :S // 2 * 2].view(B, S // 2, 2) for t in sums)  # (B, S//2, 2)
        keep = pairs_of(seq)  # (B, S//2)
        losses = dpo_loss(pol[..., 0], pol[..., 1], ref[..., 0], ref[..., 1], self.beta)[keep]  # (pairs,)
        with torch.no_grad():  # the implicit rewards r̂ = β(π − r), chosen and rejected: the step's log
            r_c, r_r = (self.beta * (pol[..., h] - ref[..., h])[keep] for h in (0, 1))  # (pairs,) each
            step = torch.stack([r_c.sum(), r_r.sum(), (r_c > r_r).sum(), keep.sum()]).double()  # (4,)
            self.sums = self.sums.to(step.device) + step  # stays on the device: no host read here
        if reduction == "none":
            return losses
        return losses.sum() if reduction == "sum" else losses.mean()


    def reduce_log(self, device: torch.device, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """The step's implicit-reward sums over `group`'s pairs, on `device`, then cleared: one
        all-reduce of 4 numbers. `group` must hold every rank that computed pair losses (train.py:
        the whole world). tp and cp peers hold the same pairs, so they weigh the pair count as they
        weigh the sums; pp stages without the head add zeros. train.py calls it before the optimizer
        step and reads the result (`stats`) after the step's host sync: no sync of its own."""
        t, self.sums = self.sums.to(device), torch.zeros(4, dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def stats(sums: torch.Tensor) -> dict[str, float]:
        """The log from reduce_log's sums: the mean chosen and rejected r̂ = β(π − r), their mean
        margin, and the share of pairs whose chosen r̂ is the higher (0 at step 1, where π = r)."""
        chosen, rejected, right, pairs = sums.tolist()
        pairs = max(pairs, 1.0)
        return {"reward_chosen": chosen / pairs, "reward_rejected": rejected / pairs,
                "reward_margin": (chosen - rejected) / pairs, "reward_accuracy": right / pairs}


def stats_text(s: dict[str, float]) -> str:
    """The step line's DPO part."""
    return (f"reward chosen {s['reward_chosen']:+.3f} rejected {s['reward_rejected']:+.3f} · "
            f"margin {s['reward_margin']:+.3f} · acc {s['reward_accuracy']:.1%}")


def _take_keys(loss: DPOLoss, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs = dict(kwargs)
    loss.seq, loss.ref = kwargs.pop("dpo_seq", None), kwargs.pop("dpo_ref", None)
    return args, kwargs


def apply_dpo(chunks: list[nn.Module], beta: float, *, rows_per_pair: int = 1,
              cp_group: dist.ProcessGroup | None) -> DPOLoss:
    """Turn each model chunk into a DPO one: the chunk holding lm_head computes DPOLoss, every chunk
    takes dpo_seq/dpo_ref from its keywords. Apply after tp (it wraps tp's loss_fn). rows_per_pair
    and cp_group: DPOLoss's (cp_group None is the default group; a run without cp passes its group
    of one, or None when torch.distributed is not initialized)."""
    with_head = [c for c in chunks if c.lm_head is not None]
    loss = DPOLoss(with_head[0].loss_fn if with_head else None, beta, rows_per_pair=rows_per_pair,
                   cp_group=cp_group)
    for c in chunks:
        if c.lm_head is not None:
            c.loss_fn = loss
        c.register_forward_pre_hook(lambda m, a, k: _take_keys(loss, m, a, k), with_kwargs=True)
    return loss


# --- refinement: the trainer's glue (train.py --dpo): data, and the reference in the training layout
def load(args: argparse.Namespace, grid: Any) -> tuple[PairDataset, chat.ChatTemplate, list]:
    """--data's pairs, or the built-in arithmetic ones (the SFT demo's training chats, whatever --seed),
    tokenized on every rank (no cache yet)."""
    import data
    tpl = sft.chat_template(data.load_tokenizer(args.tokenizer))
    ds = PairDataset(load_pairs(args.data) if args.data else arithmetic_pairs(), tpl,
                     args.seq_len, args.packing)
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
    """The reference's sums of every pair, by the starting policy itself, forward only through the
    training layout's pipeline (pp.forward_only: tp/sp, pp, ZeRO, cp as in training): each dp rank
    its share of each global batch; the (rows, S/cp) sums, whole after DPOLoss's cp all-reduce, are
    all-gathered over dp·cp and cp rank 0's kept. The last stage keeps them (the others hold zeros:
    they never compute the loss)."""
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
        reps = grid.at.dp  # dp · cp: dp_group's ranks; the cp ranks of a replica hold the same sums
        if reps > 1:  # gloo gathers into a flat tensor only
            out = mine.new_empty(reps * per * S)
            dist.all_gather_into_tensor(out, mine.flatten().contiguous(), group=grid.dp_group)
            mine = out.view(dp_size, reps // dp_size, per, S)[:, 0].reshape(dp_size * per, S)  # cp rank 0's
        ds.set_reference(rows, mine.cpu())
    loss.record = None
