"""A real ``engram serve --data-parallel-size 2 --device cpu``: concurrent greedy completions (float64) equal one
engine's, /metrics counts both replicas' steps, and the startup log says which replica created each shared table;
a replica killed mid-stream fails the request in flight with an error event naming it, and the server exits with
status 4 within 60 s with no replica left running (never hangs)."""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import engram
from engram.commands.serve import EXIT_ENGINE_FAILED
from engram.server.launcher import ServerProcess, metric

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["hello world", "the tables are", "a b c d e f", "memory is cheap", "gate it", "two three four"]


@pytest.fixture
def shm(tmp_path):
    d = Path("/dev/shm") / f"engram-test-{os.getpid()}-{tmp_path.name}"
    d.mkdir()
    yield d
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def _replica_pids(server_pid: int) -> list[int]:
    """The spawned replica processes among the server's children (the resource tracker is not one)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    return sorted(p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())


def _serve(tmp_path_factory, tmp_path, shm: Path) -> ServerProcess:
    cache_dir = tmp_path_factory.getbasetemp() / "engram-cache"
    config = '{"advanced": {"shm_dir": "%s"}}' % shm
    return ServerProcess(["tiny", "--threads", "1", "--device", "cpu", "--dtype", "float64", "--tier", "host",
                          "--data-parallel-size", "2", "--engram-config", config, "--log-level", "info"],
                         cache_dir, tmp_path / "log")


def test_two_replicas_serve_one_engines_completions(tmp_path_factory, tmp_path, shm):
    one = engram.LLM("tiny", device="cpu", dtype="float64", tier="host")
    want = [o.outputs[0].text for o in one.generate(PROMPTS, engram.SamplingParams(temperature=0.0, max_tokens=10,
                                                                                     ignore_eos=True),
                                                    use_tqdm=False)]
    with _serve(tmp_path_factory, tmp_path, shm) as s:
        def complete(prompt: str) -> str:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert got == want
        assert len(_replica_pids(s.proc.pid)) == 2
        steps = httpx.get(s.url + "/engram/steps", timeout=30).json()
        assert sum(steps["stats"]["steps_by_kind"].values()) == len(steps["steps"]) > 0
        assert [r["pid"] for r in steps["stats"]["replicas"]] == _replica_pids(s.proc.pid)
        assert metric(s.url, "engram_num_requests_running") == 0
        log = s.log()
    layers = len(one.loaded.engram_config.layer_ids)
    assert log.count(" packed: created ") == layers and log.count(" packed: mapped (created by pid ") == layers, log
    assert "data-parallel replica 0" in log and "data-parallel replica 1" in log


def test_a_killed_replica_fails_requests_in_flight_and_the_server_exits(tmp_path_factory, tmp_path, shm):
    s = _serve(tmp_path_factory, tmp_path, shm).wait_ready()
    events: list[str] = []
    started = threading.Event()

    def consume(prompt: str) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1500, "ignore_eos": True, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
        except httpx.HTTPError as e:  # the server may close the connection as it exits
            events.append(f"closed: {e!r}")
        finally:
            started.set()

    threads = [threading.Thread(target=consume, args=(p,)) for p in ("a replica goes", "the other one stays")]
    for t in threads:
        t.start()
    try:
        assert started.wait(120), s.log()
        replicas = _replica_pids(s.proc.pid)
        assert len(replicas) == 2, replicas
        os.kill(replicas[-1], signal.SIGKILL)
        killed = time.monotonic()
        code = s.proc.wait(60)
        assert time.monotonic() - killed < 60
        for t in threads:
            t.join(60)
        log = s.log()
    finally:
        s.stop()
    assert code == EXIT_ENGINE_FAILED, log
    errors = [e for e in events if e.startswith('{"error"')]  # both streams end with an error event, not a length
    assert len(errors) == 2 and all("replica 1" in e and "exit code -9" in e for e in errors), events[-4:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "data-parallel replica 1" in log and "the engine stopped" in log, log[-2000:]
    for pid in replicas:  # no replica outlives the server
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
