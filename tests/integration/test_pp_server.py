"""A real ``engram serve --pipeline-parallel-size 2 --device cpu`` whose last stage is killed mid-request: the request in
flight fails, the server logs which rank died and exits with status 4 within 60 s (never hangs), no stage left."""
from __future__ import annotations

import pytest

from engram.commands.serve import EXIT_ENGINE_FAILED
from tests.spawned import all_gone, kill_a_child_mid_stream, tiny_cpu_server

pytestmark = pytest.mark.timeout(600)


def test_a_killed_stage_fails_requests_in_flight_and_the_server_exits(tmp_path_factory, tmp_path):
    s = tiny_cpu_server(tmp_path_factory, tmp_path, "--pipeline-parallel-size", "2")
    code, log, events, ranks = kill_a_child_mid_stream(s, ["a stage goes", "and the other microbatch"])
    assert code == EXIT_ENGINE_FAILED, log
    # the streams that had begun end with an error event, never a length (one still connecting may only be closed)
    errors = [e for e in events if e.startswith('{"error"')]
    assert errors and all("exited with code -9" in e and '"code": 500' in e for e in errors), events[-3:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "rank 1 (pid" in log and "exited with code -9" in log and "the engine stopped" in log, log[-2000:]
    assert all_gone(ranks)  # neither a stage nor the engine process outlives the server
