"""The engine on CUDA (skipped without a GPU): batch composition invariance in float64, the CUDA path equal to
the CPU path in float64, tiers giving bitwise-equal rows and the same tokens in bf16 within one process, and
4b-like generating end to end."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import engram
from engram.model.loader import load_model
from engram.store.options import StoreOptions
from tests.integration.test_engine import prompts, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def test_cuda_float64_concurrent_chunked_and_preempted_equal_alone(tmp_path):
    tiny = load_model("tiny", dtype=torch.float64, device=CUDA, cache_dir=tmp_path, progress=False)
    reqs = prompts(16)
    alone = [run(tiny, [p], max_num_seqs=1)[0][0] for p in reqs]
    together, _, _ = run(tiny, reqs, max_num_seqs=16, max_num_batched_tokens=64)
    squeezed, engine, _ = run(tiny, reqs, max_num_seqs=16, max_num_batched_tokens=7 * 3, block_size=8,
                              num_kv_blocks=24, max_model_len=192)
    assert engine.num_preemptions > 0
    assert together == alone and squeezed == alone


def test_cuda_float64_rows_and_tokens_equal_the_cpu_path(tmp_path):
    """The engine's CUDA path (Triton table gather, CUDA attention and sampling) against its CPU reference path,
    same batches: staged rows bitwise equal, greedy tokens equal."""
    ref_model = load_model("tiny", dtype=torch.float64, device=torch.device("cpu"), cache_dir=tmp_path, progress=False)
    tiny = load_model("tiny", dtype=torch.float64, device=CUDA, cache_dir=tmp_path, progress=False)
    reqs = prompts(16, seed=9)
    ref, ref_engine, _ = run(ref_model, reqs, record=True, max_num_seqs=16, max_num_batched_tokens=64)
    got, engine, _ = run(tiny, reqs, record=True, max_num_seqs=16, max_num_batched_tokens=64)
    assert got == ref
    assert len(engine.lookup.staged) == len(ref_engine.lookup.staged)
    for a, b in zip(ref_engine.lookup.staged, engine.lookup.staged):
        for lid in tiny.engram_config.layer_ids:
            ra, rb = a.rows(lid, a.step_id), b.rows(lid, b.step_id)  # [T, n_cols, D] float64
            assert rb.device.type == "cuda" and torch.equal(ra.view(torch.uint8), rb.cpu().view(torch.uint8))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_bf16_tiers_give_bitwise_equal_rows_and_tokens(tmp_path, tier, eager):
    """Eager, every step stages its rows through the recording executor: rows and tokens compared. With graphs
    the gathers (tier gpu, host) or the slab decodes (disk) run inside them, so the tokens are (the slabs'
    rows against rows copied in: tests/gpu/test_piecewise_graphs.py)."""
    tiny = load_model("tiny", dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False)
    options = {"io": "buffered", "cache_rows": 500} if tier == "disk" else {}
    other = dataclasses.replace(tiny, tables={}, tier=tier,
                                store_options=StoreOptions().replace(**options))  # the Worker opens them
    reqs = prompts(16, seed=7)
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64, enforce_eager=eager)
    ref, ref_engine, _ = run(tiny, reqs, record=eager, **cfg)
    got, engine, _ = run(other, reqs, record=eager, **cfg)
    assert got == ref
    if not eager:
        assert ref_engine.stats()["graph_replays"] > 0 and engine.stats()["graph_replays"] > 0
        return
    assert len(engine.lookup.staged) == len(ref_engine.lookup.staged)
    for a, b in zip(ref_engine.lookup.staged, engine.lookup.staged):
        for lid in tiny.engram_config.layer_ids:
            ra, rb = a.rows(lid, a.step_id), b.rows(lid, b.step_id)
            assert ra.device.type == "cuda" and torch.equal(ra.view(torch.uint8), rb.view(torch.uint8))


def test_4b_like_generates_greedy_and_seeded(tmp_path):
    llm = engram.LLM("4b-like", engram_config={"table_rows": 1 << 16}, cache_dir=str(tmp_path), max_model_len=512,
                     max_num_seqs=8)
    assert llm.dtype == torch.bfloat16 and llm.device.type == "cuda"
    texts = ["The table store serves rows", "Continuous batching packs prompts", "A"] * 2
    greedy = llm.generate(texts, engram.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in greedy)
    assert greedy[0].outputs[0].token_ids == greedy[3].outputs[0].token_ids  # same prompt, same batch
    seeded = engram.SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    a = llm.generate(texts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(texts[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
