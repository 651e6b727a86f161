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


def test_repeated_read_errors_leave_no_lookup_in_flight_and_the_engine_recovers(tmp_path):
    llm = engram.LLM("tiny", tier="disk", cache_dir=str(tmp_path), engram_config={"io": "buffered"},
                     max_num_seqs=4)
    engine = llm.engine
    tables = engine.executor.worker.tables
    want = llm.generate([[5, 17, 99, 4]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    values = tables[min(tables)].manifest.values_path  # the first Engram layer: the step waits for it at once
    shutil.copyfile(values, tmp_path / "values.bak")
    size = values.stat().st_size
    with open(values, "r+b") as f:
        f.write(b"\0" * size)  # every page now fails its checksum
    limit = tables[min(tables)].options.max_inflight
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
