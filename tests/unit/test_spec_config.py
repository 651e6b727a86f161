"""Speculative decoding's config (engine/spec/config.py) and the n-gram proposer (engine/spec/ngram.py): vLLM's keys,
errors naming the key, the decode reservation per proposer and its refusal at start, async scheduling refused."""
from __future__ import annotations

import pytest

from engram.engine.config import EngineConfig
from engram.engine.spec.config import SpeculativeConfig, decode_reservation, logit_rows
from engram.engine.spec.ngram import NgramProposer


def test_vllm_keys_and_defaults():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)  # one given: both
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)  # vLLM's default window
    d = SpeculativeConfig.from_dict({"model": "tiny", "num_speculative_tokens": 2})
    assert d.method == "draft_model" and d.uses_draft_model  # a model without a method: a draft model
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).speculative_config.method \
        == "ngram"


@pytest.mark.parametrize("options, needle", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method='eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens=0"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2}, 'needs "method"'),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min=4"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "tiny"}, "speculative_config.model='tiny'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model=None"),
    ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_tokens": 3}, "unknown speculative_config key"),
])
def test_bad_options_name_the_key(options, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        SpeculativeConfig.from_dict(options)


def test_the_reservation_per_proposer():
    # a draft model: (K + 1) verify rows + K rows of its own; n-gram: K + 1
    draft = {"method": "draft_model", "model": "tiny"}
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512,
                       speculative_config={**draft, "num_speculative_tokens": 5})
    assert decode_reservation(cfg) == 32 * 11 == 352 and logit_rows(cfg) == 32 * 6
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512,
                       speculative_config={**draft, "num_speculative_tokens": 7})
    assert decode_reservation(cfg) == 480
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert decode_reservation(cfg) == 192 and logit_rows(cfg) == 192
    assert decode_reservation(EngineConfig(max_num_seqs=32)) == 32 == logit_rows(EngineConfig(max_num_seqs=32))


def test_an_undersized_step_budget_is_refused_naming_the_options():
    with pytest.raises(ValueError) as e:
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=256,
                     speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 5})
    text = str(e.value)
    for needle in ("max_num_seqs=32", "(1 + 2K) = 352", "engine.max_num_batched_tokens=256", "num_speculative_tokens"):
        assert needle in text, text
    EngineConfig(max_num_seqs=32, max_num_batched_tokens=352,  # exactly the reservation fits
                 speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 5})
    with pytest.raises(ValueError, match=r"\(K \+ 1\) = 192"):
        EngineConfig(max_num_seqs=32, max_num_batched_tokens=191,
                     speculative_config={"method": "ngram", "num_speculative_tokens": 5})


def test_async_scheduling_is_refused_with_speculation():
    with pytest.raises(ValueError, match="engine.async_scheduling=True: speculative decoding runs with synchronous"):
        EngineConfig(async_scheduling=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    EngineConfig(async_scheduling=None, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_ngram_proposer_copies_what_followed_the_longest_suffix():
    p = NgramProposer(1, 3)
    toks = [7, 1, 2, 3, 9, 9, 1, 2, 3]
    start, stop = p.propose(toks, 2)  # suffix [1, 2, 3] occurred at 1..3, followed by 9, 9
    assert toks[start:stop] == [9, 9]
    assert p.propose([1, 2, 3, 4], 3) == (0, 0)  # nothing recurs
    toks = [5, 6, 1, 5, 6, 2, 5, 6]
    start, stop = p.propose(toks, 1)  # [5, 6] twice before: the latest with a token after it
    assert toks[start:stop] == [2]
    start, stop = p.propose(toks, 3)  # the latest followed by 3 tokens
    assert toks[start:stop] == [2, 5, 6]
    start, stop = p.propose(toks, 4)  # only the earliest is followed by 4
    assert toks[start:stop] == [1, 5, 6, 2]
    start, stop = NgramProposer(2, 2).propose([4, 8, 4, 9, 4], 2)  # n = 1 is below the minimum
    assert (start, stop) == (0, 0)


def _verify_step(num_seqs: int, k: int):
    """A verify step: every sequence decodes its token and k drafts, all rows with logits."""
    import torch

    from engram.engine.step import SampleSpec, StepDescription

    t = num_seqs * (k + 1)
    cu = torch.arange(0, t + 1, k + 1)
    greedy = SampleSpec(0.0, 1.0, 0, None, 0, (), -1, -1)
    return StepDescription(0, list(range(num_seqs)), [10] * num_seqs, [k + 1] * num_seqs, torch.zeros(t, dtype=torch.long),
                           torch.zeros(t, dtype=torch.long), cu, torch.full((num_seqs,), 10 + k + 1),
                           torch.zeros(num_seqs, 1, dtype=torch.long), torch.zeros(t, dtype=torch.long), None, {},
                           list(range(num_seqs)), [greedy] * t, num_drafts=[k] * num_seqs)


def test_per_step_buffers_hold_the_reservation():
    import torch

    from engram.config import EngramConfig
    from engram.engine.memory import warmup_step
    from engram.engine.runners.mixed_inputs import MixedInputs

    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64,
                       speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3})
    step = _verify_step(8, 3)  # 8 x (K + 1) = 32 rows of logits
    assert step.logits_indices == list(range(32)) and step.draft_rows == [r for r in range(32) if r % 4]
    reserved = MixedInputs(64, 8, 256, 16, 3, 0, [], torch.device("cpu"), max_logits=logit_rows(cfg))
    assert reserved.fits(step) and reserved.inputs(32, None).logits_indices.numel() == 32
    plain = MixedInputs(64, 8, 256, 16, 3, 0, [], torch.device("cpu"))  # LM-head rows for one token a sequence
    assert not plain.fits(step)
    warm = warmup_step(cfg, EngramConfig.preset("tiny"), 16)  # the profiled step scores every verify row too
    assert len(warm.samples) == len(warm.logits_indices) == 8 * 4


def test_speculative_counters_merge_over_data_parallel_replicas():
    from types import SimpleNamespace

    from engram.engine.dp_stats import merge_stats

    def snap(steps, drafts, accepted, at):
        return {"running": 1, "waiting": 0, "kv_blocks_total": 10, "kv_blocks_free": 5, "tables": {},
                "speculative": {"method": "ngram", "num_speculative_tokens": 2, "spec_steps": steps,
                                "draft_tokens": drafts, "accepted_tokens": accepted, "plain_decode_steps": 0,
                                "acceptance_rate": accepted / drafts, "mean_acceptance_length": 1 + accepted / steps,
                                "accepted_at": at}}

    infos = [SimpleNamespace(index=i, pid=i, num_kv_blocks=10) for i in range(2)]
    spec = merge_stats([snap(4, 8, 6, [4, 2]), snap(6, 12, 3, [3, 0])], infos)["speculative"]
    assert spec["num_speculative_tokens"] == 2 and spec["accepted_at"] == [7, 2]
    assert spec["acceptance_rate"] == 9 / 20 and spec["mean_acceptance_length"] == 1 + 9 / 10
