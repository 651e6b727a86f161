"""A failing disk read fails its step, never the engine: the tiny model on the disk tier, the first Engram
layer's values.bin overwritten on disk so that every page fails its CRC32C. Every failed step must drop
the lookups it started, or after ``max_inflight`` failures every later step would be refused."""
from __future__ import annotations

import shutil
import time

import pytest

import engram
from engram.engine.sampling_params import SamplingParams
from engram.store.page_crc import CorruptPageError

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_repeated_read_errors_leave_no_lookup_in_flight_and_the_engine_recovers(tmp_path, async_scheduling):
    llm = engram.LLM("tiny", tier="disk", cache_dir=str(tmp_path), engram_config={"io": "buffered"},
                     max_num_seqs=4, async_scheduling=async_scheduling)
    engine = llm.engine
    tables = engine.executor.worker.tables
    want = llm.generate([[5, 17, 99, 4]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    values = tables[min(tables)].manifest.values_path  # the first Engram layer: the step waits for it at once
    shutil.copyfile(values, tmp_path / "values.bak")
    size = values.stat().st_size
    with open(values, "r+b") as f:
        f.write(b"\0" * size)  # every page now fails its checksum
    limit = tables[min(tables)].options.advanced.max_inflight
    for i in range(limit + 3):
        engine.add_request(f"bad{i}", [5, 17, 99, 4 + i], PARAMS)
        with pytest.raises(CorruptPageError) as err:
            engine.step()
        assert err.value.request_ids == [f"bad{i}"]
        assert engine.abort_request(f"bad{i}")
    deadline = time.monotonic() + 10  # a dropped lookup whose reads were running frees its slot when they end
    while any(t.stats()["inflight"] for t in tables.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert {lid: t.stats()["inflight"] for lid, t in tables.items()} == {lid: 0 for lid in tables}
    assert tables[min(tables)].stats()["corrupt_pages"] > 0
    shutil.copyfile(tmp_path / "values.bak", values)  # the disk is good again
    assert llm.generate([[5, 17, 99, 4]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_table_that_goes_bad_mid_generation_fails_the_running_requests_only(tmp_path, async_scheduling):
    """Two requests decoding when every page of a table starts failing: the step fails naming both (async:
    the step launched ahead fails, the one before it is still read), nothing leaks, and once the file is
    good again new requests get the tokens of a clean run."""
    from engram.engine.engine import StepError

    llm = engram.LLM("tiny", tier="disk", cache_dir=str(tmp_path), engram_config={"io": "buffered"},
                     max_num_seqs=4, async_scheduling=async_scheduling)
    engine = llm.engine
    tables = engine.executor.worker.tables
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([[5, 17, 99, 4], [6, 18, 98]], params, use_tqdm=False)]
    values = tables[min(tables)].manifest.values_path
    shutil.copyfile(values, tmp_path / "values.bak")
    engine.add_request("a", [5, 17, 99, 4], params)
    engine.add_request("b", [6, 18, 98], params)
    for _ in range(3):
        engine.step()
    with open(values, "r+b") as f:
        f.write(b"\0" * values.stat().st_size)
    failed = []
    for _ in range(4):  # async: the step already launched may still come back before the failing one
        try:
            engine.step()
        except (StepError, CorruptPageError) as e:
            failed = sorted(e.request_ids)
            break
    assert failed == ["a", "b"]
    for rid in failed:
        engine.abort_request(rid)
    assert not engine.has_unfinished()
    shutil.copyfile(tmp_path / "values.bak", values)
    deadline = time.monotonic() + 10
    while any(t.stats()["inflight"] for t in tables.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(t.stats()["inflight"] == 0 for t in tables.values())
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    got = [o.outputs[0].token_ids for o in llm.generate([[5, 17, 99, 4], [6, 18, 98]], params, use_tqdm=False)]
    assert got == want
