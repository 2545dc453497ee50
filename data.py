"""Pretraining data: a byte tokenizer, corpus → one flat token memmap, and a lazy dataset of rows.

What it does
    `prepare` tokenizes a corpus — a .txt file (one document), a .jsonl file (one document per line,
    its "text" field) or a folder of such files — appends EOS after every document and writes one flat
    stream `tokens.bin` (uint16 when the vocab fits, else uint32) plus `meta.json`. `TokenDataset`
    serves rows of seq_len+1 tokens by index, read lazily through a memmap. `default_corpus` is the
    data used without --data: the running Python's stdlib sources (real text on every machine),
    byte-tokenized by `ByteTokenizer` (no download), prepared once into a cache folder.

Reference
    nanoGPT's flat uint16 token file with EOS separators (data/openwebtext/prepare.py); ByT5's byte
    vocabulary (Xue et al. 2022).

Run
    torchrun --nproc_per_node 1 train.py --data corpus.txt      (a .jsonl file or a folder works too)

Invariants
    - The stream is a pure function of (files, tokenizer, max_bytes): a folder's .txt/.jsonl files in
      sorted relative-path order (recursive), documents in file order, EOS after each non-empty
      document; max_bytes keeps the first max_bytes bytes of document text.
    - A folder is prepared iff meta.json exists and its token count matches tokens.bin's size. Both
      are written under temporary names and renamed, tokens first, meta last: a crashed prepare
      leaves no meta.json and never passes for a finished one.
    - Row i = tokens[i*S : i*S + S + 1]: neighbouring rows share one boundary token, so each token
      is a target at most once. No shuffling here: the order is the sampler's job (dp.py).
    - Missing paths raise FileNotFoundError; other bad input raises ValueError naming the file.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

FORMAT_VERSION = 1
# Left out of the default corpus: installed packages are not the stdlib, and the test suites are 60%
# of it (so they would crowd out the library under the cap), some in deliberately broken encodings.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ------------------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; four specials follow. Needs no files at all."""

    name = "bytes"
    path = None
    specials = ("<|bos|>", "<|eos|>", "<|pad|>", "<|sep|>")
    bos_id, eos_id, pad_id, sep_id = 256, 257, 258, 259
    vocab_size = 260

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        # Runs of bytes are decoded together: one character may span several ids.
        parts, run = [], bytearray()
        for i in map(int, ids):
            if 0 <= i < 256:
                run.append(i)
            elif 256 <= i < self.vocab_size:
                parts += [run.decode("utf-8", errors="replace"), self.specials[i - 256]]
                run.clear()
            else:
                raise ValueError(f"id {i} is outside the byte tokenizer's vocab of {self.vocab_size}")
        return "".join(parts) + run.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local HF tokenizer behind the ByteTokenizer interface (the raw one is `.hf`). The adapter
    exists for three traps: HF `encode` adds BOS by default, HF `vocab_size` leaves out added tokens
    (whose ids are larger), and `eos_token_id` may be None."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # heavy import, only when an HF tokenizer is used

        self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.path = str(Path(path).resolve())
        self.name = Path(self.path).name
        self.vocab_size = len(self.hf)  # counts added tokens, unlike hf.vocab_size
        self.bos_id, self.eos_id, self.pad_id = (
            self.hf.bos_token_id, self.hf.eos_token_id, self.hf.pad_token_id)
        if self.eos_id is None:
            raise ValueError(f"tokenizer {path} has no eos_token; documents need one as a separator")

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids])


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """None or "bytes" → the built-in ByteTokenizer; else a local HF tokenizer dir (no network)."""
    if path is None or path == "bytes":
        return ByteTokenizer()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist (pass a local HF "
                                f"tokenizer folder, or 'bytes' for the built-in byte tokenizer)")
    return HFTokenizer(path)


# ------------------------------------------------------------------------------- corpus → tokens
def _source_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"corpus {source} does not exist")
    files = [p for p in source.rglob("*") if p.is_file() and p.suffix in (".txt", ".jsonl")]
    if not files:
        raise ValueError(f"corpus folder {source} holds no .txt or .jsonl files")
    return sorted(files, key=lambda p: p.relative_to(source).as_posix())


def _documents(path: Path) -> Iterator[str]:
    """A .jsonl file yields each line's "text"; any other file is one document, read byte-exact
    (strict UTF-8, no newline translation)."""
    try:
        if path.suffix != ".jsonl":
            yield path.read_bytes().decode("utf-8")
            return
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():  # blank lines (a trailing newline) hold no document
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise ValueError(f'{path}:{lineno}: line has no string "text" field')
                yield record["text"]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.start} of the chunk read)") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def _capped(texts: Iterator[str], max_bytes: int | None) -> Iterator[tuple[str, int]]:
    """Yield (document, its UTF-8 size), at most max_bytes in all; the document crossing the cap is
    cut at a character boundary and ends the corpus. Empty documents would only add a lone EOS:
    they are dropped."""
    left = max_bytes
    for text in texts:
        raw = text.encode("utf-8")
        if left is not None and len(raw) >= left:
            text = raw[:left].decode("utf-8", errors="ignore")  # drops only a split last character
            if text:
                yield text, left
            return
        if raw:
            yield text, len(raw)
        if left is not None:
            left -= len(raw)


def _write(files: Sequence[Path], out_dir: Path, tok, max_bytes: int | None, source: str) -> Path:
    """Tokenize `files` into out_dir/tokens.bin + meta.json (see the module invariants)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    total = sum(f.stat().st_size for f in files)  # progress in bytes; approximate for .jsonl
    if max_bytes is not None:
        total = min(total, max_bytes)
    # Per-process temporary names: two processes preparing one folder never write into the same
    # file, and each rename is atomic (still, let one rank prepare while the others wait).
    tmp = out_dir / f"tokens.bin.tmp{os.getpid()}"
    n_tokens = n_docs = 0
    try:
        with open(tmp, "wb") as f, tqdm(total=total, unit="B", unit_scale=True,
                                        desc=f"tokenizing {Path(source).name}") as bar:
            texts = (text for path in files for text in _documents(path))
            for text, n_bytes in _capped(texts, max_bytes):
                ids = np.asarray(tok.encode(text) + [tok.eos_id], dtype=np.int64)
                if ids.min() < 0 or ids.max() >= tok.vocab_size:  # would wrap silently in uint16
                    raise ValueError(f"tokenizer {tok.name} produced id {ids.max()} outside its "
                                     f"vocab_size {tok.vocab_size}")
                ids.astype(dtype).tofile(f)
                n_tokens, n_docs = n_tokens + len(ids), n_docs + 1
                bar.update(n_bytes)
        if n_docs == 0:
            raise ValueError(f"corpus {source} is empty: no document has any text")
        (out_dir / "meta.json").unlink(missing_ok=True)  # an old meta must not describe new tokens
        os.replace(tmp, out_dir / "tokens.bin")
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"format_version": FORMAT_VERSION, "tokenizer": tok.name, "tokenizer_path": tok.path,
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": dtype.name, "num_tokens":
            n_tokens, "num_documents": n_docs, "source": source, "max_bytes": max_bytes}
    tmp_meta = out_dir / f"meta.json.tmp{os.getpid()}"
    tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp_meta, out_dir / "meta.json")
    return out_dir


def prepare(source: str | Path, out_dir: str | Path, tokenizer_path: str | None = None,
            max_bytes: int | None = None) -> Path:
    """Tokenize a .txt / .jsonl file or a folder of them into out_dir; returns out_dir."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    source = Path(source)
    files = _source_files(source)  # bad paths fail before the tokenizer is loaded
    tok = load_tokenizer(tokenizer_path)
    return _write(files, Path(out_dir), tok, max_bytes, str(source.resolve()))


def default_corpus(cache_dir: str | Path | None = None, max_bytes: int = 8_000_000) -> Path:
    """The running Python's stdlib .py sources (no tests, no site-packages), sorted by relative path,
    byte-tokenized, first max_bytes bytes; prepared on first use, then reused."""
    root = Path(sysconfig.get_paths()["stdlib"])
    version = ".".join(map(str, sys.version_info[:3]))
    out = Path(cache_dir or Path.home() / ".cache" / "attotron" / f"stdlib-{version}-{max_bytes}")
    try:
        meta = _read_meta(out)
        if (meta["tokenizer"], meta.get("max_bytes"), meta.get("source")) == (
                ByteTokenizer.name, max_bytes, str(root)):
            return out
    except (OSError, ValueError):
        pass  # absent, unfinished or damaged: prepare it again
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return _write(files, out, ByteTokenizer(), max_bytes, str(root))


# ------------------------------------------------------------------------------------- the dataset
def _read_meta(data_dir: Path) -> dict:
    """meta.json of a prepared folder, checked against tokens.bin."""
    path, tokens = data_dir / "meta.json", data_dir / "tokens.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a prepared dataset (run "
                                f"data.prepare), or its prepare did not finish")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is corrupt: {e}") from None
    need = {"format_version", "vocab_size", "eos_id", "dtype", "num_tokens"}
    missing = sorted(need - meta.keys()) if isinstance(meta, dict) else "a JSON object"
    if missing:
        raise ValueError(f"{path} is corrupt: it lacks {missing}")
    if meta["format_version"] != FORMAT_VERSION or meta["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{path}: format_version {meta['format_version']}, dtype {meta['dtype']} "
                         f"(this data.py reads {FORMAT_VERSION}, uint16/uint32): prepare again")
    expected = meta["num_tokens"] * np.dtype(meta["dtype"]).itemsize
    size = tokens.stat().st_size if tokens.is_file() else None
    if size != expected:
        raise ValueError(f"{tokens} {'is missing' if size is None else f'has {size} bytes'} but "
                         f"{path} says {meta['num_tokens']} {meta['dtype']} tokens = {expected} "
                         f"bytes; prepare the data again")
    return meta


class TokenDataset(torch.utils.data.Dataset):
    """Row i = tokens[i*seq_len : i*seq_len + seq_len + 1] as a LongTensor (seq_len+1,); the model
    input is row[:-1] and the shifted labels row[1:]."""

    def __init__(self, data_dir: str | Path, seq_len: int):
        self.data_dir = Path(data_dir)
        self.meta = _read_meta(self.data_dir)
        self.vocab_size, self.eos_id = self.meta["vocab_size"], self.meta["eos_id"]
        n = self.meta["num_tokens"]
        if seq_len < 1 or n < seq_len + 1:
            raise ValueError(f"{self.data_dir} holds {n} tokens: not one row of seq_len+1 = "
                             f"{seq_len + 1} (seq_len must be >= 1)")
        self.seq_len = seq_len
        self.rows = (n - 1) // seq_len  # the tail that does not fill a row is left out
        self._tokens = None  # mapped on first read, so each DataLoader worker maps its own

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> torch.Tensor:
        i = int(i)
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} out of range for {self.rows} rows")
        if self._tokens is None:
            self._tokens = np.memmap(self.data_dir / "tokens.bin", dtype=self.meta["dtype"], mode="r")
        start = i * self.seq_len
        return torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}  # pickle the path, never the mapped tokens

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise when the data's ids can index past the model's embedding."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(f"{self.data_dir} was tokenized with a vocab of {self.vocab_size} "
                             f"({self.meta.get('tokenizer')}) but the model's vocab_size is "
                             f"{model_vocab_size}: ids up to {self.vocab_size - 1} would not fit")

