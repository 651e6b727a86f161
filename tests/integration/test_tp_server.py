"""A real ``engram serve --tensor-parallel-size 2 --device cpu``: its engine process starts the TP ranks as its own
children. A greedy float64 completion equals LLM.generate at TP 1; a rank killed mid-stream fails the stream in flight
with an error naming its exit code, the server logs which rank died and exits with status 4 within 60 s (never
hangs), and neither the ranks nor the engine process outlive it."""
from __future__ import annotations

import httpx
import pytest

import engram
from engram.commands.serve import EXIT_ENGINE_FAILED
from tests.spawned import all_gone, engine_processes, kill_mid_stream, tiny_cpu_server

pytestmark = pytest.mark.timeout(600)

PROMPT = "Ranks of the table"


def test_tp_ranks_serve_tp1_completions_and_a_killed_rank_stops_the_server(tmp_path_factory, tmp_path):
    s = tiny_cpu_server(tmp_path_factory, tmp_path, "--dtype", "float64", "--tensor-parallel-size", "2")
    pids: list[int] = []

    def a_rank() -> int:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        served = httpx.post(s.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        ref = engram.LLM(model="tiny", device="cpu", dtype="float64",
                         cache_dir=str(tmp_path_factory.getbasetemp() / "engram-cache")).generate(
            [PROMPT], engram.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert served == ref[0].outputs[0].text
        pids.extend(engine_processes(s.proc.pid))
        engine = httpx.get(s.url + "/engram/steps", timeout=60).json()["stats"]["engine_loop"]["pid"]
        assert pids[0] == engine and len(pids) == 3, (engine, pids)
        return pids[-1]

    code, log, events = kill_mid_stream(s, ["a rank goes"], a_rank)
    assert code == EXIT_ENGINE_FAILED, log
    errors = [e for e in events if e.startswith('{"error"')]  # the stream ends with an error event, not a length
    assert len(errors) == 1 and "exited with code -9" in errors[0] and '"code": 500' in errors[0], events[-3:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "exited with code -9" in log and "the engine stopped" in log, log[-2000:]
    assert all_gone(pids)  # neither a rank nor the engine process outlives the server
