"""The user's path: your model, your tokenizer, your data, with no silent trap (pairing.py, formats.py).

The references: the tokenizer's own apply_chat_template and encode (transformers), the files the
user wrote, and attotron's built-in template rendered piece by piece (chat.builtin_template)."""
import argparse
import json
from pathlib import Path

import pytest
import torch

import chat
import cli
import data
import feed
import grid as G
import model as M
import pairing
import sft
import weights as W
from dist import run_ranks
from test_sft import CHATML, chatml_tokenizer

GRID = G.Grid(rank=0, world=1, device=torch.device("cpu"))


def _main(rank: int, world: int, argv: list[str]) -> None:
    import train
    train.main(argv)


def bpe_model(folder: Path, template: str | None = CHATML) -> object:
    """A tiny random Llama sized to a byte-level BPE with the ChatML template, saved with it."""
    tok = chatml_tokenizer(template)
    cfg = M.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                        eos_token_id=tok.eos_token_id)
    W.save_hf(W.materialize(M.build(cfg), "cpu", seed=0).state_dict(), cfg, folder)
    tok.save_pretrained(str(folder))
    return tok


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SUMS = [(37, 45), (1, 2), (3, 4), (5, 6)]
CHATS = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                       {"role": "assistant", "content": f"The answer is {a + b}."}]} for a, b in SUMS]
PAIRS = [{"prompt": f"What is {a} + {b}?", "chosen": [{"role": "assistant", "content": str(a + b)}],
          "rejected": [{"role": "assistant", "content": str(a + b + 1)}]} for a, b in SUMS]
PROMPTS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in SUMS]


def settled(argv: list[str]) -> tuple[argparse.Namespace, M.LlamaConfig, list[str]]:
    """parse_args, then pairing.settle against --init-from's config or the preset (train.configure)."""
    args = cli.parse_args(argv)
    cfg = W.load_config(args.init_from) if args.init_from else M.PRESETS[args.model]
    cfg, errors = pairing.settle(args, cfg)
    return args, cfg, errors


# ------------------------------------------------------------------------------ the tokenizer travels
def test_init_from_carries_the_tokenizer(tmp_path):
    """--init-from a folder with a BPE tokenizer and no --tokenizer: SFT trains on the tokenizer's own
    ids of its ChatML rendering, and the export carries that tokenizer and template. DPO and GRPO
    then start from the export (the README's chain) and read the same ids."""
    tok = bpe_model(tmp_path / "m")
    chats, pairs = write_jsonl(tmp_path / "c.jsonl", CHATS), write_jsonl(tmp_path / "p.jsonl", PAIRS)
    prompts = write_jsonl(tmp_path / "q.jsonl", PROMPTS)
    common = ["--seq-len", "64", "--batch-size", "2", "--steps", "1", "--cache-dir", str(tmp_path / "cache")]
    argv = ["--sft", "--init-from", str(tmp_path / "m"), "--data", str(chats), "--export-hf", str(tmp_path / "sft"),
            *common]
    run_ranks(_main, 1, argv)
    def ids(turns: list) -> list[int]:
        return tok(tok.apply_chat_template(turns, tokenize=False), add_special_tokens=False)["input_ids"]
    cached = sft.read_cache(feed.cache_path(cli.parse_args(argv), ".attotron-sft"))
    want = [i for c in CHATS for i in ids(c["messages"])[:-1]]  # each chat's inputs: its ids but the last
    assert cached.inputs.tolist() == want and max(want) >= 260  # BPE ids, not bytes
    out = data.load_tokenizer(str(tmp_path / "sft"))
    assert out.hf.chat_template == CHATML and out.hf.get_vocab() == tok.get_vocab()
    # DPO and GRPO from the export, without --tokenizer
    for mode, extra in (("--dpo", ["--data", str(pairs)]),
                        ("--grpo", ["--data", str(prompts), "--grpo-group", "2", "--grpo-max-new", "3"])):
        argv = [mode, "--init-from", str(tmp_path / "sft"), *extra, *common]
        args, cfg, errors = settled(argv)
        assert errors == [] and args.tokenizer == str(tmp_path / "sft") and "from --init-from" in args.tokenizer_note
        args.micro_batches = 1
        if mode == "--dpo":
            import dpo
            ds = dpo.load(args, GRID)[0]
            assert ds.docs[0][0][0] == ids(dpo.parse_pair(PAIRS[0])[0])
        else:
            import grpo
            ds = grpo.load(args, GRID)[0]
            assert ds.prompts[0] == tok(tok.apply_chat_template(
                [{"role": "user", "content": PROMPTS[0]["prompt"]}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"]
        run_ranks(_main, 1, argv + ["--export-hf", str(tmp_path / mode[2:])])
        assert data.load_tokenizer(str(tmp_path / mode[2:])).hf.chat_template == CHATML


def test_builtin_template_as_jinja(tmp_path):
    """The export's chat_template of the built-in template (pairing.builtin_jinja), loaded back by
    transformers, renders the built-in template's ids exactly. With the byte tokenizer every prompt
    and every masked chat is the same. So `--sft --export-hf out/sft`, then `--grpo --init-from
    out/sft`, trains on the ids SFT trained on."""
    tok = data.ByteTokenizer()
    tpl = chat.builtin_template(tok)
    W.write_tokenizer(pairing.export_tokenizer(argparse.Namespace(), None, tpl), tmp_path)
    again = chat.chat_template(data.load_tokenizer(str(tmp_path)))
    chats, _ = sft.arithmetic_chats(n_train=100)
    for c in chats:
        assert chat.tokenize_samples(c, again) == chat.tokenize_samples(c, tpl)
        for k in range(1, len(c)):
            assert again.render(c[:k], True) == tpl.render(c[:k], True)
    assert (again.end_id, again.pad_id) == (tpl.end_id, tpl.pad_id)
    cfg = M.PRESETS["tiny"]
    W.save_hf(W.materialize(M.build(cfg), "cpu", seed=0).state_dict(), cfg, tmp_path / "sft",
              tokenizer=pairing.export_tokenizer(argparse.Namespace(), None, tpl))
    assert settled(["--grpo", "--init-from", str(tmp_path / "sft")])[2] == []


def test_tokenizer_refusals(tmp_path):
    """One message each, naming the flag: a --tokenizer that disagrees with --init-from; a model
    whose vocab the byte tokenizer cannot serve; a tokenizer without a chat template for --sft (unless
    --chat-template builtin); --dpo / --grpo from random weights (unless --allow-random-init)."""
    bpe_model(tmp_path / "m")
    bare = tmp_path / "bare"  # the same model without its tokenizer files
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((tmp_path / "m" / f).read_bytes())
    errs = settled(["--sft", "--init-from", str(bare)])[2]
    assert len(errs) == 1 and "has no tokenizer files" in errs[0] and "--tokenizer" in errs[0]
    assert settled(["--sft", "--init-from", str(bare), "--tokenizer", str(tmp_path / "m")])[2] == []
    errs = settled(["--sft", "--init-from", str(tmp_path / "m"), "--tokenizer", "bytes"])[2]
    assert len(errs) == 1 and errs[0].startswith("--tokenizer bytes disagrees with --init-from")
    plain = chatml_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "plain"))
    errs = settled(["--sft", "--init-from", str(bare), "--tokenizer", str(tmp_path / "plain")])[2]
    assert len(errs) == 1 and "has no chat template: pass --chat-template builtin" in errs[0]
    assert settled(["--sft", "--init-from", str(bare), "--tokenizer", str(tmp_path / "plain"),
                    "--chat-template", "builtin"])[2] == []
    for mode in ("--dpo", "--grpo"):
        errs = settled([mode])[2]
        assert len(errs) == 1 and f"{mode} without --init-from" in errs[0] and "--allow-random-init" in errs[0]
        assert settled([mode, "--allow-random-init"])[2] == []


def test_preset_sized_to_the_tokenizer(tmp_path, capfd):
    """--tokenizer DIR with a preset: its vocab and eos are the tokenizer's, and the start-up line says
    so. The run pretrains on the tokenizer's ids of the user's text."""
    chatml_tokenizer().save_pretrained(str(tmp_path / "tok"))
    tok = data.load_tokenizer(str(tmp_path / "tok"))
    args, cfg, errors = settled(["--tokenizer", str(tmp_path / "tok"), "--data", "x.txt"])
    assert errors == [] and (cfg.vocab_size, cfg.eos_token_id) == (tok.vocab_size, tok.eos_id)
    assert "vocab sized to it" in args.tokenizer_note
    assert "default corpus is byte-tokenized" in settled(["--tokenizer", str(tmp_path / "tok")])[2][0]
    (tmp_path / "c.txt").write_text("What is 37 + 45? The answer is 82.\n" * 40)
    run_ranks(_main, 1, ["--tokenizer", str(tmp_path / "tok"), "--data", str(tmp_path / "c.txt"), "--seq-len", "16",
                         "--batch-size", "2", "--steps", "1", "--cache-dir", str(tmp_path / "cache"),
                         "--export-hf", str(tmp_path / "out")])
    line = next(t for t in capfd.readouterr().out.splitlines() if t.startswith("model "))
    assert f"tokenizer tok ({tok.vocab_size} ids; --model tiny's vocab sized to it)" in line
    assert line.endswith(f" · cache {tmp_path / 'cache'}")  # the start-up line names the cache folder
    assert W.load_config(tmp_path / "out").vocab_size == tok.vocab_size
    assert data.load_tokenizer(str(tmp_path / "out")).encode("What is") == tok.encode("What is")


def test_export_refuses_to_replace_a_folder(tmp_path):
    """--export-hf into a folder that holds a model is refused unless --overwrite."""
    bpe_model(tmp_path / "m")
    errors = lambda *argv: cli.validate(cli.parse_args(list(argv)), M.PRESETS["tiny"], GRID)  # noqa: E731
    refused = errors("--export-hf", str(tmp_path / "m"))
    assert len(refused) == 1 and "already holds a model" in refused[0] and "--overwrite" in refused[0]
    assert errors("--export-hf", str(tmp_path / "m"), "--overwrite") == []
    assert errors("--export-hf", str(tmp_path / "new")) == []


# ------------------------------------------------------------------------------ the verifier
def test_verifier_by_file_or_module(tmp_path):
    """--verifier path/to/file.py:fn loads the file; a module off sys.path names PYTHONPATH."""
    import grpo
    (tmp_path / "myrewards.py").write_text("def score(reply, gold):\n    return float(reply.strip() == gold)\n")
    fn = grpo.load_verifier(f"{tmp_path / 'myrewards.py'}:score")
    assert (fn(" 42 ", "42"), fn("41", "42")) == (1.0, 0.0)
    with pytest.raises(ValueError, match=r"No module named 'myrewards'; .*PYTHONPATH.*myrewards.py:score"):
        grpo.load_verifier("myrewards:score")
    with pytest.raises(ValueError, match=r"the file .*nope.py does not exist"):
        grpo.load_verifier(f"{tmp_path / 'nope.py'}:score")
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(ValueError, match=r"broken.py:score.*no_such_module_here"):
        grpo.load_verifier(f"{tmp_path / 'broken.py'}:score")
    with pytest.raises(ValueError, match=r"has no attribute 'nope'"):
        grpo.load_verifier(f"{tmp_path / 'myrewards.py'}:nope")
    args = cli.parse_args(["--grpo", "--verifier", f"{tmp_path / 'myrewards.py'}:score"])
    assert not [e for e in cli.validate_grpo(args) if "--verifier" in e]


# ------------------------------------------------------------------------------ data in
def every_format(tmp_path: Path, rows: list[dict], name: str) -> list[Path]:
    """The same records as JSONL, JSONL.gz, a JSON array, parquet, an arrow file and a save_to_disk folder."""
    import gzip
    import datasets
    lines = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / f"{name}.jsonl").write_text(lines)
    with gzip.open(tmp_path / f"{name}.jsonl.gz", "wt") as f:
        f.write(lines)
    (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / f"{name}.parquet"))
    ds.save_to_disk(str(tmp_path / f"{name}-saved"))
    arrow = next((tmp_path / f"{name}-saved").glob("*.arrow"))
    (tmp_path / f"{name}.arrow").write_bytes(arrow.read_bytes())
    return [tmp_path / f"{name}{s}" for s in (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow", "-saved")]


def test_every_format_reads_the_same_records(tmp_path):
    """SFT chats, DPO pairs (TRL's conversational and plain-text formats) and GRPO prompts read the
    same from every format; --data-column picks the field; the JSONL reader is the reference."""
    import dpo
    import formats
    import grpo
    cache = tmp_path / "cache"
    chats = [{"id": i, "conv": c["messages"]} for i, c in enumerate(CHATS)]
    for path in every_format(tmp_path, chats, "chats"):
        got = formats.parse_all(path, lambda r: sft.parse_conversation(formats.chat(r, "conv")), cache_dir=cache)[0]
        assert got == [c["messages"] for c in CHATS], path
    text_pairs = [{"prompt": p["prompt"], "chosen": p["chosen"][0]["content"], "rejected": p["rejected"][0]["content"]}
                  for p in PAIRS]
    for path in every_format(tmp_path, text_pairs, "pairs"):
        got = formats.parse_all(path, dpo.parse_pair, cache_dir=cache)[0]
        assert got == [dpo.parse_pair(p) for p in PAIRS], path  # text replies = one assistant turn each
    with pytest.raises(ValueError, match=r"p.jsonl:1: .*need a 'prompt'"):
        formats.parse_all(write_jsonl(tmp_path / "p.jsonl", [{"chosen": "a", "rejected": "b"}]), dpo.parse_pair)
    prompts = [{"question": p["prompt"], "solution": p["answer"]} for p in PROMPTS]
    for path in every_format(tmp_path, prompts, "prompts"):
        assert grpo.load_prompts(str(path), "question", cache) == [
            ([{"role": "user", "content": p["prompt"]}], p["answer"]) for p in PROMPTS], path
    # pretraining: a parquet column, tokenized as the same texts in JSONL
    docs = [{"body": f"document {i}: " + "words " * i} for i in range(5)]
    a = data.prepare(every_format(tmp_path, docs, "docs")[3], tmp_path / "a", column="body", cache_dir=cache)
    b = data.prepare(write_jsonl(tmp_path / "t.jsonl", [{"text": d["body"]} for d in docs]), tmp_path / "b")
    assert (a / "tokens.bin").read_bytes() == (b / "tokens.bin").read_bytes()


def test_sft_on_a_folder_and_what_a_folder_skips(tmp_path, capsys):
    """--sft --data <folder> reads every record file in it; a text file there is refused by name.
    Pretraining on a folder reads .md and names the files it skips."""
    folder = tmp_path / "chats"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", CHATS[:2])
    write_jsonl(folder / "b.jsonl", CHATS[2:])
    args = cli.parse_args(["--sft", "--data", str(folder), "--seq-len", "64", "--cache-dir", str(tmp_path / "cache")])
    args.micro_batches = 1  # train.configure resolves it before the data loads
    ds = feed.load_sft(args, GRID)[0]
    assert ds.stats.conversations == len(CHATS)
    (folder / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt is a text file: this mode reads records"):
        feed.load_sft(args, GRID)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("# title\n")
    (corpus / "b.pdf").write_bytes(b"%PDF")
    data.prepare(corpus, tmp_path / "out")
    assert "1 file(s) not read (.pdf): b.pdf" in capsys.readouterr().out
    assert data.read_meta(tmp_path / "out")["num_documents"] == 1
