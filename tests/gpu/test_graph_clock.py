"""GraphClock stamps (benchmarks/graph_clock.py) inside CUDA graphs, and the first Engram layer's wait read from
them in decode replays (skipped without CUDA). The CPU side of the clock and of the reading is in
tests/unit/test_replay_timeline.py."""
from __future__ import annotations

import pytest
import torch

import engram
import engram.engine.lookup_stream as lookup_stream
from benchmarks.graph_clock import GraphClock, install
from benchmarks.replay_timeline import clock_timeline
from engram.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_stamps_in_a_graph_replay_order_two_streams():
    clock = GraphClock("cuda")
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    clock.stamp("fork")  # eager warm-up compiles the stamp kernel before the capture
    with torch.cuda.graph(graph):
        clock.stamp("fork")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000)  # ~1 ms
            clock.stamp("side_done")
        clock.stamp("main_free")
        torch.cuda.current_stream().wait_stream(side)
        clock.stamp("joined")
    for _ in range(2):
        graph.replay()
        got = clock.read()
        assert all(got[n] > 0 for n in ("fork", "side_done", "main_free", "joined"))
        assert got["fork"] <= got["main_free"] < got["side_done"] <= got["joined"]
        assert got["side_done"] - got["fork"] > 300_000  # the spin, in ns


def test_the_clock_sees_a_delayed_lookup_as_exposed_in_decode_replays(tmp_path, monkeypatch):
    """tiny, tier host, overlap on, graphs: without a delay the first Engram layer barely waits; with the
    lookup stream spun ~5 ms before its gathers, the stamps show that wait (and the lookup's length)."""
    readings = {}
    for delay in (0, 10_000_000):
        monkeypatch.setattr(lookup_stream, "DELAY_CYCLES", delay)
        clock = GraphClock("cuda")
        install(clock, monkeypatch.setattr)
        llm = engram.LLM("tiny", tier="host", dtype=torch.float32, cache_dir=str(tmp_path),
                         engram_config={"lookup_overlap": True}, max_num_seqs=4)
        engine = llm.engine
        for i in range(4):
            engine.add_request(f"r{i}", [5 + i, 17, 99, 4 + 3 * i], SamplingParams(temperature=0.0, max_tokens=12,
                                                                                   ignore_eos=True))
        for _ in range(4):
            engine.step()
        replays = engine.stats()["graph_replays"]
        clock.read_snapshots()
        for _ in range(4):
            engine.step()
            clock.snapshot()
        assert engine.stats()["graph_replays"] - replays == 4
        layers = sorted(llm.loaded.engram_config.layer_ids)
        readings[delay] = [clock_timeline(s, layers) for s in clock.read_snapshots()]
    quiet, delayed = readings[0], readings[10_000_000]
    assert max(t.exposed_us for t in quiet) < 500
    assert min(t.exposed_us for t in delayed) > 2_000 and min(t.lookup_us for t in delayed) > 2_000
    assert all(t.bound_us >= 0.8 * t.exposed_us for t in delayed)  # the wait is the lookup not yet done
