"""Forced decoding: a sampling run forced onto the model's own greedy output is, step for step, the greedy
run — same logits and same Engram row ids, bitwise — while its sampler still draws as in real decode.
Prompt logprobs (the scoring path of evaluation harnesses) equal a whole-prompt forward's."""
from __future__ import annotations

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from tests.engine_runs import engine_wrapping_lookup
from tests.integration.test_engine import RecordingExecutor

CPU = torch.device("cpu")


def recorded_run(loaded, prompts, params):
    engine = engine_wrapping_lookup(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32),
                                    RecordingExecutor, CPU)
    worker = engine.executor.worker
    logits: list[torch.Tensor] = []
    assert worker.runners == [worker.eager]  # every step on the CPU: no graph runner
    run = worker.eager.run
    worker.eager.run = lambda step, staged, patch=None: logits.append(run(step, staged, patch)) or logits[-1]
    for i, (p, q) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, q)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o.outputs[0].token_ids
    return [out[f"r{i}"] for i in range(len(prompts))], logits, worker.lookup.plans


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forcing_the_greedy_output_reproduces_logits_and_row_ids_bitwise(dtype):
    tiny = load_model("tiny", dtype=dtype, device=CPU, progress=False)
    prompts = [tiny.tokenizer.encode(t).ids for t in ("The table store serves rows", "Batching packs", "A")]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref, ref_logits, ref_steps = recorded_run(tiny, prompts, [greedy] * 3)
    forced = [SamplingParams(temperature=1.0, seed=i, max_tokens=10, ignore_eos=True, forced_token_ids=t)
              for i, t in enumerate(ref)]
    got, logits, steps = recorded_run(tiny, prompts, forced)
    assert got == ref
    assert len(logits) == len(ref_logits) and len(steps) == len(ref_steps)
    for a, b in zip(ref_logits, logits):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(ref_steps, steps):
        assert a.engram_row_ids.keys() == b.engram_row_ids.keys()
        assert all(torch.equal(a.engram_row_ids[l], b.engram_row_ids[l]) for l in a.engram_row_ids)
    unforced, _, _ = recorded_run(tiny, prompts, [SamplingParams(temperature=1.0, seed=i, max_tokens=10,
                                                                 ignore_eos=True) for i in range(3)])
    assert unforced != ref  # the forced runs really sampled at temperature 1 and were overridden


def test_forced_tokens_are_validated_against_the_vocabulary():
    tiny = load_model("tiny", dtype=torch.float32, device=CPU, progress=False)
    engine = LLMEngine(tiny, EngineConfig(), CPU, torch.float32)
    with pytest.raises(ValueError, match="forced_token_ids 99999 is outside the vocabulary"):
        engine.add_request("x", [5, 6], SamplingParams(forced_token_ids=[3, 99999]))


def test_prompt_logprobs_score_every_prompt_token_once_across_chunks_and_preemption():
    """Prompt logprobs equal the log-softmax of a whole-prompt forward, whatever the chunking, and a recompute
    after preemption scores nothing twice."""
    from tests.oracles.reference import prefill_logits

    tiny = load_model("tiny", dtype=torch.float64, device=CPU, progress=False)
    prompts = [tiny.tokenizer.encode(t).ids
               for t in ("The table store serves rows " * 6, "Batching packs prompts " * 9)]
    want = []
    for p in prompts:
        logp = prefill_logits(tiny, p).log_softmax(-1)  # [L, vocab]
        want.append([logp[t, p[t + 1]].item() for t in range(len(p) - 1)])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3)
    for cfg in (dict(max_num_batched_tokens=256), dict(max_num_seqs=2, max_num_batched_tokens=7),
                dict(max_num_seqs=2, max_num_batched_tokens=16, block_size=8, num_kv_blocks=9, max_model_len=72)):
        engine = LLMEngine(tiny, EngineConfig(**cfg), CPU, torch.float64)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        final = {}
        while engine.has_unfinished():
            for o in engine.step():
                final[o.request_id] = o
        assert engine.num_preemptions > 0 or "num_kv_blocks" not in cfg  # the third run recomputes a prompt
        for i, p in enumerate(prompts):
            got = final[f"r{i}"].prompt_logprobs
            assert got[0] is None and len(got) == len(p), cfg
            assert [g.token_id for g in got[1:]] == p[1:]
            assert torch.allclose(torch.tensor([g.logprob for g in got[1:]]), torch.tensor(want[i]), atol=1e-9), cfg
            assert all(len(g.top) == 3 and g.top[0][1] >= g.logprob for g in got[1:])
