"""SamplingParams.output_kind (vLLM's RequestOutputKind): "cumulative" outputs hold everything so far,
"delta" only what each step added (their concatenation is the cumulative output), "final_only" one output
when the request finishes (what LLM.generate uses): same tokens, text and logprobs in every kind."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model

PROMPTS = ["The tables hold rows", "Engram layers gate", "A stop string ends it"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float32, device="cpu", progress=False)


def run(tiny, kind: str) -> dict[str, list]:
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128), "cpu",
                       torch.float32)
    for i, prompt in enumerate(PROMPTS):
        stop = tiny.tokenizer.decode(tiny.tokenizer.encode(" e").ids) if i == 2 else None
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, stop=stop,
                                                           output_kind=kind))
    outs: dict[str, list] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def test_delta_outputs_concatenate_to_the_cumulative_output_and_final_only_is_its_last(tiny):
    cumulative, delta, final = run(tiny, "cumulative"), run(tiny, "delta"), run(tiny, "final_only")
    for rid, outs in cumulative.items():
        last = outs[-1].outputs[0]
        assert last.finish_reason is not None and len(outs) > 1
        parts = [o.outputs[0] for o in delta[rid]]
        assert len(parts) == len(outs) and delta[rid][-1].finished
        assert [t for p in parts for t in p.token_ids] == last.token_ids
        assert "".join(p.text for p in parts) == last.text
        assert [lp for p in parts for lp in p.logprobs] == last.logprobs
        assert all(p.text == p.delta_text and p.token_ids == p.delta_token_ids for p in parts)
        assert len(final[rid]) == 1 and final[rid][0].finished
        got = final[rid][0].outputs[0]
        assert (got.token_ids, got.text, got.logprobs, got.finish_reason) == (
            last.token_ids, last.text, last.logprobs, last.finish_reason)
        assert got.delta_text == last.text  # nothing was handed out before


def test_an_unknown_output_kind_is_refused():
    with pytest.raises(ValueError, match="SamplingParams.output_kind='streaming'"):
        SamplingParams(output_kind="streaming")
    assert dataclasses.replace(SamplingParams(stop="x"), output_kind="delta").stop_list == ["x"]


def test_detokenize_false_gives_the_same_tokens_without_text_and_refuses_stop_strings(tiny):
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    outs = {}
    for detokenize in (True, False):
        engine = LLMEngine(tiny, config, "cpu", torch.float32)
        engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                           output_kind="delta", detokenize=detokenize))
        outs[detokenize] = [o.outputs[0] for _ in range(20) if engine.has_unfinished() for o in engine.step()]
    assert [o.delta_token_ids for o in outs[False]] == [o.delta_token_ids for o in outs[True]]
    assert "".join(o.delta_text for o in outs[True]) and not any(o.delta_text or o.text for o in outs[False])
    with pytest.raises(ValueError, match="SamplingParams.stop.*detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)
