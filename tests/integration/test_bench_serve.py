"""`engram bench serve` against real `engram serve` processes of the tiny model on the CPU: prompts reach the server
with exactly the drawn token counts (its usage says so), the warm-up stays out of the window's requests and steps,
the JSON holds the engine's counters and the serving roofline, Poisson arrivals pace the requests, the bench starts
its own server by default, and a server that is not there makes every request an error."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import numpy as np
import pytest

from engram.bench.corpus import LengthRange
from engram.bench.serve_client import send_one
from engram.bench.serve_workload import make_requests, model_tokenizer, token_stream
from engram.cli import main
from engram.server.launcher import ServerProcess

pytestmark = pytest.mark.timeout(600)
SMALL = ["--model", "tiny", "--input-len", "20:300", "--output-len", "3:12", "--seed", "2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(["tiny", "--threads", "1", "--max-num-seqs", "4"], None,
                       tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


def _bench(argv: list[str], out) -> tuple[int, dict]:
    rc = main(["bench", "serve", *argv, "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_prompts_reach_the_server_with_exactly_their_drawn_counts(server):
    reqs = make_requests(token_stream(model_tokenizer("tiny")), 4, LengthRange(100, 1024), LengthRange(2, 5), seed=1)

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(send_one(client, "tiny", r) for r in reqs))

    for req, rec in zip(reqs, asyncio.run(all_of_them())):
        assert rec.error is None, rec.error
        assert rec.prompt_tokens == len(req.prompt_ids) and rec.completion_tokens == req.output_len


def test_window_excludes_the_warmup_and_holds_counters_and_roofline(server, tmp_path):
    rc, doc = _bench(["--url", server.url, *SMALL, "--num-prompts", "5", "--warmup", "3", "--concurrency", "2"],
                     tmp_path / "r.json")
    r = doc["result"]
    assert rc == 0 and r["errors"] == 0, r["error_samples"]
    assert r["requests"] == 5 and r["prompt_tokens_mismatch"] == 0 and r["output_tokens_short"] == 0
    c = r["counters"]
    # the window's steps computed exactly its requests' tokens: every prompt token, and every output token but the
    # first of each request (sampled from its prompt's last step); a warm-up step in the window would add more
    assert sum(c["tokens_by_kind"].values()) == r["input_tokens"] + r["output_tokens"] - r["requests"]
    assert c["steps"] == sum(c["steps_by_kind"].values()) == c["steps_delta"] and c["eager_steps"] == c["steps"]
    assert c["gpu_busy_s"] is None  # the CPU has no device clock
    roof = r["roofline"]
    assert roof["steps"] == c["steps"] and 0 < roof["roofline_s"] and roof["ratio"] == pytest.approx(
        roof["roofline_s"] / r["wall_s"])
    assert sum(k["steps"] for k in roof["by_kind"].values()) == c["steps"]
    assert roof["ideal"]["roofline_s"] > 0 and roof["ideal"]["concurrency"] == 2
    assert roof["ceilings"]["memory_GBps"] > 0 and max(roof["gemm_curve"]["ms"]) >= 2048
    assert doc["config"]["tokenizer"]["name"] == "builtin" and doc["config"]["server_args"] is None


def test_request_rate_paces_the_requests(server, tmp_path):
    rc, doc = _bench(["--url", server.url, *SMALL, "--num-prompts", "4", "--warmup", "0", "--request-rate", "8",
                      "--no-roofline"], tmp_path / "r.json")
    r = doc["result"]
    assert rc == 0 and r["requests"] == 4 and r["errors"] == 0
    from engram.bench.serve_workload import arrival_offsets

    assert r["wall_s"] >= arrival_offsets(4, 8.0, seed=2)[-1]  # the last request left no earlier than its arrival
    assert doc["config"]["request_rate"] == 8.0 and r["roofline"] == {"skipped": "--no-roofline"}


def test_the_bench_starts_its_own_server(tmp_path):
    rc, doc = _bench([*SMALL, "--num-prompts", "3", "--warmup", "1", "--concurrency", "3", "--serve-args",
                      "--threads 1"], tmp_path / "r.json")
    assert rc == 0 and doc["result"]["requests"] == 3
    assert doc["config"]["server_args"][:2] == ["tiny", "--tier"] and "--max-num-seqs" in doc["config"]["server_args"]
    assert doc["result"]["roofline"]["steps"] == doc["result"]["counters"]["steps"]


def test_a_missing_server_counts_every_request_as_an_error(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    rc, doc = _bench(["--url", f"http://127.0.0.1:{port}", *SMALL, "--num-prompts", "3", "--warmup", "0"],
                     tmp_path / "r.json")
    r = doc["result"]
    assert rc == 1 and r["requests"] == 0 and r["errors"] == 3 and "ConnectError" in r["error_samples"][0]
    assert "ConnectError" in r["counters"]["skipped"] and "skipped" in r["roofline"]
    assert r["ttft_p50_s"] is None and np.isclose(r["output_tokens_per_s"], 0.0)


@pytest.mark.parametrize("cache_rows", [0, 300])
def test_disk_tier_bound_replays_the_servers_row_trace(tmp_path, cache_rows):
    from engram.bench.page_replay import trace_pages
    from engram.engine.row_trace import read_row_trace

    trace = tmp_path / "rows.trace"
    config = json.dumps({"io": "buffered", "cache_rows": cache_rows})
    rc, doc = _bench([*SMALL, "--tier", "disk", "--num-prompts", "5", "--warmup", "2", "--concurrency", "3",
                      "--no-roofline", "--raw-read-seconds", "0.3", "--row-trace", str(trace),
                      "--serve-args", f"--threads 1 --engram-config '{config}'"], tmp_path / "r.json")
    r = doc["result"]
    assert rc == 0 and r["errors"] == 0, r["error_samples"]
    assert doc["config"]["server_args"][5:7] == ["--row-trace", str(trace)]
    b = r["disk_bound"]
    assert "skipped" not in b, b
    assert b["window_steps"] == r["counters"]["steps"] and b["replay"]["steps"] == b["window_steps"]
    records = read_row_trace(trace)
    assert records.steps.shape[0] > b["window_steps"]  # the warm-up's steps are in the trace, before the window
    window = records.step_ids[-b["window_steps"]:]
    again = trace_pages(records, window)
    assert again["pages"] == b["replay"]["pages"] > 0 and again["misses"] == b["replay"]["misses"]
    assert b["bound_s"] == pytest.approx(b["replay"]["pages"] / b["read_ops_per_s"])
    assert b["ratio"] == pytest.approx(b["bound_s"] / r["wall_s"]) and b["target_met"] == (b["ratio"] >= 0.9)
    assert b["output_tokens_per_s_bound"] == pytest.approx(r["output_tokens"] / b["bound_s"])
    assert 0 < b["ttft_bound_s"] and b["ttft_p50_s"] == r["ttft_p50_s"]
    assert b["raw_reads"]["pages_per_call"] >= 1 and b["raw_reads"]["calls"] >= 1
    layers = b["replay"]["layers"]
    if cache_rows:  # the cache's capacity as opened (sets of 8 ways), and hits in the replay as in the run
        assert all(0 < x["cache_rows"] <= cache_rows for x in layers) and b["replay"]["hit_rate"] > 0
        assert b["measured"]["hits"] > 0
    else:  # no cache: the disk tier read each distinct page of a step's lookup once, as the replay counts
        assert b["replay"]["pages"] == b["measured"]["read_ops"] and b["replay"]["hit_rate"] == 0
