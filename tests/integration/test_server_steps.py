"""``GET /engram/steps`` of a real ``engram serve`` (tiny, CPU): after two completions it returns one record per
collected step in step order, in the documented columns, with totals that add up to the prompts and outputs, and
``since`` returns only later steps; right after each completion returns, its steps are already in the trace (the
API process files a step's records before it delivers the step's tokens)."""
from __future__ import annotations

import httpx

from engram.engine.step_trace import FIELDS, StepTrace
from engram.server.launcher import ServerProcess


def test_steps_endpoint_records_every_step(tmp_path):
    server = ServerProcess(["tiny", "--device", "cpu"], None, tmp_path / "server.log")
    url = server.wait_ready().url
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for prompt in ([5, 6, 7, 8, 9], [11, 12]):
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                    "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
            body = c.get("/engram/steps").json()
            assert body["fields"] == list(FIELDS)
            steps = StepTrace.from_json(body)
            assert [s.step_id for s in steps] == sorted(s.step_id for s in steps)
            assert sum(s.num_tokens for s in steps) == 5 + 2 + 2 * 3  # prompts, then 3 fed-back tokens each
            assert sum(s.sampled for s in steps) == 2 * 4
            assert all(s.route == "eager" and s.gpu_s is None for s in steps)
            assert body["stats"]["steps_by_route"] == {"eager": len(steps)}
            later = StepTrace.from_json(c.get("/engram/steps", params={"since": steps[1].step_id}).json())
            assert [s.step_id for s in later] == [s.step_id for s in steps[2:]]
            for k in range(1, 13):  # every response's last step is in the trace when the response is read
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 2,
                                                    "ignore_eos": True, "temperature": 0})
                assert r.status_code == 200, r.text
                now = StepTrace.from_json(c.get("/engram/steps").json())
                assert sum(s.sampled for s in now) == 2 * 4 + 2 * k, k
    finally:
        server.stop()
