"""Server behaviour under pressure, with real subprocesses: a full queue -> 503 + Retry-After, a table read
error fails only that step's requests (the server keeps serving), SIGTERM drains in-flight streams."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from engram.server.launcher import ServerProcess, metric

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "engram-cache"


def _stream_body(max_tokens):
    return {"model": "tiny", "prompt": "Streams that outlive", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}


def test_full_queue_answers_503_with_retry_after(cache_dir, tmp_path):
    s = ServerProcess(["tiny", "--threads", "1", "--max-num-seqs", "1", "--max-waiting", "0"], cache_dir,
                      tmp_path / "log").wait_ready()

    async def burst():
        body = {"model": "tiny", "prompt": "Streams that outlive", "max_tokens": 1500, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))

    try:
        responses = asyncio.run(burst())  # capacity is one request: the burst overflows it
        ok = [r for r in responses if r.status_code == 200]
        full = [r for r in responses if r.status_code == 503]
        assert len(ok) + len(full) == 8 and ok and full
        assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == 503 for r in full)
        assert all(r.json()["usage"]["completion_tokens"] == 1500 for r in ok)
        assert httpx.post(s.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        s.stop()


def test_table_read_error_fails_only_that_step_and_server_keeps_serving(cache_dir, tmp_path):
    s = ServerProcess(["tiny", "--threads", "1", "--tier", "disk", "--engram-config", '{"io": "buffered"}'], cache_dir,
                      tmp_path / "log").wait_ready()
    try:
        body = {"model": "tiny", "prompt": "Disk rows", "max_tokens": 4, "temperature": 0}
        good = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert good.status_code == 200
        values = sorted(Path(cache_dir, "tables").glob("*/layer1/values.bin"))
        assert values, "tiny's disk tables not found"
        saved = {p: p.read_bytes() for p in values}
        for p in values:  # truncate in place: every read of this table now comes back short
            os.truncate(p, 0)
        try:
            for _ in range(10):  # more failures than a table's max_inflight (8): none may keep a lookup in flight
                bad = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
                assert bad.status_code == 500, bad.text
                msg = bad.json()["error"]["message"]
                assert "values.bin" in msg and "offset" in msg and "in flight" not in msg
                assert "short read" in msg and "file is 0 bytes now" in msg and "[Errno 0]" not in msg, msg
                assert httpx.get(s.url + "/health").status_code == 200
        finally:
            for p, data in saved.items():  # restore the same inode's contents
                with open(p, "r+b") as f:
                    f.write(data)
        again = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]

        # a stream already running when the table goes bad ends with an error event; counted once, as an error
        errors = metric(s.url, "engram_requests_total", 'finish_reason="error"')
        aborts = metric(s.url, "engram_requests_total", 'finish_reason="abort"')
        with httpx.stream("POST", s.url + "/v1/completions", json=_stream_body(1500), timeout=60) as r:
            lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(lines))
            for p in values:
                os.truncate(p, 0)
            try:
                rest = list(lines)
            finally:
                for p, data in saved.items():
                    with open(p, "r+b") as f:
                        f.write(data)
        assert rest[-1] == "[DONE]" and "values.bin" in json.loads(rest[-2])["error"]["message"]
        deadline = time.monotonic() + 30
        while metric(s.url, "engram_requests_total", 'finish_reason="error"') == errors and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # an abort counted on top would land right after the error
        assert metric(s.url, "engram_requests_total", 'finish_reason="error"') == errors + 1
        assert metric(s.url, "engram_requests_total", 'finish_reason="abort"') == aborts
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        s.stop()


def test_sigterm_drains_in_flight_streams_then_exits(cache_dir, tmp_path):
    s = ServerProcess(["tiny", "--threads", "1"], cache_dir, tmp_path / "log").wait_ready()
    events: list = []

    def consume(started: threading.Event):
        with httpx.stream("POST", s.url + "/v1/completions", json=_stream_body(1500), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    started = threading.Event()
    t = threading.Thread(target=consume, args=(started,))
    t.start()
    try:
        assert started.wait(60)
        s.proc.send_signal(signal.SIGTERM)  # while the 1500-token stream is still running
        t.join(120)
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown: exit by that signal
        assert s.proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        s.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) > 100  # the stream ran on well past the signal
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=2)
