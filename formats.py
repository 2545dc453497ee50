"""Every file format --data takes: text, JSONL (.gz), JSON arrays, parquet and arrow, as records.

What it does
    `files(source)` lists what a --data path holds: the file itself, or a folder's text and record
    files in sorted relative-path order. A folder's other files are named as skipped, never ignored.
    `records(path)` yields (where, record) from one record file. JSONL and JSONL.gz are read
    line by line here, so an error names its line. JSON arrays, parquet and arrow go through
    Hugging Face `datasets` (an optional dependency, imported only for them). A `save_to_disk`
    folder is read whole.
    `parse_all(source, parse)` applies a mode's parser (a chat, a pair, a prompt) to every record.
    It returns the parsed items and the count skipped with skip_bad. An error names the record.
    `column(record, name)` takes --data-column's field.
    `digest(source)` hashes every file of a source: the cache key of the chat modes.

Reference
    TRL's dataset formats (standard and conversational; language modeling, prompt-only,
    preference): https://huggingface.co/docs/trl/dataset_formats. docs/data-formats.md lists
    what each mode reads.

Run
    python train.py --data corpus/ --data-column body            # .txt, .md, .parquet ... in one folder
    python train.py --sft --init-from DIR --data chats.parquet --data-column conversation

Invariants (tests/test_user_path.py)
    - Each format gives the records the file holds, in order (test_every_format_reads_the_same_records).
    - A folder's skipped files are named in one note (test_folder_names_what_it_skips).

Builds on: nothing of attotron's (stdlib; `datasets` for JSON arrays, parquet and arrow)
"""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Iterator

# read as one document each (pretraining); .gz of each too
TEXT = (".txt", ".md", ".markdown", ".rst", ".text", ".tex", ".org", ".html", ".htm", ".xml", ".csv", ".tsv")
LINES = (".jsonl", ".jsonl.gz", ".ndjson")  # one JSON object a line, read here
TABLES = (".json", ".json.gz", ".parquet", ".arrow")  # read through `datasets`


def kind(path: Path) -> str | None:
    """"text", "lines", "table", "saved" (a datasets save_to_disk folder) or None (not data)."""
    name = path.name.lower()
    if path.is_dir():
        return "saved" if (path / "dataset_info.json").is_file() and (path / "state.json").is_file() else None
    if name.endswith(LINES):
        return "lines"
    if name.endswith(TABLES):
        return "table"
    if name.endswith(TEXT) or name.endswith(tuple(s + ".gz" for s in TEXT)):
        return "text"
    return None


def files(source: str | Path) -> tuple[list[Path], list[Path]]:
    """(the data files of `source`, a folder's skipped files). A file stands for itself. A folder
    holds its text and record files, recursively, sorted by relative path. A save_to_disk folder
    is one source."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"--data {source} does not exist")
    if source.is_file() or kind(source) == "saved":
        return [source], []
    found, skipped, saved = [], [], set()
    for p in sorted(source.rglob("*"), key=lambda p: p.relative_to(source).as_posix()):
        if any(s in p.parents for s in saved):
            continue
        k = kind(p)
        if k == "saved":
            saved.add(p)
            found.append(p)
        elif p.is_file():
            (found if k else skipped).append(p)
    if not found:
        raise ValueError(f"--data folder {source} holds no data file (text: {', '.join(TEXT)}; records: "
                         f"{', '.join(LINES + TABLES)})"
                         + (f"; it holds {skipped_text(skipped)}" if skipped else ""))
    return found, skipped


def skipped_text(skipped: list[Path]) -> str:
    """'3 files skipped (.pdf ×2, .png): a.pdf, b.pdf, c.png'."""
    exts: dict[str, int] = {}
    for p in skipped:
        exts[p.suffix or p.name] = exts.get(p.suffix or p.name, 0) + 1
    kinds = ", ".join(f"{e} ×{n}" if n > 1 else e for e, n in sorted(exts.items()))
    names = ", ".join(p.name for p in skipped[:5]) + (" ..." if len(skipped) > 5 else "")
    return f"{len(skipped)} file(s) not read ({kinds}): {names}"


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.name.lower().endswith(".gz") else open(path, encoding="utf-8")


def read_text(path: Path) -> str:
    """A text file (or its .gz), byte-exact: strict UTF-8, no newline translation."""
    raw = gzip.open(path).read() if path.name.lower().endswith(".gz") else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.start})") from None


def records(path: Path, cache_dir: Path | None = None) -> Iterator[tuple[str, Any]]:
    """(where, record) of every record of `path`: 'file:line' for JSONL, 'file row N' for tables.
    A line that is not JSON yields its ValueError as the record: the caller decides (skip_bad)."""
    k = kind(path)
    if k == "lines":
        try:
            with _open_text(path) as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield f"{path}:{lineno}", json.loads(line)
                        except json.JSONDecodeError as e:
                            yield f"{path}:{lineno}", ValueError(f"not valid JSON ({e.msg})")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not valid UTF-8 (byte {e.start} of the chunk read)") from None
        except (OSError, EOFError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        return
    if k not in ("table", "saved"):
        raise ValueError(f"{path} is not a record file ({', '.join(LINES + TABLES)}, or a datasets "
                         f"save_to_disk folder)")
    for i, row in enumerate(_table(path, cache_dir)):
        yield f"{path} row {i}", {key: v for key, v in row.items() if v is not None}  # a column absent here


def _table(path: Path, cache_dir: Path | None) -> Any:
    """A JSON array, parquet or arrow file (or a save_to_disk folder) as a `datasets.Dataset`."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: reading {path.suffix} files needs the `datasets` package "
                         f"(pip install datasets), or convert it to JSONL") from None
    datasets.disable_progress_bars()
    cache = str(cache_dir / "hf-datasets") if cache_dir else None  # datasets' own cache: never the home folder
    name = path.name.lower()
    try:
        if path.is_dir():
            return datasets.load_from_disk(str(path))
        if name.endswith(".arrow"):
            return datasets.Dataset.from_file(str(path))
        if name.endswith(".parquet"):
            return datasets.Dataset.from_parquet(str(path), cache_dir=cache)
        return datasets.Dataset.from_json(str(path), cache_dir=cache)
    except Exception as e:  # noqa: BLE001 - pyarrow and datasets raise many types; name the file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path}: not readable as {path.suffix.lstrip('.')} ({first})") from None


def column(record: Any, name: str | None, default: str | None = None) -> Any:
    """--data-column's field of a record (or `default`'s; the whole record when both are None)."""
    key = name or default
    if key is None:
        return record
    if not isinstance(record, dict) or key not in record:
        have = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"no {key!r} field (it has {have})" + ("" if name else "; pass --data-column NAME"))
    return record[key]


def chat(record: Any, name: str | None) -> Any:
    """A chat record for sft.parse_conversation: the record itself, or --data-column's turns as
    "messages" (ShareGPT's "conversations" when its turns have "from")."""
    if name is None:
        return record
    turns = column(record, name)
    sharegpt = isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]
    return {"conversations" if sharegpt else "messages": turns}


def parse_all(source: str | Path, parse: Callable[[Any], Any], skip_bad: bool = False,
              cache_dir: Path | None = None) -> tuple[list, int]:
    """parse(record) for every record of every file of `source`; (items, records skipped).
    A record parse rejects raises ValueError('where: reason'), or is skipped and counted."""
    found, _ = files(source)
    out, bad = [], 0
    for path in found:
        if kind(path) == "text":
            raise ValueError(f"{path} is a text file: this mode reads records (JSONL, JSON, parquet, arrow; "
                             f"docs/data-formats.md)")
        for where, rec in records(path, cache_dir):
            try:
                if isinstance(rec, ValueError):
                    raise rec
                out.append(parse(rec))
            except ValueError as e:
                if not skip_bad:
                    raise ValueError(f"{where}: {e}") from None
                bad += 1
    if not out:
        raise ValueError(f"--data {source} holds no record" + (f" (all {bad} malformed, skipped)" if bad else ""))
    return out, bad


def digest(source: str | Path) -> str:
    """sha256 over every data file of `source` (its relative name and bytes): a cache key."""
    source = Path(source)
    h = hashlib.sha256()
    for path in files(source)[0]:
        for f in ([path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())):
            h.update(f.relative_to(source if source.is_dir() else source.parent).as_posix().encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 23):
                    h.update(chunk)
    return h.hexdigest()
