"""`engram bench serve`'s prompts: the prompts of a request corpus (engram/bench/corpus.py), the committed
natural-v1 by default, in a seeded order; a missing or altered corpus stops the command before any server
starts. The load itself runs against a real server in tests/integration/test_server.py."""
from pathlib import Path

import numpy as np
import pytest

from engram.bench.corpus import Corpus, CorpusError, CorpusRequest, FORMAT, load_corpus, write_corpus
from engram.bench.serve_load import DEFAULT_CORPUS, corpus_prompts
from engram.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_default_is_the_committed_corpus_in_a_seeded_order():
    assert DEFAULT_CORPUS == REPO / "bench" / "corpus" / "natural-v1.jsonl"
    corpus = load_corpus(DEFAULT_CORPUS)
    prompts, sha = corpus_prompts(seed=0)
    assert sha == corpus.sha256 and len(prompts) == len(corpus.requests)
    order = np.random.default_rng(0).permutation(len(corpus.requests))
    assert prompts == [corpus.requests[i].prompt for i in order]
    assert corpus_prompts(seed=0)[0] == prompts  # deterministic for a seed
    other = corpus_prompts(seed=1)[0]
    assert other != prompts and sorted(other) == sorted(prompts)  # another order of the same prompts


def _tiny_corpus(path: Path, prompts: list[str]) -> None:
    reqs = [CorpusRequest(id=i, prompt=p, continuation=" more", prompt_tokens=1, continuation_tokens=1,
                          sources=["x.py"]) for i, p in enumerate(prompts)]
    write_corpus(Corpus({"format": FORMAT, "requests": len(reqs)}, reqs), path)


def test_corpus_option_and_its_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    _tiny_corpus(path, ["alpha beta", "gamma delta", "epsilon"])
    prompts, _ = corpus_prompts(path, seed=5)
    assert sorted(prompts) == ["alpha beta", "epsilon", "gamma delta"]
    with pytest.raises(CorpusError, match="no such file"):
        corpus_prompts(tmp_path / "missing.jsonl")
    path.write_bytes(path.read_bytes().replace(b"alpha", b"ALPHA"))
    with pytest.raises(CorpusError, match="does not match the recorded"):
        corpus_prompts(path)
    # the command refuses before starting a server (no --url: it would start one)
    with pytest.raises(SystemExit, match=r"engram bench serve: corpus .*does not match the recorded"):
        main(["bench", "serve", "--corpus", str(path), "--duration", "1"])


def test_a_run_in_which_every_request_fails_is_still_written(tmp_path):
    import asyncio
    import json
    import socket

    from engram.bench.report import write_result
    from engram.bench.serve_load import run_load

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: every request fails to connect
    result = asyncio.run(run_load(f"http://127.0.0.1:{port}", "tiny", 2, 0.3, 4, ["a prompt"]))
    assert result["requests"] == 0 and result["errors"] > 0 and "ConnectError" in result["error_samples"][0]
    assert result["ttft_p50_s"] is None and result["e2e_p99_s"] is None
    path = write_result("serve-load", {}, result, out=tmp_path / "r.json")
    assert json.loads(path.read_text())["result"]["tpot_p99_s"] is None
