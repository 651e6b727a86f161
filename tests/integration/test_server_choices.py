"""Logprobs, echo, lists of prompts and n > 1 against the real server in a subprocess, through the official
openai client (httpx for raw streams): OpenAI's legacy completions logprobs and chat logprobs shapes and their
consistency with greedy decoding and with each other, the lm-eval loglikelihood path (echo + logprobs +
max_tokens 0) on text and token-id prompts, seeds per choice (seed + j), prompt-major choice indices, streams
that reassemble to the non-streaming body, usage counts, and a disconnect that aborts every choice."""
from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from engram.model.presets import TOKENIZER_FILE
from engram.server.launcher import ServerProcess, metric

pytestmark = pytest.mark.timeout(300)

PROMPT = "The table rows are"
TOKENIZER = Tokenizer.from_file(str(TOKENIZER_FILE))  # the presets' tokenizer
MAX_NUM_SEQS, MAX_WAITING = 4, 4  # capacity 8: a response of more choices is refused


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    with ServerProcess(["tiny", "--threads", "1", "--dtype", "float64", "--max-num-seqs", str(MAX_NUM_SEQS),
                       "--max-waiting", str(MAX_WAITING)], cache, tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    """The JSON chunks of an SSE stream (which must end with [DONE])."""
    with httpx.stream("POST", url + path, json={"model": "tiny", **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        payloads = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def _check_legacy(lp, text: str, k: int, greedy: bool) -> None:
    """OpenAI's legacy logprobs: parallel lists, logprobs <= 0, k alternatives each, offsets into ``text``."""
    n = len(lp.tokens)
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i, (tok, own, top, at) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)):
        if own is None:  # only the first prompt token, which nothing predicts
            assert i == 0 and top is None
            continue
        assert own <= 0 and len(top) == k and all(v <= 0 for v in top.values())
        if greedy and k:
            best = max(top, key=top.get)
            assert best == tok and top[best] == pytest.approx(own, abs=1e-6)
        if not tok.startswith("bytes:"):
            assert text[at:at + len(tok)] == tok, (i, tok, text[at:])


def test_completion_logprobs_shape_and_greedy_consistency(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert len(c.logprobs.tokens) == 6 == r.usage.completion_tokens
    assert None not in c.logprobs.token_logprobs  # no echo: every token was generated, so scored
    _check_legacy(c.logprobs, c.text, 3, greedy=True)
    assert "".join(c.logprobs.tokens) == c.text
    zero = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True}).choices[0]
    assert zero.text == c.text and zero.logprobs.top_logprobs == [{}] * 6
    assert zero.logprobs.token_logprobs == c.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs" and "20" in e.value.body["message"]


def test_echo_max_tokens_0_scores_the_prompt_alike_for_text_and_token_ids(client):
    ids = TOKENIZER.encode(PROMPT).ids
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = text.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and text.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == len(ids) == text.usage.prompt_tokens
    _check_legacy(c.logprobs, c.text, 1, greedy=False)
    # the same prompt as token ids, twice in one request: the same text, tokens and logprobs
    batch = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=0, echo=True, logprobs=1)
    assert [b.index for b in batch.choices] == [0, 1] and batch.usage.prompt_tokens == 2 * len(ids)
    for b in batch.choices:
        assert b.text == PROMPT and b.logprobs.tokens == c.logprobs.tokens
        assert math.fsum(b.logprobs.token_logprobs[1:]) == math.fsum(c.logprobs.token_logprobs[1:])
    # lm-eval's request (one generated token after the echo) scores the prompt the same way
    lm_eval = client.completions.create(model="tiny", prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                        logprobs=1, extra_body={"ignore_eos": True}).choices[0]
    assert lm_eval.logprobs.token_logprobs[:len(ids)] == c.logprobs.token_logprobs
    # a generated token's logprob is the one the prompt scoring gives it once it is part of the prompt
    gen = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True}).choices[0]
    assert lm_eval.logprobs.token_logprobs[-1] == gen.logprobs.token_logprobs[0]
    longer = client.completions.create(model="tiny", prompt=ids + TOKENIZER.encode(gen.text).ids, max_tokens=0,
                                       echo=True, logprobs=1).choices[0]
    assert longer.logprobs.token_logprobs[-1] == pytest.approx(gen.logprobs.token_logprobs[0], abs=1e-5)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]


def test_n_with_seed_is_reproducible_and_choice_j_uses_seed_plus_j(client):
    def texts(**kw):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                      extra_body={"ignore_eos": True}, **kw)
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)], r.usage

    three, usage = texts(n=3, seed=11)
    assert texts(n=3, seed=11)[0] == three  # the whole response repeats
    assert len(set(three)) > 1  # the choices are independent samples
    assert texts(seed=12)[0] == [three[1]]  # choice j samples with seed + j
    single = texts(seed=11)[1]
    assert usage.prompt_tokens == single.prompt_tokens and usage.completion_tokens == 3 * 8  # prompt counted once


def test_list_of_prompts_times_n_numbers_choices_prompt_major(client):
    prompts = ["Rows of a table", "Memory"]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert by_index[2 * p] == by_index[2 * p + 1] == alone.choices[0].text
    assert r.usage.prompt_tokens == sum(len(TOKENIZER.encode(p).ids) for p in prompts)  # once per prompt
    assert r.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as e:  # 3 x 3 choices > max_num_seqs + max_waiting
        client.completions.create(model="tiny", prompt=["a", "b", "c"], n=3, max_tokens=2)
    assert e.value.body["param"] == "n" and str(MAX_NUM_SEQS + MAX_WAITING) in e.value.body["message"]
    for bad, needle in ((["a", ""], "prompt[1] is empty"),
                        (["a", "x " * 5000], "prompt[1]: This model's maximum context length is")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=bad, max_tokens=2)
        assert e.value.body["param"] == "prompt" and needle in e.value.body["message"]


@pytest.mark.parametrize("max_tokens", [6, 0])
def test_streamed_choices_reassemble_to_the_body(server, max_tokens):
    body = {"prompt": [TOKENIZER.encode(PROMPT).ids, [5, 6, 7]], "n": 2, "max_tokens": max_tokens,
            "temperature": 1.0, "seed": 3, "logprobs": 2, "echo": True, "ignore_eos": True}
    full = _post(server.url, "/v1/completions", body)
    assert full["usage"]["completion_tokens"] == 4 * max_tokens
    chunks = _stream(server.url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"] == full["usage"] and chunks[-1]["choices"] == []
    pieces = [c["choices"][0] for c in chunks[:-1]]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    for want in full["choices"]:
        mine = [p for p in pieces if p["index"] == want["index"]]
        assert "".join(p["text"] for p in mine) == want["text"]
        assert mine[-1]["finish_reason"] == want["finish_reason"] == "length"
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for p in mine for x in p["logprobs"][key]] == want["logprobs"][key], key
    if max_tokens:
        assert len({c["text"] for c in full["choices"][:2]}) == 2  # the seeded choices differ
    else:
        assert [c["text"] for c in full["choices"]] == [PROMPT, PROMPT] + [TOKENIZER.decode([5, 6, 7])] * 2


def test_chat_logprobs_and_n(server, client):
    msgs = [{"role": "user", "content": "What is a table?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0, n=2,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 10
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 5 and "".join(t.token for t in content) == c.message.content
        for t in content:
            assert t.logprob <= 0 and t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
            assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    body = {"messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}
    chunks = _stream(server.url, "/v1/chat/completions", body)
    streamed = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert streamed == _post(server.url, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_disconnect_aborts_every_choice(server):
    aborted = metric(server.url, "engram_requests_total", 'finish_reason="abort"')
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"model": "tiny", "prompt": ["one", "two"], "n": 2, "max_tokens": 2000, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(6))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and metric(server.url, "engram_requests_total",
                                                 'finish_reason="abort"') < aborted + 4:
        time.sleep(0.2)
    assert metric(server.url, "engram_requests_total", 'finish_reason="abort"') == aborted + 4
    while time.monotonic() < deadline and metric(server.url, "engram_num_requests_running") > 0:
        time.sleep(0.2)
    assert metric(server.url, "engram_num_requests_running") == 0
