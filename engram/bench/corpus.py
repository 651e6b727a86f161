"""Natural-text request corpus for benchmarks: ``engram bench corpus`` writes one, ``load_corpus`` reads it (the
presets' random weights repeat one token, which hashes to the same rows and measures nothing).

Requests (a *prompt* and a *continuation*) are cut one after another from the standard library's prose
(``corpus_source``), at word boundaries whose pieces encode to exactly the drawn ``LengthRange`` lengths. The file is
UTF-8 JSON lines with sorted keys (a header, then one line per request) with ``<stem>.sha256`` beside it, which
``load_corpus`` checks."""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

HELP = "write a natural-text request corpus (stdlib prose, seeded token lengths) and its SHA-256"
FORMAT = "engram-corpus/1"
_REQUEST_KEYS = {"id": int, "prompt": str, "continuation": str, "prompt_tokens": int,
                 "continuation_tokens": int, "sources": list}


class CorpusError(ValueError):
    """A corpus file that is missing its checksum, fails it, or is malformed (the message names the file)."""


@dataclass(frozen=True)
class LengthRange:
    """Token lengths drawn uniformly from the integers [low, high] (low == high: a fixed length)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length range low={self.low}, high={self.high}: need 1 <= low <= high")

    @classmethod
    def parse(cls, text: str, option: str = "length") -> "LengthRange":
        """``"LO:HI"`` or ``"N"``; ValueError naming ``option`` and the text."""
        parts = text.split(":")
        try:
            low, high = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
            return cls(low, high)
        except ValueError:
            raise ValueError(f"{option}={text!r}: expected LO:HI or N, token counts with 1 <= LO <= HI") from None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=n)

    def to_dict(self) -> dict[str, Any]:
        return {"dist": "uniform", "low": self.low, "high": self.high}


@dataclass
class CorpusTokenizer:
    """A ``tokenizers.Tokenizer`` with padding and truncation off, and what identifies it in a corpus."""

    name: str  # "builtin", or the file's last three path parts (never a machine's directory)
    sha256: str  # of the tokenizer.json bytes
    path: Path
    tokenizer: Any = field(repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size}

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Raw token ids (int64) of each text, no special tokens added."""
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def load_tokenizer(spec: str) -> CorpusTokenizer:
    """``builtin``, ``pkg:PACKAGE/PATH`` (a file in an installed package) or a tokenizer.json path."""
    from tokenizers import Tokenizer

    if spec == "builtin":
        from engram.model.presets import TOKENIZER_FILE
        path, name = Path(TOKENIZER_FILE), "builtin"
    elif spec.startswith("pkg:"):
        package, _, rel = spec[4:].partition("/")
        found = importlib.util.find_spec(package) if package else None
        if found is None or not found.submodule_search_locations or not rel:
            raise ValueError(f"tokenizer={spec!r}: expected pkg:PACKAGE/PATH naming an installed package")
        path, name = Path(list(found.submodule_search_locations)[0]) / rel, f"{package}/{rel}"
    else:
        path = Path(spec)
        name = "/".join(path.resolve().parts[-3:])
    if not path.is_file():
        raise ValueError(f"tokenizer={spec!r}: no file at {path}")
    data = path.read_bytes()
    tok = Tokenizer.from_str(data.decode("utf-8"))
    tok.no_padding()
    tok.no_truncation()
    return CorpusTokenizer(name=name, sha256=hashlib.sha256(data).hexdigest(), path=path, tokenizer=tok)


@dataclass(frozen=True)
class CorpusRequest:
    id: int
    prompt: str
    continuation: str
    prompt_tokens: int  # under the corpus tokenizer
    continuation_tokens: int
    sources: list[str]  # stdlib files (relative paths) the text came from


@dataclass
class Corpus:
    header: dict[str, Any]
    requests: list[CorpusRequest]
    sha256: str | None = None  # of the file it was loaded from

    def to_bytes(self) -> bytes:
        lines = [self.header] + [asdict(r) for r in self.requests]
        return "".join(json.dumps(x, ensure_ascii=False, sort_keys=True, separators=(",", ":")) + "\n"
                       for x in lines).encode("utf-8")


class _TextStream:
    """The concatenated documents from a cursor on, the encoding of what is buffered, and their ``sources``."""

    def __init__(self, docs: Iterator[tuple[str, str]], tok: CorpusTokenizer):
        self.docs, self.tok = docs, tok
        self.text, self.sources, self.enc = "", [], None
        self.files: set[str] = set()

    def _append(self) -> bool:
        try:
            rel, doc = next(self.docs)
        except StopIteration:
            return False
        sep = "\n\n" if self.text else ""
        self.sources.append((len(self.text) + len(sep), rel))
        self.files.add(rel)
        self.text += sep + doc
        self.enc = None
        return True

    def fill(self, tokens: int, made: int) -> None:
        """Buffer and encode at least ``tokens`` tokens; CorpusError when the prose runs out."""
        if self.enc is not None and len(self.enc.ids) >= tokens:
            return
        while True:
            while len(self.text) < 6 * tokens and self._append():  # 6 chars > a token of English text
                pass
            self.enc = self.tok.tokenizer.encode(self.text, add_special_tokens=False)
            if len(self.enc.ids) >= tokens:
                return
            if not self._append():
                raise CorpusError(f"the standard library's prose ran out after {made} requests; ask for "
                                  f"fewer requests or shorter lengths")

    def cut(self, start: int, lo: int, hi: int, target: int) -> int:
        """Token index j in [start + lo, start + hi] nearest start + target, at a word boundary, whose piece encodes
        alone to exactly j - start tokens."""
        offsets, text = self.enc.offsets, self.text
        c0 = offsets[start][0]

        def clean(j: int) -> bool:
            c = offsets[j][0]
            return c > 0 and offsets[j - 1][1] <= c and (text[c - 1].isspace() or text[c].isspace())

        cands = [j for j in range(start + lo, min(start + hi, len(offsets) - 1) + 1) if clean(j)]
        for j in sorted(cands, key=lambda j: (abs(j - start - target), j)):
            if self.tok.count(text[c0:offsets[j][0]]) == j - start:
                return j
        raise CorpusError(f"no word boundary {lo}..{hi} tokens after {text[c0:c0 + 60]!r}")

    def take(self, end_tok: int) -> tuple[str, list[str]]:
        """Remove and return the text before token ``end_tok`` with its files (and the whitespace after it)."""
        c = self.enc.offsets[end_tok][0]
        used = [rel for off, rel in self.sources if off < c]
        piece, rest = self.text[:c], self.text[c:]
        shift = c + len(rest) - len(rest.lstrip())
        before = [(0, rel) for off, rel in self.sources if off <= shift][-1:]
        self.sources = before + [(off - shift, rel) for off, rel in self.sources if off > shift]
        self.text, self.enc = self.text[shift:], None
        return piece, used


def generate_corpus(requests: int, seed: int, prompt_tokens: LengthRange, continuation_tokens: LengthRange,
                    tok: CorpusTokenizer, root: str | os.PathLike | None = None) -> Corpus:
    """``requests`` requests from the stdlib under ``root``, deterministic in (seed, files, tokenizer, lengths)."""
    from engram.bench.corpus_source import SOURCE_NAME, documents, stdlib_files

    if requests < 1:
        raise ValueError(f"requests={requests}: must be >= 1")
    rng = np.random.default_rng(seed)
    files = stdlib_files(root)
    order = rng.permutation(len(files))
    p_len = prompt_tokens.sample(rng, requests)
    c_len = continuation_tokens.sample(rng, requests)
    stream = _TextStream(documents([files[i] for i in order], root), tok)
    out = []
    for i in range(requests):
        stream.fill(prompt_tokens.high + continuation_tokens.high + 1, i)
        jp = stream.cut(0, prompt_tokens.low, prompt_tokens.high, int(p_len[i]))
        jc = stream.cut(jp, continuation_tokens.low, continuation_tokens.high, int(c_len[i]))
        cp = stream.enc.offsets[jp][0]
        text, sources = stream.take(jc)
        out.append(CorpusRequest(id=i, prompt=text[:cp], continuation=text[cp:], prompt_tokens=jp,
                                 continuation_tokens=jc - jp, sources=sources))
    header = {"format": FORMAT, "seed": seed, "requests": requests, "prompt_tokens": prompt_tokens.to_dict(),
              "continuation_tokens": continuation_tokens.to_dict(), "tokenizer": tok.info(),
              "source": SOURCE_NAME, "python": platform.python_version(), "files": len(stream.files),
              "tokens": sum(r.prompt_tokens + r.continuation_tokens for r in out)}
    return Corpus(header, out)


def checksum_path(path: str | os.PathLike) -> Path:
    """Where the SHA-256 of a corpus file is recorded: ``<dir>/<stem>.sha256``."""
    return Path(path).with_suffix(".sha256")


def write_corpus(corpus: Corpus, path: str | os.PathLike) -> str:
    """Write the corpus file and its ``.sha256`` beside it (each atomically); return the SHA-256."""
    path = Path(path)
    data = corpus.to_bytes()
    digest = hashlib.sha256(data).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, content in ((path, data), (checksum_path(path), f"{digest}  {path.name}\n".encode())):
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(content)
        tmp.replace(target)
    return digest


def load_corpus(path: str | os.PathLike, sha256: str | None = None) -> Corpus:
    """Read a corpus file after checking its SHA-256 (``sha256``, else the recorded one); CorpusError names the file."""
    path = Path(path)
    if sha256 is None:
        sums = checksum_path(path)
        if not sums.is_file():
            raise CorpusError(f"corpus {path}: no recorded SHA-256 at {sums} (write corpora with "
                              f"`engram bench corpus`, which records it)")
        recorded = sums.read_text().split()
        sha256 = recorded[0] if recorded else ""
    data = path.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256.lower():
        raise CorpusError(f"corpus {path}: SHA-256 {actual} does not match the recorded {sha256}: the file "
                          f"was changed or truncated; regenerate it or restore the committed one")
    lines = data.decode("utf-8").splitlines()

    def parse(n: int) -> dict[str, Any]:
        try:
            obj = json.loads(lines[n])
        except json.JSONDecodeError as e:
            raise CorpusError(f"corpus {path}: line {n + 1} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"corpus {path}: line {n + 1} is not a JSON object")
        return obj

    header = parse(0) if lines else {}
    if header.get("format") != FORMAT:
        raise CorpusError(f"corpus {path}: header format={header.get('format')!r}, expected {FORMAT!r}")
    if header.get("requests") != len(lines) - 1:
        raise CorpusError(f"corpus {path}: header requests={header.get('requests')!r} but the file holds "
                          f"{len(lines) - 1} request lines")
    reqs = []
    for n in range(1, len(lines)):
        obj = parse(n)
        for key, kind in _REQUEST_KEYS.items():
            if not isinstance(obj.get(key), kind):
                raise CorpusError(f"corpus {path}: line {n + 1} field {key!r}={obj.get(key)!r}: expected "
                                  f"{kind.__name__}")
        if obj["id"] != n - 1:
            raise CorpusError(f"corpus {path}: line {n + 1} field 'id'={obj['id']}: expected {n - 1}")
        reqs.append(CorpusRequest(**{k: obj[k] for k in _REQUEST_KEYS}))
    return Corpus(header, reqs, sha256=actual)


def encode_corpus(corpus: Corpus, tok: CorpusTokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt ids, continuation ids) per request under ``tok``; its own tokenizer must give the recorded counts."""
    prompts = tok.encode([r.prompt for r in corpus.requests])
    conts = tok.encode([r.continuation for r in corpus.requests])
    if tok.sha256 == corpus.header.get("tokenizer", {}).get("sha256"):
        for r, p, c in zip(corpus.requests, prompts, conts):
            for name, ids, want in (("prompt_tokens", p, r.prompt_tokens), ("continuation_tokens", c,
                                                                            r.continuation_tokens)):
                if ids.size != want:
                    raise CorpusError(f"corpus request {r.id}: {name}={want} recorded, but its text encodes "
                                      f"to {ids.size} tokens with the same tokenizer")
    return list(zip(prompts, conts))


def token_stats(encoded: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """Totals, distinct ids, and the shares of the most common token and 4-gram (near 1: a model stuck on one token)."""
    ids = np.concatenate([x for pair in encoded for x in pair])
    _, counts = np.unique(ids, return_counts=True)
    grams = np.stack([ids[i:ids.size - 3 + i] for i in range(4)], axis=1) if ids.size >= 4 else np.zeros((0, 4))
    _, gram_counts = np.unique(grams, axis=0, return_counts=True)
    p_lens = np.array([p.size for p, _ in encoded])
    c_lens = np.array([c.size for _, c in encoded])
    return {"requests": len(encoded), "tokens": int(ids.size), "distinct_tokens": int(counts.size),
            "top_token_share": float(counts.max() / ids.size) if ids.size else 0.0,
            "top_4gram_share": float(gram_counts.max() / len(grams)) if len(grams) else 0.0,
            "prompt_tokens_mean": float(p_lens.mean()), "prompt_tokens_min": int(p_lens.min()),
            "prompt_tokens_max": int(p_lens.max()), "continuation_tokens_mean": float(c_lens.mean()),
            "continuation_tokens_min": int(c_lens.min()), "continuation_tokens_max": int(c_lens.max())}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="corpus file to write (its SHA-256 goes to <stem>.sha256)")
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-tokens", default="100:1024", help="prompt length LO:HI (uniform) or N")
    p.add_argument("--continuation-tokens", default="100:1024", help="continuation length LO:HI or N")
    p.add_argument("--tokenizer", default="builtin",
                   help="builtin, pkg:PACKAGE/PATH or a tokenizer.json path: lengths are counted in its tokens")


def run(args: argparse.Namespace) -> int:
    from engram.bench.report import format_table

    try:
        prompt = LengthRange.parse(args.prompt_tokens, "--prompt-tokens")
        cont = LengthRange.parse(args.continuation_tokens, "--continuation-tokens")
        tok = load_tokenizer(args.tokenizer)
        corpus = generate_corpus(args.requests, args.seed, prompt, cont, tok)
    except ValueError as e:
        raise SystemExit(f"engram bench corpus: {e}") from None
    digest = write_corpus(corpus, args.out)
    stats = token_stats(encode_corpus(load_corpus(args.out), tok))
    summary = {"path": str(args.out), "sha256": digest, "bytes": os.path.getsize(args.out), **corpus.header,
               "stats": stats}
    print(json.dumps(summary, indent=2))
    print(format_table([{"requests": stats["requests"], "tokens": stats["tokens"],
                         "prompt mean": stats["prompt_tokens_mean"], "cont. mean": stats["continuation_tokens_mean"],
                         "distinct ids": stats["distinct_tokens"], "top token": stats["top_token_share"],
                         "top 4-gram": stats["top_4gram_share"], "files": corpus.header["files"],
                         "MB": os.path.getsize(args.out) / 1e6}]))
    return 0
