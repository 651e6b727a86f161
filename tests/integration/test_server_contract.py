"""The request contract against a real `engram serve` subprocess (max_model_len 256): vLLM's context rule and
message for ``max_tokens``, ``null`` meaning the default, strict JSON types, ``stream_options`` only with
``stream``, finite sampling values, the message fields vLLM accepts, and token counters that include aborted
requests."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from engram.server.launcher import ServerProcess, metric

pytestmark = pytest.mark.timeout(600)
CONTEXT = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(["tiny", "--threads", "1", "--dtype", "float64", "--max-model-len", str(CONTEXT)],
                       tmp_path_factory.getbasetemp() / "engram-cache",
                       tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


def _post(server, body: dict | str, path: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps({"model": "tiny", **body})
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=120)


def _error(r: httpx.Response, param: str | None = None) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == 400 and (param is None or err["param"] == param), err
    return err["message"]


def _vllm(prompt: int, completion: int) -> str:
    return (f"This model's maximum context length is {CONTEXT} tokens. However, you requested {prompt + completion} "
            f"tokens ({prompt} in the messages, {completion} in the completion). Please reduce the length of the "
            "messages or completion.")


@pytest.mark.parametrize("prompt_len,max_tokens", [(2, 5000), (250, 16), (252, 5), (1, CONTEXT)])
def test_max_tokens_beyond_the_context_is_refused_with_vllms_message(server, prompt_len, max_tokens):
    body = {"prompt": [5] * prompt_len, "max_tokens": max_tokens}
    if max_tokens == 16:
        body.pop("max_tokens")  # the default counts as asked for, as in vLLM
    assert _error(_post(server, body), "prompt") == _vllm(prompt_len, max_tokens)


def test_max_tokens_that_fit_exactly_are_served_in_full(server):
    r = _post(server, {"prompt": [5] * 250, "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 250, "completion_tokens": 6, "total_tokens": 256}


def test_a_text_prompt_is_counted_in_tokens_and_named_in_a_list(server):
    msg = _error(_post(server, {"prompt": ["hi", "hi"], "max_tokens": 5000}), "prompt")
    assert msg.startswith("prompt[0]: This model's maximum context length is 256 tokens.") and \
        "5000 in the completion" in msg, msg


def test_null_max_tokens_is_the_default_16(server):
    for body in ({"max_tokens": None}, {}):
        r = _post(server, {"prompt": [5, 6, 7], "ignore_eos": True, **body})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_chat_without_max_tokens_may_generate_up_to_the_context(server):
    messages = [{"role": "user", "content": "Hi"}]
    for limit in ({}, {"max_tokens": None}):
        r = _post(server, {"messages": messages, "ignore_eos": True, "temperature": 0, **limit},
                  "/v1/chat/completions")
        assert r.status_code == 200, r.text
        usage, choice = r.json()["usage"], r.json()["choices"][0]
        assert usage["total_tokens"] == CONTEXT and choice["finish_reason"] == "length", usage
    prompt = usage["prompt_tokens"]
    for field in ("max_tokens", "max_completion_tokens"):
        r = _post(server, {"messages": messages, field: CONTEXT}, "/v1/chat/completions")
        assert _error(r, "messages") == _vllm(prompt, CONTEXT)


def test_a_prompt_that_fills_the_context_is_refused_with_vllms_message(server):
    msg = _error(_post(server, {"messages": [{"role": "user", "content": "word " * 400}]}, "/v1/chat/completions"),
                 "messages")
    assert msg.startswith("This model's maximum context length is 256 tokens. However, you requested ") and \
        msg.endswith(" tokens in the messages, Please reduce the length of the messages."), msg


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("max_tokens", 5.0), ("stream", "yes"), ("stream", 1), ("n", True), ("n", "2"),
    ("temperature", "0.5"), ("seed", "1"), ("ignore_eos", "false"), ("echo", 0), ("stop_token_ids", ["1"]),
])
def test_wrong_json_types_are_refused_not_coerced(server, field, value):
    r = _post(server, {"prompt": "hi", field: value})
    msg = _error(r)
    assert r.json()["error"]["param"].split(".")[0] == field and msg.startswith(field), msg


def test_an_integer_stands_for_a_float(server):
    assert _post(server, {"prompt": "hi", "max_tokens": 2, "temperature": 0, "top_p": 1}).status_code == 200


@pytest.mark.parametrize("body", ['{"model": "tiny", "prompt": "hi", "temperature": NaN}',
                                  '{"model": "tiny", "prompt": "hi", "top_p": NaN}',
                                  '{"model": "tiny", "prompt": "hi", "temperature": Infinity}'])
def test_non_finite_sampling_values_are_refused_as_such(server, body):
    msg = _error(_post(server, body))
    assert "finite number" in msg and "less than or equal" not in msg, msg


def test_stream_options_need_stream_true(server):
    options = {"include_usage": True}
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for stream in ({}, {"stream": False}):
            msg = _error(_post(server, {**body, "max_tokens": 2, "stream_options": options, **stream}, path),
                         "stream_options")
            assert "Stream options can only be defined when `stream=True`." in msg
        r = _post(server, {**body, "max_tokens": 2, "stream_options": options, "stream": True}, path)
        assert r.status_code == 200 and '"usage"' in r.text, r.text
        assert _post(server, {**body, "max_tokens": 2, "stream_options": {}}, path).status_code == 200  # as vLLM


def test_chat_messages_may_carry_a_name_and_a_tool_call_id(server):
    messages = [{"role": "system", "content": "Be brief.", "name": "rules"},
                {"role": "user", "content": "What is 2 + 2?", "name": "alice"},
                {"role": "assistant", "content": "Let me check."},
                {"role": "tool", "content": "4", "tool_call_id": "call_1"}]
    r = _post(server, {"messages": messages, "max_tokens": 3}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    r = _post(server, {"messages": [{"role": "user", "content": "hi", "nickname": "x"}]}, "/v1/chat/completions")
    assert r.status_code == 400 and "messages.0.nickname" in r.json()["error"]["message"], r.text


def test_token_counters_include_aborted_requests(server):
    before = (metric(server.url, "engram_prompt_tokens_total"), metric(server.url, "engram_generation_tokens_total"),
              metric(server.url, "engram_requests_total", 'finish_reason="abort"'))
    body = {"model": "tiny", "prompt": [5] * 40, "max_tokens": 200, "ignore_eos": True, "stream": True}
    received = 0
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1  # one chunk per step that had text: at most the tokens generated
                if received >= 20:
                    break  # the client leaves mid-stream: the request is aborted
    deadline = time.monotonic() + 30
    while metric(server.url, "engram_requests_total", 'finish_reason="abort"') == before[2]:
        assert time.monotonic() < deadline, "the abort was never counted"
        time.sleep(0.1)
    prompt = metric(server.url, "engram_prompt_tokens_total") - before[0]
    generated = metric(server.url, "engram_generation_tokens_total") - before[1]
    assert prompt == 40, prompt
    assert 20 <= generated < 200, generated
