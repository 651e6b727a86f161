"""Helpers of the tests that kill a server's spawned processes (its engine process, and that one's TP ranks, PP stages
or DP replicas: the server's grandchildren): find them, stream a completion while they die, and tell that one is gone."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import httpx


def spawned_children(pid: int) -> list[int]:
    """The processes ``pid`` spawned with multiprocessing's spawn (the resource tracker is not one), ascending."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    return sorted(p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def engine_processes(server_pid: int) -> list[int]:
    """The server's engine process (its one spawned child) first, then the processes that one spawned (TP ranks, PP
    stages or DP replicas), ascending."""
    engine = spawned_children(server_pid)
    assert len(engine) == 1, f"server {server_pid} has spawned {engine}, not one engine process"
    return [*engine, *spawned_children(engine[0])]


def all_gone(pids: list[int], timeout: float = 30.0) -> bool:
    """Whether every process of ``pids`` has exited within ``timeout`` seconds (an engine process reaps its children
    as it ends, which may be just after its parent exited)."""
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def stream_completion(url: str, body: dict, events: list[str], started: threading.Event) -> None:
    """POST a streaming completion, appending each SSE data payload to ``events`` (and ``closed: ...`` if the server
    drops the connection as it exits); ``started`` is set at the first event or at the end."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as e:
        events.append(f"closed: {e!r}")
    finally:
        started.set()


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (or is a zombie nobody reaped yet)."""
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split()[2] == "Z"


def tiny_cpu_server(tmp_path_factory, tmp_path, *args: str):
    """A ready ``engram serve tiny`` on the CPU (one thread); the ranks or stages ``args`` start are children of its
    engine process (``kill_a_child_mid_stream`` counts them)."""
    from engram.server.launcher import ServerProcess

    cache_dir = tmp_path_factory.getbasetemp() / "engram-cache"
    return ServerProcess(["tiny", "--threads", "1", "--device", "cpu", *args], cache_dir, tmp_path / "log").wait_ready()


def kill_a_child_mid_stream(server, prompts: list[str], children: int = 2) -> tuple[int, str, list[str], list[int]]:
    """``kill_mid_stream`` of the last of the ``children`` processes that ``server``'s engine process spawned -> (its
    exit status, its log, every stream's events, the pids of the engine process and its children)."""
    pids: list[int] = []

    def last_child() -> int:
        pids.extend(engine_processes(server.proc.pid))
        assert len(pids) == 1 + children, pids
        return pids[-1]

    return (*kill_mid_stream(server, prompts, last_child), pids)


def kill_mid_stream(server, prompts: list[str], victim: Callable[[], int]) -> tuple[int, str, list[str]]:
    """Stream one long greedy completion per prompt from ``server`` (a ServerProcess, ready), SIGKILL the process
    ``victim()`` names once the first event arrived, and wait for the server to exit (within 60 s, else the test
    fails) -> (its exit status, its log, every stream's events). The server is stopped whatever happens."""
    events: list[str] = []
    started = threading.Event()
    body = {"model": "tiny", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    threads = [threading.Thread(target=stream_completion, args=(server.url, {**body, "prompt": p}, events, started))
               for p in prompts]
    for t in threads:
        t.start()
    try:
        assert started.wait(120), server.log()
        os.kill(victim(), signal.SIGKILL)
        killed = time.monotonic()
        code = server.proc.wait(60)
        assert time.monotonic() - killed < 60
        for t in threads:
            t.join(60)
        return code, server.log(), events
    finally:
        server.stop()
