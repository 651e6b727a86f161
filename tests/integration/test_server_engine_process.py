"""`engram serve` runs the engine in a spawned process of its own, the API process detokenizing, matching stop strings
and framing SSE (the routes' behaviour: test_server.py): stop strings found in the API process give what the engine
gives matching them itself (float64, concurrent, against LLM.generate), the loop's host times and the engine process's
pid in ``GET /engram/steps``, and a killed engine process fails the stream in flight, after which the server exits
with status 4 in bounded time."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from engram.commands.serve import EXIT_ENGINE_FAILED
from engram.server.launcher import ServerProcess
from tests.spawned import gone, kill_mid_stream

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "engram-cache"


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    with ServerProcess(["tiny", "--threads", "1", "--dtype", "float64", "--max-num-seqs", "32"], cache_dir,
                       tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


def test_stop_strings_matched_in_the_api_process_equal_the_engines(server, cache_dir):
    import engram

    prompts = [f"Stop {i}: the rows of " + "memory " * (i % 4) for i in range(12)]
    llm = engram.LLM(model="tiny", dtype="float64", cache_dir=str(cache_dir))
    free = llm.generate(prompts, engram.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    cases = []  # (prompt, stop strings cut from its own free-running text, logprobs)
    for i, (p, out) in enumerate(zip(prompts, free)):
        text = out.outputs[0].text
        stop = [text[6 + i % 5: 9 + i % 5]] if i % 3 else [text[-3:], "\u00e9\u00e9 never matched"]
        cases.append((p, stop, 1 if i % 4 else None))

    async def one(client, p, stop, logprobs):
        body = {"model": "tiny", "prompt": p, "temperature": 0, "ignore_eos": True, "max_tokens": 24, "stop": stop,
                **({"logprobs": logprobs} if logprobs is not None else {})}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"], c["finish_reason"], c["stop_reason"], (c["logprobs"] or {}).get("tokens")

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, *case) for case in cases))

    served = asyncio.run(all_of_them())
    ref = llm.generate([p for p, _, _ in cases],
                       [engram.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, logprobs=k)
                        for _, stop, k in cases], use_tqdm=False)
    assert [s[:3] for s in served] == [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                                       for o in ref]
    assert sum(1 for s in served if s[1] == "stop") >= 8  # the stops were hit, not run past
    for (_, _, k), s, o in zip(cases, served, ref):  # logprobs end at the stop too
        assert (s[3] is None) == (k is None) and (k is None or len(s[3]) == len(o.outputs[0].token_ids))


def test_steps_report_the_engine_process_and_its_loop_times(server):
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                         "ignore_eos": True}, timeout=60)
    assert r.status_code == 200
    body = httpx.get(server.url + "/engram/steps", timeout=60).json()
    loop = body["stats"]["engine_loop"]
    assert loop["pid"] != server.proc.pid and loop["tid"] == loop["pid"]
    assert loop["steps"] >= len(body["steps"]) >= 3 and 0 < loop["step_cpu_s"] <= loop["loop_cpu_s"]
    assert body["stats"]["steps"] >= 3 and open(f"/proc/{loop['pid']}/cmdline", "rb").read().find(b"spawn") >= 0


def test_a_killed_engine_process_fails_the_stream_and_the_server_exits_4(cache_dir, tmp_path):
    s = ServerProcess(["tiny", "--threads", "1"], cache_dir, tmp_path / "log").wait_ready()
    pid = None

    def engine_pid() -> int:
        nonlocal pid
        pid = httpx.get(s.url + "/engram/steps", timeout=60).json()["stats"]["engine_loop"]["pid"]
        return pid

    code, log, events = kill_mid_stream(s, ["A stream in flight"], engine_pid)
    assert code == EXIT_ENGINE_FAILED, log
    errors = [e for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and f"pid {pid}, exit code -9" in errors[0] and '"code": 500' in errors[0], events[-3:]
    assert not any('"finish_reason": "length"' in e for e in events)
    assert "the engine stopped" in log and gone(pid), log[-2000:]
