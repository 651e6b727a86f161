"""Decode CUDA graphs (engine/runners/graphs.py, skipped without a GPU): a replay equals the same callables run
eagerly at the padded bucket size, bitwise; decode steps really replay (counted); a batch above every bucket
runs eager with a log line; greedy outputs with graphs equal --enforce-eager; the Engram gathers run inside the
graph (the graph runner) on tiers gpu and host (uncached), stay counted, and give the tokens tier gpu gives."""
from __future__ import annotations

import logging

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.runners.decode_inputs import graph_buckets
from engram.engine.runners.graphs import GraphRunner
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from engram.module import Projected

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype=torch.bfloat16, device=CUDA, progress=False)


def test_buckets():
    assert graph_buckets(1) == [1] and graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_buckets(100)[-3:] == [80, 96, 100]


def run(engine, n, max_tokens=12, **params):
    for i in range(n):
        engine.add_request(f"r{i}", f"Prompt {i} " * (1 + i % 5), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                                    **params))
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o.outputs[0]
    return [out[f"r{i}"] for i in range(n)]


def test_decode_steps_replay_and_a_replay_equals_eager_at_the_bucket_size(tiny):
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=8, max_model_len=256), CUDA, torch.bfloat16)
    worker = engine.executor.worker
    graphs = worker.runners[0]
    assert isinstance(graphs, GraphRunner) and [r.name for r in worker.runners] == ["graph", "mixed-graph", "eager"]
    assert graphs.io.buckets == [1, 2, 4, 8]
    for i in range(3):
        engine.add_request(f"r{i}", f"Prompt {i} about tables", SamplingParams(temperature=0.0, max_tokens=20,
                                                                               ignore_eos=True))
    engine.step()  # prefill: eager (with async scheduling the first decode step is launched too)
    first = engine.stats()["graph_replays"]
    assert first == int(engine.pipeline.async_scheduling())
    for _ in range(4):
        engine.step()
    assert engine.stats()["graph_replays"] == first + 4  # a silent eager fallback would leave this at first
    replayed = graphs.logits[4].clone()  # 3 sequences -> bucket 4; buffers still hold the last step
    def rows(layer_id: int):  # the static rows the replay read (its lookup-stream wait exists only in the graph)
        return Projected(4, (graphs.projected[layer_id][:4],)) if graphs.projected else graphs.rows[layer_id][:4]

    with torch.inference_mode():  # the graph's inputs, its gathered rows (the consuming layers' reads) included
        inputs = graphs.io.inputs(4, rows)
        eager = tiny.model.compute_logits(tiny.model.forward(inputs, worker.kv))
    assert torch.equal(replayed.view(torch.uint8), eager.view(torch.uint8))


def test_a_batch_above_every_bucket_runs_eager_with_a_log_line(tiny, caplog):
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=6, max_graph_batch=4, max_model_len=256), CUDA,
                       torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="engram.engine.runners.decode_inputs"):
        outs = run(engine, 6, temperature=0.0)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert "above the largest CUDA graph (4): runs eager" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_outputs_with_graphs_equal_enforce_eager(dtype, tmp_path):
    loaded = load_model("tiny", dtype=dtype, device=CUDA, cache_dir=tmp_path, progress=False)
    cfg = dict(max_num_seqs=16, max_model_len=256)
    graphs = LLMEngine(loaded, EngineConfig(**cfg), CUDA, dtype)
    eager = LLMEngine(loaded, EngineConfig(enforce_eager=True, **cfg), CUDA, dtype)
    assert eager.executor.worker.runners == [eager.executor.worker.eager]
    a, b = run(graphs, 11, logprobs=2, temperature=0.0), run(eager, 11, logprobs=2, temperature=0.0)
    assert graphs.stats()["graph_replays"] > 0
    for x, y in zip(a, b):
        if x.token_ids != y.token_ids:
            at = next(j for j, (p, q) in enumerate(zip(x.token_ids, y.token_ids)) if p != q)
            top = y.logprobs[at].top
            assert top[0][1] - top[1][1] < 1e-2, f"diverged at {at} with top-2 gap {top[0][1] - top[1][1]:.3g}"


@pytest.mark.parametrize("tier,options,in_graph", [("gpu", {}, True), ("host", {}, True),
                                                   ("host", {"cache_rows": 256}, False),
                                                   ("disk", {"io": "buffered"}, False)])
def test_engram_gathers_run_inside_the_graph_where_the_tier_allows(tmp_path, tier, options, in_graph):
    import dataclasses

    from engram.store.options import StoreOptions

    base = load_model("tiny", dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False)
    loaded = dataclasses.replace(base, tables={}, tier=tier, store_options=StoreOptions().replace(**options))
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_model_len=256), CUDA, torch.bfloat16)
    assert isinstance(engine.executor.worker.runners[0], GraphRunner) == in_graph  # else the piecewise runner
    for i in range(3):
        engine.add_request(f"r{i}", f"Prompt {i} about tables", SamplingParams(temperature=0.0, max_tokens=9,
                                                                               ignore_eos=True))
    engine.step()  # prefill: one lookup per layer through the executor (+ the first decode launched ahead)
    first = engine.stats()
    before = {lid: s["lookups"] for lid, s in first["tables"].items()}
    for _ in range(5):
        engine.step()
    after = engine.stats()
    assert after["graph_replays"] == first["graph_replays"] + 5
    assert all(after["tables"][lid]["lookups"] == before[lid] + 5 for lid in before)  # counted either way
    # rows are bitwise equal across tiers, so the same batches give the same tokens as tier gpu with graphs
    ref = LLMEngine(base, EngineConfig(max_num_seqs=4, max_model_len=256), CUDA, torch.bfloat16)
    other = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_model_len=256), CUDA, torch.bfloat16)
    assert [o.token_ids for o in run(other, 4, max_tokens=9, temperature=0.0)] == \
        [o.token_ids for o in run(ref, 4, max_tokens=9, temperature=0.0)]


def test_another_threads_cuda_work_does_not_break_the_capture(tiny):
    """A thread doing unsafe CUDA calls (pinned allocations, pageable copies to the device: what a table's
    lookup finishing in the background does) while an engine captures its decode graphs: with
    CAPTURE_ERROR_MODE "thread_local" the capture holds and decode steps replay (in "global" mode any such
    call invalidates it)."""
    import threading

    from engram.engine.runners import decode_inputs

    assert decode_inputs.CAPTURE_ERROR_MODE == "thread_local"
    stop, calls, errors = threading.Event(), [0], []

    def busy() -> None:
        while not stop.is_set():
            try:
                torch.empty(1 << 14).pin_memory()
                torch.ones(256).to(CUDA)  # pageable: a synchronous copy
                calls[0] += 1
            except RuntimeError as e:  # in "global" mode these calls fail while another thread captures
                errors.append(str(e))

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        engine = LLMEngine(tiny, EngineConfig(max_num_seqs=4, max_model_len=256), CUDA, torch.bfloat16)
    finally:
        stop.set()
        thread.join()
    assert calls[0] > 0 and not errors, errors[:1]
    outs = run(engine, 2, temperature=0.0)
    assert all(len(o.token_ids) == 12 for o in outs) and engine.stats()["graph_replays"] > 0
