"""``return_tokens_as_token_ids`` (vLLM's request field) against the real server, through the official openai client
(``extra_body``), streaming and not: completions and chat logprobs name each token ``token_id:N``, N the id the plain
request's token string belongs to; logprobs, text, offsets and bytes stay those of the plain request; echoed prompt
tokens are the ids sent; a value that is not a boolean is refused."""
from __future__ import annotations

import re

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from engram.model.presets import TOKENIZER_FILE
from engram.server.launcher import ServerProcess
from engram.server.logprobs import TokenStrings

pytestmark = pytest.mark.timeout(300)

PROMPT = "The table rows are"
TOKENIZER = Tokenizer.from_file(str(TOKENIZER_FILE))
STRINGS = TokenStrings(TOKENIZER)
AS_IDS = {"return_tokens_as_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "engram-cache"
    with ServerProcess(["tiny", "--threads", "1", "--device", "cpu", "--max-num-seqs", "4"], cache,
                       tmp_path_factory.mktemp("srv") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def ids_of(tokens: list[str]) -> list[int]:
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens), tokens
    return [int(t.split(":")[1]) for t in tokens]


def test_completion_logprobs_name_token_ids_streaming_and_not(client):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    plain = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0]
    got = client.completions.create(**args, extra_body=AS_IDS).choices[0]
    ids = ids_of(got.logprobs.tokens)
    assert got.text == plain.text and TOKENIZER.decode(ids) == plain.text
    assert [STRINGS.text(i) for i in ids] == plain.logprobs.tokens  # the plain strings belong to these ids
    assert got.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert got.logprobs.text_offset == plain.logprobs.text_offset  # offsets still index the text
    for mine, theirs in zip(got.logprobs.top_logprobs, plain.logprobs.top_logprobs, strict=True):
        assert [STRINGS.text(i) for i in ids_of(list(mine))] == list(theirs)
        assert list(mine.values()) == list(theirs.values())
    stream = client.completions.create(**args, stream=True, extra_body=AS_IDS)
    pieces = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == got.logprobs.tokens
    assert [x for p in pieces for x in p.token_logprobs] == got.logprobs.token_logprobs
    assert [x for p in pieces for x in p.top_logprobs] == got.logprobs.top_logprobs
    off = client.completions.create(**args, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False})
    assert off.choices[0].logprobs.tokens == plain.logprobs.tokens


def test_echoed_prompt_tokens_are_the_ids_sent(client):
    sent = TOKENIZER.encode(PROMPT).ids + [5, 6, 7]
    r = client.completions.create(model="tiny", prompt=sent, max_tokens=0, echo=True, logprobs=1, extra_body=AS_IDS)
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{i}" for i in sent] and lp.token_logprobs[0] is None
    two = client.completions.create(model="tiny", prompt=sent, max_tokens=2, echo=True, logprobs=1, temperature=0,
                                    extra_body=AS_IDS).choices[0].logprobs
    assert ids_of(two.tokens)[:len(sent)] == sent and len(two.tokens) == len(sent) + 2


def test_chat_logprobs_name_token_ids_streaming_and_not(client):
    msgs = [{"role": "user", "content": "What is a table?"}]
    args = dict(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**args, extra_body={"ignore_eos": True}).choices[0]
    got = client.chat.completions.create(**args, extra_body=AS_IDS).choices[0]
    assert got.message.content == plain.message.content
    content = got.logprobs.content
    ids = ids_of([t.token for t in content])
    assert TOKENIZER.decode(ids) == plain.message.content
    for t, p, i in zip(content, plain.logprobs.content, ids, strict=True):
        assert STRINGS.text(i) == p.token and t.logprob == p.logprob
        assert t.bytes == p.bytes == list(STRINGS.bytes(i))  # bytes stay the token's own
        assert [STRINGS.text(j) for j in ids_of([x.token for x in t.top_logprobs])] == [x.token for x in p.top_logprobs]
        assert [x.logprob for x in t.top_logprobs] == [x.logprob for x in p.top_logprobs]
        assert t.top_logprobs[0].token == t.token
    stream = client.chat.completions.create(**args, stream=True, extra_body=AS_IDS)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.bytes) for t in streamed] == [(t.token, t.logprob, t.bytes) for t in content]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_value_that_is_not_a_boolean_is_refused(server, path, body):
    r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 2, "logprobs": 1 if "prompt" in body
                                            else True, "return_tokens_as_token_ids": "yes", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert "return_tokens_as_token_ids" in r.json()["error"]["message"]
