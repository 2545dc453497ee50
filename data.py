"""Pretraining data: a byte tokenizer, corpus → one flat token memmap, and a lazy dataset of rows.

What it does
    `prepare` tokenizes a corpus: a text file (.txt, .md ...: one document), a record file (JSONL,
    JSON, parquet, arrow: one document per record, its "text" field or --data-column) or a folder
    of such files (formats.py reads them). It appends EOS after every document. It writes one
    flat stream `tokens.bin` (uint16 when the vocab fits, else uint32) plus `meta.json`.
    With `val_fraction` > 0, that share of the DOCUMENTS goes to a second stream, `val.bin`.
    It is the held-out split of the validation loss.
    `TokenDataset` serves rows of seq_len+1 tokens of either split by index, read lazily through a memmap.
    `is_prepared` says whether a prepared folder still matches its source and options.
    `default_corpus` is the data used without --data: the running Python's stdlib sources. They are
    real text on every machine. `ByteTokenizer` tokenizes them with no download, once, into a cache.

Reference
    nanoGPT's flat uint16 token file with EOS separators (data/openwebtext/prepare.py). ByT5's byte
    vocabulary (Xue et al. 2022).

Run
    torchrun --nproc_per_node 1 train.py --data corpus.txt      (a .jsonl file or a folder works too)

Invariants
    - The streams are a pure function of (files, tokenizer, max_bytes, val_fraction). A folder's
      data files come in sorted relative-path order (recursive), documents in file order.
      EOS follows each non-empty document. max_bytes keeps the first max_bytes bytes of text.
    - Document i (0-based, over the whole corpus) is held out iff floor((i+1)·f) > floor(i·f), with
      f = val_fraction. Whole documents are held out, so no row of one split shares a token with the
      other. They are spread evenly: a folder sorted by path would otherwise hold out one topic.
      A .txt file is one document, so it alone gives no held-out split.
    - A folder is prepared iff meta.json exists and its token counts match the streams' sizes.
      Every file is written under a temporary name and renamed, tokens first, meta last. A crashed
      prepare leaves no meta.json, so it never passes for a finished one. A full disk removes the
      partial files and says so.
    - Staleness (`is_prepared`): meta.json records a fingerprint of the source and of the tokenizer
      folder's files. Per file it holds the relative path, size, mtime and a SHA-256 of 16 sampled
      64 KiB chunks (the whole file under 1 MiB). An edit that changes the size or the mtime is
      caught. A same-size copy with its mtime preserved (cp -p, rsync -a, tar) is caught by the sample.
      Hashing whole files would also catch an in-place edit that keeps the size and the mtime and
      misses every sample. It would read the whole corpus at every launch (minutes for 100 GB).
      The sample reads at most 1 MiB per file.
    - Row i = tokens[i*S : i*S + S + 1]. Neighbouring rows share one boundary token, so each token is
      a target at most once. There is no shuffling here: the order is the sampler's job (dp.py).
    - Missing paths raise FileNotFoundError. Other bad input raises ValueError naming the file.

Builds on: formats.py (the file formats of a corpus)
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import sysconfig
from fractions import Fraction
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

import formats

FORMAT_VERSION = 1
SPLITS = {"train": ("tokens.bin", "num_tokens"), "val": ("val.bin", "num_val_tokens")}
SAMPLE_CHUNKS, CHUNK_BYTES = 16, 64 * 1024  # content sampled per file for the staleness check
# an HF tokenizer folder has at least one of these
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
# Left out of the default corpus. Installed packages are not the stdlib. The test suites are 60% of
# it, so they would crowd out the library under the cap, and some use deliberately broken encodings.
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
    """A local HF tokenizer behind the ByteTokenizer interface (the raw one is `.hf`).
    The adapter exists for three traps. HF `encode` adds BOS by default. HF `vocab_size` leaves out
    added tokens, whose ids are larger. And `eos_token_id` may be None."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer  # heavy import, only when an HF tokenizer is used

        _check_tokenizer_dir(Path(path))
        try:  # never run the folder's Python, never ask on stdin (transformers' prompt)
            self.hf = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers raises many types; name the folder
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"tokenizer folder {path} could not be loaded: {first}") from None
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


def _check_tokenizer_dir(folder: Path) -> None:
    """Refuse a folder that is no HF tokenizer, or that asks to run its own code (`auto_map`).
    A data folder must never execute Python on every rank of a cluster."""
    if not any((folder / n).is_file() for n in TOKENIZER_FILES):
        raise ValueError(f"{folder} is not an HF tokenizer folder: it has none of "
                         f"{', '.join(TOKENIZER_FILES)}")
    for name in ("tokenizer_config.json", "config.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from None
        auto = cfg.get("auto_map") if isinstance(cfg, dict) else None
        if auto and (name == "tokenizer_config.json" or "AutoTokenizer" in auto):
            raise ValueError(f"{f} asks to run Python code from the folder (auto_map {auto}); "
                             f"attotron never runs code from a tokenizer folder: use one whose "
                             f"tokenizer.json loads with a built-in transformers class")


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """None or "bytes" → the built-in ByteTokenizer; else a local HF tokenizer dir (no network)."""
    if path is None or path == "bytes":
        return ByteTokenizer()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist (pass a local HF "
                                f"tokenizer folder, or 'bytes' for the built-in byte tokenizer)")
    return HFTokenizer(path)


# ------------------------------------------------------------------------------- corpus → tokens
def _source_files(source: Path, report: bool = False) -> list[Path]:
    """formats.files: a file, or a folder's text and record files (its other files named when
    `report`)."""
    if not source.exists():
        raise FileNotFoundError(f"corpus {source} does not exist")
    files, skipped = formats.files(source)
    if skipped and report:
        print(f"note: --data {source}: {formats.skipped_text(skipped)}", flush=True)
    return files


def _documents(path: Path, column: str | None = None, cache_dir: Path | None = None) -> Iterator[str]:
    """A record file (formats.py: JSONL, JSON, parquet, arrow) yields each record's "text" (or
    `column`). Any other file is one document, read byte-exact (strict UTF-8, no newline translation)."""
    if formats.kind(path) in ("table", "saved") or (formats.kind(path) == "lines" and path.suffix != ".jsonl"):
        for where, record in formats.records(path, cache_dir):
            if isinstance(record, ValueError):
                raise ValueError(f"{where}: {record}")
            text = record.get(column or "text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ValueError(f'{where}: record has no string "{column or "text"}" field'
                                 + ("" if column else " (--data-column names another)"))
            yield text
        return
    field = column or "text"
    try:
        if path.suffix != ".jsonl":
            yield formats.read_text(path)
            return
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():  # blank lines (a trailing newline) hold no document
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise ValueError(f'{path}:{lineno}: line has no string "{field}" field')
                yield record[field]
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.start} of the chunk read)") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None


def _capped(texts: Iterator[str], max_bytes: int | None) -> Iterator[tuple[str, int]]:
    """Yield (document, its UTF-8 size), at most max_bytes in all. The document crossing the cap is
    cut at a character boundary and ends the corpus. Empty documents would only add a lone EOS,
    so they are dropped."""
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


def _held_out(i: int, frac: Fraction) -> bool:
    """Document i goes to the validation split: floor((i+1)·f) > floor(i·f), in exact integers."""
    n, d = frac.numerator, frac.denominator
    return (i + 1) * n // d > i * n // d


def fingerprint(files: Sequence[Path], root: Path) -> str:
    """SHA-256 over each file's path relative to root, size, mtime and a content sample.
    The sample is the whole file up to SAMPLE_CHUNKS·CHUNK_BYTES. Beyond, it is SAMPLE_CHUNKS chunks
    evenly spaced from the first byte to the last. The module invariants say why not whole files."""
    h = hashlib.sha256()
    # a datasets save_to_disk folder counts as its files
    files = [f for p in files for f in ([p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file()))]
    for path in files:
        st = path.stat()
        h.update(f"{path.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            if st.st_size <= SAMPLE_CHUNKS * CHUNK_BYTES:
                h.update(f.read())
                continue
            for k in range(SAMPLE_CHUNKS):  # the first chunk starts at 0, the last ends at the end
                f.seek(k * (st.st_size - CHUNK_BYTES) // (SAMPLE_CHUNKS - 1))
                h.update(f.read(CHUNK_BYTES))
    return h.hexdigest()


def source_key(source: str | Path, tokenizer_path: str | None = None, max_bytes: int | None = None,
               val_fraction: float = 0.0, column: str | None = None) -> dict:
    """What a folder prepared from `source` must record in meta.json to be current. It holds the
    source's and the tokenizer's fingerprints, and the options that shape the streams."""
    source = Path(source).resolve()
    files = _source_files(source)
    root = source if source.is_dir() else source.parent
    tok = None
    if tokenizer_path not in (None, "bytes"):
        tok = Path(tokenizer_path).resolve()
        tok_files = sorted(p for p in tok.iterdir() if p.is_file()) if tok.is_dir() else []
    return {"source": str(source), "source_fingerprint": fingerprint(files, root),
            "tokenizer_path": None if tok is None else str(tok),
            "tokenizer_fingerprint": None if tok is None else fingerprint(tok_files, tok),
            "max_bytes": max_bytes, "val_fraction": val_fraction} | ({"data_column": column} if column else {})


def is_prepared(out_dir: str | Path, source: str | Path, tokenizer_path: str | None = None,
                max_bytes: int | None = None, val_fraction: float = 0.0, column: str | None = None) -> bool:
    """out_dir holds a complete preparation of `source` as it is now. Same files, sizes, mtimes and
    sampled content, same tokenizer files, same options."""
    try:
        meta = read_meta(Path(out_dir))
    except (OSError, ValueError):
        return False
    key = source_key(source, tokenizer_path, max_bytes, val_fraction, column)
    return all(meta.get(k) == v for k, v in key.items()) and meta.get("data_column") == column


def _write(files: Sequence[Path], out_dir: Path, tok, max_bytes: int | None, key: dict,
           val_fraction: float = 0.0, column: str | None = None, cache_dir: Path | None = None) -> Path:
    """Tokenize `files` into out_dir/tokens.bin (+ val.bin) + meta.json (see the module invariants)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.uint32)
    total = sum(f.stat().st_size for f in files)  # progress in bytes; approximate for .jsonl
    if max_bytes is not None:
        total = min(total, max_bytes)
    frac = Fraction(val_fraction).limit_denominator(10**6)
    # Per-process temporary names: two processes preparing one folder never write into one file.
    # Each rename is atomic. Still, let one rank prepare while the others wait.
    tmp = {split: out_dir / f"{name}.tmp{os.getpid()}" for split, (name, _) in SPLITS.items()}
    tmp_meta = out_dir / f"meta.json.tmp{os.getpid()}"
    count = {split: [0, 0] for split in SPLITS}  # tokens, documents
    source = key["source"]
    try:
        with open(tmp["train"], "wb") as ft, open(tmp["val"], "wb") as fv, \
                tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {Path(source).name}") as bar:
            texts = (text for path in files for text in _documents(path, column, cache_dir))
            for i, (text, n_bytes) in enumerate(_capped(texts, max_bytes)):
                ids = np.asarray(tok.encode(text) + [tok.eos_id], dtype=np.int64)
                if ids.min() < 0 or ids.max() >= tok.vocab_size:  # would wrap silently in uint16
                    raise ValueError(f"tokenizer {tok.name} produced id {ids.max()} outside its "
                                     f"vocab_size {tok.vocab_size}")
                split = "val" if _held_out(i, frac) else "train"
                (fv if split == "val" else ft).write(ids.astype(dtype).tobytes())
                count[split][0] += len(ids)
                count[split][1] += 1
                bar.update(n_bytes)
        if count["train"][1] == 0:  # document 0 is never held out (val_fraction < 1)
            raise ValueError(f"corpus {source} is empty: no document has any text")
        (out_dir / "meta.json").unlink(missing_ok=True)  # an old meta must not describe new tokens
        os.replace(tmp["train"], out_dir / "tokens.bin")
        if count["val"][1]:
            os.replace(tmp["val"], out_dir / "val.bin")
        else:
            (out_dir / "val.bin").unlink(missing_ok=True)
        meta = {"format_version": FORMAT_VERSION, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
                "eos_id": tok.eos_id, "dtype": dtype.name, "num_tokens": count["train"][0],
                "num_documents": count["train"][1], "num_val_tokens": count["val"][0],
                "num_val_documents": count["val"][1], **key}
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(tmp_meta, out_dir / "meta.json")
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        raise OSError(f"no space left on device while preparing {out_dir} from {source} "
                      f"({e.filename or 'tokens.bin'}); the partial files were removed: free space "
                      f"there, or prepare the data elsewhere and pass that folder as --data") from None
    finally:
        for t in (*tmp.values(), tmp_meta):
            t.unlink(missing_ok=True)
    return out_dir


def prepare(source: str | Path, out_dir: str | Path, tokenizer_path: str | None = None,
            max_bytes: int | None = None, val_fraction: float = 0.0, column: str | None = None,
            cache_dir: Path | None = None) -> Path:
    """Tokenize a text or record file, or a folder of them (formats.py), into out_dir, and return
    out_dir. val_fraction of the documents go to the validation split. `column`: the records'
    text field (default "text"). cache_dir: where `datasets` may cache what it reads."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    source = Path(source)
    files = _source_files(source, report=True)  # bad paths fail before the tokenizer is loaded
    tok = load_tokenizer(tokenizer_path)
    key = source_key(source, tokenizer_path, max_bytes, val_fraction, column)
    return _write(files, Path(out_dir), tok, max_bytes, key, val_fraction, column, cache_dir)


def default_corpus(cache_dir: str | Path | None = None, max_bytes: int = 8_000_000,
                   val_fraction: float = 0.0) -> Path:
    """The running Python's stdlib .py sources (no tests, no site-packages), sorted by relative path.
    Byte-tokenized, the first max_bytes bytes. Prepared on first use, then reused."""
    root = Path(sysconfig.get_paths()["stdlib"])
    version = ".".join(map(str, sys.version_info[:3]))
    out = Path(cache_dir or Path.home() / ".cache" / "attotron" / f"stdlib-{version}-{max_bytes}")
    try:
        meta = read_meta(out)
        if (meta["tokenizer"], meta.get("max_bytes"), meta.get("source"), meta.get("val_fraction", 0.0)) \
                == (ByteTokenizer.name, max_bytes, str(root), val_fraction):
            return out
    except (OSError, ValueError):
        pass  # absent, unfinished or damaged: prepare it again
    files = []
    for folder, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    key = {"source": str(root), "tokenizer_path": None, "max_bytes": max_bytes, "val_fraction": val_fraction}
    return _write(files, out, ByteTokenizer(), max_bytes, key, val_fraction)


# ------------------------------------------------------------------------------------- the dataset
def read_meta(data_dir: Path) -> dict:
    """meta.json of a prepared folder, checked against tokens.bin."""
    path = data_dir / "meta.json"
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
    for name, field in SPLITS.values():
        tokens, n = data_dir / name, meta.get(field, 0)
        expected = n * np.dtype(meta["dtype"]).itemsize
        size = tokens.stat().st_size if tokens.is_file() else None
        if size != expected and (n or size is not None):
            raise ValueError(f"{tokens} {'is missing' if size is None else f'has {size} bytes'} but "
                             f"{path} says {n} {meta['dtype']} tokens = {expected} "
                             f"bytes; prepare the data again")
    return meta


class TokenDataset(torch.utils.data.Dataset):
    """Row i = tokens[i*seq_len : i*seq_len + seq_len + 1] as a LongTensor (seq_len+1,).
    The model input is row[:-1], and the shifted labels are row[1:].
    split "train" reads tokens.bin. "val" reads the held-out documents in val.bin."""

    def __init__(self, data_dir: str | Path, seq_len: int, split: str = "train"):
        self.data_dir = Path(data_dir)
        self.meta = read_meta(self.data_dir)
        self.vocab_size, self.eos_id = self.meta["vocab_size"], self.meta["eos_id"]
        self.file, field = SPLITS[split]
        n = self.meta.get(field, 0)
        if seq_len < 1 or n < seq_len + 1:
            what = "" if split == "train" else \
                f" in its held-out split ({self.meta.get('num_val_documents', 0)} documents)"
            raise ValueError(f"{self.data_dir} holds {n} tokens{what}: not one row of seq_len+1 = "
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
            self._tokens = np.memmap(self.data_dir / self.file, dtype=self.meta["dtype"], mode="r")
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

