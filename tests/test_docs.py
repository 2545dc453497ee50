"""The docs point at what exists: every `file.py:name` reference in docs/reading.md names a function
or class (dotted for a method) defined in that file, and every relative link in README.md and docs/
resolves to a file, and to a heading when it names one (#anchor, GitHub's slug). Pure Python: ast and
regular expressions, no torch import (well under a second).

Each reference carries the line range of its definition, and a stale range fails the test.
    python tests/test_docs.py            # print the references whose line range is stale
    python tests/test_docs.py --fix      # rewrite docs/reading.md's line ranges from the code
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READING = ROOT / "docs" / "reading.md"
# `tp.py:ColumnParallelLinear.forward` (lines 268-271): the range is optional
REF = re.compile(r"`((?:[\w-]+/)*[\w-]+\.py):([A-Za-z_][\w.]*)`(?: \(lines (\d+)-(\d+)\))?")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def definitions(path: Path) -> dict[str, tuple[int, int]]:
    """{"Class", "Class.method", "function": (first line, last line)} of a file, decorators included."""
    out: dict[str, tuple[int, int]] = {}

    def walk(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                out[prefix + node.name] = (first, node.end_lineno)
                if isinstance(node, ast.ClassDef):
                    walk(node.body, prefix + node.name + ".")

    walk(ast.parse(path.read_text()).body, "")
    return out


def references(text: str) -> list[re.Match]:
    return list(REF.finditer(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)} | \
        set(re.findall(r'<a id="([^"]+)"', text))


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_reading_references_exist():
    text = READING.read_text()
    refs = references(text)
    assert len(refs) >= 20, "docs/reading.md should walk the code by `file.py:name` references"
    missing = []
    for m in refs:
        path = ROOT / m.group(1)
        if not path.exists() or m.group(2) not in definitions(path):
            missing.append(f"{m.group(1)}:{m.group(2)}")
    assert not missing, f"docs/reading.md names what the code does not define: {missing}"


def test_reading_line_ranges_current():
    """Every reference gives its lines, and they are the definition's lines now: a learner who
    follows a range lands on the code it names (`python tests/test_docs.py --fix` refreshes them)."""
    stale = []
    for m in references(READING.read_text()):
        path = ROOT / m.group(1)
        defs = definitions(path) if path.exists() else {}
        span = defs.get(m.group(2))
        given = (int(m.group(3)), int(m.group(4))) if m.group(3) else None
        if span is not None and given != span:
            stale.append(f"{m.group(1)}:{m.group(2)} says {given}, the code has {span}")
    assert not stale, "stale line ranges in docs/reading.md (python tests/test_docs.py --fix): " + "; ".join(stale)


def test_relative_links_resolve():
    broken = []
    for md in pages():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # links inside code blocks are text
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
            if not dest.exists():
                broken.append(f"{md.name}: {target} ({rel} does not exist)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{md.name}: {target} (no such heading)")
    assert not broken, broken


CORES = ("model.py", "tp.py", "zero.py", "zero3.py", "dp.py", "pp.py", "pp_schedules.py", "cp.py", "ac.py",
         "precision.py")
BANNER = re.compile(r"^\s*# -+ *(refinement|extensions?)\b", re.I)
EXTENSION_WORDS = re.compile(r"expert|router|\bmoe\b|lora|fp8|offload|muon", re.I)


def code_before_banner(path: Path) -> list[tuple[int, str]]:
    """(line number, line) of the code above the file's first refinement banner: no docstrings, no
    comments. A docstring may point at an extension; the code a learner reads first may not."""
    src = path.read_text()
    doc: set[int] = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    out = []
    for i, line in enumerate(src.splitlines(), 1):
        if BANNER.match(line):
            break
        code = line.split("#", 1)[0].strip()
        if code and i not in doc:
            out.append((i, code))
    return out


def test_cores_read_as_if_no_extension_existed():
    """Each core file's code above its first refinement banner names no extension (experts,
    routers, MoE, and the extensions to come). Extensions plug in from their own files or after
    a banner (docs/seams.md)."""
    found = [f"{name}:{i}: {code}" for name in CORES for i, code in code_before_banner(ROOT / name)
             if EXTENSION_WORDS.search(code)]
    assert not found, "extension code in a core path:\n" + "\n".join(found)


def refresh(fix: bool) -> int:
    """Print (or, with fix, rewrite) every reference whose line range differs from the code's."""
    text, stale, cache = READING.read_text(), 0, {}

    def current(m: re.Match) -> str:
        nonlocal stale
        path = ROOT / m.group(1)
        defs = cache.setdefault(path, definitions(path) if path.exists() else {})
        if m.group(2) not in defs:
            print(f"missing: {m.group(1)}:{m.group(2)}")
            return m.group(0)
        a, b = defs[m.group(2)]
        new = f"`{m.group(1)}:{m.group(2)}` (lines {a}-{b})"
        if new != m.group(0):
            stale += 1
            print(f"{m.group(0)}  ->  lines {a}-{b}")
        return new

    text = REF.sub(current, text)
    if fix:
        READING.write_text(text)
    print(f"{stale} stale line ranges" + (" rewritten" if fix and stale else ""))
    return 1 if stale and not fix else 0


if __name__ == "__main__":
    sys.exit(refresh("--fix" in sys.argv[1:]))
