"""Prompt rows ahead of their prefill (engine/prefetch_plan.py, prefetch_stage.py) on a real engine on the CPU over
real table files: greedy tokens and logprobs are bitwise the same with prefetch on and off (chunked prefill,
preemption, an abort mid-prompt, a budget of one range); every token row read from the staging area equals a direct
gather of that step's planned ids at that position (so rows shifted by one position fail), and the staged ranges'
ids are the step's; ranges are freed on abort and preemption; the staging bytes are part of the KV budget."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.prefetch_plan import RANGE_TOKENS
from engram.engine.prefetch_stage import PrefetchStaging
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from engram.store.options import StoreOptions
from tests.engine_runs import drain

CPU, F64 = torch.device("cpu"), torch.float64
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model("tiny", dtype=F64, device=CPU, cache_dir=tmp_path_factory.mktemp("tables"), progress=False)


def on_tier(tiny, tier: str, **options):
    return dataclasses.replace(tiny, tables={}, tier=tier, store_options=StoreOptions().replace(**options))


def prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, 4096, (7,), generator=g).tolist()
    return [torch.randint(3, 4096, (n,), generator=g).tolist() for n in (300, 40, 600, 2)] + [phrase * 90]


def run(loaded, reqs, abort_at: int | None = None, **cfg):
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, **cfg), CPU, F64)
    for i, ids in enumerate(reqs):
        engine.add_request(f"r{i}", ids, PARAMS)
    if abort_at is not None:
        for _ in range(abort_at):
            engine.step()
        assert engine.abort_request("r2")  # 600 tokens: mid-prompt, with ranges staged ahead
        engine.step()
        staging = engine.executor.worker.prefetch
        assert not [k for k in staging._ranges if k[0] == engine_seq_id(engine, "r2")]
    return drain(engine), engine


def engine_seq_id(engine, request_id: str) -> int:
    return int(request_id[1:])  # requests were added in order: sequence ids 0, 1, ...


class CheckedStaging(PrefetchStaging):
    """The Worker's staging area, checking each step it serves: the staged ranges' ids are the planned ids of the
    positions a step reads from them, and every token row written from staging equals a direct gather."""

    checked_rows = 0

    def overlay(self, step, layer_id, rows, table, fetch_dtype, n_cols):
        waited = super().overlay(step, layer_id, rows, table, fetch_dtype, n_cols)
        for use in step.staged_uses:
            planned = step.engram_row_ids[layer_id][use.row:use.row + use.count]  # [count, n_cols]
            staged = self._ranges.get(use.key)
            assert staged is not None, f"range {use.key} was not staged"
            assert torch.equal(staged.range.row_ids[layer_id][use.offset:use.offset + use.count], planned)
            want = table.gather(planned.reshape(-1), dtype=fetch_dtype).to(rows.dtype)
            got = rows[use.row * n_cols:(use.row + use.count) * n_cols]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"layer {layer_id} use {use}"
            type(self).checked_rows += use.count
        return waited


@pytest.mark.parametrize("tier,options", [("disk", {"io": "buffered"}), ("host", {}),
                                          ("disk", {"io": "buffered", "cache_rows": 400})],
                         ids=["disk", "host", "disk-cache"])
def test_tokens_equal_with_prefetch_on_and_off_and_staged_rows_are_the_positions_rows(tiny, tier, options,
                                                                                       monkeypatch):
    loaded, reqs = on_tier(tiny, tier, **options), prompts()
    want, _ = run(loaded, reqs)
    monkeypatch.setattr("engram.engine.worker.PrefetchStaging", CheckedStaging)
    CheckedStaging.checked_rows = 0
    got, engine = run(loaded, reqs, prompt_prefetch=True)
    assert got == want
    stats = engine.stats()["prefetch"]
    assert stats["active"] and stats["staged"] > 0 and stats["rows_direct"] == 0 and stats["used_bytes"] == 0
    staged_positions = sum(len(r) for r in reqs) - 4 * 64  # all but the first chunks, which run at admission
    assert stats["rows_read"] >= staged_positions * len(tiny.engram_config.layer_ids) * 0.9
    assert CheckedStaging.checked_rows == stats["rows_read"]
    # the rows the prefill steps left to the tables: the staged positions are not gathered again
    assert engine.stats()["lookup_unique_ids"] < run(loaded, reqs)[1].stats()["lookup_unique_ids"] * 0.5


def test_preemption_abort_and_a_budget_of_one_range(tiny, monkeypatch):
    """A KV cache that forces preemption (ranges dropped, fetched again for the recompute), an abort mid-prompt (its
    ranges freed at once) and a staging budget of one range (FCFS, the rest waits): same tokens."""
    loaded, reqs = on_tier(tiny, "disk", io="buffered"), prompts(seed=8)
    ecfg = tiny.engram_config
    one = RANGE_TOKENS * ecfg.n_cols * len(ecfg.layer_ids) * (ecfg.row_bytes + 8)
    for cfg in (dict(num_kv_blocks=50, max_model_len=640), dict(prefetch_staging_bytes=one)):
        want, plain = run(loaded, reqs, **cfg)
        got, engine = run(loaded, reqs, prompt_prefetch=True, **cfg)
        assert got == want and engine.num_preemptions == plain.num_preemptions
        assert engine.stats()["prefetch"]["used_bytes"] == 0 and engine.prefetcher.used_bytes == 0
        assert engine.stats()["prefetch"]["rows_read"] > 0
        assert engine.num_preemptions > 0 or "num_kv_blocks" not in cfg
    want, _ = run(loaded, reqs, abort_at=3)
    got, engine = run(loaded, reqs, abort_at=3, prompt_prefetch=True)
    assert got == want and engine.stats()["prefetch"]["used_bytes"] == 0


def test_staging_is_part_of_the_budget_with_errors_naming_the_option(tiny):
    ecfg = tiny.engram_config
    with pytest.raises(ValueError, match="engine.prefetch_staging_bytes=1000: must hold at least one prompt range"):
        LLMEngine(tiny, EngineConfig(prompt_prefetch=True, prefetch_staging_bytes=1000), CPU, F64)
    with pytest.raises(ValueError, match=r"prompt prefetch staging 67108864 \(engine.prefetch_staging_bytes\)"):
        LLMEngine(tiny, EngineConfig(prompt_prefetch=True, kv_cache_memory=70 << 20, max_model_len=256), CPU, F64)
    with pytest.raises(ValueError, match="engine.prefetch_staging_bytes=-1"):
        EngineConfig(prefetch_staging_bytes=-1)
    plain = LLMEngine(tiny, EngineConfig(kv_cache_memory=80 << 20, max_model_len=256), CPU, F64)
    staged = LLMEngine(tiny, EngineConfig(kv_cache_memory=80 << 20, max_model_len=256, prompt_prefetch=True,
                                          prefetch_staging_bytes=8 << 20), CPU, F64)
    per_block = plain.executor.worker.memory.bytes_per_block
    assert plain.executor.num_kv_blocks - staged.executor.num_kv_blocks == (8 << 20) // per_block
    assert ecfg.row_bytes == ecfg.head_dim + ecfg.head_dim // 32  # raw MXFP8 rows: values, then one scale per 32


def test_the_command_line_sets_the_engine_options():
    from engram.cli import build_parser
    from engram.commands.options import engine_options

    args = build_parser().parse_args(["serve", "tiny", "--prompt-prefetch", "--prefetch-staging-bytes", "8MiB",
                                      "--no-dedup-rows"])
    cfg = EngineConfig.from_options(engine_options(args))
    assert cfg.prompt_prefetch and cfg.prefetch_staging_bytes == 8 << 20 and not cfg.dedup_rows
    default = EngineConfig.from_options(engine_options(build_parser().parse_args(["serve", "tiny"])))
    assert not default.prompt_prefetch and default.dedup_rows and default.prefetch_staging_bytes == 64 << 20
