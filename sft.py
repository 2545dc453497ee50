"""Supervised fine-tuning data: chat JSONL → tokens with an assistant-only loss mask → FFD-packed rows.

What it does
    1. `load_jsonl` reads conversations, one JSON object per line, in the `messages` format
       ({"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}) or the ShareGPT
       variant ({"conversations": [{"from": "system"|"human"|"gpt", "value": str}, ...]}). A malformed
       line raises ValueError naming the file and line number, or is skipped and counted (skip_bad).
    2. `tokenize_conversation` renders a chat with the tokenizer's chat template (apply_chat_template)
       or, when it has none, the built-in template below, and builds the loss mask by rendering
       prefixes: the tokens between render(turns[:k], add_generation_prompt=True) and
       render(turns[:k+1]) are assistant turn k. Targets are that span up to and including the token
       that ends the reply (`end_id`, the eos); the template's header and any text after the end token
       stay -100. Every prefix must render as a token prefix of the whole chat, or ValueError: a
       template that rewrites earlier turns cannot be masked this way.
    3. `ffd` packs conversations into rows of seq_len tokens, first-fit-decreasing (Johnson 1973:
       rows <= 11/9·OPT + 6/9, Dósa 2007, tight). `SFTDataset` serves each row as input_ids,
       position_ids and labels; `report()` prints fill efficiency against the lower bound
       ceil(tokens / seq_len) and against padding (one conversation per row, `packing="none"`).
    4. `arithmetic_chats` is the embedded default set (deterministic multi-turn arithmetic chats, held-out
       questions disjoint from training ones); `evaluate` greedily answers held-out questions with
       model.generate and returns exact-match accuracy.

Built-in template (the byte tokenizer, or any tokenizer without a chat_template)
    <bos>system: {content}\\nuser: {content}\\nassistant: {content}<eos>user: {content}\\nassistant: ...
    i.e. [bos] + per turn: non-assistant turns encode "{role}: {content}\\n"; an assistant turn encodes
    "assistant: " (the generation prompt, never a target) + "{content}" + [eos] (targets). Pieces are
    encoded separately and concatenated, so the template is prefix-stable with any tokenizer.

Shifted labels and packing (the invariants)
    A conversation renders to ids[0..L-1]; the model consumes ids[:-1] (L-1 positions) and
    labels[t] = ids[t+1] if ids[t+1] is a target else -100, aligned with the logits (model.py's
    convention). A conversation costs L-1 positions in a row; its last input position predicts its own
    final eos, so no label ever refers to the next conversation's tokens.
    position_ids restart at 0 per conversation, so model.attention_mask makes attention block-diagonal.
    The padded tail gets pad_id, label -100 and positions restarting at 0: it is one more "document"
    that sees only itself (never a real conversation), and real tokens never see it (it comes later).
    Over-long conversations (L-1 > seq_len) are truncated (kept: the first seq_len inputs; dropped when
    no target survives) or dropped (overlong="drop"); both are counted in the report, never silent.

Run
    torchrun --nproc_per_node 1 train.py --sft --packing ffd --eval-every 50

Builds on: model.py
"""
from __future__ import annotations

import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from model import generate

IGNORE_INDEX = -100
# the default set packs to 99.5% fill at 1024 (98.8% at 512: its shortest chats are ~40 tokens long)
DEFAULT_SEQ_LEN = 1024
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant"}
Conversation = list[dict[str, str]]  # [{"role": ..., "content": ...}, ...]


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
    """Conversations of a JSONL file and the number of skipped bad lines (blank lines are ignored).
    A bad line raises ValueError('file:line: reason') unless skip_bad."""
    convs, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                convs.append(parse_conversation(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                if not skip_bad:
                    raise ValueError(f"{path}:{lineno}: malformed conversation: {e}") from None
                bad += 1
    return convs, bad


# ----------------------------------------------------------------------------------------- templates
@dataclass
class ChatTemplate:
    render: Callable[[Conversation, bool], list[int]]  # (turns, add_generation_prompt) → token ids
    end_id: int  # the token closing an assistant reply: last target of a turn, where generation stops
    pad_id: int
    decode: Callable[[list[int]], str]


def builtin_template(tok: Any) -> ChatTemplate:
    """The template in the module docstring, for data.ByteTokenizer, or an HF tokenizer without a
    chat_template (raw or behind data.HFTokenizer); no bos when the tokenizer has none."""
    if hasattr(tok, "bos_id"):  # data.py's ByteTokenizer / HFTokenizer: encode adds no specials
        bos, eos, pad, enc = tok.bos_id, tok.eos_id, tok.pad_id, tok.encode
    else:  # a raw transformers tokenizer
        bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    bos = [] if bos is None else [bos]
    if eos is None:
        raise ValueError("the built-in chat template ends replies with eos; the tokenizer has no eos token")

    def render(turns: Conversation, add_generation_prompt: bool) -> list[int]:
        ids = list(bos)
        for t in turns:
            if t["role"] == "assistant":
                ids += enc("assistant: ") + enc(t["content"]) + [eos]
            else:
                ids += enc(f"{t['role']}: {t['content']}\n")
        return ids + (enc("assistant: ") if add_generation_prompt else [])
    return ChatTemplate(render, eos, eos if pad is None else pad, tok.decode)


def chat_template(tok: Any, end_id: int | None = None) -> ChatTemplate:
    """The tokenizer's own chat template when it has one, else the built-in one. `tok` is a
    transformers tokenizer, data.HFTokenizer (its `.hf` is used) or data.ByteTokenizer. end_id defaults
    to the eos token (instruct models' tokenizers set eos to the end-of-turn token, e.g. <|im_end|>)."""
    if not getattr(getattr(tok, "hf", tok), "chat_template", None):
        return builtin_template(tok)
    tok = getattr(tok, "hf", tok)

    def render(turns: Conversation, add_generation_prompt: bool) -> list[int]:
        if not turns and not add_generation_prompt:
            return []
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        return tok(text, add_special_tokens=False)["input_ids"]  # the template writes bos itself
    end = tok.eos_token_id if end_id is None else end_id
    if end is None:
        raise ValueError("pass end_id: the tokenizer has no eos token to end assistant replies")
    pad = tok.pad_token_id
    return ChatTemplate(render, end, end if pad is None else pad, tok.decode)


def _require_prefix(short: list[int], long: list[int], what: str) -> None:
    if long[:len(short)] != short:
        i = next((i for i, (a, b) in enumerate(zip(short, long)) if a != b), len(long))
        raise ValueError(f"chat template is not prefix-stable: {what} ({len(short)} tokens) is not a "
                         f"token prefix of the longer rendering ({len(long)} tokens), first difference "
                         f"at token {i}; the assistant mask cannot be derived by rendering prefixes")


def tokenize_conversation(turns: Conversation, tpl: ChatTemplate) -> tuple[list[int], list[int]]:
    """Rendered ids (L,) and shifted labels (L-1,): labels[t] is the target of position t (input ids[t]),
    ids[t+1] where that token belongs to an assistant reply (content + end token), else -100."""
    full = tpl.render(turns, False)
    target = [False] * len(full)
    for k, t in enumerate(turns):
        if t["role"] != "assistant":
            continue
        before, after = tpl.render(turns[:k], True), tpl.render(turns[:k + 1], False)
        _require_prefix(before, after, f"turns[:{k}] + generation prompt")
        _require_prefix(after, full, f"turns[:{k + 1}]")
        span = after[len(before):]
        # the reply ends at its end token; template text after it (ChatML's "\n") is not a target
        stop = len(span) - span[::-1].index(tpl.end_id) if tpl.end_id in span else len(span)
        target[len(before):len(before) + stop] = [True] * stop
    labels = [full[t + 1] if target[t + 1] else IGNORE_INDEX for t in range(len(full) - 1)]
    return full, labels


# ----------------------------------------------------------------------------------------- packing
def ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing: item indices grouped into rows of at most `capacity` tokens. Items are
    taken longest first (ties by index) and go into the first (lowest-index) row with room. A max
    segment tree over the rows' free space finds that row in O(log n): never-opened rows have full
    capacity and lie to the right of the opened ones, so 'leftmost fitting leaf' is exactly first-fit."""
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
    truncated: int  # over-long, cut to seq_len inputs and kept
    dropped: int  # over-long with overlong="drop", or nothing left to learn after truncation
    tokens: int  # real input positions over the kept conversations
    targets: int  # positions with a label
    longest: int  # longest kept conversation, in input positions
    seq_len: int
    packing: str
    rows: int  # rows of the active packing mode
    ffd_rows: int  # rows FFD needs (computed in both modes, for the comparison)

    def report(self) -> str:
        kept, S = self.conversations - self.dropped, self.seq_len
        bound = math.ceil(self.tokens / S)
        mark = {"ffd": ("*", " "), "none": (" ", "*")}[self.packing]
        return "\n".join([
            f"SFT data: {self.conversations} conversations, {self.truncated} truncated and {self.dropped} "
            f"dropped at seq_len {S}; {self.tokens} tokens, {self.targets} targets",
            f" {mark[0]} packing ffd : {self.ffd_rows} rows (lower bound ceil(tokens/seq_len) = {bound}, "
            f"+{self.ffd_rows - bound}), fill {self.tokens / max(self.ffd_rows * S, 1):.2%}",
            f" {mark[1]} packing none: {kept} rows, fill {self.tokens / max(kept * S, 1):.2%} "
            f"({self.tokens / max(kept * self.longest, 1):.2%} padded only to the longest, {self.longest})",
        ])


class SFTDataset:
    """Packed rows: `ds[i]` → {"input_ids", "position_ids", "labels"}, each a (seq_len,) int64 tensor.
    Conversations are stored flat (int32), rows are built on access, so memory stays ~8 bytes/token."""

    def __init__(self, convs: list[Conversation], tokenizer: Any, seq_len: int, packing: str = "ffd",
                 overlong: str = "truncate", template: ChatTemplate | None = None):
        if packing not in ("ffd", "none") or overlong not in ("truncate", "drop") or seq_len < 2:
            raise ValueError(f"packing must be ffd|none (got {packing!r}), overlong truncate|drop "
                             f"(got {overlong!r}), seq_len >= 2 (got {seq_len})")
        tpl = template or chat_template(tokenizer)
        self.seq_len, self.pad_id, self.packing = seq_len, tpl.pad_id, packing
        inputs, labels, lengths, truncated, dropped = [], [], [], 0, 0
        for turns in convs:
            ids, lab = tokenize_conversation(turns, tpl)
            if len(lab) > seq_len:
                if overlong == "drop" or all(x == IGNORE_INDEX for x in lab[:seq_len]):
                    dropped += 1
                    continue
                truncated += 1
                ids, lab = ids[:seq_len + 1], lab[:seq_len]
            inputs += ids[:-1]
            labels += lab
            lengths.append(len(lab))
        if not lengths:
            raise ValueError(f"no conversation fits: all {len(convs)} were dropped at seq_len {seq_len}")
        self.tokens = torch.tensor(inputs, dtype=torch.int32)  # (N,) all conversations' inputs, back to back
        self.labels = torch.tensor(labels, dtype=torch.int32)  # (N,)
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)
        ffd_rows = ffd(lengths, seq_len)
        self.rows = ffd_rows if packing == "ffd" else [[i] for i in range(len(lengths))]
        self.stats = PackStats(len(convs), truncated, dropped, len(inputs),
                               sum(x != IGNORE_INDEX for x in labels), max(lengths), seq_len, packing,
                               len(self.rows), len(ffd_rows))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        spans = [(self.offsets[i], self.offsets[i + 1]) for i in self.rows[r]]
        pad = self.seq_len - sum(b - a for a, b in spans)
        tail = lambda value: [torch.full((pad,), value, dtype=torch.int32)]  # noqa: E731
        ids = torch.cat([self.tokens[a:b] for a, b in spans] + tail(self.pad_id))
        labels = torch.cat([self.labels[a:b] for a, b in spans] + tail(IGNORE_INDEX))
        row = {"input_ids": ids.long(), "labels": labels.long()}  # (S,) each
        if self.packing == "ffd":  # one conversation per row needs no document boundaries: plain causal
            # positions restart per conversation; the padding is one more document starting at 0
            row["position_ids"] = torch.cat([torch.arange(b - a) for a, b in spans] + [torch.arange(pad)])
        return row

    def report(self) -> str:
        return self.stats.report()

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise when an id (input, label or pad) would index past the model's embedding."""
        top = max(int(self.tokens.max()), int(self.labels.max()), self.pad_id)
        if top >= model_vocab_size:
            raise ValueError(f"the SFT data holds token id {top} but the model's vocab_size is "
                             f"{model_vocab_size} (was the model built for this tokenizer?)")


# ----------------------------------------------------------------------------------------- default set
SYSTEM_PROMPTS = [None, "You are a calculator. Reply with the number only.",
                  "Answer arithmetic questions with just the result."]
QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?",
             "Calculate {a} {op} {b}.", "What do you get for {a} {op} {b}?"]
FOLLOW_UPS = {"+": "Now add {c}.", "-": "Now subtract {c}."}


def arithmetic_chats(n_train: int = 20000, n_eval: int = 200, max_operand: int = 99,
                     ops: tuple[str, ...] = ("+", "-"), p_follow_up: float = 0.3,
                     seed: int = 0) -> tuple[list[Conversation], list[Conversation]]:
    """Deterministic synthetic chats: optional system prompt, "What is 37 + 45?" → "82" in varied
    phrasing, sometimes follow-ups ("Now add 5." → "87"). Results never go negative. The first question
    (a, op, b) of every eval chat never occurs as a first question in training (disjoint sets)."""
    rng = random.Random(seed)
    keys = [(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)
            if op == "+" or a >= b]
    rng.shuffle(keys)
    if n_eval >= len(keys):
        raise ValueError(f"n_eval={n_eval} leaves no training questions out of {len(keys)}")
    held_out, seen = keys[:n_eval], keys[n_eval:]

    def chat(key: tuple[int, str, int]) -> Conversation:
        a, op, b = key
        system = rng.choice(SYSTEM_PROMPTS)
        turns = [{"role": "system", "content": system}] if system else []
        value = a + b if op == "+" else a - b
        turns += [{"role": "user", "content": rng.choice(QUESTIONS).format(a=a, op=op, b=b)},
                  {"role": "assistant", "content": str(value)}]
        while rng.random() < p_follow_up:
            op = rng.choice(ops)
            c = rng.randint(0, max_operand if op == "+" else min(value, max_operand))
            value = value + c if op == "+" else value - c
            turns += [{"role": "user", "content": FOLLOW_UPS[op].format(c=c)},
                      {"role": "assistant", "content": str(value)}]
        return turns
    return [chat(rng.choice(seen)) for _ in range(n_train)], [chat(k) for k in held_out]


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: Any, eval_set: list[Conversation],
             max_new_tokens: int = 8, batch_size: int = 64, template: ChatTemplate | None = None) -> float:
    """Exact-match accuracy of greedy answers (model.generate) over every assistant turn of eval_set,
    the earlier turns given as the reference chat. Prompts of equal length are batched together
    (generate takes no padding); an answer must end with end_id within max_new_tokens."""
    tpl = template or chat_template(tokenizer)
    device = next(model.parameters()).device
    prompts, golds = [], []
    for turns in eval_set:
        for k, t in enumerate(turns):
            if t["role"] == "assistant":
                prompts.append(tpl.render(turns[:k], True))
                golds.append(t["content"].strip())
    by_len = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    correct = 0
    for n, idx in sorted(by_len.items()):
        for j in range(0, len(idx), batch_size):
            chunk = idx[j:j + batch_size]
            x = torch.tensor([prompts[i] for i in chunk], device=device)  # (b, n)
            out = generate(model, x, max_new_tokens, tpl.end_id)[:, n:].tolist()  # (b, <= max_new)
            for i, new in zip(chunk, out):
                if tpl.end_id in new:
                    correct += tpl.decode(new[:new.index(tpl.end_id)]).strip() == golds[i]
    return correct / max(len(prompts), 1)
