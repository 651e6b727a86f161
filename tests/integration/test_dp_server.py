"""A real ``engram serve --data-parallel-size 2 --device cpu``: concurrent greedy completions (float64) equal one
engine's, /metrics counts both replicas' steps, and the startup log says which replica created each shared table;
the replicas are children of the server's engine process; a replica killed mid-stream fails the request in flight with
an error event naming it, and the server exits with status 4 within 60 s with neither a replica nor the engine process
left running (never hangs)."""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import httpx
import pytest

import engram
from engram.commands.serve import EXIT_ENGINE_FAILED
from engram.server.launcher import ServerProcess, metric
from tests.spawned import all_gone, engine_processes, kill_a_child_mid_stream

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["hello world", "the tables are", "a b c d e f", "memory is cheap", "gate it", "two three four"]


def _serve(tmp_path_factory, tmp_path, shm: Path) -> ServerProcess:
    cache_dir = tmp_path_factory.getbasetemp() / "engram-cache"
    config = '{"advanced": {"shm_dir": "%s"}}' % shm
    return ServerProcess(["tiny", "--threads", "1", "--device", "cpu", "--dtype", "float64", "--tier", "host",
                          "--data-parallel-size", "2", "--engram-config", config, "--log-level", "info"],
                         cache_dir, tmp_path / "log")


def test_two_replicas_serve_one_engines_completions(tmp_path_factory, tmp_path, shm_dir):
    shm = shm_dir
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
        engine, *replicas = engine_processes(s.proc.pid)
        assert len(replicas) == 2
        steps = httpx.get(s.url + "/engram/steps", timeout=30).json()
        assert sum(steps["stats"]["steps_by_kind"].values()) == len(steps["steps"]) > 0
        assert steps["stats"]["engine_loop"]["pid"] == engine
        assert [r["pid"] for r in steps["stats"]["replicas"]] == replicas
        assert metric(s.url, "engram_num_requests_running") == 0
        log = s.log()
    layers = len(one.loaded.engram_config.layer_ids)
    assert log.count(" packed: created ") == layers and log.count(" packed: mapped (created by pid ") == layers, log
    assert "data-parallel replica 0" in log and "data-parallel replica 1" in log


def test_a_killed_replica_fails_requests_in_flight_and_the_server_exits(tmp_path_factory, tmp_path, shm_dir):
    s = _serve(tmp_path_factory, tmp_path, shm_dir).wait_ready()
    code, log, events, replicas = kill_a_child_mid_stream(s, ["a replica goes", "the other one stays"])
    assert code == EXIT_ENGINE_FAILED, log
    # the streams that had begun end with an error event, never a length (one still connecting may only be closed)
    errors = [e for e in events if e.startswith('{"error"')]
    assert errors and all("replica 1" in e and "exit code -9" in e for e in errors), events[-4:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "data-parallel replica 1" in log and "the engine stopped" in log, log[-2000:]
    assert all_gone(replicas)  # neither a replica nor the engine process outlives the server
