"""`engram serve --tensor-parallel-size 2 --engine-loop process`: the engine process starts the TP ranks as its own
children. A greedy float64 completion equals LLM.generate at TP 1; a rank killed mid-stream fails the stream in flight
and the server exits with status 4 within 60 s, and neither the ranks nor the engine process outlive it."""
from __future__ import annotations

import time

import httpx
import pytest

from engram.commands.serve import EXIT_ENGINE_FAILED
from engram.server.launcher import ServerProcess
from tests.spawned import gone, kill_mid_stream, spawned_children

pytestmark = pytest.mark.timeout(600)


def test_tp_ranks_under_the_engine_process_serve_and_a_killed_rank_stops_the_server(tmp_path_factory, tmp_path):
    import engram

    cache_dir = tmp_path_factory.getbasetemp() / "engram-cache"
    s = ServerProcess(["tiny", "--threads", "1", "--device", "cpu", "--dtype", "float64", "--tensor-parallel-size", "2",
                       "--engine-loop", "process"], cache_dir, tmp_path / "log").wait_ready()
    pids: list[int] = []

    def a_rank() -> int:
        body = {"model": "tiny", "prompt": "Ranks of the table", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        served = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        ref = engram.LLM(model="tiny", dtype="float64", cache_dir=str(cache_dir)).generate(
            ["Ranks of the table"], engram.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
            use_tqdm=False)
        assert served == ref[0].outputs[0].text
        engine = httpx.get(s.url + "/engram/steps", timeout=60).json()["stats"]["engine_loop"]["pid"]
        assert spawned_children(s.proc.pid) == [engine]
        pids.extend([engine, *spawned_children(engine)])
        assert len(pids) == 3, pids
        return pids[-1]

    code, log, events = kill_mid_stream(s, ["A stream over two ranks"], a_rank)
    assert code == EXIT_ENGINE_FAILED, log
    errors = [e for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and "exited with code -9" in errors[0] and '"code": 500' in errors[0], events[-3:]
    assert "the engine stopped" in log, log[-2000:]
    deadline = time.monotonic() + 30
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(p) for p in pids)  # neither the engine process nor a rank outlives the server
