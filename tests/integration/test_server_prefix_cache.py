"""Prefix caching through real ``engram serve`` processes (tiny, CPU): a second request sharing a prompt prefix is
served from the cache, ``/metrics`` counts it (``engram_prefix_cache_*``), ``POST /reset_prefix_cache`` forgets the
cache, ``--no-enable-prefix-caching`` turns it off, and ``engram bench serve --shared-prefix-len`` sends one system
prompt before every user turn and reports the window's hits in its JSON."""
from __future__ import annotations

import json

import httpx
import pytest

from engram.cli import main
from engram.server.launcher import ServerProcess

pytestmark = pytest.mark.timeout(600)
PREFIX = list(range(100, 148))  # 48 tokens: three full blocks of 16


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _complete(c: httpx.Client, prompt: list[int]) -> list[int]:
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                                        "temperature": 0, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("enabled", [True, False])
def test_metrics_and_reset(tmp_path, enabled):
    args = ["tiny", "--device", "cpu", "--threads", "1"] + ([] if enabled else ["--no-enable-prefix-caching"])
    with ServerProcess(args, None, tmp_path / "server.log") as server, \
            httpx.Client(base_url=server.url, timeout=120) as c:
        first = _complete(c, PREFIX + [7, 8, 9])
        _complete(c, PREFIX + [10, 11])
        text = c.get("/metrics").text
        assert _metric(text, "engram_prefix_cache_hit_blocks_total") == (3 if enabled else 0)
        assert _metric(text, "engram_prefix_cache_queries_total") == (2 if enabled else 0)
        assert _metric(text, "engram_prefix_cache_token_hit_rate") == (pytest.approx(48 / (51 + 50)) if enabled else 0)
        r = c.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["reset"] is True
        assert (r.json()["dropped_blocks"] > 0) == enabled
        text = c.get("/metrics").text
        assert _metric(text, "engram_prefix_cache_cached_blocks") == 0
        assert _metric(text, "engram_prefix_cache_resets_total") == 1
        assert _complete(c, PREFIX + [7, 8, 9]) == first  # computed again, the same text
        assert _metric(c.get("/metrics").text, "engram_prefix_cache_hit_blocks_total") == (3 if enabled else 0)


def test_bench_serve_shared_prefix_reports_hits(tmp_path):
    with ServerProcess(["tiny", "--device", "cpu", "--threads", "1", "--max-num-seqs", "4"], None,
                       tmp_path / "server.log") as server:
        out = tmp_path / "r.json"
        rc = main(["bench", "serve", "--url", server.url, "--model", "tiny", "--input-len", "10:20", "--output-len",
                   "2:3", "--shared-prefix-len", "96", "--num-prompts", "6", "--warmup", "1", "--concurrency", "1",
                   "--no-roofline", "--out", str(out)])
    r = json.loads(out.read_text())["result"]
    assert rc == 0 and r["errors"] == 0 and r["prompt_tokens_mismatch"] == 0
    pc = r["prefix_cache"]
    # the warm-up cached the system prompt's 6 blocks; each measured request reuses them
    assert pc["enabled"] and pc["queries"] == 6 and pc["hit_blocks"] == 6 * 6
    assert pc["hit_tokens"] == 6 * 96 and pc["token_hit_rate"] == pytest.approx(pc["hit_tokens"] / pc["queried_tokens"])
    assert r["input_tokens"] >= 6 * (96 + 10)
