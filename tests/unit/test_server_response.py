"""The server's response state over delta outputs (engine requests with ``output_kind="delta"``): each
choice accumulates token ids, logprobs and text, so the body, the usage and the stream chunks are those of
the cumulative outputs, without the engine copying the output so far at every step."""
from __future__ import annotations

from engram.engine.outputs import CompletionOutput, RequestOutput
from engram.engine.step import TokenLogprobs
from engram.server.response import Choice, PromptSpec, ResponseState, Shape


def delta(rid: str, toks: list[int], text: str, finish: str | None = None) -> RequestOutput:
    lps = [TokenLogprobs(t, -0.5, [(t, -0.5)]) for t in toks]
    c = CompletionOutput(index=0, text=text, token_ids=list(toks), logprobs=lps, finish_reason=finish,
                         delta_text=text, delta_token_ids=list(toks))
    return RequestOutput(request_id=rid, prompt="p", prompt_token_ids=[1, 2], outputs=[c], finished=finish is not None)


def test_choices_accumulate_delta_outputs_into_the_body_and_the_usage():
    prompt = PromptSpec([1, 2], "p")
    choices = [Choice(0, "r-0", prompt, None, None), Choice(1, "r-1", prompt, None, None)]
    resp = ResponseState("id", Shape("text_completion", None), "tiny", [prompt], choices, None)
    steps = [delta("r-0", [5], "Hel"), delta("r-1", [7], ""), delta("r-0", [6, 9], "lo"),
             delta("r-1", [8], "ab", "length"), delta("r-0", [4], "!", "stop")]
    firsts = [resp.record(o)[1] for o in steps]
    assert firsts == [True, True, False, False, False] and resp.finished
    assert choices[0].token_ids == [5, 6, 9, 4] and len(choices[0].logprobs) == 4
    body = resp.body()
    assert [c["text"] for c in body["choices"]] == ["Hello!", "ab"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


def test_stream_chunks_carry_each_delta_once():
    prompt = PromptSpec([1, 2], "p")
    choice = Choice(0, "r-0", prompt, None, None)
    resp = ResponseState("id", Shape("chat.completion", None), "tiny", [prompt], [choice], None)
    texts = []
    for o in (delta("r-0", [5], "Hi"), delta("r-0", [6], ""), delta("r-0", [7], " there", "stop")):
        c, first = resp.record(o)
        for chunk in resp.chunks(c, first):
            texts.append(chunk["choices"][0]["delta"].get("content", ""))
    assert "".join(texts) == "Hi there" and choice.sent == 3
