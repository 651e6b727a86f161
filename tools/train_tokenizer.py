"""Train the built-in byte-level BPE tokenizer (engram/model/assets/tokenizer.json) offline.

Inputs, all local: every docstring (module, class, function) of the Python standard library's ``.py``
sources (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``test``/``tests`` folders and
``idlelib``), read with ``ast`` (nothing is imported), plus the repository's ``docs/**/*.md`` and
``README.md`` when present. Files are read in sorted order and the trainer runs single-threaded-stable
(the ``tokenizers`` BPE trainer is deterministic for identical input), so the same inputs give the same
file. The list of inputs with their SHA-256 is written next to the tokenizer (``tokenizer.inputs.json``).

    python tools/train_tokenizer.py            # writes engram/model/assets/tokenizer.json
    python tools/train_tokenizer.py --vocab-size 4096 --out /tmp/tok.json
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "engram" / "model" / "assets" / "tokenizer.json"
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]  # ids 0, 1, 2
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(out)


def docstrings(path: Path) -> list[str]:
    """All docstrings of one source file, in source order; unparsable files give none."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [d for node in ast.walk(tree) if isinstance(node, kinds) and (d := ast.get_docstring(node))]


def repo_docs() -> list[Path]:
    files = sorted((REPO / "docs").rglob("*.md")) if (REPO / "docs").is_dir() else []
    readme = REPO / "README.md"
    return ([readme] if readme.is_file() else []) + files


def corpus() -> tuple[list[str], list[dict]]:
    """(texts, manifest): one text per docstring / doc file, and each input file with its SHA-256."""
    texts: list[str] = []
    manifest: list[dict] = []
    stdlib_root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        ds = docstrings(path)
        if ds:
            texts.extend(ds)
            manifest.append({"file": f"stdlib/{path.relative_to(stdlib_root)}",
                             "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    for path in repo_docs():
        texts.append(path.read_text(encoding="utf-8"))
        manifest.append({"file": str(path.relative_to(REPO)), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    return texts, manifest


def train(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size including special tokens")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="tokenizer.json to write")
    args = p.parse_args(argv)
    if args.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise SystemExit(f"--vocab-size={args.vocab_size}: needs at least {256 + len(SPECIAL_TOKENS)} "
                         "(bytes + specials)")
    texts, manifest = corpus()
    tok = train(texts, args.vocab_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out), pretty=False)
    inputs = {"python": sys.version.split()[0], "vocab_size": args.vocab_size, "texts": len(texts),
              "files": manifest}
    args.out.with_name(args.out.stem + ".inputs.json").write_text(json.dumps(inputs, indent=1) + "\n")
    print(f"wrote {args.out}: {tok.get_vocab_size()} ids from {len(texts)} texts in {len(manifest)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
