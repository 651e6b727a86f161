"""English prose shipped with Python itself: the standard library's docstrings, comments and pydoc topics. A *document*
is one stdlib file's prose in source order (docstrings and full-line comment blocks, split into paragraphs;
``pydoc_data/topics.py`` gives its help topics). A paragraph is kept when ``is_prose`` accepts it and it was not seen
before in the iteration; whitespace collapses to single spaces. Only local files are read; the text depends on the
Python version, so benchmarks publish the corpus file with its SHA-256."""
from __future__ import annotations

import ast
import io
import os
import re
import sysconfig
import tokenize
from pathlib import Path
from typing import Iterable, Iterator

SOURCE_NAME = "python-stdlib-prose"
# Test suites, vendored packages and codec tables (hundreds of generated near-identical modules).
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "encodings"})
TOPICS_FILE = "pydoc_data/topics.py"  # a dict of help-topic texts, not docstrings
MIN_WORDS = 5
MIN_WORD_SHARE = 0.6  # share of tokens that are plain words (letters, optional trailing punctuation)
MAX_SYMBOL_SHARE = 0.03  # share of characters that are code symbols
_WORD = re.compile(r"[(\"']?[A-Za-z][a-z'-]*[.,;:!?)\"']*")
_SYMBOLS = frozenset("{}[]=<>_*/\\|#@$%^~`")
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (the base install's, also inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted relative ``.py`` paths under ``root`` (default ``stdlib_root()``) but EXCLUDED_DIRS; ValueError if none.
    """
    base = Path(root) if root is not None else stdlib_root()
    found: list[str] = []
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if x not in EXCLUDED_DIRS)
        rel = Path(d).relative_to(base)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    if not found:
        raise ValueError(f"stdlib root={str(base)!r}: no .py files found")
    return sorted(found)


def normalize(text: str) -> str:
    """Whitespace runs (newlines included) -> one space; ends stripped."""
    return " ".join(text.split())


def is_prose(text: str) -> bool:
    """True for a normalized paragraph that reads as English prose rather than code or a table."""
    if ">>>" in text:
        return False
    words = text.split()
    if len(words) < MIN_WORDS:
        return False
    if sum(1 for w in words if _WORD.fullmatch(w)) < MIN_WORD_SHARE * len(words):
        return False
    return sum(1 for c in text if c in _SYMBOLS) <= MAX_SYMBOL_SHARE * len(text)


def _docstrings(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


def _comment_blocks(source: bytes) -> list[tuple[int, str]]:
    """Runs of consecutive full-line comments -> (first line, text); a bare ``#`` line ends a paragraph."""
    out: list[tuple[int, str]] = []
    block: list[str] = []
    first = last = -2
    try:
        for tok in tokenize.tokenize(io.BytesIO(source).readline):
            if tok.type != tokenize.COMMENT or not tok.line.lstrip().startswith("#"):
                continue
            text = tok.string.lstrip("#").strip()
            if tok.start[0] != last + 1 or not text:
                if block:
                    out.append((first, "\n".join(block)))
                block, first = [], tok.start[0]
            if text:
                block.append(text)
            last = tok.start[0]
    except (tokenize.TokenError, SyntaxError):
        pass  # a file tokenize cannot finish keeps the comments read so far
    if block:
        out.append((first, "\n".join(block)))
    return out


def _topic_texts(tree: ast.AST) -> list[tuple[int, str]]:
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 200]


def file_paragraphs(root: str | os.PathLike, rel: str) -> list[str]:
    """One file's normalized paragraphs in source order, unfiltered (none when Python cannot parse it)."""
    source = (Path(root) / rel).read_bytes()
    try:
        tree = ast.parse(source, rel)
    except (SyntaxError, ValueError):
        return []
    pieces = _topic_texts(tree) if rel == TOPICS_FILE else _docstrings(tree) + _comment_blocks(source)
    pieces.sort(key=lambda p: p[0])
    return [normalize(p) for _, text in pieces for p in _PARAGRAPH_BREAK.split(text) if p.strip()]


def documents(files: Iterable[str], root: str | os.PathLike | None = None) -> Iterator[tuple[str, str]]:
    """(relative path, document text) for ``files`` in order, paragraphs already produced dropped."""
    base = Path(root) if root is not None else stdlib_root()
    seen: set[str] = set()
    for rel in files:
        kept = []
        for para in file_paragraphs(base, rel):
            if para not in seen and is_prose(para):
                seen.add(para)
                kept.append(para)
        if kept:
            yield rel, "\n\n".join(kept)
