"""The step trace's lookup counters (engine/lookup_timing.py, step_trace.py) and ``engram bench serve``'s split of them
by step kind (bench/serve_counters.py), on a real engine on the CPU over real table files (tiers host and disk): the
per-kind numbers add up to the window's totals and to the engine's own totals, and they are not trivial where they
must not be (every eager step measured, the tables' time counted under their tier, prompts' repeated n-grams
deduplicated, the host gap of synchronous steps)."""
from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch

from engram.bench.serve_counters import KINDS, window_counters
from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.engine.step_trace import StepTrace
from engram.model.loader import load_model
from engram.store.options import StoreOptions
from tests.engine_runs import drain

CPU, F64 = torch.device("cpu"), torch.float64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model("tiny", dtype=F64, device=CPU, cache_dir=tmp_path_factory.mktemp("tables"), progress=False)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("tier,options", [("host", {}), ("disk", {"io": "buffered"}),
                                          ("disk", {"io": "buffered", "cache_rows": 500})],
                         ids=["host", "disk", "disk-cache"])
def test_counters_by_kind_add_up_and_measure_what_they_must(tiny, tier, options):
    loaded = dataclasses.replace(tiny, tables={}, tier=tier, store_options=StoreOptions().replace(**options))
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32), CPU, F64)
    phrase = [31, 32, 33, 34, 35, 36]
    for i, prompt in enumerate([phrase * 8, [5] + phrase * 3, list(range(100, 140)), [7, 8, 9]]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1))
    start = time.monotonic()
    drain(engine)
    records, after = engine.step_trace(), engine.stats()
    c = window_counters(records, {}, after, time.monotonic() - start)
    total, kinds = c["lookups"], c["lookups_by_kind"]
    assert {k for k in KINDS if c["steps_by_kind"][k]} >= {"decode", "prefill", "mixed"}
    n_cols, layers = tiny.engram_config.n_cols, len(tiny.engram_config.layer_ids)

    # the kinds add up to the window, and the window (every step since start) to the engine's totals
    for key in ("lookup_exposed_s", "host_gap_s"):
        assert close(sum(kinds[k][key] for k in KINDS), total[key])
    for layer in range(layers):
        for key in ("ids", "unique_ids"):
            assert sum(kinds[k][key][layer] for k in KINDS if kinds[k][key]) == total[key][layer]
    tiers = set(total["gather_s"])
    for t in tiers:
        assert close(sum(kinds[k]["gather_s"].get(t, 0.0) for k in KINDS), total["gather_s"][t])
    assert close(total["lookup_exposed_s"], after["lookup_exposed_s"])
    assert close(total["host_gap_s"], after["host_gap_s"])
    assert sum(total["ids"]) == after["lookup_ids"] and sum(total["unique_ids"]) == after["lookup_unique_ids"]
    assert tiers == set(after["gather_s_by_tier"])

    # non-trivial: every step staged its rows eagerly on the CPU, so every one was measured and waited
    want_tier = tier + ("+cache" if options.get("cache_rows") else "")
    assert tiers == {want_tier}
    assert total["lookup_unmeasured_steps"] == 0
    for r in records:
        assert r.lookup_exposed_s > 0 and r.gather_s[want_tier] > 0
        assert r.ids == (r.num_tokens * n_cols,) * layers and all(0 < u <= i for u, i in zip(r.unique_ids, r.ids))
    for k in ("decode", "prefill", "mixed"):
        assert kinds[k]["lookup_exposed_s"] > 0 and kinds[k]["gather_s"][want_tier] > 0
    assert all(r > 1.5 for r in kinds["prefill"]["dedup_ratio"])  # the phrase repeats 8 times
    # synchronous steps: each launch follows the read of the step before, after its outputs and scheduling
    assert all(r.host_gap_s > 0 for r in records[1:]) and records[0].host_gap_s == 0.0
    # the hot-row cache's hit rate over the run, in the engine's stats and the bench's window
    cache = c["hot_cache"]
    if options.get("cache_rows"):
        layers_stats = after["tables"].values()
        assert cache["hits"] == sum(t["hits"] for t in layers_stats) > 0 and cache["misses"] > 0
        assert cache["hit_rate"] == after["hot_cache"]["hit_rate"] == cache["hits"] / (cache["hits"] + cache["misses"])
        assert cache["bytes"] == after["hot_cache"]["bytes"] > 0
    else:
        assert cache["hit_rate"] is None and cache["bytes"] == 0
    # what the server's GET /engram/steps carries: the records survive JSON
    assert StepTrace.from_json(json.loads(json.dumps(StepTrace.to_json(records)))) == records
