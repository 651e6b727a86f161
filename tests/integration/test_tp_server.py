"""A real ``engram serve --tensor-parallel-size 2 --device cpu`` whose rank is killed mid-request: the request in
flight fails, the server logs which rank died and exits with status 4 within 60 s (never hangs)."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from engram.commands.serve import EXIT_ENGINE_FAILED
from engram.server.launcher import ServerProcess

pytestmark = pytest.mark.timeout(600)


def _rank_pids(server_pid: int) -> list[int]:
    """The spawned rank processes among the server's children (the resource tracker is not one)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    return sorted(p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def test_a_killed_rank_fails_requests_in_flight_and_the_server_exits(tmp_path_factory, tmp_path):
    cache_dir = tmp_path_factory.getbasetemp() / "engram-cache"
    s = ServerProcess(["tiny", "--threads", "1", "--device", "cpu", "--tensor-parallel-size", "2"], cache_dir,
                      tmp_path / "log").wait_ready()
    events: list[str] = []
    status: list[int] = []
    started = threading.Event()

    def consume() -> None:
        body = {"model": "tiny", "prompt": "a rank goes", "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                status.append(r.status_code)
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        except httpx.HTTPError as e:  # the server may close the connection as it exits
            events.append(f"closed: {e!r}")
        finally:
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    try:
        assert started.wait(120), s.log()
        ranks = _rank_pids(s.proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[-1], signal.SIGKILL)
        killed = time.monotonic()
        code = s.proc.wait(60)
        assert time.monotonic() - killed < 60
        t.join(60)
        log = s.log()
    finally:
        s.stop()
    assert code == EXIT_ENGINE_FAILED, log
    errors = [e for e in events if e.startswith('{"error"')]  # the stream ends with an error event, not a length
    assert len(errors) == 1 and "exited with code -9" in errors[0] and '"code": 500' in errors[0], events[-3:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "exited with code -9" in log and "the engine stopped" in log, log[-2000:]
    for pid in ranks:  # no rank outlives the server
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
