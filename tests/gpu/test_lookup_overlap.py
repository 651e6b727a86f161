"""Lookup overlap on CUDA (skipped without a GPU): Engram gathers on their own stream, an event per layer.

* Equal: tokens and logprobs bitwise equal with ``lookup_overlap`` on and off through ``LLM.generate``
  (16 concurrent greedy requests of unequal lengths, chunked prefill, a forced preemption), tiers gpu and
  host, CUDA graphs on and off, float32; the decode graphs really replay with the lookup branch captured.
* Overlapping: a profile of a decode step finds a kernel of the lookup stream running while a kernel of
  the main stream runs (a synchronous implementation, one stream, cannot).
* Exposed time: with the lookup stream delayed, ``engine.stats()["lookup_exposed_s"]`` (the
  ``engram_lookup_exposed_seconds`` metric) counts the consumers' waits.
* A race detector that can fail: with the lookup stream delayed (``DELAY_CYCLES``) and the consumers'
  waits dropped (``DROP_WAIT``), layers read rows before their gather wrote them, and the run must differ
  from the reference or be stopped by the Worker's idle check; with the waits kept, the same delay must
  change nothing.
"""
from __future__ import annotations

import pytest
import torch

import engram
import engram.engine.lookup_stream as lookup_stream
from engram.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def prompts(n: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    lengths = [3, 150, 9, 33, 64, 5, 97, 17, 2, 120, 48, 7, 70, 26, 11, 88][:n]
    return [torch.randint(3, 4096, (n_,), generator=g).tolist() for n_ in lengths]


def run(tmp_path, overlap: bool, tier: str = "gpu", eager: bool = False, **engine):
    llm = engram.LLM("tiny", tier=tier, dtype=torch.float32, cache_dir=str(tmp_path),
                     engram_config={"lookup_overlap": overlap}, enforce_eager=eager, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts(), params, use_tqdm=False)
    worker = llm.engine.executor.worker
    assert (worker.lookup_stream is not None) == overlap
    if overlap:
        assert worker.lookup_stream.idle()
    got = [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]
    return got, llm


@pytest.mark.parametrize("tier", ["gpu", "host"])
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_overlap_on_equals_off_bitwise(tmp_path, tier, eager):
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64, block_size=16, num_kv_blocks=40, max_model_len=192)
    off, _ = run(tmp_path, False, tier, eager, **cfg)
    on, llm = run(tmp_path, True, tier, eager, **cfg)
    assert on == off
    assert llm.engine.num_preemptions > 0
    if not eager:
        assert llm.engine.stats()["graph_replays"] > 0


def _kernels_by_stream(prof):
    """(start, end, stream, name) of every CUDA kernel in a profile."""
    from torch.autograd import DeviceType

    out = []
    for evt in prof.profiler.kineto_results.events():
        if evt.device_type() == DeviceType.CUDA and "Memcpy" not in evt.name() and "Memset" not in evt.name():
            out.append((evt.start_ns(), evt.end_ns(), evt.device_resource_id(), evt.name()))
    return out


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_profile_shows_the_lookup_stream_running_beside_the_main_stream(tmp_path, monkeypatch, eager):
    from torch.profiler import ProfilerActivity, profile

    # ~0.1 ms on the lookup stream before its gathers, set before the graphs are captured (a replay runs no
    # Python): the gathers then certainly run while the embedding and layer 0 compute on the main stream
    monkeypatch.setattr(lookup_stream, "DELAY_CYCLES", 200_000)
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
    kernels = _kernels_by_stream(prof)
    lookup = [k for k in kernels if "gather" in k[3].lower()]
    assert lookup, "no gather kernel in the profile"
    streams = {k[2] for k in lookup}
    main = [k for k in kernels if k[2] not in streams]
    assert main, f"every kernel ran on the lookup stream(s) {streams} (side stream id {side})"
    overlapping = [(g, m) for g in lookup for m in main if g[0] < m[1] and m[0] < g[1]]
    assert overlapping, "no gather ran while a main-stream kernel ran: the lookups did not overlap"


def test_race_detector_catches_a_dropped_wait_and_passes_with_the_wait(tmp_path, monkeypatch):
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64)
    ref, _ = run(tmp_path, False, "gpu", True, **cfg)
    monkeypatch.setattr(lookup_stream, "DELAY_CYCLES", 20_000_000)  # ~10 ms: later than any layer that reads
    kept, llm = run(tmp_path, True, "gpu", True, **cfg)
    assert kept == ref  # delayed gathers, waited for: nothing changes
    exposed = llm.engine.stats()["lookup_exposed_s"]  # every eager step's first Engram layer waited ~10 ms
    assert exposed > 0.005 * llm.engine.num_steps, exposed
    monkeypatch.setattr(lookup_stream, "DROP_WAIT", True)
    try:
        raced, _ = run(tmp_path, True, "gpu", True, **cfg)
    except RuntimeError as e:  # the Worker's idle check: a gather still ran after the tokens were read
        assert "lookup stream still runs" in str(e)
    else:
        assert raced != ref, "layers read rows before their gathers and nothing changed: the detector is blind"
    finally:
        torch.cuda.synchronize()
