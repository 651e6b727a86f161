"""`engram bench serve` without a server: its requests (prompts of exactly the drawn token counts, cut in order from
the corpus's prose under the model's tokenizer, deterministic in the seed), Poisson arrivals, the metrics'
definitions on hand-made timings, the window's engine counters, and a missing or altered corpus or a bad option
stopping the command before any server starts. The load itself runs against real servers in
tests/integration/test_bench_serve.py."""
import asyncio
import socket
from pathlib import Path

import numpy as np
import pytest

from engram.bench.corpus import Corpus, CorpusError, CorpusRequest, FORMAT, LengthRange, load_tokenizer, write_corpus
from engram.bench.serve_client import RequestRecord, drive, summarize
from engram.bench.serve_counters import window_counters
from engram.bench.serve_workload import (DEFAULT_CORPUS, ServeRequest, arrival_offsets, make_requests,
                                         model_tokenizer, token_stream)
from engram.cli import main
from engram.engine.step_trace import StepRecord

REPO = Path(__file__).resolve().parents[2]


def test_prompts_are_exact_consecutive_cuts_of_the_corpus_prose():
    assert DEFAULT_CORPUS == REPO / "bench" / "corpus" / "natural-v1.jsonl"
    tok = model_tokenizer("tiny")
    stream = token_stream(tok, seed=0)
    reqs = make_requests(stream, 20, LengthRange(100, 1024), LengthRange(5, 9), seed=3)
    rng = np.random.default_rng(3)
    want_in, want_out = rng.integers(100, 1025, 20), rng.integers(5, 10, 20)
    assert [len(r.prompt_ids) for r in reqs] == want_in.tolist() and [r.output_len for r in reqs] == want_out.tolist()
    flat = np.concatenate([r.prompt_ids for r in reqs])
    assert (flat == stream.ids[:flat.size]).all()  # one after another, no token skipped or repeated
    text = tok.tokenizer.decode(reqs[0].prompt_ids)
    assert len(set(text.split())) > 30  # natural prose, not one repeated token
    assert make_requests(stream, 20, LengthRange(100, 1024), LengthRange(5, 9), seed=3) == reqs
    assert make_requests(stream, 20, LengthRange(100, 1024), LengthRange(5, 9), seed=4) != reqs
    assert token_stream(tok, seed=1).ids.size == stream.ids.size and not np.array_equal(token_stream(tok, seed=1).ids,
                                                                                         stream.ids)


def _tiny_corpus(path: Path, texts: list[str]) -> None:
    reqs = [CorpusRequest(id=i, prompt=p, continuation=" more", prompt_tokens=1, continuation_tokens=1,
                          sources=["x.py"]) for i, p in enumerate(texts)]
    write_corpus(Corpus({"format": FORMAT, "requests": len(reqs)}, reqs), path)


def test_a_short_corpus_wraps_round_and_bad_corpora_are_refused(tmp_path):
    path = tmp_path / "c.jsonl"
    _tiny_corpus(path, ["alpha beta", "gamma delta"])
    stream = token_stream(load_tokenizer("builtin"), path)
    n = stream.ids.size
    reqs = make_requests(stream, 3, LengthRange(n + 2, n + 2), LengthRange(1, 1))
    assert reqs[0].prompt_ids == stream.ids.tolist() + stream.ids[:2].tolist()  # still exactly n + 2 tokens
    assert reqs[1].prompt_ids[0] == stream.ids[2]
    with pytest.raises(CorpusError, match="no such file"):
        token_stream(load_tokenizer("builtin"), tmp_path / "missing.jsonl")
    path.write_bytes(path.read_bytes().replace(b"alpha", b"ALPHA"))
    with pytest.raises(CorpusError, match="does not match the recorded"):
        token_stream(load_tokenizer("builtin"), path)
    # the command refuses before starting a server (no --url: it would start one)
    with pytest.raises(SystemExit, match=r"engram bench serve: corpus .*does not match the recorded"):
        main(["bench", "serve", "--corpus", str(path), "--num-prompts", "1"])
    with pytest.raises(SystemExit, match=r"--input-len='9:3'"):
        main(["bench", "serve", "--input-len", "9:3"])
    with pytest.raises(SystemExit, match=r"--tokenizer"):
        main(["bench", "serve", "--model", str(tmp_path)])
    with pytest.raises(ValueError, match="num_prompts=0"):
        make_requests(stream, 0, LengthRange(1, 1), LengthRange(1, 1))


def test_arrivals_all_at_once_or_poisson():
    assert (arrival_offsets(5, float("inf")) == 0).all()
    t = arrival_offsets(4000, 20.0, seed=1)
    gaps = np.diff(t)
    assert t[0] == 0.0 and (gaps >= 0).all() and abs(gaps.mean() - 0.05) < 0.005  # mean gap 1 / rate
    assert abs(gaps.std() - gaps.mean()) < 0.1 * gaps.mean()  # exponential: std equals mean
    assert (arrival_offsets(4000, 20.0, seed=1) == t).all()
    with pytest.raises(ValueError, match="request_rate=0"):
        arrival_offsets(3, 0.0)


def test_metrics_follow_vllm_definitions():
    a = RequestRecord(prompt_len=10, output_len=5, sent=0.0, chunk_times=[0.5, 0.6, 0.8, 0.9], end=1.0,
                      prompt_tokens=10, completion_tokens=5)  # 5 tokens in 4 chunks
    b = RequestRecord(prompt_len=7, output_len=3, sent=1.0, chunk_times=[1.2, 1.3, 1.4], end=1.4,
                      prompt_tokens=8, completion_tokens=3)  # the server counted another prompt length
    bad = RequestRecord(prompt_len=4, output_len=3, sent=0.0, error="HTTP 503: b'busy'")
    out = summarize([a, b, bad], wall=2.0)
    assert (out["requests"], out["errors"], out["error_samples"]) == (2, 1, ["HTTP 503: b'busy'"])
    assert (out["input_tokens"], out["output_tokens"], out["prompt_tokens_mismatch"]) == (17, 8, 1)
    assert out["output_tokens_per_s"] == 4.0 and out["requests_per_s"] == 1.0
    assert out["ttft_p50_s"] == pytest.approx(0.35)  # 0.5 and 0.2
    assert out["tpot_mean_s"] == pytest.approx(((1.0 - 0.5) / 4 + (0.4 - 0.2) / 2) / 2)  # (e2e - ttft) / (n - 1)
    assert out["itl_mean_s"] == pytest.approx(np.mean([0.1, 0.2, 0.1, 0.1, 0.1]))  # chunk gaps, all requests
    assert out["e2e_p99_s"] == pytest.approx(np.percentile([1.0, 0.4], 99))
    none = summarize([bad], wall=1.0)
    assert none["ttft_p50_s"] is None and none["itl_p99_s"] is None and none["output_tokens_per_s"] == 0.0


def test_every_request_to_a_closed_port_is_an_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there: every request fails to connect
    reqs = [ServeRequest([5, 6, 7], 2)] * 3
    records, wall = asyncio.run(drive(f"http://127.0.0.1:{port}", "tiny", reqs, np.zeros(3), concurrency=2))
    out = summarize(records, wall)
    assert out["requests"] == 0 and out["errors"] == 3 and "ConnectError" in out["error_samples"][0]
    with pytest.raises(ValueError, match="2 arrival offsets for 3 requests"):
        asyncio.run(drive(f"http://127.0.0.1:{port}", "tiny", reqs, np.zeros(2), concurrency=None))


def test_a_connection_reset_mid_stream_names_its_cause_and_where():
    """A real socket that answers one SSE chunk and then resets (SO_LINGER 0): the error says ReadError, the OS
    error under it, and that it struck after the first chunk."""
    import struct
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def answer_then_reset():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        time.sleep(1.0)  # the client has read the chunk (a reset discards what it has not read yet)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # a reset, not an orderly close

    t = threading.Thread(target=answer_then_reset)
    t.start()
    records, _ = asyncio.run(drive(f"http://127.0.0.1:{srv.getsockname()[1]}", "tiny", [ServeRequest([5], 4)],
                                   np.zeros(1), concurrency=1))
    t.join(10)
    srv.close()
    error = records[0].error
    assert error.startswith("ReadError") and "after 1 chunks" in error, error
    assert "Connection reset" in error or "ECONNRESET" in error or "104" in error, error


def test_window_counters_sum_the_records():
    recs = [StepRecord(3, "eager", 40, 2, 0, 2, 40, 500, 0.010, 0.5),  # its idle spans the pause before the window
            StepRecord(4, "mixed-graph", 20, 3, 2, 3, 60, 300, 0.004, 0.001),
            StepRecord(5, "graph", 3, 3, 3, 3, 63, 63, 0.002, 0.003)]
    before = {"graph_replays": 10, "mixed_graph_replays": 0, "lookup_exposed_s": 1.0, "steps": 3, "preemptions": 0}
    after = {"graph_replays": 11, "mixed_graph_replays": 1, "lookup_exposed_s": 1.25, "steps": 6, "preemptions": 0}
    c = window_counters(recs, before, after, wall=0.1)
    assert c["steps_by_kind"] == {"decode": 1, "mixed": 1, "prefill": 1} and c["eager_steps"] == 1
    assert c["steps_by_route"] == {"eager": 1, "mixed-graph": 1, "graph": 1}
    assert c["tokens_by_kind"] == {"decode": 3, "mixed": 20, "prefill": 40}
    assert c["eager_min_tokens_by_kind"] == {"decode": None, "mixed": None, "prefill": 40}
    assert c["gpu_busy_s"] == pytest.approx(0.016) and c["gpu_idle_s"] == pytest.approx(0.004)
    assert c["gpu_idle_share"] == pytest.approx(0.04)
    assert (c["graph_replays_delta"], c["mixed_graph_replays_delta"], c["steps_delta"]) == (1, 1, 3)
    assert c["lookup_exposed_s_delta"] == pytest.approx(0.25)
    from engram.bench.report import format_table
    from engram.bench.serve_load import format_tables

    result = {**summarize([], 0.1), "counters": c, "roofline": {"skipped": "--no-roofline"}}
    text = format_tables(result, format_table)
    assert "GPU idle between steps: 0.004 s, 4.0% of wall, gap p50 2.000 ms" in text
    assert "skipped (--no-roofline)" in text
    cpu = window_counters([StepRecord(1, "eager", 3, 3, 3, 3, 9, 9, None, None)], {}, {}, wall=1.0)
    assert cpu["gpu_busy_s"] is None and cpu["gpu_idle_share"] is None and "steps_delta" not in cpu
