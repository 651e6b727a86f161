"""Host-side row-id deduplication (engine/row_dedup.py): over real table files on every tier, a step planned with
deduplication stages bitwise the rows of the plain, non-deduplicated gather of every planned id, for a batch that
repeats n-grams (and with pending rows patched in, as async scheduling leaves them); the ratio of ids to distinct ids
is what the repeats make it; and greedy tokens are the same with dedup on and off."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.lookup import LookupExecutor
from engram.engine.pending import PendingPatch
from engram.engine.planner import LookupPlanner
from engram.engine.row_dedup import dedupe
from engram.engine.sampling_params import SamplingParams
from engram.engine.step import StepDescription
from engram.hashing import NgramHasher
from engram.model.loader import load_model
from engram.store.options import StoreOptions
from tests.engine_runs import drain

CPU, F64 = torch.device("cpu"), torch.float64
TIERS = [("gpu", {}), ("host", {}), ("host", {"cache_rows": 64}), ("disk", {"io": "buffered"}),
         ("disk", {"io": "buffered", "cache_rows": 64})]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model("tiny", dtype=F64, device=CPU, cache_dir=tmp_path_factory.mktemp("tables"), progress=False)


def repeating_step(loaded, dedup: bool, pending_rows=()):
    """One packed step of two sequences whose prompts repeat a 5-token phrase (its n-grams hash to the same rows)."""
    phrase = [101, 202, 303, 404, 505]
    seqs = [phrase * 6 + [7, 8], [9] + phrase * 4]
    hasher = NgramHasher.from_tokenizer(loaded.engram_config, loaded.compressed_tokenizer)
    flat = [t for s in seqs for t in s]
    compressed = torch.tensor(loaded.compressed_tokenizer.compress(flat, ()), dtype=torch.long)
    cu = torch.tensor([0, len(seqs[0]), len(flat)], dtype=torch.long)
    lookback = hasher.initial_lookback(2)
    plan = LookupPlanner(hasher, dedup=dedup).plan(compressed, cu, lookback, pending_rows=list(pending_rows))
    t = len(flat)
    empty = torch.zeros(t, dtype=torch.long)
    step = StepDescription(step_id=7, seq_ids=[0, 1], start_positions=[0, 0], num_new_tokens=[len(s) for s in seqs],
                           token_ids=torch.tensor(flat), positions=empty, cu_seqlens=cu, context_lens=cu[1:],
                           block_tables=torch.zeros(2, 1, dtype=torch.long), slot_mapping=empty, dead_mask=None,
                           engram_row_ids=plan.row_ids, sample_rows=[], samples=[], engram_dedup=plan.dedup,
                           pending_rows=list(pending_rows))
    return step, plan


@pytest.mark.parametrize("tier,options", TIERS, ids=["gpu", "host", "host-cache", "disk", "disk-cache"])
def test_deduplicated_lookups_stage_the_plain_gathers_rows_bitwise(tiny, tier, options):
    loaded = dataclasses.replace(tiny, tables={}, tier=tier, store_options=StoreOptions().replace(**options))
    tables = loaded.open_tables()
    try:
        executor = LookupExecutor(tables, loaded.engram_config, F64, CPU)
        step, plan = repeating_step(loaded, dedup=True)
        plain_step, _ = repeating_step(loaded, dedup=False)
        assert plain_step.engram_dedup == {} and set(step.engram_dedup) == set(step.engram_row_ids)
        staged, plain = executor.submit(step), executor.submit(plain_step)
        for lid, ids in step.engram_row_ids.items():
            # the reference: every planned id gathered straight from the table, no dedup on the engine's side
            want = tables[lid].gather(ids.reshape(-1), dtype=torch.float32).to(F64).reshape(*ids.shape, -1)
            for got in (staged.rows(lid, 7), plain.rows(lid, 7)):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        ids, unique = plan.dedup_counts()
        assert all(i == step.num_tokens * loaded.engram_config.n_cols for i in ids)
        assert all(i / u > 2.0 for i, u in zip(ids, unique))  # 10 repeats of the phrase: its n-grams recur
        gathered = {lid: t.stats()["rows"] for lid, t in tables.items()}
        assert gathered != {} and all(v > 0 for v in gathered.values())
    finally:
        for t in tables.values():
            t.close()


def test_pending_rows_get_slots_of_their_own_and_expand_to_the_patched_ids(tiny):
    """A step with tokens in flight: their placeholder rows keep slots after the distinct known ids, the patch fills
    them, and the expansion is the patched plain ids row for row (on the host path and the device path)."""
    step, _ = repeating_step(tiny, dedup=True, pending_rows=[31, 52])
    tables = tiny.open_tables()
    g = torch.Generator().manual_seed(1)
    row_ids = {lid: torch.randint(0, t.rows, (2, tiny.engram_config.n_cols), generator=g) for lid, t in tables.items()}
    patch = PendingPatch(torch.tensor([31, 52]), torch.tensor([5, 6]), row_ids, None)
    for lid, ids in step.engram_row_ids.items():
        dd = step.engram_dedup[lid]
        want = patch.patched(ids, row_ids[lid]).reshape(-1)
        assert torch.equal(dd.patched_unique(row_ids[lid])[dd.inverse], want)
        assert dd.num_unique == dd.num_known + 2 * tiny.engram_config.n_cols
    executor = LookupExecutor(tables, tiny.engram_config, F64, CPU)
    staged = executor.submit(step, patch)  # CPU tables take the patched ids on the host
    plain = dataclasses.replace(step, engram_dedup={})
    ref = executor.submit(plain, patch)
    for lid in step.engram_row_ids:
        assert torch.equal(staged.rows(lid, 7).view(torch.uint8), ref.rows(lid, 7).view(torch.uint8))


def test_dedupe_without_pending_rows_is_numpy_unique():
    ids = torch.tensor([[5, 3, 5], [3, 9, 9]])
    dd = dedupe(ids)
    assert dd.unique.tolist() == [3, 5, 9] and torch.equal(dd.unique[dd.inverse], ids.reshape(-1))


def test_tokens_equal_with_dedup_on_and_off(tiny):
    phrase = [11, 12, 13, 14]
    reqs = [phrase * 9, [3] + phrase * 5 + [99], list(range(40, 61))]

    def run(dedup: bool):
        engine = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, dedup_rows=dedup), CPU, F64)
        for i, ids in enumerate(reqs):
            engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                            logprobs=2))
        return drain(engine), engine.stats()

    (on, son), (off, soff) = run(True), run(False)
    assert on == off
    assert son["lookup_ids"] == soff["lookup_ids"] == soff["lookup_unique_ids"] > son["lookup_unique_ids"]
