"""Speculative decoding on CUDA (skipped without a GPU): verify steps replay the mixed-step graphs (counted by
route), tiers gpu and host, n-gram and draft-model proposers, in bf16 and float32; a run with them is bitwise equal
to the same runner run eagerly on the same static inputs (``capture=False``), and forced natural continuations come
out as forced with their logprobs within float rounding of a run without speculation. The CPU checks:
tests/integration/test_speculative.py, tests/unit/test_mixed_inputs.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from tests.engine_runs import drain, mixed_graphs_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
         "draft": {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}}


def _prompts():
    base = [(11 * j) % 400 + 3 for j in range(60)]
    return [base[i:] + base[:i] for i in range(0, 48, 6)]  # 8 prompts whose second half repeats their first


def _engine(loaded, spec=None, **config):
    return LLMEngine(loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, speculative_config=spec,
                                          **config), CUDA, loaded.dtype)


def _run(engine):
    for i, p in enumerate(_prompts()):
        quote = p[10:34]  # a continuation quoting the prompt: n-gram drafts are accepted
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=len(quote), logprobs=2,
                                                      forced_token_ids=quote, ignore_eos=True))
    return drain(engine)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def loaded(request):
    return load_model("tiny", dtype=request.param, device=CUDA, progress=False)


@pytest.mark.parametrize("tier", ["gpu", "host"])
@pytest.mark.parametrize("method", list(SPECS))
def test_verify_steps_replay_mixed_graphs_bitwise(loaded, tier, method):
    model = dataclasses.replace(loaded, tables={}, tier=tier)
    replayed = _engine(model, SPECS[method])
    want = _run(replayed)
    stats = replayed.stats()
    # the forced continuation quotes the prompt: n-gram drafts find it, the random-weight draft model does not
    # (its greedy tokens are not the quote), so only the n-gram run must be mostly accepted
    assert stats["speculative"]["spec_steps"] >= 8, stats
    assert method != "ngram" or stats["speculative"]["acceptance_rate"] > 0.5, stats
    assert stats["mixed_graph_replays"] >= 8 and stats["steps_by_route"].get("eager", 0) == 0, stats["steps_by_route"]
    assert _run(mixed_graphs_eager(_engine(model, SPECS[method]))) == want  # tokens and logprobs, bitwise


def test_forced_outputs_and_logprobs_match_a_run_without_speculation(loaded):
    got = _run(_engine(loaded, SPECS["ngram"]))
    want = _run(_engine(loaded))
    tol = 0.05 if loaded.dtype == torch.bfloat16 else 1e-3  # graph buckets differ in shape: float rounding only
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a[0] - b[0]) for a, b in zip(logprobs, got[rid][1])) <= tol, rid
