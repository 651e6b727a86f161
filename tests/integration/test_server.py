"""The real server in a subprocess, over HTTP (httpx and the openai client): bodies, streaming, chat,
cancellation, concurrency equal to LLM.generate in float64, and every bad input -> 4xx
OpenAI error body."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from engram.server.launcher import ServerProcess, metric

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "engram-cache"


@pytest.fixture(scope="module")
def server(cache_dir, tmp_path_factory):
    with ServerProcess(["tiny", "--threads", "1", "--dtype", "float64", "--max-num-seqs", "32"], cache_dir,
                      tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


def _complete(url, **body):
    body = {"model": "tiny", "prompt": "The table rows are", "max_tokens": 12, "temperature": 0, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = httpx.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"


def test_completion_body_and_usage(server):
    r = _complete(server.url, max_tokens=7, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    assert body["usage"]["completion_tokens"] == 7
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 7 and body["usage"]["prompt_tokens"] > 0


def test_streaming_chunks_concatenate_to_non_streaming_text(server):
    full = _complete(server.url, max_tokens=20, ignore_eos=True).json()["choices"][0]["text"]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "The table rows are", "max_tokens": 20, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 20


def test_chat_plain_and_streaming_with_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a table?"}]
    resp = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    text = resp.choices[0].message.content
    assert resp.choices[0].message.role == "assistant" and resp.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == text
    comp = client.completions.create(model="tiny", prompt="Rows", max_tokens=5, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length")


def test_32_concurrent_requests_equal_llm_generate_float64(server, cache_dir):
    import engram

    prompts = [f"Request {i}: the memory of " + "tables " * (i % 5) for i in range(32)]
    lens = [4 + (i * 7) % 21 for i in range(32)]

    async def one(client, p, n):
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": n,
                                                         "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lens)))

    served = asyncio.run(all_of_them())
    llm = engram.LLM(model="tiny", dtype="float64", cache_dir=str(cache_dir))
    ref = llm.generate(prompts, [engram.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens],
                       use_tqdm=False)
    assert served == [o.outputs[0].text for o in ref]


def _err(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and err["code"] == status and "type" in err
    return err


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": 17}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "n": 129}, 400, "n"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
    ({"prompt": "x " * 5000}, 400, "maximum context length is 2048 tokens"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
])
def test_bad_completion_requests(server, body, status, needle):
    body = {"model": "tiny", **body}
    err = _err(httpx.post(server.url + "/v1/completions", json=body, timeout=60), status)
    assert needle in err["message"]


def test_invalid_json_bad_chat_and_unknown_route(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert "JSON" in _err(r, 400)["message"]
    _err(httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []}), 400)
    _err(httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "wizard",
                                                                                              "content": "hi"}]}), 400)
    _err(httpx.get(server.url + "/v1/nothing"), 404)
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_client_disconnect_cancels_and_frees_the_sequence(server):
    aborted = metric(server.url, "engram_requests_total", 'finish_reason="abort"')
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": "A long one", "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric(server.url, "engram_requests_total", 'finish_reason="abort"') == aborted + 1 and \
                metric(server.url, "engram_num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert metric(server.url, "engram_requests_total", 'finish_reason="abort"') == aborted + 1
    # the freed sequence does not linger: a new request still runs and the running gauge drops back to 0
    assert _complete(server.url, max_tokens=2).status_code == 200
    assert metric(server.url, "engram_num_requests_running") == 0


def test_metrics_are_engram_prefixed(server):
    _complete(server.url, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert names and all(n.startswith("engram_") for n in names)
    for needed in ("engram_time_to_first_token_seconds_bucket", "engram_time_per_output_token_seconds_bucket",
                   "engram_num_requests_waiting", "engram_kv_cache_usage_ratio", "engram_table_rows_total",
                   "engram_table_bytes_read_total", "engram_table_hits_total", "engram_table_misses_total",
                   "engram_lookup_exposed_seconds_total"):
        assert needed in names, needed
    assert metric(server.url, "engram_table_rows_total", 'layer="1",tier="gpu"') > 0
