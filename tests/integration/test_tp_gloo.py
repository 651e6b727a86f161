"""Tensor parallelism on the CPU over gloo, with real spawned Worker processes (engine/multiproc.py, parallel/tp.py):
TP2 of the tiny model against TP1 in float64, the per-rank share of the sharded weights and KV cache, and a killed
rank making generate raise instead of hanging."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import engram
from engram.engine.config import EngineConfig
from engram.engine.multiproc import RankFailed
from engram.parallel import tp
from tests.tp_compare import worst_logprob_gap

PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(dtype="float64", device="cpu", num_kv_blocks=48, max_model_len=256, max_num_seqs=4)
TOP = 3


def _params(max_tokens: int = 6) -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1():
    return engram.LLM("tiny", **ENGINE)


@pytest.fixture(scope="module")
def tp2():
    llm = engram.LLM("tiny", tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.engine.executor.close()


def test_tp2_matches_tp1_in_float64(tp1, tp2):
    want, got = tp1.generate(PROMPTS, _params(), use_tqdm=False), tp2.generate(PROMPTS, _params(), use_tqdm=False)
    worst = worst_logprob_gap(want, got)
    assert worst <= 1e-9, f"max relative logprob difference {worst:.3e}"


def test_tp4_with_fewer_kv_heads_than_ranks_matches_tp1(tp1):
    """tiny has 2 KV heads: at TP4 each rank keeps the one KV head its single query head reads."""
    llm = engram.LLM("tiny", tensor_parallel_size=4, **ENGINE)
    try:
        got = llm.generate(PROMPTS[:2], _params(4), use_tqdm=False)
        assert llm.engine.stats()["kv_bytes"] * 2 == tp1.engine.stats()["kv_bytes"]
    finally:
        llm.engine.executor.close()
    want = tp1.generate(PROMPTS[:2], _params(4), use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


def test_each_rank_holds_its_share(tp1, tp2):
    full = tp.parameter_bytes(tp1.loaded.model)
    ranks = tp2.engine.executor.rank_bytes
    assert len(ranks) == 2
    for r, b in enumerate(ranks):
        # heads, MLP columns and vocabulary rows split evenly on tiny (4 heads, 2 KV heads, tied embedding)
        assert b["sharded"] == full["sharded"] // 2, (r, b, full)
        assert b["total"] - b["sharded"] == full["total"] - full["sharded"], "the replicated rest is whole"
    # tiny has num_kv_heads=2 >= N: the KV cache of a rank holds one KV head per layer
    assert tp2.engine.stats()["kv_bytes"] * 2 == tp1.engine.stats()["kv_bytes"]


def test_bad_tp_sizes_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="num_heads=4 does not divide over tensor_parallel_size=3"):
        engram.LLM("tiny", tensor_parallel_size=3, **ENGINE)


def test_a_killed_rank_makes_generate_raise():
    llm = engram.LLM("tiny", tensor_parallel_size=2, **ENGINE)
    try:
        llm.generate(PROMPTS[:1], _params(2), use_tqdm=False)
        os.kill(llm.engine.executor.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9") as failed:
            llm.generate(PROMPTS, _params(), use_tqdm=False)  # the step pipeline wraps it in a StepError
        assert time.monotonic() - start < 60
        assert isinstance(failed.value, RankFailed) or isinstance(failed.value.__cause__, RankFailed)
        with pytest.raises(RankFailed):  # the executor stays stopped: later calls fail at once
            llm.engine.executor.stats()
        assert not any(p.is_alive() for p in llm.engine.executor.procs)
    finally:
        llm.engine.executor.close()
