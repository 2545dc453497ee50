"""Chat → token ids with an assistant-only loss mask, for the built-in template or any HF chat template.

What it does
    `chat_template(tok, reply_end)` picks how chats are rendered. It takes the tokenizer's own chat
    template (transformers' apply_chat_template) when there is one, else the built-in one below.
    `tokenize_conversation(turns, tpl)` returns the ids of the whole chat and the shifted labels.
    labels[t] = ids[t+1] where that token belongs to an assistant reply, else -100.
    `tokenize_samples` is what datasets call: the same, with the per-turn fallback below.

Run
    torchrun --nproc_per_node 1 train.py --sft --data chats.jsonl --tokenizer DIR [--reply-end TOKEN]

How the mask is found (character spans, not token prefixes)
    For each assistant turn k the TEXT is rendered twice. "before" is turns[:k] with the generation
    prompt, "after" is turns[:k+1]. The reply starts where "before" ends. It ends with the text of
    the end-of-turn token, searched backwards in the part of "after" that the whole chat shares.
    So the reply is what the model must write after the generation prompt. It holds nothing the
    template adds after the end token (ChatML's "\\n"). Nor does it hold what the template adds only
    where a chat stops (Phi-3's eos, written when no generation prompt is asked).
    The whole chat is then tokenized ONCE. The fast tokenizer's offsets map the spans to tokens.
    Rule: a token is a target iff it holds at least one reply character. A token straddling a
    boundary (a BPE merge across the end of the generation prompt) is thus a target.
    The ids are exactly the tokenizer's own rendering of the whole chat (apply_chat_template).
    Token-prefix checks cannot promise that. A byte-level BPE splits "\\n\\n" at the end of a text
    differently from "\\n\\n" + more text, and Llama-3's generation prompt ends so.
    A slow tokenizer has no offsets. It encodes the text piece by piece, split at the span boundaries.
    The mask is then exact, but the ids may differ from its whole-text ids.

The end of a reply
    It is the template's own end-of-turn token, not always the tokenizer's eos. Gemma ends turns
    with <end_of_turn>. A Llama-3 base tokenizer's eos is <|end_of_text|>, its turns end with <|eot_id|>.
    It is detected from a probe chat: the first special or added token after the reply.
    `reply_end` (train.py --reply-end TOKEN) overrides it. `tpl.end_source` says which was used.

Templates that rewrite earlier turns
    Some templates render an earlier turn differently once later turns follow. Qwen3 and
    DeepSeek-R1 drop the reasoning of earlier assistant turns. Then turns[:k+1] is not a text prefix
    of the whole chat, and one sample cannot hold every reply as written. Such a chat becomes one
    sample per assistant turn: turns[:k+1], with only reply k as the target. That is exactly what
    inference sees. The packing report counts these chats. A template whose generation prompt is
    not a prefix of the reply turn's rendering cannot be masked at all: ValueError.

Built-in template (data.ByteTokenizer, or any tokenizer without a chat_template)
    <bos>system: {content}\\nuser: {content}\\nassistant: {content}<end>user: {content}\\nassistant: ...
    [bos] comes first, when the tokenizer has one. A non-assistant turn encodes "{role}: {content}\\n".
    An assistant turn encodes "assistant: ", the generation prompt and never a target. Then
    "{content}" + [end] follow, the targets. end is eos unless reply_end is given.
    Each piece is encoded alone, which is exact with any tokenizer.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

IGNORE_INDEX = -100
Conversation = list[dict[str, str]]  # [{"role": ..., "content": ...}, ...]
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes"}]


@dataclass
class ChatTemplate:
    render: Callable[[Conversation, bool], list[int]]  # (turns, add_generation_prompt) → ids (prompts)
    encode: Callable[[Conversation, bool], tuple[list[int], list[bool]]]  # (turns, last reply only) →
    #                                                  ids of the whole chat, is-reply flag per token
    end_id: int  # the token closing an assistant reply: last target of a turn, where generation stops
    end_source: str  # how end_id was chosen, for the packing report
    pad_id: int
    decode: Callable[[list[int]], str]
    fingerprint: str  # changes whenever the tokenizer, the template or end_id does (cache key)


class TemplateRewritesTurns(ValueError):
    """Rendering more turns changed the text of earlier ones (see the module docstring)."""


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def builtin_template(tok: Any, reply_end: str | None = None) -> ChatTemplate:
    """The built-in template of the module docstring. It serves data.ByteTokenizer, or an HF tokenizer
    without a chat_template (raw or behind data.HFTokenizer). No bos when the tokenizer has none."""
    if hasattr(tok, "bos_id"):  # data.py's ByteTokenizer / HFTokenizer: encode adds no specials
        bos, eos, pad, enc = tok.bos_id, tok.eos_id, tok.pad_id, tok.encode
    else:  # a raw transformers tokenizer
        bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    end, source = eos, "the tokenizer's eos"
    if reply_end is not None:
        end, source = _single_token(enc, reply_end), "--reply-end"
    if end is None:
        raise ValueError("the built-in chat template ends replies with eos; the tokenizer has no eos "
                         "token (pass --reply-end TOKEN)")
    bos = [] if bos is None else [bos]

    def pieces(turns: Conversation, gen: bool, last_only: bool = False) -> list[tuple[list[int], bool]]:
        out = [(bos, False)]
        for k, t in enumerate(turns):
            if t["role"] == "assistant":
                out += [(enc("assistant: "), False),
                        (enc(t["content"]) + [end], not last_only or k == len(turns) - 1)]
            else:
                out.append((enc(f"{t['role']}: {t['content']}\n"), False))
        return out + [(enc("assistant: "), False)] * gen

    def encode(turns: Conversation, last_only: bool) -> tuple[list[int], list[bool]]:
        p = pieces(turns, False, last_only)
        return [i for ids, _ in p for i in ids], [flag for ids, flag in p for _ in ids]

    inner = getattr(tok, "hf", tok)
    state = _tokenizer_state(inner) if hasattr(inner, "get_vocab") else getattr(tok, "name", type(tok).__name__)
    return ChatTemplate(lambda turns, gen: [i for ids, _ in pieces(turns, gen) for i in ids], encode,
                        end, source, end if pad is None else pad, tok.decode,
                        _digest("builtin-v1", state, bos, end))


def _single_token(enc: Callable[[str], list[int]], text: str) -> int:
    ids = enc(text)
    if len(ids) != 1:
        raise ValueError(f"--reply-end {text!r} is not one token of the tokenizer (it encodes to {ids})")
    return ids[0]


def chat_template(tok: Any, reply_end: str | None = None) -> ChatTemplate:
    """The tokenizer's own chat template when it has one, else the built-in one.
    `tok` is a transformers tokenizer, data.HFTokenizer (its `.hf` is used) or data.ByteTokenizer.
    reply_end is the token text that ends a reply. By default it is detected from the template."""
    if not getattr(getattr(tok, "hf", tok), "chat_template", None):
        return builtin_template(tok, reply_end)
    tok = getattr(tok, "hf", tok)

    def text(turns: Conversation, gen: bool) -> str:
        if not turns and not gen:
            return ""
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=gen)

    def tokens(s: str) -> list[int]:
        return tok(s, add_special_tokens=False)["input_ids"]  # the template writes bos itself

    if reply_end is not None:
        end, source = _single_token(tokens, reply_end), "--reply-end"
    else:
        end, source = _detect_end(tok, text, tokens), "detected from the template"
    end_text = tok.decode([end])
    pad = tok.pad_token_id

    def encode(turns: Conversation, last_only: bool) -> tuple[list[int], list[bool]]:
        full = text(turns, False)
        spans = []
        for k, t in enumerate(turns):
            if t["role"] != "assistant" or (last_only and k != len(turns) - 1):
                continue
            before, after = text(turns[:k], True), text(turns[:k + 1], False)
            _require_prefix(before, after, f"the generation prompt after turns[:{k}]", ValueError)
            # the last end token that the whole chat shares with turns[:k+1]. What a template adds
            # only where the chat stops (Phi-3's eos after the last message) is not in the chat.
            stop = after.rfind(end_text, len(before), _common_prefix(after, full))
            if stop < 0:
                stop = after.rfind(end_text, len(before))
                if stop < 0:
                    raise ValueError(f"assistant turn {k}: the template renders no {end_text!r} (the reply's "
                                     f"end token, {source}) after the reply: {after[len(before):][:80]!r}; "
                                     f"pass --reply-end TOKEN")
                _require_prefix(after[:stop + len(end_text)], full, f"turns[:{k + 1}]", TemplateRewritesTurns)
            spans.append((len(before), stop + len(end_text)))
        return _tokens_of_spans(tok, full, spans)

    return ChatTemplate(lambda turns, gen: tokens(text(turns, gen)), encode, end, source,
                        end if pad is None else pad, tok.decode,
                        _digest("hf-v1", _tokenizer_state(tok), tok.chat_template, end))


def _tokenizer_state(tok: Any) -> Any:
    """Everything that decides the ids of a text: the fast tokenizer's whole definition, else the vocab."""
    if hasattr(tok, "backend_tokenizer"):
        return tok.backend_tokenizer.to_str()
    return [type(tok).__name__, sorted(tok.get_vocab().items()), str(tok.special_tokens_map)]


def _detect_end(tok: Any, text: Callable[[Conversation, bool], str], tokens: Callable[[str], list[int]]) -> int:
    """The first special or added token the template writes after a probe reply."""
    try:
        before, after = text(PROBE[:1], True), text(PROBE, False)
    except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja raise_exception)
        raise ValueError(f"cannot detect the token that ends a reply: the chat template failed on a "
                         f"user/assistant probe chat ({e}); pass --reply-end TOKEN") from None
    _require_prefix(before, after, "the generation prompt after a probe user turn", ValueError)
    reply, content = after[len(before):], PROBE[1]["content"]
    rest = reply[reply.find(content) + len(content):] if content in reply else ""
    special = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    found = next((i for i in tokens(rest) if i in special), None)
    if found is None:
        raise ValueError(f"cannot detect the token that ends a reply: after a probe reply the chat template "
                         f"writes {rest!r}, with no special token; pass --reply-end TOKEN")
    return found


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _require_prefix(short: str, long: str, what: str, error: type) -> None:
    if not long.startswith(short):
        i = _common_prefix(short, long)
        raise error(f"chat template is not prefix-stable: the text of {what} is not a prefix of the longer "
                    f"rendering (first difference at character {i}: {short[i:i + 30]!r} vs "
                    f"{long[i:i + 30]!r}); the reply cannot be located in it")


def _tokens_of_spans(tok: Any, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Tokenize `full`; a token is a target iff it holds a character of some span."""
    if tok.is_fast:
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        mark = bytearray(len(full))
        for a, b in spans:
            mark[a:b] = b"\x01" * (b - a)
        return enc["input_ids"], [1 in mark[s:e] for s, e in enc["offset_mapping"]]
    ids, flags, at = [], [], 0  # slow tokenizer: piece by piece, split at the span boundaries
    for a, b in spans + [(len(full), len(full))]:
        for piece, flag in ((full[at:a], False), (full[a:b], True)):
            got = tok(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids, flags = ids + got, flags + [flag] * len(got)
        at = b
    return ids, flags


def _labels(ids: list[int], flags: list[bool]) -> list[int]:
    return [ids[t + 1] if flags[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]


def tokenize_conversation(turns: Conversation, tpl: ChatTemplate) -> tuple[list[int], list[int]]:
    """Rendered ids (L,) and shifted labels (L-1,). labels[t] is the target of position t, whose input
    is ids[t]. It is ids[t+1] where that token belongs to an assistant reply (content + end token),
    else -100. Raises TemplateRewritesTurns or ValueError (see the module docstring)."""
    ids, flags = tpl.encode(turns, False)
    return ids, _labels(ids, flags)


def tokenize_samples(turns: Conversation, tpl: ChatTemplate) -> tuple[list[tuple[list[int], list[int]]], bool]:
    """([(ids, labels)], split): the whole chat as one sample, with split False.
    When the template rewrites earlier turns, one sample per assistant turn, with split True."""
    try:
        return [tokenize_conversation(turns, tpl)], False
    except TemplateRewritesTurns:
        out = []
        for k, t in enumerate(turns):
            if t["role"] == "assistant":
                ids, flags = tpl.encode(turns[:k + 1], True)
                out.append((ids, _labels(ids, flags)))
        return out, True
