"""The requests of ``engram bench serve``: prompts of exactly the drawn number of tokens, cut one after another from a
checked corpus's natural prose as encoded by the model's own tokenizer, each with a drawn output length, and their
arrival times. Prompts are token-id lists, so the server computes exactly the drawn count (a text cut re-tokenizes to a
different count wherever the cut splits a word or merges with its neighbour). Deterministic in (corpus, tokenizer,
ranges, seed); it knows nothing of servers or HTTP."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engram.bench.corpus import CorpusError, CorpusTokenizer, LengthRange, load_corpus, load_tokenizer

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "bench" / "corpus" / "natural-v1.jsonl"
DEFAULT_LENGTHS = "100:1024"  # the Engram paper's nano-vLLM workload: input and output lengths Uniform(100, 1024)


@dataclass(frozen=True)
class ServeRequest:
    """One request: ``prompt_ids`` sent as the completion's prompt, ``output_len`` tokens asked with ignore_eos."""

    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class TokenStream:
    """A corpus's prose as one token stream: its requests' prompt + continuation texts, in a seeded order."""

    ids: np.ndarray  # [N] int64 token ids
    corpus_sha256: str
    tokenizer: dict  # CorpusTokenizer.info() of the tokenizer that encoded it


def model_tokenizer(model: str, tokenizer: str | None = None) -> CorpusTokenizer:
    """The tokenizer prompts are counted in: ``tokenizer`` (a ``load_tokenizer`` spec) if given, else the model's (a
    preset's built-in one, a checkpoint directory's tokenizer.json); ValueError naming ``--tokenizer`` otherwise."""
    from engram.model.presets import MODEL_PRESETS

    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    if model in MODEL_PRESETS:
        return load_tokenizer("builtin")
    path = Path(model) / "tokenizer.json"
    if path.is_file():
        return load_tokenizer(str(path))
    raise ValueError(f"model={model!r} is neither a preset {MODEL_PRESETS} nor a directory with a tokenizer.json: "
                     f"pass --tokenizer (a tokenizer.json path) so prompt lengths are counted in the server's tokens")


def token_stream(tok: CorpusTokenizer, path: str | os.PathLike | None = None, seed: int = 0) -> TokenStream:
    """The corpus at ``path`` (default: the committed natural-v1) encoded by ``tok``: each request's prompt and
    continuation as one document, documents in ``default_rng(seed).permutation`` order. CorpusError names the file."""
    path = Path(DEFAULT_CORPUS if path is None else path)
    if not path.is_file():
        raise CorpusError(f"corpus {path}: no such file (write one with `engram bench corpus`, pass it with --corpus)")
    corpus = load_corpus(path)
    order = np.random.default_rng(seed).permutation(len(corpus.requests))
    docs = tok.encode([corpus.requests[i].prompt + corpus.requests[i].continuation for i in order])
    ids = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    if ids.size == 0:
        raise CorpusError(f"corpus {path}: its requests encode to no tokens")
    return TokenStream(ids=ids, corpus_sha256=corpus.sha256, tokenizer=tok.info())


def make_requests(stream: TokenStream, num: int, input_len: LengthRange, output_len: LengthRange,
                  seed: int = 0) -> list[ServeRequest]:
    """``num`` requests, lengths drawn from ``default_rng(seed)`` (all input lengths, then all output lengths); request
    i's prompt is the next ``input_len[i]`` tokens of the stream, wrapping round to its start when it runs out."""
    if num < 1:
        raise ValueError(f"num_prompts={num}: must be >= 1")
    rng = np.random.default_rng(seed)
    p_len, o_len = input_len.sample(rng, num), output_len.sample(rng, num)
    ids, n = stream.ids, stream.ids.size
    out, cursor = [], 0
    for p, o in zip(p_len.tolist(), o_len.tolist()):
        idx = (cursor + np.arange(p)) % n  # a prompt longer than the stream repeats it: still exactly p tokens
        out.append(ServeRequest(prompt_ids=ids[idx].tolist(), output_len=o))
        cursor = (cursor + p) % n
    return out


def arrival_offsets(num: int, request_rate: float, seed: int = 0) -> np.ndarray:
    """[num] seconds after the start at which each request is sent: all at 0 for an infinite rate, else a Poisson
    process (exponential gaps of mean 1 / rate from ``default_rng(seed + 1)``), the first at 0."""
    if not request_rate > 0:
        raise ValueError(f"request_rate={request_rate}: must be > 0 (inf: send every request at once)")
    if np.isinf(request_rate):
        return np.zeros(num)
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / request_rate, size=num)
    gaps[0] = 0.0
    return np.cumsum(gaps)
