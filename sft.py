"""Supervised fine-tuning data: chat JSONL → tokens with an assistant-only loss mask → FFD-packed rows.

What it does
    1. `load_jsonl` reads conversations, one JSON object per line. It takes the `messages` format
       ({"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}) or ShareGPT's
       ({"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}). A malformed
       line raises ValueError naming the file and line. With skip_bad it is skipped and counted.
    2. chat.py renders each chat, with the tokenizer's chat template or the built-in one. It finds
       the assistant replies by character spans, which gives the ids and their loss mask.
       `prepare_sft` does this ONCE per data set, in one process (train.py: rank 0, the others
       wait). A progress bar shows conversations/s and tokens/s. The result is a memmap cache in
       train.py's --cache-dir. Its key is the data's bytes, the tokenizer and the template: a
       change to any of them re-makes it. `read_cache` maps it.
    3. `ffd` packs samples into rows of seq_len tokens, first-fit-decreasing. Johnson 1973 bounds
       the rows by 11/9·OPT + 6/9, tight by Dósa 2007. `SFTDataset` serves each row as input_ids,
       position_ids and labels. `report()` compares the fill with the lower bound ceil(tokens /
       seq_len), and with padding (one conversation per row, `packing="none"`).
    4. `arithmetic_chats` is the embedded default set: deterministic multi-turn arithmetic chats.
       Its held-out questions are disjoint from the training ones. feed.evaluate answers them with
       model.generate, greedy or sampled, and returns exact-match accuracy.

Shifted labels and packing (the invariants)
    A conversation (a sample) renders to ids[0..L-1]. The model consumes ids[:-1], L-1 positions.
    labels[t] = ids[t+1] if ids[t+1] is a target, else -100: aligned with the logits, as in model.py.
    A conversation costs L-1 positions in a row. Its last input position predicts its own final
    end token, so no label ever refers to the next conversation's tokens.
    position_ids restart at 0 per conversation. feed.get_batch turns them into document boundaries
    (attention.Documents), so attention stays inside each conversation without an S×S mask.
    The padded tail gets pad_id, label -100 and positions restarting at 0. It is one more
    "document" that sees only itself, and real tokens never see it (it comes later).
    `real_tokens` marks it False, for statistics that must count the data's tokens only.
    Over-long conversations (L-1 > seq_len) are truncated or dropped (overlong="drop").
    Truncation keeps the first seq_len inputs, and drops the sample when no target survives.
    The report counts both, never silent.

Run
    torchrun --nproc_per_node 1 train.py --sft --packing ffd --eval-every 50

Builds on: chat.py (templates and masks)
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from chat import (ChatTemplate, Conversation, builtin_template, chat_template,  # noqa: F401 (API)
                  tokenize_conversation, tokenize_samples)

IGNORE_INDEX = -100
# The default set packs to 99.3% fill at 1024, and 99.2% at 512. At the built-in demo's 256 it
# packs to 96.6%: its chats are 30 to ~320 tokens long.
DEFAULT_SEQ_LEN = 1024
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}


# ----------------------------------------------------------------------------------------- loading
def parse_conversation(obj: Any) -> Conversation:
    """One JSON object → [{"role", "content"}]; ValueError (a short reason) when it is not a chat."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        turns, role_key, text_key, roles = obj["messages"], "role", "content", {r: r for r in ROLES}
    elif "conversations" in obj:
        turns, role_key, text_key, roles = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise ValueError("no 'messages' or 'conversations' key")
    if not isinstance(turns, list) or not turns:
        raise ValueError("the turn list is empty or not a list")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or t.get(role_key) not in roles or not isinstance(t.get(text_key), str):
            raise ValueError(f"turn {i} needs {role_key!r} in {sorted(roles)} and a string {text_key!r}, "
                             f"got {str(t)[:80]}")
        out.append({"role": roles[t[role_key]], "content": t[text_key]})
    if not any(t["role"] == "assistant" for t in out):
        raise ValueError("no assistant turn (nothing to learn)")
    return out


def load_jsonl(path: str | Path, skip_bad: bool = False) -> tuple[list[Conversation], int]:
    """Conversations of a JSONL file, and the number of skipped bad lines. Blank lines are ignored.
    A bad line (not UTF-8, not JSON, not a chat) raises ValueError('file:line: reason').
    With skip_bad it is skipped. A file without any conversation raises ValueError saying why."""
    convs, bad = [], 0
    with open(path, "rb") as f:  # decoded per line, so an encoding error names its line
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                convs.append(parse_conversation(json.loads(line)))
            except UnicodeDecodeError as e:
                if not skip_bad:
                    raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the "
                                     f"line)") from None
                bad += 1
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                if not skip_bad:
                    raise ValueError(f"{path}:{lineno}: malformed conversation: {e}") from None
                bad += 1
    if not convs:
        why = f"all {bad} non-blank lines are malformed (skipped)" if bad else "the file is empty"
        raise ValueError(f"{path} holds no conversation: {why}")
    return convs, bad


# ----------------------------------------------------------------------------------------- tokenizing
CACHE_VERSION = 1
ARRAYS = {"inputs": np.int32, "labels": np.int32, "lengths": np.int64, "targets": np.int64}


@dataclass
class Tokenized:
    """Every sample of a chat set, tokenized once, back to back in numpy arrays.
    They are memory-mapped when read from the cache. A sample is a conversation, or one assistant
    turn of a per-turn chat."""
    inputs: np.ndarray  # (N,) int32: each sample's first L-1 rendered ids (the model's inputs)
    labels: np.ndarray  # (N,) int32: their shifted labels (-100 where not a target)
    lengths: np.ndarray  # (n,) int64: L-1 per sample
    targets: np.ndarray  # (n,) int64: labels that are targets, per sample
    conversations: int  # source conversations
    per_turn: int  # conversations split per assistant turn (chat.tokenize_samples)
    max_id: int  # largest token id anywhere (inputs, labels and the final ids)
    end: str  # the reply's end token and where it came from
    skipped: int = 0  # malformed lines skipped while loading (skip_bad)


def tokenize_all(convs: list[Conversation], tpl: ChatTemplate, progress: bool = True) -> Tokenized:
    """Tokenize every conversation; a progress bar (conversations/s, tokens/s) when `progress`."""
    inputs, labels, lengths, targets = array("i"), array("i"), array("q"), array("q")
    per_turn, max_id, t0 = 0, 0, time.time()
    with tqdm(total=len(convs), unit="conv", desc="tokenizing chats", disable=not progress,
              mininterval=1.0) as bar:
        for n, turns in enumerate(convs, 1):
            samples, split = tokenize_samples(turns, tpl)
            per_turn += split
            for ids, lab in samples:
                inputs.extend(ids[:-1])
                labels.extend(lab)
                lengths.append(len(lab))
                targets.append(sum(x != IGNORE_INDEX for x in lab))
                max_id = max(max_id, max(ids))
            if n % 1000 == 0:
                bar.set_postfix_str(f"{len(inputs):,} tokens, {len(inputs) / (time.time() - t0):,.0f} tok/s",
                                    refresh=False)
            bar.update()
    return Tokenized(*(np.frombuffer(a, dtype) for a, dtype in zip((inputs, labels, lengths, targets),
                                                                   ARRAYS.values())),
                     len(convs), per_turn, max_id, f"{tpl.decode([tpl.end_id])!r} (id {tpl.end_id}, "
                                                   f"{tpl.end_source})")


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes, the cache key of a chat file. It hashes the whole file, not a
    sample, so an edit anywhere re-makes the cache. At ~1.5 GB/s here it is far faster than tokenizing."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def read_cache(out: str | Path, key: str | None = None) -> Tokenized | None:
    """The cached set, or None when absent, unfinished, damaged or made for another key (None: any)."""
    out = Path(out)
    try:
        meta = json.loads((out / "meta.json").read_text())
        if key is not None and meta["key"] != key:
            return None
        arrays = {}
        for name, dtype in ARRAYS.items():
            path, n = out / f"{name}.bin", meta["sizes"][name]
            if path.stat().st_size != n * np.dtype(dtype).itemsize:
                return None
            # copy-on-write: torch.from_numpy needs a writable array; nothing is ever written
            arrays[name] = np.memmap(path, dtype, mode="c") if n else np.zeros(0, dtype)
        return Tokenized(**arrays, **{k: meta[k] for k in ("conversations", "per_turn", "max_id", "end",
                                                           "skipped")})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(t: Tokenized, out: Path, key: str) -> None:
    """Arrays under temporary names, each renamed into place, and meta.json last (removed first).
    A crash leaves no meta.json, so an unfinished cache never passes for a finished one."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    for name in ARRAYS:
        tmp = out / f"{name}.bin.tmp{os.getpid()}"
        getattr(t, name).tofile(tmp)
        os.replace(tmp, out / f"{name}.bin")
    meta = {"format_version": CACHE_VERSION, "key": key, "sizes": {n: len(getattr(t, n)) for n in ARRAYS},
            **{k: getattr(t, k) for k in ("conversations", "per_turn", "max_id", "end", "skipped")}}
    tmp = out / f"meta.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, out / "meta.json")


def prepare_sft(out: str | Path, source_key: Callable[[], str],
                load: Callable[[], tuple[list[Conversation], int]], tpl: ChatTemplate) -> Tokenized:
    """Tokenize a chat set ONCE into the memmap cache `out`.
    Its key is source_key() (the data), the tokenizer and the template (tpl.fingerprint). A cache
    whose key matches is reused. Else load() gives (conversations, skipped lines), which are
    tokenized with a progress bar and written. One process does this (train.py: rank 0, the
    others waiting). Everyone then maps the cache with `read_cache`."""
    out = Path(out)
    key = hashlib.sha256(json.dumps([CACHE_VERSION, source_key(), tpl.fingerprint]).encode()).hexdigest()
    t = read_cache(out, key)
    if t is not None:
        print(f"SFT data: cached in {out} (same data, tokenizer and template)", flush=True)
        return t
    t0 = time.time()
    convs, skipped = load()
    t = tokenize_all(convs, tpl)
    t.skipped = skipped
    _write_cache(t, out, key)
    dt = max(time.time() - t0, 1e-9)
    print(f"SFT data: {t.conversations:,} conversations, {len(t.inputs):,} tokens tokenized in "
          f"{dt:.1f}s ({t.conversations / dt:,.0f} conv/s, {len(t.inputs) / dt:,.0f} tok/s), "
          f"cached in {out}", flush=True)
    return t


# ----------------------------------------------------------------------------------------- packing
def ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing: item indices grouped into rows of at most `capacity` tokens.
    Items are taken longest first (ties by index). Each goes into the first (lowest-index) row with
    room. A max segment tree over the rows' free space finds that row in O(log n). Never-opened rows
    have full capacity and lie right of the opened ones. So 'leftmost fitting leaf' is first-fit."""
    if not lengths:
        return []
    if any(not 0 < n <= capacity for n in lengths):
        raise ValueError(f"ffd: every length must be in [1, {capacity}], got {min(lengths)}..{max(lengths)}")
    size = 1 << max(len(lengths) - 1, 0).bit_length()
    # heap layout: node k has children 2k, 2k+1; leaf `size + r` is row r's free space
    free = [0] * size + [capacity] * len(lengths) + [0] * (size - len(lengths))
    for node in range(size - 1, 0, -1):
        free[node] = max(free[2 * node], free[2 * node + 1])
    rows: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        node = 1
        while node < size:  # descend to the leftmost child that still fits
            node = 2 * node if free[2 * node] >= lengths[i] else 2 * node + 1
        row = node - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        free[node] -= lengths[i]
        while node > 1:
            node //= 2
            free[node] = max(free[2 * node], free[2 * node + 1])
    return rows


@dataclass
class PackStats:
    conversations: int  # given
    samples: int  # conversations, plus the extra samples of per-turn chats
    per_turn: int  # conversations whose template rewrites earlier turns: one sample per reply
    truncated: int  # over-long samples cut to seq_len inputs and kept
    dropped: int  # over-long with overlong="drop", or nothing left to learn after truncation
    tokens: int  # real input positions over the kept samples
    targets: int  # positions with a label
    longest: int  # longest kept sample, in input positions
    seq_len: int
    packing: str
    rows: int  # rows of the active packing mode
    ffd_rows: int  # rows FFD needs (computed in both modes, for the comparison)
    end: str  # the token that ends a reply, and how it was chosen

    def report(self) -> str:
        kept, S = self.samples - self.dropped, self.seq_len
        bound = math.ceil(self.tokens / S)
        mark = {"ffd": ("*", " "), "none": (" ", "*")}[self.packing]
        split = (f" ({self.per_turn} rendered one sample per assistant turn, {self.samples} samples: the "
                 f"chat template rewrites earlier turns)" if self.per_turn else "")
        return "\n".join([
            f"SFT data: {self.conversations} conversations{split}, {self.truncated} truncated and "
            f"{self.dropped} dropped at seq_len {S}; {self.tokens} tokens, {self.targets} targets; "
            f"replies end with {self.end}",
            f" {mark[0]} packing ffd : {self.ffd_rows} rows (lower bound ceil(tokens/seq_len) = {bound}, "
            f"+{self.ffd_rows - bound}), fill {self.tokens / max(self.ffd_rows * S, 1):.2%}",
            f" {mark[1]} packing none: {kept} rows, fill {self.tokens / max(kept * S, 1):.2%} "
            f"({self.tokens / max(kept * self.longest, 1):.2%} padded only to the longest, {self.longest})",
        ])


class SFTDataset:
    """Packed rows: `ds[i]` → {"input_ids", "labels", "real_tokens"}, and "position_ids" when packed.
    Each is a (seq_len,) tensor: int64, or bool for real_tokens (False on the padding tail).
    Samples stay where tokenizing put them, in flat int32 arrays memory-mapped from the cache.
    `spans[i]` is kept sample i's [start, end) in them. Rows are built on access.
    So a dataset costs ~8 bytes per token of disk and almost no memory."""

    def __init__(self, data: list[Conversation] | Tokenized, tokenizer: Any, seq_len: int,
                 packing: str = "ffd", overlong: str = "truncate", template: ChatTemplate | None = None,
                 only: np.ndarray | None = None):
        """data: conversations (tokenized here, no progress bar) or a Tokenized set (prepare_sft).
        only: a (n,) bool mask of the samples to use (a held-out split and the rest); None: all."""
        if packing not in ("ffd", "none") or overlong not in ("truncate", "drop") or seq_len < 2:
            raise ValueError(f"packing must be ffd|none (got {packing!r}), overlong truncate|drop "
                             f"(got {overlong!r}), seq_len >= 2 (got {seq_len})")
        tpl = template or chat_template(tokenizer)
        if not isinstance(data, Tokenized) and not data:
            raise ValueError("no conversations given")
        t = data if isinstance(data, Tokenized) else tokenize_all(data, tpl, progress=False)
        self.seq_len, self.pad_id, self.packing, self.max_id = seq_len, tpl.pad_id, packing, t.max_id
        self.tokens, self.labels = torch.from_numpy(t.inputs), torch.from_numpy(t.labels)  # (N,) int32
        starts = np.cumsum(t.lengths) - t.lengths  # (n,)
        lengths, targets = t.lengths.copy(), t.targets.copy()
        keep = np.ones(len(t.lengths), dtype=bool) if only is None else only.copy()
        truncated = dropped = 0
        for i in np.flatnonzero((t.lengths > seq_len) & keep):  # over-long: keep the first seq_len inputs
            kept = int((t.labels[starts[i]:starts[i] + seq_len] != IGNORE_INDEX).sum())
            if overlong == "drop" or kept == 0:
                keep[i], dropped = False, dropped + 1
            else:
                lengths[i], targets[i], truncated = seq_len, kept, truncated + 1
        self.spans = [(a, a + n) for a, n in zip(starts[keep].tolist(), lengths[keep].tolist())]
        if not self.spans:
            raise ValueError(f"no conversation fits: all {t.conversations} were dropped at seq_len {seq_len} "
                             f"(overlong={overlong!r}; a truncated one is dropped when none of its "
                             f"first seq_len positions is a target): raise --seq-len")
        kept_lengths = lengths[keep].tolist()
        ffd_rows = ffd(kept_lengths, seq_len)
        self.rows = ffd_rows if packing == "ffd" else [[i] for i in range(len(kept_lengths))]
        self.stats = PackStats(t.conversations, len(t.lengths), t.per_turn, truncated, dropped,
                               sum(kept_lengths), int(targets[keep].sum()), max(kept_lengths), seq_len,
                               packing, len(self.rows), len(ffd_rows), t.end)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        spans = [self.spans[i] for i in self.rows[r]]
        pad = self.seq_len - sum(b - a for a, b in spans)
        tail = lambda value: [torch.full((pad,), value, dtype=torch.int32)]  # noqa: E731
        ids = torch.cat([self.tokens[a:b] for a, b in spans] + tail(self.pad_id))
        labels = torch.cat([self.labels[a:b] for a, b in spans] + tail(IGNORE_INDEX))
        # real_tokens: the padding tail is no token of the data, so token statistics skip it
        row = {"input_ids": ids.long(), "labels": labels.long(),  # (S,) each
               "real_tokens": torch.arange(self.seq_len) < self.seq_len - pad}
        if self.packing == "ffd":  # one conversation per row needs no document boundaries: plain causal
            # positions restart per conversation; the padding is one more document starting at 0
            row["position_ids"] = torch.cat([torch.arange(b - a) for a, b in spans] + [torch.arange(pad)])
        return row

    def report(self) -> str:
        return self.stats.report()

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise when an id (input, label or pad) would index past the model's embedding."""
        top = max(self.max_id, self.pad_id)
        if top >= model_vocab_size:
            raise ValueError(f"the SFT data holds token id {top} but the model's vocab_size is "
                             f"{model_vocab_size} (was the model built for this tokenizer?)")

# ----------------------------------------------------------------------------------------- default set
SYSTEM_PROMPTS = [None, "You are a calculator. Reply with the number only.",
                  "Answer arithmetic questions with just the result."]
QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?",
             "Calculate {a} {op} {b}.", "What do you get for {a} {op} {b}?"]
FOLLOW_UPS = {"+": "Now add {c}.", "-": "Now subtract {c}."}


def _question_keys(max_operands: tuple[int, int], ops: tuple[str, ...],
                   rng: random.Random) -> list[tuple[int, str, int]]:
    """Every first question (a, op, b), a <= max_operands[0], b <= max_operands[1], shuffled: the
    first n_eval are held out."""
    top_a, top_b = max_operands
    keys = [(a, op, b) for op in ops for a in range(top_a + 1) for b in range(top_b + 1)
            if op == "+" or a >= b]
    rng.shuffle(keys)
    return keys


def arithmetic_chats(n_train: int = 20000, n_eval: int = 100, max_operands: tuple[int, int] = (99, 9),
                     ops: tuple[str, ...] = ("+",), p_follow_up: float = 0.3,
                     seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic synthetic chats: an optional system prompt, then "What is 37 + 5?" → "42".
    The phrasing varies. Some chats have follow-ups ("Now add 4." → "46", c <= max_operands[1]).
    Results never go negative. The first question (a, op, b) of an eval chat never occurs in
    training. It is no training chat's first question: the sets are disjoint. Nor is it a follow-up:
    a training chat ends before a follow-up that would restate it.
    The defaults (a number below 100 plus a digit) give 1000 questions, 100 held out. The tiny model
    learns them in a short CPU run as a rule, not a table. It answers held-out questions about as
    well as training ones. Single-digit sums (max_operands=(9, 9)) it learns as a table of 100 facts.
    Two-digit sums and differences (max_operands=(99, 99), ops=("+", "-")) it does not learn at all.
    docs/post-training.md has the measurements."""
    rng = random.Random(seed)
    keys = _question_keys(max_operands, ops, rng)
    if n_eval >= len(keys):
        raise ValueError(f"n_eval={n_eval} leaves no training questions out of {len(keys)}")
    held_out, seen = keys[:n_eval], keys[n_eval:]
    banned = set(held_out)

    def chat(key: tuple[int, str, int], train: bool) -> Conversation:
        a, op, b = key
        system = rng.choice(SYSTEM_PROMPTS)
        turns = [{"role": "system", "content": system}] if system else []
        value = a + b if op == "+" else a - b
        turns += [{"role": "user", "content": rng.choice(QUESTIONS).format(a=a, op=op, b=b)},
                  {"role": "assistant", "content": str(value)}]
        cut = False  # a training chat ends before a follow-up that restates a held-out question
        while rng.random() < p_follow_up:  # ("Now add 4." after 38 is 38 + 4); the draws go on, so
            op = rng.choice(ops)            # every other chat stays what it was
            c = rng.randint(0, max_operands[1] if op == "+" else min(value, max_operands[1]))
            cut = cut or (train and (value, op, c) in banned)
            value = value + c if op == "+" else value - c
            if not cut:
                turns += [{"role": "user", "content": FOLLOW_UPS[op].format(c=c)},
                          {"role": "assistant", "content": str(value)}]
        return turns
    return [chat(rng.choice(seen), True) for _ in range(n_train)], [chat(k, False) for k in held_out]


def held_out_phrasings(n_eval: int = 100, max_operands: tuple[int, int] = (99, 9),
                       ops: tuple[str, ...] = ("+",), seed: int = 0) -> list[Conversation]:
    """Each held-out first question of arithmetic_chats (same arguments), in every phrasing and
    under every system prompt. These are single-turn chats, 15 per question. They make a steadier
    eval than one chat per question: one model's answers to a question's phrasings differ."""
    out = []
    for a, op, b in _question_keys(max_operands, ops, random.Random(seed))[:n_eval]:
        value = a + b if op == "+" else a - b
        for system in SYSTEM_PROMPTS:
            for q in QUESTIONS:
                out.append(([{"role": "system", "content": system}] if system else [])
                           + [{"role": "user", "content": q.format(a=a, op=op, b=b)},
                              {"role": "assistant", "content": str(value)}])
    return out
