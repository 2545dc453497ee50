"""The tokenizer belongs to the model: which tokenizer and chat template a run uses, checked first.

What it does
    `settle(args, cfg)` decides the run's tokenizer before any data or model exists.
    --init-from DIR with a tokenizer of its own uses it: --tokenizer need not repeat it.
    An explicit --tokenizer that disagrees with the model is refused (vocab size, bos and eos ids).
    A model whose vocab is not the byte tokenizer's 260 is never paired with the byte tokenizer
    by default: the run stops and asks for the model's tokenizer.
    A preset (no --init-from) with --tokenizer DIR is sized to it: its vocab, bos and eos ids.
    A tokenizer without a chat template is refused for --sft, --dpo and --grpo. `--chat-template
    builtin` asks for attotron's built-in template instead (chat.builtin_template).
    --dpo and --grpo need a model to start from: without --init-from, --allow-random-init.
    `chat_template(args)` is the template the loaders use. `export_tokenizer(args, tpl)` is the
    tokenizer an export writes, with the template the run trained with as its `chat_template`.
    `builtin_jinja` writes the built-in template as jinja: transformers renders it to the same text.

Why
    Byte ids below 260 fit any larger vocab. So a BPE model fed byte-tokenized data trains without
    an error, on the wrong ids. A run must know its tokenizer before it prepares a single document.

Run
    python train.py --sft --init-from out/pretrained --data chats.jsonl     # out/pretrained's tokenizer
    python train.py --data corpus.txt --tokenizer my-bpe                    # tiny, sized to my-bpe

Invariants (tests/test_user_path.py)
    - --init-from a folder with a BPE tokenizer, no --tokenizer: SFT, DPO and GRPO train on its ids,
      and the export carries it and its chat template (test_init_from_carries_the_tokenizer).
    - builtin_jinja renders the built-in template's ids exactly (test_builtin_template_as_jinja).
    - Every refusal is one message naming the flag (test_tokenizer_refusals).

Builds on: chat.py (templates), data.py (tokenizers), model.py (the config)
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import chat
import data
import model as M

BYTE_VOCAB = data.ByteTokenizer.vocab_size


def has_tokenizer(folder: str | None) -> bool:
    """`folder` holds the files of an HF tokenizer (data.TOKENIZER_FILES)."""
    return folder is not None and any((Path(folder) / n).is_file() for n in data.TOKENIZER_FILES)


def is_bytes(tok: Any) -> bool:
    """The byte tokenizer, or an export of it (ids 0-255 are the bytes, eos 257)."""
    if isinstance(tok, data.ByteTokenizer):
        return True
    probe = "héllo\n"
    return tok.vocab_size == BYTE_VOCAB and tok.eos_id == 257 and tok.encode(probe) == list(probe.encode())


def _ids(value: Any) -> set:
    return set(value) if isinstance(value, (list, tuple)) else {value}


def disagreements(tok: Any, cfg: M.LlamaConfig, specials: bool = True) -> list[str]:
    """How `tok` disagrees with a model's config: ids past its vocab, other bos or eos ids (with
    `specials`). A model's vocab may be larger than its tokenizer's (padded rows), never smaller."""
    out = []
    if tok.vocab_size > cfg.vocab_size:
        out.append(f"its {tok.vocab_size} ids do not fit the model's vocab_size {cfg.vocab_size}")
    if is_bytes(tok) and cfg.vocab_size != BYTE_VOCAB:
        out.append(f"it is the byte tokenizer ({BYTE_VOCAB} ids) but the model's vocab_size is "
                   f"{cfg.vocab_size}: the model was trained with another tokenizer")
    for name in ("bos", "eos") if specials else ():
        mine, theirs = getattr(tok, f"{name}_id"), getattr(cfg, f"{name}_token_id")
        if mine is not None and theirs is not None and mine not in _ids(theirs):
            out.append(f"its {name} id is {mine}, the model's {name}_token_id {theirs}")
    return out


def _against_folder(tok: Any, explicit: str, folder: str) -> list[str]:
    """An explicit --tokenizer against the model folder's own: the same ids for the same tokens."""
    if Path(folder).resolve() == Path(explicit).resolve():
        return []
    try:
        own = data.load_tokenizer(folder)
    except (OSError, ValueError):
        return []  # the config check above is all there is to go by
    differ = [f"{k} {getattr(tok, k)} (the folder's: {getattr(own, k)})" for k in ("vocab_size", "bos_id", "eos_id")
              if getattr(tok, k) != getattr(own, k)]
    return [f"--tokenizer {explicit} disagrees with the tokenizer of --init-from {folder}: {', '.join(differ)}. "
            f"Drop --tokenizer: the model folder's own is used"] if differ else []


def settle(args: argparse.Namespace, cfg: M.LlamaConfig) -> tuple[M.LlamaConfig, list[str]]:
    """The run's tokenizer, chosen and checked (module docstring); returns the config (a preset sized
    to --tokenizer) and the problems, one message each. Sets args.tokenizer to the folder used and
    args.tokenizer_note to what the start-up line says of it."""
    explicit = args.tokenizer
    if args.tokenizer is None and args.init_from and has_tokenizer(args.init_from):
        args.tokenizer = args.init_from
    try:
        tok = data.load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as e:
        return cfg, [f"--tokenizer: {e}" if explicit else f"--init-from {args.init_from}'s tokenizer: {e}"]
    errors = []
    args.tokenizer_note = f"tokenizer {tok.name} ({tok.vocab_size:,} ids"
    if args.init_from:
        # the byte tokenizer by default: only its vocab must be the model's (transformers' configs
        # carry bos/eos ids of their own family even when the model was trained on bytes)
        bad = disagreements(tok, cfg, specials=explicit is not None)
        if bad and explicit is None and args.tokenizer:
            errors.append(f"--init-from {args.init_from}: its tokenizer disagrees with its config.json: "
                          f"{'; '.join(bad)}")
        elif bad and explicit is None:
            errors.append(f"--init-from {args.init_from} has no tokenizer files, and the byte tokenizer "
                          f"cannot serve it: {'; '.join(bad)}. Pass --tokenizer with the tokenizer the model "
                          f"was trained with")
        elif bad:
            errors.append(f"--tokenizer {explicit} disagrees with --init-from {args.init_from}: "
                          f"{'; '.join(bad)}. Drop --tokenizer" + (" (the model folder's own is used)" if
                          has_tokenizer(args.init_from) else "") + ", or pass the model's tokenizer")
        if not bad and explicit is not None and has_tokenizer(args.init_from):
            errors += _against_folder(tok, explicit, args.init_from)
        args.tokenizer_note += ", from --init-from)" if explicit is None and args.tokenizer else ")"
    elif not isinstance(tok, data.ByteTokenizer):  # a preset: sized to the tokenizer
        cfg = dataclasses.replace(cfg, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
        args.tokenizer_note += f"; --model {args.model}'s vocab sized to it)"
    else:
        args.tokenizer_note += ")"
    chats = args.sft or args.dpo or args.grpo
    if args.chat_template is not None and not chats:
        errors.append("--chat-template goes with --sft, --dpo or --grpo")
    if chats and not isinstance(tok, data.ByteTokenizer) and not getattr(tok.hf, "chat_template", None) \
            and args.chat_template != "builtin":
        errors.append(f"the tokenizer {args.tokenizer} has no chat template: pass --chat-template builtin "
                      f"to render chats with attotron's built-in one (chat.py), or use a tokenizer with a "
                      f"chat_template")
    if not chats and args.data is None and not is_bytes(tok):
        errors.append(f"the tokenizer {args.tokenizer} is not the byte tokenizer, and without --data the "
                      f"default corpus is byte-tokenized: pass --data (text, JSONL or a folder) to pretrain on")
    if (args.dpo or args.grpo) and not args.init_from and not args.allow_random_init:
        mode = "--dpo" if args.dpo else "--grpo"
        errors.append(f"{mode} without --init-from trains a random model: start from a trained one "
                      f"(--init-from its --export-hf folder), or pass --allow-random-init")
    return cfg, errors


def chat_template(args: argparse.Namespace, tok: Any = None) -> chat.ChatTemplate:
    """The chat template of the run: the tokenizer's own, or the built-in one (the byte tokenizer's,
    or --chat-template builtin)."""
    tok = tok or data.load_tokenizer(args.tokenizer)
    if getattr(args, "chat_template", None) == "builtin":
        return chat.builtin_template(tok, getattr(args, "reply_end", None))
    return chat.chat_template(tok, getattr(args, "reply_end", None))


def builtin_jinja(tok: Any, tpl: chat.ChatTemplate) -> str:
    """The built-in template (chat.builtin_template) as a jinja chat_template. transformers renders
    it to the same text; with the byte tokenizer, to the same ids."""
    def text(i: int | None) -> str:
        if i is None:
            return ""
        t = tok.decode([i])  # a special token's text (or a --reply-end token's)
        if "{" in t or "}" in t:
            raise ValueError(f"the token {t!r} cannot be written into a jinja template literally")
        return t
    end = text(tpl.end_id)
    return (text(tok.bos_id) + "{% for m in messages %}{% if m['role'] == 'assistant' %}assistant: "
            "{{ m['content'] }}" + end + "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def export_tokenizer(args: argparse.Namespace, path: str | None, tpl: chat.ChatTemplate | None) -> Any:
    """The tokenizer an export writes, from `path`, with a chat_template. A chat run writes the
    template it trained with. Pretraining keeps the tokenizer's own; the byte tokenizer gets the
    built-in one, the template a later --sft on it uses."""
    tok = data.load_tokenizer(path)
    own = getattr(getattr(tok, "hf", None), "chat_template", None)
    builtin = getattr(args, "chat_template", None) == "builtin" or not own
    if tpl is None and not isinstance(tok, data.ByteTokenizer):
        return tok  # pretraining: the tokenizer as it is
    if builtin:
        jinja = builtin_jinja(tok, tpl or chat.builtin_template(tok))
        if isinstance(tok, data.ByteTokenizer):
            tok.chat_template = jinja  # weights.write_tokenizer writes it
        else:
            tok.hf.chat_template = jinja
    return tok
