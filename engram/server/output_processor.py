"""OutputProcessor: the API process's half of the engine's output path: it turns the engine process's TokenDeltas
into the RequestOutputs (``output_kind`` "delta") that an in-process engine (``engram.LLM``) would have made,
detokenizing each request incrementally and matching its stop strings here (engine/detokenizer.py, the engine's own).

The engine checks EOS, stop token ids, ``max_tokens`` and the context; a stop string is found here, so the engine runs
a request on for a step or two until its abort arrives: those tokens are dropped and the output equals the engine's.
At one token the engine's order holds: EOS and stop tokens, then stop strings, then length.
"""
from __future__ import annotations

from typing import Any

from engram.engine.detokenizer import IncrementalDetokenizer
from engram.engine.outputs import CompletionOutput, RequestOutput


class _Request:
    __slots__ = ("prompt_ids", "detok", "prompt_logprobs", "finished")

    def __init__(self, prompt_ids: list[int], detok: IncrementalDetokenizer):
        self.prompt_ids, self.detok = prompt_ids, detok
        self.prompt_logprobs: list | None = None  # from its first delta, when asked
        self.finished = False


class OutputProcessor:
    """Per-request detokenizers keyed by request id; ``add`` before the request reaches the engine, ``drop`` when its
    stream is gone. Used from one thread at a time for ``process`` (the client's reader)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt_ids: list[int], params: Any) -> None:
        self._requests[request_id] = _Request(prompt_ids, IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop_list, params.skip_special_tokens,
            params.include_stop_str_in_output))

    def drop(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def process(self, deltas: list) -> tuple[list[RequestOutput], list[str]]:
        """-> (the RequestOutputs of ``deltas``, the ids a stop string finished here: abort them in the engine).
        Deltas of unknown or finished requests (aborted, stopped here) are dropped."""
        outputs, stopped = [], []
        for d in deltas:
            req = self._requests.get(d.request_id)
            if req is None or req.finished:
                continue
            if d.prompt_logprobs is not None:
                req.prompt_logprobs = d.prompt_logprobs
            finish, stop_reason, kept = d.finish_reason, d.stop_reason, len(d.token_ids)
            for i, tok in enumerate(d.token_ids):
                req.detok.add_token(tok)
                last = i == len(d.token_ids) - 1
                if req.detok.stopped_by is not None and not (last and finish == "stop"):
                    finish, stop_reason, kept = "stop", req.detok.stopped_by, i + 1
                    if d.finish_reason is None:
                        stopped.append(d.request_id)
                    break
            req.finished = finish is not None
            tokens = d.token_ids[:kept]
            logprobs = d.logprobs[:kept] if d.logprobs is not None else None
            text = req.detok.take_delta(req.finished)
            outputs.append(RequestOutput(
                request_id=d.request_id, prompt=None, prompt_token_ids=req.prompt_ids,
                outputs=[CompletionOutput(index=0, text=text, token_ids=tokens, finish_reason=finish,
                                          stop_reason=stop_reason, delta_text=text, delta_token_ids=tokens,
                                          logprobs=logprobs)],
                finished=req.finished, prompt_logprobs=req.prompt_logprobs))
        return outputs, stopped
