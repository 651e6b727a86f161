"""v4-small-like on CUDA (skipped without one): the preset builds on one GPU in bf16 (weights drawn there), and its
greedy tokens and logprobs are bitwise equal with the tables in HBM and in pinned host memory (the same batch, the
same kernels; only where the rows live differs), over a batch of natural prompts that mixes lengths, decoding through
the captured V4 decode graphs (runners/v4_graphs.py)."""
from __future__ import annotations

import gc

import pytest
import torch

import engram

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["The history of the printing press begins", "In the morning the market opened with",
           "A short note on hashing: every n-gram of token ids", "tables"]


def _run(tier: str) -> list[tuple[list[int], list[float]]]:
    llm = engram.LLM("v4-small-like", tier=tier, max_num_seqs=8)
    params = engram.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.engine.stats()["steps_by_route"].get("graph", 0) > 0  # decode through the V4 graphs
        return [(list(o.outputs[0].token_ids), [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_v4_small_like_tiers_gpu_and_host_are_bitwise_equal():
    gpu = _run("gpu")
    host = _run("host")
    assert all(len(ids) == 24 for ids, _ in gpu)
    assert gpu == host
