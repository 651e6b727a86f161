"""Lookup overlap on CUDA (skipped without a GPU): Engram gathers on their own stream, an event per layer.

* Equal: tokens and logprobs bitwise equal with ``lookup_overlap`` on and off through ``LLM.generate``
  (64 concurrent greedy requests of unequal lengths, chunked prefill, forced preemptions), tiers gpu, host,
  host with a hot-row cache and disk, CUDA graphs on and off, float32; the decode graphs really replay with
  the lookup branch captured, and their stale-row flags (read back with every step's tokens) stay clear.
* Overlapping: a profile of a decode step finds the lookup stream's kernels (its gathers, projections and
  the test's spin before them) running while kernels of the main stream run; a synchronous implementation,
  where the main stream waits for the lookups before its first layer, cannot.
* Exposed time: with the lookup stream delayed, ``engine.stats()["lookup_exposed_s"]`` (the
  ``engram_lookup_exposed_seconds`` metric) counts the consumers' waits.
* A race detector that can fail: with the lookup stream delayed (``DELAY_CYCLES``) and the consumers'
  waits dropped (``DROP_WAIT``), layers read rows before their gather wrote them, and the run must differ
  from the reference or be stopped (eager: the Worker's idle check; graphs: the stale-row flags); with the
  waits kept, the same delay must change nothing.
"""
from __future__ import annotations

import pytest
import torch

import engram
import engram.engine.lookup_stream as lookup_stream
from engram.bench.device_time import cuda_kernels
from engram.engine.runners.graphs import GraphRunner
from engram.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def prompts(n: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    lengths = [3, 150, 9, 33, 64, 5, 97, 17, 2, 120, 48, 7, 70, 26, 11, 88]
    return [torch.randint(3, 4096, (lengths[i % 16] + i // 16,), generator=g).tolist() for i in range(n)]


TIERS = {"gpu": ("gpu", {}), "host": ("host", {}), "host-cache": ("host", {"cache_rows": 500}),
         "disk": ("disk", {"io": "buffered"})}


def run(tmp_path, overlap: bool, tier: str = "gpu", eager: bool = False, n: int = 16, **engine):
    where, options = TIERS[tier]
    llm = engram.LLM("tiny", tier=where, dtype=torch.float32, cache_dir=str(tmp_path),
                     engram_config={"lookup_overlap": overlap, **options},
                     enforce_eager=eager, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts(n), params, use_tqdm=False)
    worker = llm.engine.executor.worker
    assert (worker.lookup_stream is not None) == overlap
    if overlap:
        assert worker.lookup_stream.idle()
    got = [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]
    return got, llm


@pytest.mark.parametrize("tier,eager", [("gpu", False), ("gpu", True), ("host", False), ("host", True),
                                        ("host-cache", False), ("disk", False)],
                         ids=["gpu-graphs", "gpu-eager", "host-graphs", "host-eager", "host-cache", "disk"])
def test_overlap_on_equals_off_bitwise(tmp_path, tier, eager):
    """Tiers whose gathers are in the graph (the graph runner) run both ways; the hot-row cache and the disk
    tier (the piecewise runner) stage or read their rows through the executor in graph and eager steps alike,
    so their graph runs cover both."""
    # 48 blocks of 8 tokens for 64 sequences of up to 170 tokens: preemptions are certain
    cfg = dict(max_num_seqs=64, max_num_batched_tokens=64, block_size=8, num_kv_blocks=48, max_model_len=192)
    off, _ = run(tmp_path, False, tier, eager, n=64, **cfg)
    on, llm = run(tmp_path, True, tier, eager, n=64, **cfg)
    assert on == off
    assert llm.engine.num_preemptions > 0
    if not eager:
        assert llm.engine.stats()["graph_replays"] > 0
        graphs = llm.engine.executor.worker.runners[0]
        in_graph = isinstance(graphs, GraphRunner)
        assert in_graph == (tier in ("gpu", "host"))  # the lookup branch is in the graph
        if in_graph:
            assert graphs.stale is not None and not graphs.stale.any() and (graphs.row_tags >= 0).all()


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_profile_shows_the_lookup_stream_running_beside_the_main_stream(tmp_path, monkeypatch, eager):
    from torch.profiler import ProfilerActivity, profile

    # ~10 ms on the lookup stream before its gathers, set before the graphs are captured (a replay runs no
    # Python). It outlasts the host's preparation of an eager step (its first main-stream kernel comes
    # ~0.1-0.5 ms after the lookups are issued, more under the profiler's CPU activity: with ~2 ms the eager
    # case failed once in four H200 runs), so the main stream's embedding and layer 0 run during it
    monkeypatch.setattr(lookup_stream, "DELAY_CYCLES", 20_000_000)
    llm = engram.LLM("tiny", tier="host", dtype=torch.float32, cache_dir=str(tmp_path),
                     engram_config={"lookup_overlap": True}, enforce_eager=eager, max_num_seqs=4)
    engine = llm.engine
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    side = engine.executor.worker.lookup_stream.stream.stream_id
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof.profiler.kineto_results.events())  # (start, end, stream, name)
    gathers = [k for k in kernels if "gather" in k[3].lower()]
    assert gathers, "no gather kernel in the profile"
    streams = {k[2] for k in gathers}
    assert len(streams) == 1, f"gathers ran on several streams {streams}"
    lookup = [k for k in kernels if k[2] in streams]  # the spin, the gathers and the projections
    main = [k for k in kernels if k[2] not in streams]
    assert main, f"every kernel ran on the lookup stream {streams} (side stream id {side})"
    overlapping = [(g, m) for g in lookup for m in main if g[0] < m[1] and m[0] < g[1]]
    assert overlapping, "no lookup-stream kernel ran while a main-stream kernel ran: the lookups did not overlap"
    # the main stream's first kernels (embedding, layer 0) start before the lookup stream's last gather ends
    assert min(m[0] for m in main) < max(g[1] for g in gathers)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_race_detector_catches_a_dropped_wait_and_passes_with_the_wait(tmp_path, monkeypatch, eager):
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64)
    ref, _ = run(tmp_path, False, "gpu", eager, **cfg)
    monkeypatch.setattr(lookup_stream, "DELAY_CYCLES", 20_000_000)  # ~10 ms: later than any layer that reads
    kept, llm = run(tmp_path, True, "gpu", eager, **cfg)
    assert kept == ref  # delayed gathers, waited for: nothing changes
    if eager:  # every eager step's first Engram layer waited for most of the ~10 ms spin (the host's
        # preparation of the step hides the rest: 4.6 ms a step was measured); graph replays are not timed
        exposed = llm.engine.stats()["lookup_exposed_s"]
        assert exposed > 0.001 * llm.engine.num_steps, exposed
    else:
        assert llm.engine.stats()["graph_replays"] > 0
    monkeypatch.setattr(lookup_stream, "DROP_WAIT", True)
    try:
        raced, _ = run(tmp_path, True, "gpu", eager, **cfg)
    except RuntimeError as e:  # eager: the Worker's idle check; graphs: the stale-row flags
        # the step that failed first is re-run to isolate the failing requests; the error raised is the
        # re-run's, so the detection that fired first is found along the exception chain
        chain = []
        while e is not None and len(chain) < 20:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        wanted = "lookup stream still runs" if eager else "stale Engram rows"
        assert any(wanted in m for m in chain), chain
    else:
        assert raced != ref, "layers read rows before their gathers and nothing changed: the detector is blind"
    finally:
        torch.cuda.synchronize()
