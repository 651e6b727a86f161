"""On CUDA (skipped without a GPU): a decode step never waits for the device except to read the sampled
tokens (torch's sync detector in "error" mode around whole engine steps, tiers gpu and host), and the KV
cache is sized from a profiled warm-up forward."""
from __future__ import annotations

import pytest
import torch

import engram.engine.worker as worker_module
from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_decode_steps_synchronise_only_to_read_the_sampled_tokens(tmp_path, monkeypatch, tier):
    loaded = load_model("tiny", tier=tier, dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=8, max_model_len=256), CUDA, torch.bfloat16)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, min_tokens=30),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", f"Prompt number {i} about tables", p)
    for _ in range(3):  # prefill and the first decodes (allocator and generator warm-up)
        engine.step()
    reads = []

    real_read = worker_module.read_tokens

    def read_tokens(sampled):
        torch.cuda.set_sync_debug_mode(0)
        try:
            reads.append(sampled.token_ids.numel())
            return real_read(sampled)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(worker_module, "read_tokens", read_tokens)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            assert len(engine.step()) == len(params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert reads == [len(params)] * 5


def test_kv_cache_is_sized_from_a_profiled_warm_up_step(tmp_path):
    loaded = load_model("tiny", dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False)
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512,
                                            gpu_memory_utilization=0.5), CUDA, torch.bfloat16)
    memory = engine.executor.worker.memory
    assert memory.step_peak_bytes is not None and memory.step_peak_bytes > 0
    assert memory.num_blocks == 16 * (512 // 16)  # the tiny model fits max_num_seqs full sequences
    assert all(t.stats()["lookups"] == 0 for t in engine.executor.worker.tables.values())  # warm-up not counted
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.001 .* profiled peak"):
        LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_model_len=512, gpu_memory_utilization=0.001), CUDA,
                  torch.bfloat16)
