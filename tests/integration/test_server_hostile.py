"""What a hostile (or careless) client sends, against the real server in a subprocess over real HTTP and the
official openai client: every such request is refused with a 4xx naming the field or the limit, counted in
engram_requests_rejected_total{reason}, and never fails, stalls or bloats the requests running beside it."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from engram.server import DEFAULT_MAX_REQUEST_BYTES
from engram.server.launcher import ServerProcess, metric
from engram.server.protocol import MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    with ServerProcess(["tiny", "--threads", "1", "--dtype", "float64"], cache,
                      tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _post(url, body: dict | bytes, path="/v1/completions"):
    if isinstance(body, dict):
        body = json.dumps({"model": "tiny", **body}).encode()
    return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=120)


def _err(r, status: int, needle: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and needle in err["message"], err
    return err


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class _Stream(threading.Thread):
    """A long greedy stream running beside the hostile requests; records when each chunk arrived."""

    def __init__(self, url: str, max_tokens: int = 400):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.times, self.text, self.started = url, max_tokens, [], "", threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "A stream beside", "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.monotonic())
                    self.text += json.loads(line[6:])["choices"][0]["text"]
                    self.started.set()

    def max_gap(self) -> float:
        return max(b - a for a, b in zip(self.times, self.times[1:]))


def test_huge_bodies_and_prompts_are_refused_fast_without_stalling_or_growing_the_server(server):
    quiet = _Stream(server.url)
    quiet.start()
    assert quiet.started.wait(60)
    quiet.join(300)  # the same stream alone: its text and its pace without hostile neighbours
    stream = _Stream(server.url)
    stream.start()
    assert stream.started.wait(60)
    rss = _rss_kib(server.proc.pid)
    too_large = metric(server.url, "engram_requests_rejected_total", 'reason="too_large"')

    t0 = time.monotonic()  # 50 MB: refused before it is read or parsed
    _err(_post(server.url, {"prompt": "x" * 50_000_000}), 413, str(DEFAULT_MAX_REQUEST_BYTES))
    t1 = time.monotonic()  # just under the body limit: refused by its length before tokenizing
    _err(_post(server.url, {"prompt": "words " * 600_000}), 400, "max_model_len")
    t2 = time.monotonic()  # within the characters bound, over max_model_len once tokenized (in a worker thread)
    _err(_post(server.url, {"prompt": "\u00e9\u4e2d" * 20_000}), 400, "maximum context length is 2048 tokens")
    t3 = time.monotonic()
    _err(_post(server.url, {"prompt": list(range(5, 105)) * 5_000}), 400,  # token ids
         "However, you requested 500016 tokens (500000 in the messages, 16 in the completion)")
    _err(_post(server.url, {"messages": [{"role": "user", "content": "words " * 600_000}]}, "/v1/chat/completions"),
         400, "max_model_len")
    assert t1 - t0 < 20 and t2 - t1 < 10 and t3 - t2 < 10, (t1 - t0, t2 - t1, t3 - t2)
    # a chunked body (no Content-Length) is cut off at the limit as well
    chunks = (b'{"model": "tiny", "prompt": "' + b"y" * 1_000_000 for _ in range(8))
    r = httpx.post(server.url + "/v1/completions", content=chunks, headers={"Content-Type": "application/json"},
                   timeout=120)
    _err(r, 413, "--max-request-bytes")
    assert metric(server.url, "engram_requests_rejected_total", 'reason="too_large"') == too_large + 2

    stream.join(300)
    assert _rss_kib(server.proc.pid) - rss < 256 * 1024, "the server kept the hostile bodies"
    assert stream.text == quiet.text and len(stream.times) == len(quiet.times)  # not failed, not altered
    assert stream.max_gap() < max(3.0, 10 * quiet.max_gap()), (stream.max_gap(), quiet.max_gap())  # not stalled


def test_request_body_limit_is_an_option(tmp_path_factory, tmp_path):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    s = ServerProcess(["tiny", "--threads", "1", "--max-request-bytes", "1000"], cache, tmp_path / "log").wait_ready()
    try:
        assert _post(s.url, {"prompt": "fits", "max_tokens": 2}).status_code == 200
        _err(_post(s.url, {"prompt": "z" * 1000, "max_tokens": 2}), 413, "limit of 1000 bytes")
    finally:
        s.stop()


def test_seed_beyond_int64_is_a_400_and_the_requests_beside_it_run(server, client):
    async def batch():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            good = [c.post("/v1/completions", json={"model": "tiny", "prompt": f"seeded {i}", "max_tokens": 6,
                                                    "seed": seed, "ignore_eos": True})
                    for i, seed in enumerate([0, 2**63 - 1, -(2**63), 7])]
            bad = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "seed": 2**70, "max_tokens": 6})
            return await asyncio.gather(bad, *good)

    bad, *good = asyncio.run(batch())
    assert _err(bad, 400, "seed")["param"] == "seed"
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6 for r in good), \
        [r.text for r in good]
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, seed=-(2**63) - 1)
    with pytest.raises(openai.BadRequestError, match="seed"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], seed=2**64)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["\\udfff"]}', "prompt"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
     "messages.0.content"),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param):
    err = _err(_post(server.url, body, path), 400, "surrogate")
    assert err["param"].startswith(param), err


def test_malformed_bodies_are_400(server):
    _err(_post(server.url, b'{"model": "tiny", "prompt": "\xff\xfe"}'), 400, "")
    _err(_post(server.url, b'{"\\ud800": 1, "prompt": "x"}'), 400, "")  # the error repeats nothing unencodable
    _err(_post(server.url, b'[1, 2]'), 400, "")


@pytest.mark.parametrize("extra,param,needle", [
    ({"stop": [f"s{i}" for i in range(MAX_STOP + 1)]}, "stop", f"at most {MAX_STOP}"),
    ({"stop": "q" * (MAX_STOP_CHARS + 1)}, "stop", f"at most {MAX_STOP_CHARS} are allowed"),
    ({"stop": ["ok", ""]}, "stop", "empty"),
    ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids", str(MAX_STOP_TOKEN_IDS)),
    ({"stop_token_ids": [3, 4096]}, "stop_token_ids", "stop_token_ids[1]=4096 is outside the vocabulary"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids[0]=-1"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids", "stop_token_ids"),
    ({"max_tokens": 2**70}, "max_tokens", "max_tokens"),
    ({"top_k": 2**70}, "top_k", "top_k"),
])
def test_stop_conditions_and_integers_are_bounded(server, extra, param, needle):
    err = _err(_post(server.url, {"prompt": "x", "max_tokens": 2, **extra}), 400, needle)
    assert err["param"] == param


def test_bounded_stop_conditions_at_the_limit_run(server):
    r = _post(server.url, {"prompt": "x", "max_tokens": 3, "stop": ["s" * MAX_STOP_CHARS] * MAX_STOP,
                           "stop_token_ids": [4095] * MAX_STOP_TOKEN_IDS})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kwargs,param", [
    ({"best_of": 2}, "best_of"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"suffix": " the end"}, "suffix"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
])
def test_unsupported_completion_fields_are_400_with_the_openai_client(server, client, kwargs, param):
    before = metric(server.url, "engram_requests_rejected_total", 'reason="unsupported"')
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == param and param in e.value.body["message"]
    assert metric(server.url, "engram_requests_rejected_total", 'reason="unsupported"') == before + 1


@pytest.mark.parametrize("kwargs,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"5": -100}}, "logit_bias"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"store": True}, "store"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"extra_body": {"min_p": 0.1}}, "min_p"),
])
def test_unsupported_chat_fields_are_400_with_the_openai_client(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       **kwargs)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_unsupported_message_parts_are_400(client):
    with pytest.raises(openai.BadRequestError, match="messages.0.audio"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x", "audio": {}}])
    with pytest.raises(openai.BadRequestError, match="messages.0.content"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_no_op_values_of_unsupported_fields_are_accepted(client):
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0, logprobs=False,
        presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}, n=1,
        user="u", metadata={"k": "v"}, store=False, parallel_tool_calls=False)
    assert chat.choices[0].finish_reason in ("stop", "length")
    comp = client.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=1, presence_penalty=0,
                                     frequency_penalty=0, suffix=None, logprobs=None)
    assert comp.choices[0].finish_reason in ("stop", "length")


def test_model_by_id(server, client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.models.retrieve("gpt-9")
    _err(httpx.get(server.url + "/v1/models/org/name"), 404, "org/name")


def test_every_4xx_is_counted_by_reason(server):
    def counts():
        return {k: metric(server.url, "engram_requests_rejected_total", f'reason="{k}"')
                for k in ("invalid", "unsupported", "not_found", "too_large")}

    before = counts()
    _err(_post(server.url, {"prompt": "x", "max_tokens": 0}), 400, "max_tokens")  # bad value
    _err(_post(server.url, b"{nope"), 400, "JSON")  # not JSON
    _err(_post(server.url, {"prompt": "x", "model": "other"}), 404, "other")  # unknown model
    _err(httpx.get(server.url + "/v1/nothing"), 404, "Not Found")  # unknown route
    _err(httpx.get(server.url + "/v1/completions"), 405, "Method Not Allowed")
    _err(_post(server.url, {"prompt": "x", "frobnicate": 1}), 400, "frobnicate")  # unknown field
    _err(_post(server.url, {"prompt": "x", "logit_bias": {"1": 1}}), 400, "logit_bias")  # unimplemented field
    _err(_post(server.url, {"prompt": "x" * (DEFAULT_MAX_REQUEST_BYTES + 1)}), 413, "limit")
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"invalid": 3, "unsupported": 2, "not_found": 2,
                                                         "too_large": 1}
