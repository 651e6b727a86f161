"""Tensor parallelism over NCCL, one GPU a rank (engine/tp_rank.py with ``device="cuda"``; skipped with fewer than two
GPUs): TP2 of tiny in float64 gives TP1's greedy tokens and logprobs within a relative 1e-9, for both WKV layouts,
with the tables sharded by column on the gpu and host tiers; each rank runs with NVLink multicast off."""
from __future__ import annotations

import pytest
import torch

import engram
from engram.engine.tp_rank import NCCL_ENV
from tests.tp_compare import worst_logprob_gap

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(dtype="float64", device="cuda", num_kv_blocks=48, max_model_len=256, max_num_seqs=4)


def _params() -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1():
    return engram.LLM("tiny", **ENGINE, enforce_eager=True)


@pytest.mark.parametrize("tier,wkv", [("gpu", "replicated"), ("gpu", "column"), ("host", "replicated")])
def test_nccl_tp2_matches_tp1(tp1, tier, wkv):
    llm = engram.LLM("tiny", tier=tier, tensor_parallel_size=2, engram_config={"wkv_tp": wkv}, **ENGINE)
    try:
        got = llm.generate(PROMPTS, _params(), use_tqdm=False)
        ranks = llm.engine.executor.rank_bytes
        envs = llm.engine.executor.rank_env
    finally:
        llm.engine.executor.close()
    assert worst_logprob_gap(tp1.generate(PROMPTS, _params(), use_tqdm=False), got) <= 1e-9
    full = engram.parallel.tp.parameter_bytes(tp1.loaded.model)
    assert all(b["sharded"] * 2 == full["sharded"] for b in ranks)
    assert envs == [NCCL_ENV, NCCL_ENV] and NCCL_ENV["NCCL_NVLS_ENABLE"] == "0"  # multicast off in every rank
