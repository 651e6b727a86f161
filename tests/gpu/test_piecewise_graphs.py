"""Piecewise decode graphs (engine/cuda_graphs.py, ``PIECEWISE``) on CUDA (skipped without a GPU): for tables
whose rows are copied in before a replay (the disk tier, hot-row caches), one graph per layer range, cut at
each Engram layer.

* The same kernels at the same shapes as the one-graph replay: tokens and logprobs bitwise equal.
* The host waits for a later Engram layer's reads only after the pieces before it were launched.
"""
from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

import engram.engine.cuda_graphs as cuda_graphs
import engram.engine.lookup as lookup_mod
from engram.engine import step_lookups
from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from engram.store import late_caching
from engram.store.options import StoreOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
CFG = dict(max_num_seqs=8, max_model_len=256)


def disk_model(tmp_path, options: dict):
    base = load_model("tiny", dtype=torch.float32, device=CUDA, cache_dir=tmp_path, progress=False)
    return dataclasses.replace(base, tables={}, tier="disk", store_options=StoreOptions(**options))


def generate(engine, n: int = 6) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    for i in range(n):
        engine.add_request(f"r{i}", f"Rows come from the disk {i} " * (1 + i % 4), params)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o.outputs[0]
    return [(out[f"r{i}"].token_ids, [(lp.logprob, lp.top) for lp in out[f"r{i}"].logprobs]) for i in range(n)]


@pytest.mark.parametrize("options", [{"io": "buffered"}, {"io": "buffered", "cache_rows": 300}],
                         ids=["disk", "disk-cache"])
def test_piecewise_replays_equal_the_one_graph_replays_bitwise(tmp_path, monkeypatch, options):
    monkeypatch.setattr(cuda_graphs, "PIECEWISE", False)  # the reference: one graph per bucket
    whole_engine = LLMEngine(disk_model(tmp_path, options), EngineConfig(**CFG), CUDA, torch.float32)
    assert not whole_engine.executor.worker.graphs.ranges
    whole = generate(whole_engine)
    monkeypatch.setattr(cuda_graphs, "PIECEWISE", True)
    engine = LLMEngine(disk_model(tmp_path, options), EngineConfig(**CFG), CUDA, torch.float32)
    graphs = engine.executor.worker.graphs
    assert graphs.ranges == [(0, 1, None), (1, 3, 1), (3, 4, 3)]  # tiny: Engram at layers 1 and 3 of 4
    assert all(len(p) == 3 for p in graphs.pieces.values()) and not graphs.graphs
    assert generate(engine) == whole
    assert engine.stats()["graph_replays"] > 0


@pytest.mark.parametrize("in_graph", [True, False], ids=["decoded-in-graph", "rows-copied-in"])
def test_the_host_waits_for_a_later_layers_rows_after_the_pieces_before_it_launched(tmp_path, monkeypatch, in_graph):
    monkeypatch.setattr(cuda_graphs, "PIECEWISE", True)
    monkeypatch.setattr(cuda_graphs, "DISK_DECODE_IN_GRAPH", in_graph)
    engine = LLMEngine(disk_model(tmp_path, {"io": "buffered"}), EngineConfig(**CFG), CUDA, torch.float32)
    worker = engine.executor.worker
    log: list[str] = []

    class Logged:
        def __init__(self, graph, k):
            self.graph, self.k = graph, k

        def replay(self):
            log.append(f"piece {self.k}")
            self.graph.replay()

    for size, pieces in worker.graphs.pieces.items():
        worker.graphs.pieces[size] = [Logged(g, k) for k, g in enumerate(pieces)]
    table = worker.lookup.tables[3]
    real = table.submit

    class LoggedHandle:
        def __init__(self, inner):
            self.inner = inner

        def done(self):
            return False  # still reading: the executor defers the layer

        def wait(self):
            log.append("wait 3")
            return self.inner.wait()

        def cancel(self):
            return self.inner.cancel()

    monkeypatch.setattr(table, "submit", lambda ids, dtype=torch.bfloat16, **kw: LoggedHandle(real(ids, dtype=dtype,
                                                                                                   **kw)))
    first_table = worker.lookup.tables[1]
    first_lookup = "read_slab" if in_graph else "gather"  # in the graph's slab, or rows copied in
    real_gather = getattr(first_table, first_lookup)

    def logged_gather(*a, **k):
        log.append("gather 1")
        return real_gather(*a, **k)

    monkeypatch.setattr(first_table, first_lookup, logged_gather)
    real_ids_wait = lookup_mod.HostIds.wait

    def logged_ids_wait(self):
        log.append("ids")
        return real_ids_wait(self)

    monkeypatch.setattr(lookup_mod.HostIds, "wait", logged_ids_wait)
    generate(engine, n=4)
    decode = [i for i, e in enumerate(log) if e == "piece 0"]
    assert decode, "no piecewise replay ran"
    first = decode[-1]  # the last decode step: piece 0 (embedding, layer 0) is launched before layer 1's
    # lookup runs (ChainedLookups), then piece 1, the wait for layer 3's reads, piece 2; with the rows decoded
    # in the graph the host waits for the step's row ids only once piece 0 is queued (DecodeGraphs.begin)
    rest = ["gather 1", "piece 1", "wait 3", "piece 2"]
    if in_graph:
        assert log[first:first + 6] == ["piece 0", "ids", *rest]
    else:
        assert log[first - 1:first + 5] == ["ids", "piece 0", *rest]


@pytest.mark.parametrize("late", [False, True], ids=["cached-at-finish", "cached-late"])
@pytest.mark.parametrize("together", [False, True, "at-first-read"],
                         ids=["first-alone", "reads-together", "reads-together-at-first-read"])
@pytest.mark.parametrize("probe", [True, False], ids=["probed", "host-slots"])
@pytest.mark.parametrize("background", [True, False], ids=["lookups-beside", "lookups-inline"])
@pytest.mark.parametrize("options", [{"io": "buffered"}, {"io": "buffered", "cache_rows": 300},
                                     {"io": "buffered", "cache_rows": 16}, {"io": "buffered", "cache_rows": 50_000}],
                         ids=["disk", "disk-cache", "disk-cache-spilling", "disk-cache-whole"])
def test_disk_rows_decoded_inside_the_pieces_equal_rows_copied_in(tmp_path, monkeypatch, caplog, options, probe,
                                                                  background, together, late):
    """DISK_DECODE_IN_GRAPH: the step's lookups only read pages into each layer's slab (with a hot-row cache:
    through the cache, the slots pointing into its storage, a cache of 16 rows spilling into its overflow
    rows) and the piece decodes them; tokens and logprobs are bitwise those of rows decoded on the host side
    and copied in. With CACHE_PROBE the pieces over a cache find their slots on the device, queued before the
    step's lookups: they wait for new rows, and a second pass over a cache that holds the tables finds every
    row without waiting. Their lookups run on the Worker's background thread (step_lookups.BACKGROUND) or
    inline in DecodeGraphs.run; with the lookups together (lookup.reads_together: FIRST_LOOKUP_ALONE off here;
    the same path as TOGETHER_WHEN_DEEP's at a step whose ids fill the read queue) the second layer's reads are
    submitted before the first layer's lookup runs, or (LATER_AT_FIRST_READ) right before its first read. With
    late caching (store/late_caching.py) each step's rows read are cached during the next step's lookups, beside
    the pieces already queued for it."""
    if together and not (probe and background):
        pytest.skip("reads together: measured over probed slabs with background lookups, the cached disk tier")
    monkeypatch.setattr(lookup_mod, "FIRST_LOOKUP_ALONE", not together)
    monkeypatch.setattr(lookup_mod, "TOGETHER_WHEN_DEEP", False)  # first-alone: every step, whatever its size
    monkeypatch.setattr(lookup_mod, "LATER_AT_FIRST_READ", together == "at-first-read")
    if late and not (probe and "cache_rows" in options):
        pytest.skip("late caching: probed slabs over a cache")
    monkeypatch.setattr(late_caching, "DEFER", late)
    if probe and "cache_rows" not in options:
        pytest.skip("no cache to probe")
    if not probe and not background:
        pytest.skip("only probed steps run their lookups in the background")
    monkeypatch.setattr(step_lookups, "BACKGROUND", background)
    monkeypatch.setattr(cuda_graphs, "PIECEWISE", True)
    monkeypatch.setattr(cuda_graphs, "DISK_DECODE_IN_GRAPH", False)
    monkeypatch.setattr(cuda_graphs, "CACHE_PROBE", probe)
    copied = generate(LLMEngine(disk_model(tmp_path, options), EngineConfig(**CFG), CUDA, torch.float32))
    monkeypatch.setattr(cuda_graphs, "DISK_DECODE_IN_GRAPH", True)
    engine = LLMEngine(disk_model(tmp_path, options), EngineConfig(**CFG), CUDA, torch.float32)
    graphs = engine.executor.worker.graphs
    assert sorted(graphs.slabs) == [1, 3]
    assert graphs.probes_all == probe
    reads, threads = [], set()

    def logged(real, lid):
        def read_slab(ids, slab, plan=None):
            reads.append(lid)
            threads.add(threading.current_thread().name.split("_")[0])
            return real(ids, slab, plan)
        return read_slab

    for lid, table in graphs.slab_tables.items():
        monkeypatch.setattr(table, "read_slab", logged(table.read_slab, lid))
    with caplog.at_level(logging.WARNING, logger="engram.engine.stepping"):
        assert generate(engine) == copied
    assert not caplog.records, "a step failed and ran again"  # e.g. a piece's wait that gave up
    assert engine.stats()["graph_replays"] > 0 and reads.count(1) > 0  # the first layer read into its slab
    if probe:  # the first layer's lookup ran on the waiting thread: the background one, or this one
        assert graphs.probe_counts["waited"] > 0
        assert ("engram-step-lookups" in threads) == background
        if options["cache_rows"] > 1000:
            waited = graphs.probe_counts["waited"]
            with caplog.at_level(logging.WARNING, logger="engram.engine.stepping"):
                assert generate(engine) == copied
            assert not caplog.records
            assert graphs.probe_counts["found"] > 0 and graphs.probe_counts["waited"] == waited
