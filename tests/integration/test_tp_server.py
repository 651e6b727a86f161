"""A real ``engram serve --tensor-parallel-size 2 --device cpu`` whose rank is killed mid-request: the request in
flight fails, the server logs which rank died and exits with status 4 within 60 s (never hangs)."""
from __future__ import annotations

import pytest

from engram.commands.serve import EXIT_ENGINE_FAILED
from tests.spawned import gone, kill_a_child_mid_stream, tiny_cpu_server

pytestmark = pytest.mark.timeout(600)


def test_a_killed_rank_fails_requests_in_flight_and_the_server_exits(tmp_path_factory, tmp_path):
    s = tiny_cpu_server(tmp_path_factory, tmp_path, "--tensor-parallel-size", "2")
    code, log, events, ranks = kill_a_child_mid_stream(s, ["a rank goes"])
    assert code == EXIT_ENGINE_FAILED, log
    errors = [e for e in events if e.startswith('{"error"')]  # the stream ends with an error event, not a length
    assert len(errors) == 1 and "exited with code -9" in errors[0] and '"code": 500' in errors[0], events[-3:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "exited with code -9" in log and "the engine stopped" in log, log[-2000:]
    assert all(gone(pid) for pid in ranks)  # no rank outlives the server
