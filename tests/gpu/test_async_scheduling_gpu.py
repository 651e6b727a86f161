"""Async scheduling on CUDA (skipped without a GPU): it is on by default where the tables gather device
ids, steps really run ahead (a step is launched before the one before it is read, its decode tokens
patched in on the device, decode graphs replayed), and tokens and logprobs are bitwise those of
synchronous scheduling when the batch composition is the same (every request admitted at once, no stops);
a tier whose tables need host ids (host with a hot-row cache, the disk tier) schedules synchronously by
default, and when async is asked for, its decode steps are still launched before the step before them is
read (the Worker waits for the tokens and reads the patched row ids on the host) and give the same outputs."""
from __future__ import annotations

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def generate(engine: LLMEngine, n: int = 8):
    launches, collects = [], []
    real_launch, real_collect = engine.executor.launch, engine.executor.collect
    engine.executor.launch = lambda step: (launches.append(len(collects)), real_launch(step))[1]
    engine.executor.collect = lambda h: (collects.append(1), real_collect(h))[1]
    for i in range(n):
        params = (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2) if i % 2 else
                  SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True))
        engine.add_request(f"r{i}", f"Prompt {i} about tables " * (1 + i % 4), params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            c = o.outputs[0]
            out[o.request_id] = (c.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs or []])
    ahead = sum(1 for k, done in enumerate(launches) if done < k)  # launches while an earlier step was unread
    return [out[f"r{i}"] for i in range(n)], ahead


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_async_equals_sync_bitwise_and_runs_ahead(tmp_path, tier):
    loaded = load_model("tiny", tier=tier, dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False)
    cfg = dict(max_num_seqs=8, max_model_len=256)
    sync = LLMEngine(loaded, EngineConfig(async_scheduling=False, **cfg), CUDA, torch.bfloat16)
    want, ahead_sync = generate(sync)
    auto = LLMEngine(loaded, EngineConfig(**cfg), CUDA, torch.bfloat16)
    replays = auto.stats()["graph_replays"]
    got, ahead = generate(auto)
    assert got == want
    assert ahead_sync == 0 and ahead >= 20  # every decode step was launched before the previous one was read
    assert auto.stats()["graph_replays"] - replays >= 20


@pytest.mark.parametrize("tier,options", [("host", {"cache_rows": 64}), ("disk", {"io": "buffered"}),
                                          ("disk", {"io": "buffered", "cache_rows": 64})],
                         ids=["host-cache", "disk", "disk-cache"])
def test_tables_that_need_host_ids_take_tokens_in_flight_by_default(tmp_path, tier, options):
    loaded = load_model("tiny", tier=tier, dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False,
                        engram_config=options)
    cfg = dict(max_num_seqs=4, max_model_len=128)
    sync = LLMEngine(loaded, EngineConfig(async_scheduling=False, **cfg), CUDA, torch.bfloat16)
    want, ahead = generate(sync, 4)
    assert ahead == 0 and all(len(t) == 24 for t, _ in want)
    auto = LLMEngine(loaded, EngineConfig(**cfg), CUDA, torch.bfloat16)
    assert auto.pipeline.async_scheduling()  # auto: on CUDA for every tier (host-read tables wait for the tokens in the launch)
    replays = auto.stats()["graph_replays"]
    got, ahead = generate(auto, 4)  # the same batches, the same tokens
    assert got == want
    assert ahead >= 20  # decode steps were launched before the step before them was read
    assert auto.stats()["graph_replays"] - replays >= 20
