"""The Worker is driven only through a StepDescription: a step built by hand (no engine, no scheduler)
gives the tokens the engine gives, the description survives pickling (what a multi-process executor
broadcasts), and metrics read the engine's stats() snapshot even with a wrapped lookup executor."""
from __future__ import annotations

import pickle

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.lookup import LookupExecutor
from engram.engine.sampling_params import SamplingParams
from engram.engine.step import SampleSpec, StepDescription
from engram.engine.worker import Worker
from engram.hashing import NgramHasher
from engram.model.loader import load_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.float64, device=CPU, progress=False)


def hand_built_step(loaded, prompt: list[int], block_size: int) -> StepDescription:
    """A one-sequence prefill step from first principles: blocks 0.., positions 0..L-1, hashed rows."""
    ecfg, n = loaded.engram_config, len(prompt)
    hasher = NgramHasher.from_tokenizer(ecfg, loaded.compressed_tokenizer)
    comp = torch.tensor(loaded.compressed_tokenizer.compress(prompt)).unsqueeze(0)  # [1, L]
    blocks = list(range(-(-n // block_size)))
    pos = torch.arange(n)
    greedy = SampleSpec(temperature=0.0, top_p=1.0, top_k=0, seed=None, draw=0, banned_token_ids=(),
                        forced_token_id=-1, logprobs=2)
    return StepDescription(
        step_id=0, seq_ids=[0], start_positions=[0], num_new_tokens=[n], token_ids=torch.tensor(prompt),
        positions=pos, cu_seqlens=torch.tensor([0, n]), context_lens=torch.tensor([n]),
        block_tables=torch.tensor([blocks]), slot_mapping=torch.tensor(blocks).repeat_interleave(block_size)[:n] *
        block_size + pos % block_size, dead_mask=None,
        engram_row_ids={lid: hasher.hash(comp, lid)[0] for lid in ecfg.layer_ids}, sample_rows=[0],
        samples=[greedy])


def test_worker_runs_a_hand_built_step_like_the_engine(tiny):
    prompt = tiny.tokenizer.encode("The table store serves rows").ids
    cfg = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=8, max_model_len=128)
    worker = Worker(tiny, cfg, 128, CPU, torch.float64)
    step = hand_built_step(tiny, prompt, cfg.block_size)
    before = worker.stats()["tables"][1]["lookups"]
    result = worker.execute(pickle.loads(pickle.dumps(step)))
    assert worker.stats()["tables"][1]["lookups"] == before + 1  # plain data: survives the trip to another process
    engine = LLMEngine(tiny, cfg, CPU, torch.float64)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2))
    out = engine.step()[0].outputs[0]
    assert result.step_id == 0 and result.token_ids == out.token_ids
    lp = result.logprobs[0]
    assert lp.token_id == out.token_ids[0] and lp.top[0][0] == lp.token_id and lp.logprob == lp.top[0][1]
    assert out.logprobs[0] == lp


def test_stale_rows_are_refused(tiny):
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=32, block_size=8, max_model_len=64)
    worker = Worker(tiny, cfg, 64, CPU, torch.float64)
    step = hand_built_step(tiny, [5, 6, 7], cfg.block_size)
    staged = worker.lookup.submit(step)
    with pytest.raises(RuntimeError, match="staged for step 0, consumed by step 1"):
        staged.rows(1, 1)


class CountingLookups(LookupExecutor):
    """The real lookup executor (a Worker's ``wrap_lookup``), counting the steps submitted to it."""

    def __init__(self, base: LookupExecutor):
        super().__init__(base.tables, base.cfg, base.dtype, base.device)
        self.calls = 0

    def submit(self, step, *args, **kwargs):
        self.calls += 1
        return super().submit(step, *args, **kwargs)


def test_metrics_read_the_stats_snapshot_with_a_wrapped_lookup_executor(tiny):
    from engram.server.metrics import ServerMetrics
    from tests.engine_runs import engine_wrapping_lookup

    engine = engine_wrapping_lookup(tiny, EngineConfig(max_num_seqs=2, max_model_len=128), CountingLookups)
    worker = engine.executor.worker
    assert isinstance(worker.lookup, CountingLookups) and worker.eager.lookup is worker.lookup
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    metrics = ServerMetrics("tiny", "gpu")
    engine.step()
    metrics.update(engine.stats())
    text = metrics.render().decode()
    assert worker.lookup.calls == 1
    assert f'engram_table_lookups_total{{layer="1",tier="gpu"}} {float(engine.stats()["tables"][1]["lookups"])}' in text
    assert "engram_num_requests_running 1.0" in text and "engram_kv_cache_usage_ratio" in text
    snap = engine.stats()
    assert snap["running"] == 1 and snap["steps"] == 1 and 0 < snap["kv_usage"] < 1


def test_warmup_step_is_the_largest_step_with_distinct_slots():
    from engram.config import EngramConfig
    from engram.engine.memory import warmup_step

    ecfg = EngramConfig.preset("tiny")
    step = warmup_step(EngineConfig(max_num_seqs=3, max_num_batched_tokens=10), ecfg, 4)
    assert step.num_tokens == 10 and step.num_new_tokens == [4, 3, 3] and step.sample_rows == [0, 1, 2]
    assert step.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 9, 10]  # blocks 0, 1, 2 of 4 slots
    assert sorted(step.engram_row_ids) == list(ecfg.layer_ids)
    assert all(ids.shape == (10, ecfg.n_cols) for ids in step.engram_row_ids.values())


def test_a_wrapped_lookup_executor_never_sees_the_memory_profiles_warm_up(tiny, monkeypatch):
    """The warm-up step that sizes the KV cache (memory.profile_peak_bytes, on CUDA) is invisible to statistics:
    it runs on the executor the Worker built, and ``wrap_lookup`` applies to the engine's steps only."""
    import engram.engine.worker as worker_module

    seen = []
    monkeypatch.setattr(Worker, "_profiles_memory", lambda self: True)
    monkeypatch.setattr(worker_module, "profile_peak_bytes", lambda worker, _: seen.append(type(worker.lookup)))
    worker = Worker(tiny, EngineConfig(max_num_seqs=2, max_model_len=128), 128, CPU, torch.float64,
                    wrap_lookup=CountingLookups)
    assert seen == [LookupExecutor] and isinstance(worker.lookup, CountingLookups)
    assert worker.eager.lookup is worker.lookup
