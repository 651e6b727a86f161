"""Pipeline parallelism of the ``small`` preset (12 layers, Engram at layers 1 and 6: the planner's cut 6 | 6 puts one
on each stage) against PP1 in float64, real spawned processes over gloo: PP2 and PP2 x TP2 (a
100 M-parameter model in float64 a stage: few prompts, few tokens)."""
from __future__ import annotations

import pytest

import engram
from tests.tp_compare import worst_logprob_gap

PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(dtype="float64", device="cpu", num_kv_blocks=32, max_model_len=128, max_num_seqs=4)


def _generate(**options):
    llm = engram.LLM("small", **ENGINE, **options)
    try:
        params = engram.SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        return out, getattr(llm.engine.executor, "holdings", None), llm.engine.executor.stats().get("stages")
    finally:
        if hasattr(llm.engine.executor, "close"):
            llm.engine.executor.close()


@pytest.fixture(scope="module")
def want():
    return _generate()[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_small_pp2_matches_pp1(want, tp):
    got, holdings, stages = _generate(pipeline_parallel_size=2, tensor_parallel_size=tp)
    assert worst_logprob_gap(want, got) <= 1e-9
    taken = [sum(st["early_lookups"].values()) for st in stages]  # every step's lookups once a stage, early or not
    assert taken[0] == taken[1] >= 1, [st["early_lookups"] for st in stages]
    assert stages[1]["relay"]["sent"] >= stages[0]["relay"]["received"] >= 1, [st["relay"] for st in stages]
    stages = [h for i, h in enumerate(holdings) if i % tp == 0]
    assert [h["layers"] for h in stages] == [list(range(6)), list(range(6, 12))]
    assert [h["engram_layers"] for h in stages] == [[1], [6]]
    assert [h["kv_layers"] for h in stages] == [list(range(6)), list(range(6, 12))]
