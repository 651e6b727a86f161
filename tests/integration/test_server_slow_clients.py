"""Slow and stalled clients against a real `engram serve` subprocess over raw sockets: a request head or body
that does not arrive in time gets 408 and its connection closes, and a graceful shutdown (SIGTERM) lets the
in-flight generations finish, then exits, even while a client holds a half-sent request open."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from engram.server.launcher import ServerProcess, metric

pytestmark = pytest.mark.timeout(600)

# A POST that declares a 1000-byte body and sends 1 byte of it.
HALF_SENT = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 1000\r\n\r\n{")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "engram-cache"


def _connect(s: ServerProcess, data: bytes) -> socket.socket:
    c = socket.create_connection(("127.0.0.1", s.port), timeout=60)
    c.sendall(data)
    return c


def _read_until_closed(c: socket.socket) -> bytes:
    out = b""
    while chunk := c.recv(65536):
        out += chunk
    return out


def _stream(url: str, events: list, started: threading.Event, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": "A long stream", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:  # cut off by the server
        events.append(f"cut: {type(e).__name__}")


def test_request_heads_and_bodies_that_do_not_arrive_in_time_get_408(cache_dir, tmp_path):
    with ServerProcess(["tiny", "--threads", "1", "--timeout-request-headers", "1.5", "--timeout-request-body",
                        "2"], cache_dir, tmp_path / "log") as s:
        rejected = metric(s.url, "engram_requests_rejected_total", 'reason="timeout"')
        # slowloris: many connections, each a request line and part of its headers, nothing more
        heads = [_connect(s, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") for _ in range(50)]
        silent = _connect(s, b"")  # connected, never sends a byte
        body = _connect(s, HALF_SENT)
        t0 = time.monotonic()
        answers = [_read_until_closed(c) for c in heads]
        assert time.monotonic() - t0 < 10, "the incomplete heads were not cut off at their deadline"
        assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers[0]
        assert _read_until_closed(silent).startswith(b"HTTP/1.1 408 ")
        reply = _read_until_closed(body)  # read to EOF: the connection is closed after the 408
        assert time.monotonic() - t0 < 15
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), head
        err = json.loads(payload)["error"]
        assert err["code"] == 408 and "--timeout-request-body" in err["message"], err
        assert metric(s.url, "engram_requests_rejected_total", 'reason="timeout"') == rejected + 1
        # a prompt client on the same server is served as before
        ok = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                        timeout=60)
        assert ok.status_code == 200, ok.text


def test_sigterm_drains_generations_while_a_client_holds_a_half_sent_body(cache_dir, tmp_path):
    """The half-sent request (its body would time out only after 300 s) gets 503 at the signal; the stream
    already running finishes; the process exits at once after it, far inside the graceful timeout."""
    s = ServerProcess(["tiny", "--threads", "1", "--timeout-request-body", "300", "--timeout-graceful-shutdown",
                       "120"], cache_dir, tmp_path / "log").wait_ready()
    events: list[str] = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(s.url, events, started, 600))
    try:
        slow = _connect(s, HALF_SENT)
        t.start()
        assert started.wait(60)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        reply = _read_until_closed(slow)
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        assert b"shutting down" in reply
        rc = s.proc.wait(60)
        took = time.monotonic() - t0
        t.join(60)
    finally:
        s.stop()
    assert rc in (0, -signal.SIGTERM), (rc, s.log()[-3000:])
    assert took < 60, f"the process took {took:.1f} s to exit after SIGTERM"
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_graceful_shutdown_timeout_bounds_the_drain(cache_dir, tmp_path):
    """A generation that would outlive --timeout-graceful-shutdown is cancelled at it, and the process exits
    then, whatever a client holds open."""
    s = ServerProcess(["tiny", "--threads", "1", "--dtype", "float64", "--timeout-graceful-shutdown", "2",
                       "--timeout-request-body", "300"], cache_dir, tmp_path / "log").wait_ready()
    events: list[str] = []
    started = threading.Event()
    t = threading.Thread(target=_stream, args=(s.url, events, started, 2000))
    try:
        t.start()
        assert started.wait(60)
        slow = _connect(s, HALF_SENT)
        time.sleep(0.5)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rc = s.proc.wait(60)
        took = time.monotonic() - t0
        t.join(60)
        slow.close()
    finally:
        s.stop()
    assert rc in (0, -signal.SIGTERM), (rc, s.log()[-3000:])
    assert 1.5 < took < 20, f"the process took {took:.1f} s to exit after SIGTERM with a 2 s graceful timeout"
    assert "[DONE]" not in events, "the 2000-token stream should have been cut off at the graceful timeout"
