"""data.py: byte tokenizer, prepare → tokens.bin/meta.json, TokenDataset rows, default corpus, errors.

Every expected token stream is rebuilt here independently of data.py: the byte tokenizer's ids are
the UTF-8 bytes by definition (`list(text.encode())`), and the HF tokenizer is a word-level vocab
built in the test, so "w5" is id 5 by construction. All comparisons are exact (integers).
"""
import json
import pickle
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import data

EOS = 257
TEXT = "plain ascii, then héllo wörld — 日本語 🙂\r\nand a CRLF line\n"


def utf8(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream(docs: list[str]) -> list[int]:
    """The reference token stream: each document's bytes, then EOS."""
    return [t for d in docs for t in utf8(d) + [EOS]]


def tokens_of(out_dir: Path) -> tuple[list[int], dict]:
    meta = json.loads((out_dir / "meta.json").read_text())
    return np.fromfile(out_dir / "tokens.bin", dtype=meta["dtype"]).tolist(), meta


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                    encoding="utf-8")
    return path


# ----------------------------------------------------------------------------------- tokenizers
def test_byte_tokenizer_round_trip_and_specials():
    tok = data.load_tokenizer(None)
    assert isinstance(tok, data.ByteTokenizer) and isinstance(data.load_tokenizer("bytes"),
                                                              data.ByteTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id, tok.name) == (260, 256, 257, 258,
                                                                               "bytes")
    assert tok.encode(TEXT) == utf8(TEXT)  # no specials added
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.decode(torch.tensor(tok.encode(TEXT))) == TEXT  # tensors decode too
    ids = [256] + tok.encode("é") + [257, 258, 259] + tok.encode("x")
    assert tok.decode(ids) == "<|bos|>é<|eos|><|pad|><|sep|>x"
    assert tok.decode(tok.encode("日")[:2] + [257]) == "\ufffd<|eos|>"  # a cut character is replaced
    with pytest.raises(ValueError, match="id 260 is outside the byte tokenizer's vocab of 260"):
        tok.decode([260])


# -------------------------------------------------------------------------------------- prepare
def test_prepare_txt_is_the_byte_exact_file_plus_eos(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_bytes(TEXT.encode("utf-8"))
    out = data.prepare(src, tmp_path / "out")
    tokens, meta = tokens_of(out)
    assert tokens == stream([TEXT])  # CRLF kept: the file is read byte-exact
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 260 and meta["eos_id"] == EOS
    assert (meta["num_tokens"], meta["num_documents"]) == (len(tokens), 1)
    assert meta["tokenizer"] == "bytes" and meta["source"] == str(src.resolve())
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokens.bin"]  # no temp files


def test_prepare_jsonl_documents_in_line_order(tmp_path):
    docs = ["first", "zweite Zeile ü", "", "三番目\nwith a newline", "last"]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d, "id": i} for i, d in enumerate(docs)])
    with open(src, "a") as f:
        f.write("\n\n")  # trailing blank lines hold no document
    tokens, meta = tokens_of(data.prepare(src, tmp_path / "out"))
    kept = [d for d in docs if d]  # an empty document is dropped (it would be a lone EOS)
    assert tokens == stream(kept) and meta["num_documents"] == len(kept)


def test_prepare_folder_sorted_by_relative_path(tmp_path):
    root = tmp_path / "corpus"
    # Created out of order (directory listings follow hash or creation order, not names).
    names = ["q.txt", "sub/c.txt", "m.txt", "d.txt", "sub/a.txt", "x.txt", "b.txt", "k.txt",
             "e.txt", "z/y.txt", "h.txt"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"doc {name} ☃", encoding="utf-8")
    (root / "notes.md").write_text("doc notes.md ☃", encoding="utf-8")  # text too: read
    (root / "logo.png").write_bytes(b"\x89PNG")  # not text: skipped, and named (formats.files)
    write_jsonl(root / "a.jsonl", [{"text": "a one"}, {"text": "a two"}])
    tokens, meta = tokens_of(data.prepare(root, tmp_path / "out"))
    ordered = ["b.txt", "d.txt", "e.txt", "h.txt", "k.txt", "m.txt", "notes.md", "q.txt", "sub/a.txt",
               "sub/c.txt", "x.txt", "z/y.txt"]
    assert tokens == stream(["a one", "a two"] + [f"doc {name} ☃" for name in ordered])
    assert meta["num_documents"] == 14


@pytest.mark.parametrize("cap, expected", [
    (3, ["abc"]),             # the cap ends exactly at a document end
    (6, ["abc", "é"]),        # cuts 日 after 1 of its 3 bytes: the broken character is dropped
    (8, ["abc", "é日"]),
    (100, ["abc", "é日x", "tail"]),
])
def test_prepare_max_bytes_keeps_the_first_bytes_of_text(tmp_path, cap, expected):
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "abc"}, {"text": "é日x"}, {"text": "tail"}])
    tokens, meta = tokens_of(data.prepare(src, tmp_path / "out", max_bytes=cap))
    assert tokens == stream(expected) and meta["max_bytes"] == cap


class ShiftedBytes(data.ByteTokenizer):
    """A fake wide vocab: byte b becomes id b + shift, so 'a' (97, the largest byte of "a a") can
    land on 65536."""

    def __init__(self, vocab_size: int, shift: int):
        self.vocab_size, self.shift = vocab_size, shift

    def encode(self, text):
        return [b + self.shift for b in text.encode("utf-8")]


def test_dtype_is_uint16_up_to_65536_ids_then_uint32(tmp_path, monkeypatch):
    src = tmp_path / "a.txt"
    src.write_text("a a", encoding="utf-8")
    monkeypatch.setattr(data, "load_tokenizer", lambda path: ShiftedBytes(2**16, 0))
    tokens, meta = tokens_of(data.prepare(src, tmp_path / "u16"))
    assert meta["dtype"] == "uint16" and tokens == stream(["a a"])

    shift = 2**16 - ord("a")  # 'a' → 65536, which would wrap to 0 in uint16
    monkeypatch.setattr(data, "load_tokenizer", lambda path: ShiftedBytes(2**16 + 1, shift))
    tokens, meta = tokens_of(data.prepare(src, tmp_path / "u32"))
    assert meta["dtype"] == "uint32"
    assert tokens == [b + shift for b in utf8("a a")] + [EOS] and tokens[0] == 2**16

    monkeypatch.setattr(data, "load_tokenizer", lambda path: ShiftedBytes(2**16, shift))
    with pytest.raises(ValueError, match="produced id 65536 outside its vocab_size 65536"):
        data.prepare(src, tmp_path / "bad")


def test_hf_tokenizer_dir_uint32_no_bos_added(tmp_path):
    """A real local HF tokenizer (built here, no download) with 70003 ids: uint32, ids > 65535 kept,
    the BOS its post-processor would add is not, and vocab_size counts the added specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(70000)} | {"<unk>": 70000}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<bos>", "<eos>", "<extra>"])  # ids 70001, 70002, 70003
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                      special_tokens=[("<bos>", 70001)])
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(tmp_path / "tok")
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": "w5 w69999 w65536"}, {"text": "w0 <extra>"}])
    tokens, meta = tokens_of(data.prepare(src, tmp_path / "out", tokenizer_path=tmp_path / "tok"))
    assert tokens == [5, 69999, 65536, 70002, 0, 70003, 70002]
    assert (meta["dtype"], meta["vocab_size"], meta["eos_id"]) == ("uint32", 70004, 70002)
    assert meta["tokenizer_path"] == str((tmp_path / "tok").resolve())
    assert data.load_tokenizer(str(tmp_path / "tok")).decode([5, 70003]) == "w5 <extra>"

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
        {"a": 0, "<unk>": 1}, unk_token="<unk>"))).save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ValueError, match="has no eos_token"):
        data.prepare(src, tmp_path / "out2", tokenizer_path=tmp_path / "no_eos")


# ------------------------------------------------------------------------------------ bad input
def test_prepare_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"corpus .*missing.txt does not exist"):
        data.prepare(tmp_path / "missing.txt", tmp_path / "o")
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory .*nope does not exist"):
        data.load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"corpus .*empty.txt is empty: no document has any text"):
        data.prepare(tmp_path / "empty.txt", tmp_path / "o")
    (tmp_path / "no_data").mkdir()
    (tmp_path / "no_data" / "x.pdf").write_bytes(b"%PDF")
    with pytest.raises(ValueError, match=r"no_data holds no data file .* it holds 1 file\(s\) not read \(.pdf\)"):
        data.prepare(tmp_path / "no_data", tmp_path / "o")
    write_jsonl(tmp_path / "no_text.jsonl", [{"text": "ok"}, {"text": "ok"}, {"body": "x"}])
    with pytest.raises(ValueError, match=r'no_text.jsonl:3: line has no string "text" field'):
        data.prepare(tmp_path / "no_text.jsonl", tmp_path / "o")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        data.prepare(tmp_path / "bad.jsonl", tmp_path / "o")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not valid UTF-8"):
        data.prepare(tmp_path / "latin1.txt", tmp_path / "o")
    with pytest.raises(ValueError, match="max_bytes must be positive, got 0"):
        data.prepare(tmp_path / "latin1.txt", tmp_path / "o", max_bytes=0)
    assert list((tmp_path / "o").iterdir()) == []  # failed prepares leave nothing behind


def test_failed_prepare_never_leaves_a_valid_looking_folder(tmp_path, monkeypatch):
    good = tmp_path / "good.txt"
    good.write_text("good data", encoding="utf-8")
    out = data.prepare(good, tmp_path / "out")
    before = (out / "tokens.bin").read_bytes(), (out / "meta.json").read_bytes()
    # A failure while tokenizing leaves the previous complete dataset untouched.
    write_jsonl(tmp_path / "half.jsonl", [{"text": "new"}, {"nope": 1}])
    with pytest.raises(ValueError, match="half.jsonl:2"):
        data.prepare(tmp_path / "half.jsonl", out)
    assert ((out / "tokens.bin").read_bytes(), (out / "meta.json").read_bytes()) == before
    # A crash after tokens.bin was replaced but before meta.json was written: no meta, so the
    # folder is refused instead of read with the old meta.
    monkeypatch.setattr(data.json, "dumps", lambda *a, **k: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError, match="crash"):
        data.prepare(tmp_path / "half.jsonl", out, max_bytes=3)
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir()) == ["tokens.bin"]
    with pytest.raises(FileNotFoundError, match=r"meta.json not found: .* did not finish"):
        data.TokenDataset(out, 2)


def test_token_dataset_meta_errors(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("0123456789", encoding="utf-8")  # 11 tokens with EOS
    out = data.prepare(src, tmp_path / "out")
    meta_path, bin_path = out / "meta.json", out / "tokens.bin"
    meta = json.loads(meta_path.read_text())

    with pytest.raises(ValueError, match=r"holds 11 tokens: not one row of seq_len\+1 = 12"):
        data.TokenDataset(out, 11)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        data.TokenDataset(out, 0)
    with pytest.raises(FileNotFoundError, match=r"nowhere.meta.json not found"):
        data.TokenDataset(tmp_path / "nowhere", 4)
    meta_path.write_text('{"format_version": 1, ')
    with pytest.raises(ValueError, match=r"meta.json is corrupt"):
        data.TokenDataset(out, 4)
    meta_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "num_tokens"}))
    with pytest.raises(ValueError, match=r"meta.json is corrupt: it lacks \['num_tokens'\]"):
        data.TokenDataset(out, 4)
    meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match=r"meta.json: format_version 99"):
        data.TokenDataset(out, 4)
    meta_path.write_text(json.dumps(meta))
    bin_path.write_bytes(bin_path.read_bytes()[:-2])  # one uint16 token short
    with pytest.raises(ValueError, match=r"tokens.bin has 20 bytes but .* says 11 uint16 tokens "
                                         r"= 22 bytes"):
        data.TokenDataset(out, 4)
    bin_path.unlink()
    with pytest.raises(ValueError, match=r"tokens.bin is missing but"):
        data.TokenDataset(out, 4)


# -------------------------------------------------------------------------------------- dataset
def test_token_dataset_rows_are_slices_of_the_stream(tmp_path):
    docs = ["The quick brown fox", "jumps over ☃ the lazy dog", "end"]
    ref = stream(docs)
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    out = data.prepare(src, tmp_path / "out")
    assert len(ref) - 1 == 51  # = 3 * 17: seq 1, 3, 51 use every token, seq 2, 7, 8 leave a tail
    for seq in [1, 2, 3, 7, 8, 51]:
        ds = data.TokenDataset(out, seq)
        assert len(ds) == sum(1 for i in range(len(ref)) if i * seq + seq + 1 <= len(ref))
        for i in range(len(ds)):
            row = ds[i]
            assert row.dtype == torch.long and row.shape == (seq + 1,)
            assert row.tolist() == ref[i * seq: i * seq + seq + 1]
        # Rows share one boundary token: the labels row[1:] of all rows cover ref[1:] once each.
        targets = [t for i in range(len(ds)) for t in ds[i][1:].tolist()]
        assert targets == ref[1: len(ds) * seq + 1]
        with pytest.raises(IndexError, match=f"row {len(ds)} out of range for {len(ds)} rows"):
            ds[len(ds)]
    ds = data.TokenDataset(out, 7)
    assert ds.vocab_size == 260 and ds.eos_id == EOS
    first = ds[2]  # maps the file; pickling must still send the path, not the mapped tokens
    clone = pickle.loads(pickle.dumps(ds))  # what a spawned DataLoader worker receives
    assert clone._tokens is None and torch.equal(clone[2], first)

    ds.check_vocab(260)
    ds.check_vocab(512)
    with pytest.raises(ValueError, match=r"vocab of 260 \(bytes\) but the model's vocab_size is "
                                         r"256: ids up to 259 would not fit"):
        ds.check_vocab(256)


# ------------------------------------------------------------------------------- default corpus
def stdlib_reference(cap: int) -> list[int]:
    """First `cap` bytes of the stdlib .py files (outside tests/site-packages) in sorted relative
    path order, EOS after each file — rebuilt here with rglob instead of data.py's os.walk."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = sorted((p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    out, left = [], cap
    for p in files:
        raw = p.read_bytes()
        if len(raw) >= left:  # the last file is cut to the cap, minus a split character
            return out + list(raw[:left].decode("utf-8", errors="ignore").encode()) + [EOS]
        out += list(raw) + [EOS]
        left -= len(raw)
    raise AssertionError("stdlib smaller than the cap")


def test_default_corpus_deterministic_and_reused(tmp_path, monkeypatch):
    cap = 30_000
    a = data.default_corpus(tmp_path / "a", max_bytes=cap)
    b = data.default_corpus(tmp_path / "b", max_bytes=cap)
    assert (a / "tokens.bin").read_bytes() == (b / "tokens.bin").read_bytes()
    tokens, meta = tokens_of(a)
    assert tokens == stdlib_reference(cap)
    assert meta["num_tokens"] == len(tokens) and meta["tokenizer"] == "bytes"
    assert meta["num_documents"] == tokens.count(EOS) > 1  # several whole files, then a cut one

    # Reused: the second call returns without writing anything.
    stamp = (a / "tokens.bin").stat().st_mtime_ns, (a / "meta.json").stat().st_mtime_ns
    monkeypatch.setattr(data, "_write", lambda *args: pytest.fail("reused cache was rewritten"))
    assert data.default_corpus(tmp_path / "a", max_bytes=cap) == a
    assert ((a / "tokens.bin").stat().st_mtime_ns, (a / "meta.json").stat().st_mtime_ns) == stamp
    monkeypatch.undo()

    # A damaged cache, or one made with another cap, is prepared again.
    with open(a / "tokens.bin", "r+b") as f:
        f.truncate(100)
    data.default_corpus(tmp_path / "a", max_bytes=cap)
    assert (a / "tokens.bin").read_bytes() == (b / "tokens.bin").read_bytes()
    data.default_corpus(tmp_path / "a", max_bytes=1000)
    assert tokens_of(a)[0] == stdlib_reference(1000)

    # Default location: ~/.cache/attotron/stdlib-<python version>-<cap>.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    version = ".".join(map(str, sys.version_info[:3]))
    assert data.default_corpus(max_bytes=1000) == (
        tmp_path / "home" / ".cache" / "attotron" / f"stdlib-{version}-1000")


# ------------------------------------------------------------------------- held-out split, staleness
def test_val_split_holds_out_whole_documents(tmp_path):
    """val_fraction 1/4 holds out documents 3, 7, 11 (floor((i+1)/4) > floor(i/4)): whole documents
    spread over the corpus, each in exactly one split, in corpus order."""
    docs = [f"document {i} " + "é" * i for i in range(12)]
    src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in docs])
    out = data.prepare(src, tmp_path / "out", val_fraction=0.25)
    tokens, meta = tokens_of(out)
    held = [docs[i] for i in (3, 7, 11)]
    assert tokens == stream([d for d in docs if d not in held])
    val = np.fromfile(out / "val.bin", dtype=meta["dtype"]).tolist()
    assert val == stream(held)
    assert (meta["num_documents"], meta["num_val_documents"], meta["num_val_tokens"]) == (9, 3, len(val))
    ds = data.TokenDataset(out, 5, split="val")
    assert [ds[i].tolist() for i in range(len(ds))] == [val[i * 5:i * 5 + 6] for i in range(len(ds))]
    # no split: no val.bin (an old one is removed), and the val rows say why there are none
    out = data.prepare(src, tmp_path / "out", val_fraction=0.0)
    assert not (out / "val.bin").exists() and tokens_of(out)[0] == stream(docs)
    with pytest.raises(ValueError, match=r"holds 0 tokens in its held-out split \(0 documents\)"):
        data.TokenDataset(out, 5, split="val")
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\), got 1"):
        data.prepare(src, tmp_path / "o", val_fraction=1)


def test_is_prepared_follows_the_source(tmp_path):
    """Issue 16 item 3: a changed corpus (size, mtime, or same-size content with its mtime restored,
    as cp -p / rsync -a leave it), another tokenizer file or another val_fraction is stale."""
    import os
    src = tmp_path / "c.txt"
    src.write_text("a" * 3000 + "b" * 3000, encoding="utf-8")
    out = data.prepare(src, tmp_path / "c.attotron", val_fraction=0.01)
    assert data.is_prepared(out, src, val_fraction=0.01)
    assert not data.is_prepared(out, src, val_fraction=0.02)
    assert not data.is_prepared(out, src, tokenizer_path=str(tmp_path))

    stamp = src.stat().st_mtime_ns
    src.write_text("a" * 3000 + "c" * 3000, encoding="utf-8")  # same size
    os.utime(src, ns=(stamp, stamp))  # and the old mtime: only the content sample can tell
    assert not data.is_prepared(out, src, val_fraction=0.01)
    data.prepare(src, out, val_fraction=0.01)
    assert data.is_prepared(out, src, val_fraction=0.01)
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))  # touched
    assert not data.is_prepared(out, src, val_fraction=0.01)

    big = tmp_path / "big"  # a file over the sampling threshold, in a folder
    big.mkdir()
    (big / "x.txt").write_bytes(b"x" * (data.SAMPLE_CHUNKS * data.CHUNK_BYTES * 2))
    out = data.prepare(big, tmp_path / "big.attotron")
    assert data.is_prepared(out, big)
    (big / "y.jsonl").write_text('{"text": "new file"}\n')
    assert not data.is_prepared(out, big)
    (big / "y.jsonl").unlink()
    assert data.is_prepared(out, big)
    stamp = (big / "x.txt").stat().st_mtime_ns
    with open(big / "x.txt", "r+b") as f:  # the last byte: always in the sample
        f.seek(-1, 2)
        f.write(b"y")
    os.utime(big / "x.txt", ns=(stamp, stamp))
    assert not data.is_prepared(out, big)


def test_stale_prepared_corpus_is_prepared_again_by_the_trainer(tmp_path):
    """--data c.txt after c.txt changed: the trainer prepares again instead of reusing the old rows."""
    import cli
    import feed
    import grid as G
    src = tmp_path / "c.txt"
    src.write_text("0123456789" * 10, encoding="utf-8")
    args = cli.parse_args(["--data", str(src), "--seq-len", "8"])
    grid = G.Grid(rank=0, world=1, device=torch.device("cpu"))
    assert feed.load_data(args, grid)[0].tolist() == utf8("012345678")
    src.write_text("abcdefghij" * 10, encoding="utf-8")  # same size
    assert feed.load_data(args, grid)[0].tolist() == utf8("abcdefghi")
    # a prepared folder is used as is, but not with another tokenizer than it was made with
    bad = cli.parse_args(["--data", str(feed.cache_path(args)), "--tokenizer", str(tmp_path)])
    with pytest.raises(ValueError, match=r"was prepared with the tokenizer bytes, not --tokenizer"):
        feed.load_data(bad, grid)


def test_full_disk_says_so_and_removes_the_partial_files(tmp_path):
    """A real ENOSPC from the kernel: the temporary token file is a link to /dev/full."""
    import os
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    src = tmp_path / "c.txt"
    src.write_text("some text " * 1000, encoding="utf-8")
    out = tmp_path / "out"
    out.mkdir()
    (out / f"tokens.bin.tmp{os.getpid()}").symlink_to("/dev/full")
    with pytest.raises(OSError, match=r"no space left on device while preparing .*out from .*c.txt"):
        data.prepare(src, out)
    assert list(out.iterdir()) == []  # no tokens.bin.tmp*, val.bin.tmp*, meta.json.tmp* left
