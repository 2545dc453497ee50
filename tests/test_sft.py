"""sft.py: chat loading, the assistant-only loss mask, FFD packing, the default set and its eval.

References: a brute-force FFD and an exact bin-packing search (OPT), an independent construction of
the expected masks (by hand for the built-in template, from the tokenizer's character offsets for an
HF chat template), and the plain unpacked model (one conversation per forward, causal attention
without position_ids) for the packed loss and gradients."""
import functools
import json
import math
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import chat
import sft
from data import ByteTokenizer
from dist import run_ranks
from feed import evaluate
from model import LlamaConfig, build, generate
from weights import materialize
from precision import MixedPrecisionOptimizer, OptimConfig, count_targets, normalized_loss

TOK = ByteTokenizer()
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 37 + 45?"},
        {"role": "assistant", "content": "82"},
        {"role": "user", "content": "Now add 5."},
        {"role": "assistant", "content": "The answer is 87."}]


def tiny_model(seed: int = 0) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=260, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=512)
    return materialize(build(cfg), "cpu", seed=seed)


# ----------------------------------------------------------------------------------------- FFD
def ffd_reference(lengths: list[int], cap: int) -> list[list[int]]:
    """Textbook FFD: longest first (ties by index), scan the rows left to right, open one if none fits."""
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r in range(len(rows)):
            if free[r] >= lengths[i]:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(cap - lengths[i])
    return rows


def optimal_rows(lengths: list[int], cap: int) -> int:
    """Exact bin packing by branch and bound (items longest first; bins of equal load tried once)."""
    items, best = sorted(lengths, reverse=True), [len(lengths)]

    def go(i: int, loads: list[int]) -> None:
        # prune: the items left need at least this many new bins beyond the free space of open ones
        short = sum(items[i:]) - sum(cap - x for x in loads)
        if len(loads) + max(0, math.ceil(short / cap)) >= best[0]:
            return
        if i == len(items):
            best[0] = len(loads)
            return
        tried = set()
        for b, load in enumerate(loads):
            if load + items[i] <= cap and load not in tried:
                tried.add(load)
                loads[b] += items[i]
                go(i + 1, loads)
                loads[b] -= items[i]
        go(i + 1, loads + [items[i]])
    go(0, [])
    return best[0]


def test_ffd_bound_reference_and_placement():
    rng = random.Random(0)
    worse_than_opt = 0
    for _ in range(400):
        cap = rng.randint(8, 30)
        lo = rng.choice([1, cap // 5, cap // 4])  # sizes just above cap/4, cap/5 are FFD's hard cases
        lengths = [rng.randint(max(lo, 1), cap if rng.random() < 0.3 else cap // 2 + 1)
                   for _ in range(rng.randint(1, 10))]
        rows = sft.ffd(lengths, cap)
        assert rows == ffd_reference(lengths, cap), (lengths, cap)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # each placed exactly once
        assert all(sum(lengths[i] for i in r) <= cap for r in rows)
        opt = optimal_rows(lengths, cap)
        assert opt <= len(rows) <= math.floor(11 / 9 * opt + 6 / 9), (lengths, cap, opt, len(rows))
        worse_than_opt += len(rows) > opt
    assert worse_than_opt > 0  # measured 6 of 400 (each at the bound): the bound check can fail
    # a large instance: the segment tree against the quadratic reference
    lengths = [rng.randint(1, 512) for _ in range(3000)]
    assert sft.ffd(lengths, 512) == ffd_reference(lengths, 512)
    with pytest.raises(ValueError, match=r"\[1, 10\]"):
        sft.ffd([3, 11], 10)


# ----------------------------------------------------------------------------------------- masks
def test_builtin_template_mask_token_by_token():
    ids, labels = sft.tokenize_conversation(CHAT, sft.chat_template(TOK))
    # the expected rendering and target flags, built by hand from the documented template
    exp, tgt = [TOK.bos_id], [False]
    for piece, is_target in [("system: Be brief.\n", False), ("user: What is 37 + 45?\n", False),
                             ("assistant: ", False), ("82", True), (None, True),
                             ("user: Now add 5.\n", False), ("assistant: ", False),
                             ("The answer is 87.", True), (None, True)]:
        toks = [TOK.eos_id] if piece is None else TOK.encode(piece)
        exp += toks
        tgt += [is_target] * len(toks)
    assert ids == exp
    assert labels == [exp[t + 1] if tgt[t + 1] else -100 for t in range(len(exp) - 1)]
    assert TOK.decode([x for x in labels if x != -100]) == "82<|eos|>The answer is 87.<|eos|>"


@functools.lru_cache(maxsize=None)
def bpe_json(vocab_size: int = 400) -> str:
    """A byte-level BPE (GPT-2 pre-tokenizer), trained once per module on a few lines (milliseconds). It
    learns "\n\n" as one token, so "\n\n" at the end of a text tokenizes differently from "\n\n" before
    more text: the trap of Llama-3's generation prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(["What is 37 + 45? The answer is 82.", "system user assistant model",
                            "Be brief.\n\n", "Now add 5.\n\n", "Check:\n\n82 + 5 = 87."] * 20, trainer)
    return tk.to_str()


def hf_tokenizer(template: str | None, specials: list[str], eos: str, bos: str | None = None,
                 vocab_size: int = 400):
    """A real HF fast tokenizer, built offline: the module's BPE + a family's special tokens and template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer.from_str(bpe_json(vocab_size))
    tk.add_special_tokens(specials + ["<|pad|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=bos, eos_token=eos, pad_token="<|pad|>",
                                   chat_template=template)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer(template: str | None = None):
    return hf_tokenizer(template or CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>")


def test_hf_chat_template_mask_token_by_token():
    hf = chatml_tokenizer()
    ids, labels = sft.tokenize_conversation(CHAT, sft.chat_template(hf))
    # independent expectation: the character spans of "{reply}<|im_end|>" in the ChatML text, mapped
    # to tokens through the tokenizer's offsets (no prefix rendering involved)
    text, spans = "", []
    for m in CHAT:
        text += f"<|im_start|>{m['role']}\n"
        if m["role"] == "assistant":
            spans.append((len(text), len(text) + len(m["content"]) + len("<|im_end|>")))
        text += m["content"] + "<|im_end|>\n"
    assert hf.apply_chat_template(CHAT, tokenize=False) == text
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    tgt = [any(a <= s and e <= b for a, b in spans) for s, e in enc["offset_mapping"]]
    assert labels == [ids[t + 1] if tgt[t + 1] else -100 for t in range(len(ids) - 1)]
    assert hf.decode([x for x in labels if x != -100]) == "82<|im_end|>The answer is 87.<|im_end|>"
    # data.py's HFTokenizer adapter is unwrapped to the same template
    adapter = type("Adapter", (), {"hf": hf, "bos_id": None, "eos_id": hf.eos_token_id, "pad_id": 2})()
    assert sft.tokenize_conversation(CHAT, sft.chat_template(adapter)) == (ids, labels)
    # without a chat_template the same tokenizer gets the built-in template (no bos: it has none)
    hf.chat_template = None
    ids, labels = sft.tokenize_conversation(CHAT, sft.chat_template(hf))
    assert hf.decode(ids).startswith("system: Be brief.\nuser: What is 37 + 45?\nassistant: 82<|im_end|>")
    assert hf.decode([x for x in labels if x != -100]) == "82<|im_end|>The answer is 87.<|im_end|>"


def test_template_that_is_not_prefix_stable_raises():
    hf = chatml_tokenizer("{{ messages | length }}{% for m in messages %}{{ m['content'] }}<|im_end|>"
                          "{% endfor %}")
    with pytest.raises(ValueError, match="not prefix-stable"):
        sft.tokenize_conversation(CHAT, sft.chat_template(hf))


# Real template strings of five families (as their tokenizer_config.json ships them), each with the
# family's special tokens and eos on the module's BPE. (template, specials, eos, bos, end of a reply)
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
          "<|end_header_id|>\n\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) "
           "%}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
           "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}{% else %}"
           "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
ZEPHYR = ("{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + message['content'] "
          "+ eos_token }}\n{% elif message['role'] == 'system' %}\n{{ '<|system|>\n' + message['content'] + "
          "eos_token }}\n{% elif message['role'] == 'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + "
          "eos_token }}\n{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n"
          "{% endif %}\n{% endfor %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = "
         "message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
# microsoft/Phi-3-mini-4k-instruct's template (its tokenizer_config.json): a chat ends with eos only when
# no generation prompt is asked, so turns[:k+1] is not a prefix of the whole chat, yet every reply is
# located (chat.py's "How the mask is found") and the chat stays one sample
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
        "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}"
        "{% endif %}")
FAMILIES = {
    "phi3": (PHI3, ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], "<|endoftext|>",
             None, "<|end|>"),
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|im_end|>"),
    # a Llama-3 BASE tokenizer: eos <|end_of_text|>, while chat turns end with <|eot_id|>
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"], "<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (MISTRAL, ["<s>", "</s>"], "</s>", "<s>", "</s>"),
    "zephyr": (ZEPHYR, ["<s>", "</s>"], "</s>", "<s>", "</s>"),  # <|user|> etc. are plain text there
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<bos>", "<end_of_turn>"),
}
REPLIES = ["82", "The answer is 87.\n\nCheck: 82 + 5 = 87."]  # a blank line inside a reply, too


def target_runs(ids: list[int], labels: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of target tokens in ids (labels[t] targets ids[t+1])."""
    runs = []
    for t, lab in enumerate(labels):
        if lab != -100:
            if runs and runs[-1][1] == t + 1:
                runs[-1] = (runs[-1][0], t + 2)
            else:
                runs.append((t + 1, t + 2))
    return runs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_chat_templates_ids_and_targets(family):
    """The ids equal the tokenizer's own apply_chat_template of the whole chat; the target tokens,
    decoded run by run, are exactly each reply followed by the family's end-of-turn token."""
    template, specials, eos, bos, end = FAMILIES[family]
    hf = hf_tokenizer(template, specials, eos, bos)
    chat = [{"role": "user", "content": "What is 37 + 45?"}, {"role": "assistant", "content": REPLIES[0]},
            {"role": "user", "content": "Now add 5."}, {"role": "assistant", "content": REPLIES[1]}]
    if family not in ("mistral", "gemma"):  # their templates refuse a system turn
        chat = [{"role": "system", "content": "Be brief."}] + chat
    tpl = sft.chat_template(hf)
    assert (hf.decode([tpl.end_id]), tpl.end_source) == (end, "detected from the template")
    ids, labels = sft.tokenize_conversation(chat, tpl)
    assert sft.tokenize_samples(chat, tpl) == ([(ids, labels)], False)  # one sample, not per turn
    assert ids == hf.apply_chat_template(chat, return_dict=True)["input_ids"]
    assert [hf.decode(ids[a:b]) for a, b in target_runs(ids, labels)] == [r + end for r in REPLIES]
    if family == "llama3":
        # the trap of the issue: the generation prompt's "\n\n" is one token alone, two inside the chat,
        # so a token-prefix mask would have failed here
        prompt = hf.apply_chat_template(chat[:2], add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids[:len(prompt)] != prompt
        assert sft.chat_template(hf, reply_end="<|eot_id|>").end_source == "--reply-end"
        with pytest.raises(ValueError, match="not one token"):
            sft.chat_template(hf, reply_end="eot id")


def test_straddling_token_is_a_target_iff_it_holds_reply_characters():
    hf = chatml_tokenizer()
    text = "What is 37"  # tokens What | Ġis | Ġ37; the span starts inside "Ġis" (at its "s")
    ids, flags = chat._tokens_of_spans(hf, text, [(6, 10)])
    assert hf.convert_ids_to_tokens(ids) == ["What", "Ġis", "Ġ37"] and flags == [False, True, True]
    assert chat._tokens_of_spans(hf, text, [(4, 4)])[1] == [False] * 3  # an empty span holds nothing


def test_template_that_rewrites_earlier_turns_trains_per_turn():
    """A Qwen3-like template drops the reasoning of earlier assistant turns: the chat becomes one sample
    per assistant turn, each what inference sees (the tokenizer's rendering of turns[:k+1]), with only
    its last reply as the target; counted in the report."""
    think = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not "
             "loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
             "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf = chatml_tokenizer(think)
    replies = ["<think>37 + 45</think>82", "<think>82 + 5</think>87"]
    conv = [{"role": "user", "content": "What is 37 + 45?"}, {"role": "assistant", "content": replies[0]},
            {"role": "user", "content": "Now add 5."}, {"role": "assistant", "content": replies[1]}]
    tpl = sft.chat_template(hf)
    with pytest.raises(chat.TemplateRewritesTurns, match="not prefix-stable"):
        sft.tokenize_conversation(conv, tpl)
    samples, split = chat.tokenize_samples(conv, tpl)
    assert split and len(samples) == 2
    for (ids, labels), k, reply in zip(samples, (2, 4), replies):
        assert ids == hf.apply_chat_template(conv[:k], return_dict=True)["input_ids"]
        assert [hf.decode(ids[a:b]) for a, b in target_runs(ids, labels)] == [reply + "<|im_end|>"]
    ds = sft.SFTDataset([conv, conv[:2]], hf, seq_len=128, template=tpl)
    assert (ds.stats.conversations, ds.stats.per_turn, ds.stats.samples) == (2, 1, 3)
    assert "1 rendered one sample per assistant turn, 3 samples" in ds.report()


# ----------------------------------------------------------------------------------------- packing
def short_chats(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    chats = []
    for _ in range(n):
        turns = [{"role": "user", "content": "q" * rng.randint(1, 9)},
                 {"role": "assistant", "content": "a" * rng.randint(1, 6)}]
        if rng.random() < 0.5:
            turns += [{"role": "user", "content": "more"},
                      {"role": "assistant", "content": "b" * rng.randint(1, 4)}]
        chats.append(turns)
    return chats


def test_packed_loss_and_grads_equal_one_by_one():
    """fp32. Loss: sums of the same per-token terms in another order, |rel| <= 1e-6. Grads: each
    parameter's gradient is a sum over different token sets and orders, compared at 1e-5 relative
    to its largest entry."""
    torch.manual_seed(0)
    chats = short_chats(12, seed=1)
    ds = sft.SFTDataset(chats, TOK, seq_len=128)
    tpl = sft.chat_template(TOK)
    rows = sorted(range(len(ds)), key=lambda r: -len(ds.rows[r]))[:2]  # the two fullest rows
    assert len(ds.rows[rows[0]]) >= 3 and ds.stats.tokens < len(ds) * 128  # packed, and with padding
    model = tiny_model()
    batch = {k: torch.stack([ds[r][k] for r in rows]) for k in ("input_ids", "position_ids", "labels")}
    packed = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                   reduction="sum")
    packed.backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = torch.zeros(())
    for r in rows:
        for i in ds.rows[r]:  # one conversation per forward, plain causal attention, no position_ids
            ids, labels = sft.tokenize_conversation(chats[i], tpl)
            loss = model(torch.tensor([ids[:-1]]), labels=torch.tensor([labels]), reduction="sum")
            loss.backward()
            ref = ref + loss.detach()
    assert abs(packed.item() - ref.item()) <= 1e-6 * abs(ref.item())  # measured 6e-8
    # the check is sensitive: the same rows without position_ids (attention leaking across
    # conversations) are off by ~3e-3 relative
    with torch.no_grad():
        leaky = model(batch["input_ids"], labels=batch["labels"], reduction="sum")
    assert abs(leaky.item() - ref.item()) > 1e-4 * abs(ref.item())
    for n, p in model.named_parameters():
        scale = p.grad.abs().max()
        assert (g_packed[n] - p.grad).abs().max() <= 1e-5 * scale, n  # measured <= 5e-7
    # row layout: positions restart per conversation, the label before each start is the previous
    # conversation's own closing eos, and the padded tail is its own document with no targets
    padded = 0
    for r in rows:
        row, lens = ds[r], [b - a for a, b in (ds.spans[i] for i in ds.rows[r])]
        start = 0
        for n in lens:  # each conversation: bos at position 0 ... its own eos as the last label
            assert row["position_ids"][start:start + n].tolist() == list(range(n))
            assert row["input_ids"][start] == TOK.bos_id and row["labels"][start + n - 1] == TOK.eos_id
            start += n
        assert (row["labels"][start:] == -100).all() and (row["input_ids"][start:] == TOK.pad_id).all()
        assert row["position_ids"][start:].tolist() == list(range(ds.stats.seq_len - start))
        padded += start < ds.stats.seq_len
    assert padded  # the padded tail was really checked


def test_truncate_and_drop_are_counted():
    tpl = sft.chat_template(TOK)
    long_reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 40}]
    late_reply = [{"role": "user", "content": "y" * 40}, {"role": "assistant", "content": "ok"}]
    chats = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a" * i}] for i in range(5)]
    chats += [long_reply, late_reply]  # 61 inputs each (first target at 20 | 58), others 20..24
    ds = sft.SFTDataset(chats, TOK, seq_len=30, overlong="truncate")
    # the late reply keeps no target after truncation: dropped, not truncated
    assert (ds.stats.truncated, ds.stats.dropped, len(ds.spans)) == (1, 1, 6)
    ids, labels = sft.tokenize_conversation(long_reply, tpl)
    i = 5  # the truncated one is the 6th kept conversation
    a, b = ds.spans[i]
    assert ds.tokens[a:b].tolist() == ids[:30] and ds.labels[a:b].tolist() == labels[:30]
    assert "1 truncated and 1 dropped at seq_len 30" in ds.report()
    ds = sft.SFTDataset(chats, TOK, seq_len=30, overlong="drop")
    assert (ds.stats.truncated, ds.stats.dropped, len(ds.spans)) == (0, 2, 5)
    with pytest.raises(ValueError, match="all 1 were dropped at seq_len 10"):
        sft.SFTDataset([long_reply], TOK, seq_len=10, overlong="drop")
    with pytest.raises(ValueError, match="packing must be ffd"):
        sft.SFTDataset(chats, TOK, seq_len=30, packing="greedy")


def test_packing_none_and_default_set_fill():
    chats = short_chats(20, seed=3)
    ds = sft.SFTDataset(chats, TOK, seq_len=64, packing="none")
    assert len(ds) == 20 and all(r == [i] for i, r in enumerate(ds.rows))
    row = ds[3]
    ids, labels = sft.tokenize_conversation(chats[3], sft.chat_template(TOK))
    n = len(labels)
    assert row["input_ids"][:n].tolist() == ids[:-1] and row["labels"][:n].tolist() == labels
    assert "position_ids" not in row  # one conversation per row: plain causal attention, no boundaries
    assert (row["labels"][n:] == -100).all()
    assert "* packing none: 20 rows" in ds.report()
    ds.check_vocab(260)
    with pytest.raises(ValueError, match="token id 258 but the model's vocab_size is 258"):
        ds.check_vocab(258)  # the pad id
    # the embedded default set at the default seq_len: FFD fill >= 99%, within 1% of the lower bound
    train, held_out = sft.arithmetic_chats()
    def first_questions(chats: list) -> set:
        firsts = [next(t["content"] for t in c if t["role"] == "user") for c in chats]
        return {re.search(r"(\d+) ([+-]) (\d+)", q).groups() for q in firsts}
    assert len(held_out) == 100 and not first_questions(held_out) & first_questions(train)

    def facts(chats: list) -> set:  # every (a, op, b) a training chat states, follow-ups included
        out = set()
        for c in chats:
            value = None
            for t in c:
                if t["role"] == "assistant":
                    value = t["content"]
                elif t["role"] == "user" and value is not None:  # "Now add 4." after value
                    op, b = ("+" if "add" in t["content"] else "-"), re.search(r"(\d+)", t["content"]).group(1)
                    out.add((value, op, b))
        return out
    assert not first_questions(held_out) & facts(train)  # no follow-up restates a held-out question
    assert facts(train)  # follow-ups are there
    st = sft.SFTDataset(train, TOK, seq_len=sft.DEFAULT_SEQ_LEN).stats
    bound = math.ceil(st.tokens / st.seq_len)
    assert st.tokens / (st.rows * st.seq_len) >= 0.99 and st.rows <= 1.01 * bound
    assert sft.arithmetic_chats() == (train, held_out)  # deterministic


# ----------------------------------------------------------------------------------------- preparation
def test_prepare_sft_tokenizes_once_and_remakes_on_change(tmp_path, capsys):
    """The cache is made once (progress printed), then mapped; a different source key, template,
    tokenizer, reply end token, or a damaged file re-makes it. Reference: tokenizing in memory."""
    chats, loads = short_chats(40, seed=5), []

    def load():
        loads.append(1)
        return chats, 2  # 2 "skipped lines", carried by the cache
    tpl = sft.chat_template(chatml_tokenizer())
    out = tmp_path / "chats.jsonl.attotron-sft"
    made = sft.prepare_sft(out, lambda: "v1", load, tpl)
    printed = capsys.readouterr()
    assert "tokenizing chats" in printed.err and "conv/s" in printed.out and "tok/s" in printed.out
    again = sft.prepare_sft(out, lambda: "v1", load, tpl)
    assert len(loads) == 1 and "cached in" in capsys.readouterr().out
    assert isinstance(again.inputs, np.memmap) and again.skipped == 2
    ref = sft.SFTDataset(chats, None, seq_len=64, template=tpl)
    ds = sft.SFTDataset(again, None, seq_len=64, template=tpl)
    assert ds.report() == ref.report() and len(ds) == len(ref)
    assert all(torch.equal(ds[i][k], ref[i][k]) for i in range(len(ds)) for k in ref[i])
    other_template = sft.chat_template(chatml_tokenizer(CHATML.replace("\\n{{ m['content'] }}", ": {{ m['content'] }}")))
    other_tokenizer = sft.chat_template(hf_tokenizer(CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>",
                                                     vocab_size=280))
    reply_end = sft.chat_template(chatml_tokenizer(), reply_end="\n")  # ends after <|im_end|>\n
    for key, t in (("v2", tpl), ("v1", other_template), ("v1", other_tokenizer), ("v1", reply_end), ("v1", tpl)):
        sft.prepare_sft(out, lambda: key, load, t)
    assert len(loads) == 6  # each change re-made it, and going back to the first one too
    with open(out / "labels.bin", "r+b") as f:
        f.truncate(8)  # a damaged cache is made again, never read
    assert sft.prepare_sft(out, lambda: "v1", load, tpl).labels.tolist() == made.labels.tolist()
    assert len(loads) == 7


def _prepare_on_ranks(rank: int, world: int, out: str, fail: bool) -> object:
    """feed.load_sft's pattern: rank 0 prepares (feed.prepared_once) while the others wait, then
    every rank maps the cache."""
    import feed
    import grid as G

    def load():
        assert rank == 0  # only rank 0 ever reads and tokenizes
        if fail:
            raise ValueError("chats.jsonl:3: malformed conversation")
        time.sleep(1.0)  # the other ranks wait meanwhile
        return short_chats(20, seed=2), 0

    def prepare():
        sft.prepare_sft(out, lambda: "k", load, sft.chat_template(TOK))
        return Path(out)
    try:
        t = sft.read_cache(feed.prepared_once(prepare, G.Grid(rank, world, torch.device("cpu"))))
    except ValueError as e:
        return str(e)
    return t.inputs.tolist(), t.labels.tolist(), t.lengths.tolist()


def test_prepare_sft_rank0_prepares_others_wait(tmp_path):
    results = run_ranks(_prepare_on_ranks, 3, str(tmp_path / "c"), False)
    assert results[0] == results[1] == results[2] and len(results[0][2]) == 20
    errors = run_ranks(_prepare_on_ranks, 2, str(tmp_path / "d"), True)  # rank 0's error reaches every rank
    assert errors[0] == errors[1] == "chats.jsonl:3: malformed conversation"


# ----------------------------------------------------------------------------------------- loading
def test_load_jsonl_formats_and_malformed_lines(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    share = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "yo"}]}
    bad = ['{"messages": [', '{"text": "no chat"}', '{"messages": [{"role": "bot", "content": "x"}]}',
           '{"messages": [{"role": "user", "content": "only a question"}]}', '[1, 2]',
           '{"conversations": [{"from": "gpt", "value": 3}]}']
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join([json.dumps(good), "", json.dumps(share)] + bad) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl:4: malformed conversation"):
        sft.load_jsonl(path)
    convs, n_bad = sft.load_jsonl(path, skip_bad=True)
    assert n_bad == len(bad) and convs == [good["messages"], [
        {"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}]]
    for line, reason in zip(bad[1:], ["no 'messages' or 'conversations'", "turn 0 needs 'role'",
                                      "no assistant turn", "expected a JSON object", "string 'value'"]):
        with pytest.raises(ValueError, match=reason):
            sft.parse_conversation(json.loads(line))


# ----------------------------------------------------------------------------------------- eval
class Oracle(torch.nn.Module):
    """Greedy-decodes a fixed continuation per prompt (the gold answer, or a wrong one): a model with
    a known accuracy, to check evaluate's batching, stopping and scoring. Causal, as a language model
    is: position t's logits read the tokens up to t only, so a right-padded row's padding after its
    prompt changes nothing before it."""

    def __init__(self, answers: dict[tuple, list[int]]):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.answers = answers

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*ids.shape, 260)
        for b, row in enumerate(ids.tolist()):
            for t in range(len(row)):  # position t continues row[:t + 1]
                for n in range(t + 1, 0, -1):
                    if tuple(row[:n]) in self.answers:
                        cont = self.answers[tuple(row[:n])]
                        logits[b, t, cont[min(t + 1 - n, len(cont) - 1)]] = 1.0
                        break
        return logits


def test_evaluate_exact_match_on_a_known_model():
    _, held_out = sft.arithmetic_chats(n_eval=30, max_operands=(9, 9), p_follow_up=0.5, seed=4)
    tpl = sft.chat_template(TOK)
    answers, n_turns, n_right = {}, 0, 0
    for c in held_out:
        for k, t in enumerate(c):
            if t["role"] == "assistant":
                kind = n_turns % 3  # 0: right; 1: wrong text; 2: right digits but never ends (no eos)
                ending = {0: [TOK.eos_id], 1: TOK.encode("x") + [TOK.eos_id], 2: []}[kind]
                answers[tuple(tpl.render(c[:k], True))] = TOK.encode(t["content"]) + ending
                n_turns, n_right = n_turns + 1, n_right + (kind == 0)
    assert n_turns > 30  # multi-turn chats: every assistant turn is scored
    acc = evaluate(Oracle(answers), TOK, held_out, max_new_tokens=5, batch_size=4)
    assert acc == n_right / n_turns



def test_sampled_evaluate_equals_each_draw_alone():
    """evaluate(temperature > 0, samples=k): the mean exact match of k draws a turn, draw j of turn i
    seeded with (seed, i, j). Against brute force: every draw decoded alone, one row (a row's draw does
    not depend on its batch: test_generate). The model is partly trained, so its draws are neither all
    right nor all wrong; greedy evaluation takes no samples."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and the 2-core machine is shared
    try:
        model, held_out = addition_start(200)
        tpl = sft.chat_template(TOK)
        acc = evaluate(model, TOK, held_out, max_new_tokens=5, batch_size=7, temperature=1.0, samples=3, seed=5)
        turns = [(c[:k], t["content"]) for c in held_out for k, t in enumerate(c) if t["role"] == "assistant"]
        right = 0
        for i, (prompt, gold) in enumerate(turns):
            x = torch.tensor([tpl.render(prompt, True)])  # (1, n)
            for j in range(3):
                new = generate(model, x, 5, tpl.end_id, temperature=1.0,
                               seeds=[hash((5, i, j)) % 2**63])[0, x.shape[1]:].tolist()
                right += tpl.end_id in new and tpl.decode(new[:new.index(tpl.end_id)]).strip() == gold
        assert acc == right / (3 * len(turns)) and 0 < acc < 1, (acc, right)
        # train.py's dp shards: each rank decodes every other answer; the shares sum to the whole
        shares = [evaluate(model, TOK, held_out, max_new_tokens=5, batch_size=7, temperature=1.0, samples=3,
                           seed=5, shard=(r, 2)) for r in (0, 1)]
        assert sum(shares) == pytest.approx(acc, abs=1e-12) and min(shares) > 0
        with pytest.raises(ValueError, match="greedy evaluation draws one answer"):
            evaluate(model, TOK, held_out, samples=3)
        with pytest.raises(ValueError, match="at least one draw per turn"):
            evaluate(model, TOK, held_out, temperature=1.0, samples=0)
    finally:
        torch.set_num_threads(threads)

def sft_steps(model: torch.nn.Module, ds: sft.SFTDataset, steps: int, lr: float, batch: int = 8) -> None:
    """AdamW on random packed rows, `batch` per step: 20 warm-up steps, cosine to lr/10 (as train.py)."""
    opt = MixedPrecisionOptimizer(list(model.named_parameters()), OptimConfig(lr=lr, weight_decay=0.0))
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        rows = [ds[i] for i in torch.randint(len(ds), (batch,), generator=g).tolist()]
        b = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}  # (batch, S) each
        loss = model(b["input_ids"], position_ids=b["position_ids"], labels=b["labels"], reduction="sum")
        normalized_loss(loss, count_targets(b["labels"])).backward()
        warm, cos = min(1.0, (step + 1) / 20), 0.5 * (1 + math.cos(math.pi * step / steps))
        opt.step(lr * warm * (0.1 + 0.9 * cos))


def addition_start(steps: int, lr: float = 3e-3) -> tuple[torch.nn.Module, list[sft.Conversation]]:
    """The tiny 2-layer model after `steps` SFT steps (8 rows x 128 tokens, 1 thread: deterministic)
    on single-digit addition (4000 chats, no follow-ups), and the 20 held-out chats (never trained on)."""
    torch.manual_seed(0)
    train, held_out = sft.arithmetic_chats(n_train=4000, n_eval=20, max_operands=(9, 9), ops=("+",),
                                           p_follow_up=0.0, seed=0)
    model = tiny_model(seed=0)
    sft_steps(model, sft.SFTDataset(train, TOK, seq_len=128), steps, lr)
    return model, held_out


def test_end_to_end_sft_learns_held_out_addition():
    """Short CPU run on single-digit addition (the previous built-in set, no follow-ups: 80 training
    questions, 20 held-out ones never seen in training). Untrained: 0/20 exact. Measured after 400
    steps (8 rows x 128 tokens, lr 3e-3, 2 layers x 64 hidden, 1 thread, deterministic): 13/20; the
    test asks >= 10/20 (800 steps at lr 2e-3 reach 18/20 in twice the time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # deterministic, and the 2-core machine is shared
    try:
        untrained, held_out = addition_start(0)
        before = evaluate(untrained, TOK, held_out, max_new_tokens=5)
        model, _ = addition_start(400)
        after = evaluate(model, TOK, held_out, max_new_tokens=5)
    finally:
        torch.set_num_threads(threads)
    print(f"held-out exact match: {before:.2f} untrained -> {after:.2f} after 400 steps")
    assert before <= 0.1 and after >= 0.5, (before, after)
