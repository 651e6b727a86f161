"""Mixed-step graph inputs on the CPU (engine/runners/mixed_inputs.py): the real GraphRunner with ``capture=False``
runs what a mixed-step graph holds (MixedInputs' padded static layout, the torch attention reference reading it, the
gathers over every row of the bucket) eagerly, so an engine whose Worker runs its mixed steps that way must give the
eager engine's greedy tokens and logprobs in float64, with and without async scheduling (pending tokens patched into
the static inputs); the steps really went through it. The graphs themselves: tests/gpu/test_mixed_graphs.py."""
from __future__ import annotations

import itertools

import pytest
import torch

import engram
from engram.engine.runners.graphs import GraphRunner
from engram.engine.runners.mixed_inputs import MixedInputs, token_buckets
from engram.engine.sampling_params import SamplingParams
from engram.engine.spec.config import logit_rows
from engram.engine.step import StepDescription
from tests.engine_runs import drain

PROMPTS = [list(range(5, 5 + n)) for n in (37, 3, 70, 12, 1, 29)]


def test_token_buckets_grow_by_half_then_a_third_and_end_at_the_maximum():
    assert token_buckets(2048) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(16) == [16]


def _engine(async_scheduling: bool | None, mixed: bool, speculative_config: dict | None = None):
    llm = engram.LLM("tiny", device="cpu", dtype="float64", max_num_batched_tokens=48, max_num_seqs=8,
                     async_scheduling=async_scheduling, speculative_config=speculative_config)
    if mixed:
        w = llm.engine.executor.worker
        c = llm.engine.config
        io = MixedInputs(c.max_num_batched_tokens, c.max_num_seqs, llm.engine.max_model_len, c.block_size,
                         w.memory.num_blocks, w.ecfg.n_cols, list(w.tables), w.device, max_logits=logit_rows(c))
        w.runners.insert(0, GraphRunner(w.model, w.kv, w.ecfg, w.tables, io, w.device, name="mixed-graph",
                                        capture=False))
    return llm


def _run(llm):
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=6 + i, logprobs=2,
                                                          ignore_eos=True))
    return drain(llm.engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_steps_on_the_static_inputs_give_the_eager_engines_outputs(async_scheduling):
    want = _run(_engine(async_scheduling, mixed=False))
    llm = _engine(async_scheduling, mixed=True)
    got = _run(llm)
    stats = llm.engine.stats()
    assert stats["steps_by_route"].get("mixed-graph", 0) >= 5, stats["steps_by_route"]
    assert stats["steps_by_kind"].get("mixed", 0) >= 2, stats["steps_by_kind"]
    assert set(got) == set(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for (lp, top), (lp2, top2) in zip(logprobs, got[rid][1]):
            assert abs(lp - lp2) <= 1e-9 and [t for t, _ in top] == [t for t, _ in top2]


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1},
                                  {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}])
def test_verify_steps_run_on_the_mixed_step_static_inputs(spec):
    # a verify sequence is a prefill entry of K + 1 rows, all with logits: the reserved LM-head slots take them
    want = _run(_engine(None, mixed=False))
    llm = _engine(None, mixed=True, speculative_config=spec)
    got = _run(llm)
    stats = llm.engine.stats()
    assert stats["speculative"]["spec_steps"] >= 5, stats["speculative"]
    assert set(stats["steps_by_route"]) == {"mixed-graph"}, stats["steps_by_route"]  # verify steps too
    assert set(got) == set(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for (lp, top), (lp2, top2) in zip(logprobs, got[rid][1]):
            assert abs(lp - lp2) <= 1e-9 and [t for t, _ in top] == [t for t, _ in top2]


def _step(chunks: list[int], dead: bool = False) -> StepDescription:
    """A step of fresh prompt chunks of these lengths (only what ``fits`` reads is meaningful)."""
    t = sum(chunks)
    cu = torch.tensor([0, *itertools.accumulate(chunks)])
    return StepDescription(0, list(range(len(chunks))), [0] * len(chunks), list(chunks), torch.zeros(t, dtype=torch.long),
                           torch.zeros(t, dtype=torch.long), cu, torch.tensor(chunks), torch.zeros(len(chunks), 1,
                           dtype=torch.long), torch.zeros(t, dtype=torch.long),
                           torch.zeros(t, dtype=torch.bool) if dead else None, {}, list(range(len(chunks))), [])


def test_fits_keeps_a_prefill_slot_free_and_refuses_what_runs_eager():
    io = MixedInputs(32, 8, 256, 16, 3, 0, [], torch.device("cpu"))
    assert io.fits(_step([2] * 7)) and io.bucket(14) == 16  # 16 tokens: 9 prefill slots, 7 chunks
    assert io.fits(_step([2] * 8))  # 8 chunks of 2 (a verify step at K = 1) in 16 tokens: a slot left for the pads
    assert io.fits(_step([30, 1, 1])) and not io.fits(_step([31, 1, 1]))  # tokens above the largest bucket
    assert not io.fits(_step([1] * 9))  # sequences above max_num_seqs
    assert not io.fits(_step([4, 1], dead=True))  # DEAD tokens run eager
