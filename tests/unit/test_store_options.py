"""StoreOptions: one validated object for every runtime option of a table; the host route fixed at open."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.config import EngramConfig
from engram.model.tables import open_tables
from engram.quant import quantize_mxfp8
from engram.store import StoreOptions, kernels, open_table, write_table
from engram.store.options import AdvancedOptions
from engram.store.host_route import HostRoute
from engram.store.kernels.uva import RouteBands

ROWS = 700


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    d = tmp_path_factory.mktemp("opts") / "t"
    v, s = quantize_mxfp8(torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(0)))
    write_table(d, v, s)
    return d


@pytest.mark.parametrize("key,value,rule", [
    ("queue_depth", 0, "must be in [1, 1024]"), ("queue_depth", 5000, "must be in [1, 1024]"),
    ("io", "mmap", "must be one of ['direct', 'buffered']"), ("cache_policy", "fifo", "must be one of"),
    ("host_layout", "rows", "must be one of"), ("cache_rows", -1, "must be >= 0"), ("cache_ways", 0, "must be >= 1"),
    ("max_inflight", 0, "must be >= 1"), ("chunk_pages", 0, "must be >= 1"), ("load_threads", 0, "must be >= 1"),
    ("staged_chunk_rows", 0, "must be >= 1"), ("verify", "yes", "must be true or false"),
    ("uva_max_programs", -1, "must be >= 0"),
    ("uva_tiles_per_program", 0, "must be >= 1"),
    ("count_unique", 1, "must be true or false"), ("queue_depth", True, "must be int"),
    ("queue_depth", 6.0, "must be int"), ("sorted_min_rows", 10, "must be >= 32768"),
])
def test_errors_name_the_key_and_the_value(key, value, rule):
    advanced = key in AdvancedOptions.KEYS  # tuning knobs are spelled under "advanced"
    with pytest.raises(ValueError) as e:
        StoreOptions.from_dict({"advanced": {key: value}} if advanced else {key: value})
    assert str(e.value).startswith(f"engram_config.{'advanced.' if advanced else ''}{key}={value!r}: ")
    assert rule in str(e.value)


def test_a_tuning_knob_at_the_top_level_is_refused_with_where_it_goes():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['load_threads'\].*go under \"advanced\""):
        StoreOptions.from_dict({"load_threads": 4})
    with pytest.raises(ValueError, match=r"engram_config.advanced has unknown key\(s\) \['io'\]"):
        StoreOptions.from_dict({"advanced": {"io": "buffered"}})
    assert StoreOptions.KEYS == ("cache_rows", "cache_bytes", "cache_policy", "io", "queue_depth", "shared_memory",
                                 "advanced")


def test_unknown_keys_are_listed_with_the_known_ones():
    with pytest.raises(ValueError) as e:
        StoreOptions.from_dict({"queue_depht": 8, "cache_rows": 4, "zzz": 1})
    msg = str(e.value)
    assert "unknown key(s) ['queue_depht', 'zzz']" in msg
    assert all(repr(k) in msg for k in StoreOptions.KEYS)
    assert StoreOptions.KEYS == tuple(f.name for f in dataclasses.fields(StoreOptions))


def test_defaults_and_round_trip():
    o = StoreOptions()
    a = o.advanced
    assert not a.count_unique and not a.check_device_ids and not a.background_verify and a.verify
    assert StoreOptions.from_dict(o.to_dict()) == o
    assert StoreOptions.from_dict(None) == o
    assert o.replace(io="buffered").io == "buffered"
    assert o.replace(load_threads=3).advanced.load_threads == 3  # either level by name
    assert StoreOptions.from_dict({"advanced": {"load_threads": 3}}) == o.replace(load_threads=3)
    assert a.route_bands == RouteBands()
    with pytest.raises(ValueError, match="engram_config.io='x'"):
        o.replace(io="x")


@pytest.mark.parametrize("tier,kw", [("gpu", {"count_unique": True}), ("host", {"cache_rows": 64, "cache_ways": 4}),
                                     ("host", {"host_layout": "split", "staged_min_rows": 64, "sorted_min_rows": 128}),
                                     ("disk", {"io": "buffered", "queue_depth": 3, "chunk_pages": 2,
                                               "cache_bytes": 9000})])
def test_open_table_with_options_equals_keywords(table, tier, kw):
    ids = torch.randint(0, ROWS, (300,), generator=torch.Generator().manual_seed(2))
    with open_table(table, tier, "cpu", options=StoreOptions().replace(**kw)) as a, open_table(table, tier, "cpu", **kw) as b:
        assert a.options == b.options == StoreOptions().replace(**kw)
        assert torch.equal(a.gather(ids).view(torch.uint8), b.gather(ids).view(torch.uint8))
        assert a.stats() == b.stats()
        if a.cache is not None:
            assert a.cache.capacity == b.cache.capacity and a.cache.ways == b.cache.ways
    with open_table(table, "disk", "cpu", 0, "lru", "buffered", 7) as c:  # the old positional form
        assert (c.options.io, c.options.queue_depth) == ("buffered", 7)
    with open_table(table, "disk", "cpu", options=StoreOptions(io="buffered", queue_depth=5), queue_depth=9) as c:
        assert c.options.queue_depth == 9  # keywords override the options object


def test_open_table_refuses_bad_options_before_reading(tmp_path):
    with pytest.raises(ValueError, match="engram_config.queue_depth=0"):
        open_table(tmp_path / "missing", "disk", queue_depth=0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['cache_size'\]"):
        open_table(tmp_path / "missing", "host", cache_size=4)


def test_host_route_is_decided_at_open(table, monkeypatch, backend):
    bands = {"staged_min_rows": 100, "sorted_min_rows": 1000, "staged_chunk_rows": 7}
    with open_table(table, "host", "cpu", uva_max_programs=12, uva_tiles_per_program=3, **bands) as t:
        assert t.route == HostRoute("reference", RouteBands(100, 1000, 7), 12, 3)  # no CUDA rows: torch on the CPU
        calls = []
        monkeypatch.setattr(kernels, "fast_path", lambda *a, **k: calls.append(a) or "uva")
        backend("triton")  # neither the backend nor the dispatch is consulted again per lookup
        for n in (1, 150, 2000):
            t.gather(torch.arange(n) % ROWS)
        assert calls == []


def test_route_bands():
    b = RouteBands(100, 1000)
    assert [b.route(n) for n in (99, 100, 999, 1000)] == ["direct", "staged", "staged", "sorted"]
    # ids already on the GPU never take the staged route (its CPU gather would copy them back: a sync)
    assert [b.route(n, ids_on_cpu=False) for n in (99, 100, 999, 1000)] == ["direct", "sorted", "sorted", "sorted"]
    assert HostRoute("reference", b).route(5000, True) == "reference"


def test_open_tables_takes_options_or_a_validated_dict(tmp_path):
    from engram.model.tables import ensure_preset_tables
    cfg = EngramConfig.preset("tiny")
    dirs = ensure_preset_tables(cfg, 0, cache_dir=tmp_path, progress=False)
    tables = open_tables(dirs, cfg, "host", "cpu", {"cache_rows": 32})
    assert all(t.options.cache_rows == 32 and t.cache is not None for t in tables.values())
    tables = open_tables(dirs, cfg, "disk", "cpu", StoreOptions(io="buffered"))
    assert all(t.options.io == "buffered" for t in tables.values())
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['seed'\]; known keys: \['cache_rows'"):
        open_tables(dirs, cfg, "gpu", "cpu", {"seed": 1})
