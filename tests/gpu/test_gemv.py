"""The small-batch GEMV (gemv_triton.gemv) behind ``linear`` against the float64 product and cuBLAS on CUDA
(skipped without a GPU); and its switch's default and dispatch on any machine.

Parity: the kernel accumulates in float32 in a fixed order and rounds once, so its outputs agree with the
float64 product to float32 accumulation error plus one rounding to the output dtype; cuBLAS agrees with it
to the same tolerance. A graph replay is bitwise the eager launch; two launches are bitwise equal.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import engram
from engram.engine.sampling_params import SamplingParams
from engram.model.layers import gemv

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# relative to the largest |output|: float32 accumulation over K, then one rounding to the output dtype
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


def test_the_switch_keeps_cublas_by_default_and_refuses_to_force_the_kernel_on_the_cpu():
    if "ENGRAM_GEMV" not in os.environ:
        assert gemv.SWITCH.value == "torch"
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    old = gemv.SWITCH.set("auto")
    try:
        assert not gemv.gemv_fast(x, w)
        assert torch.equal(gemv.linear(x, w), F.linear(x, w))
        gemv.SWITCH.set("triton")
        with pytest.raises(RuntimeError, match="small-batch GEMV backend 'triton' cannot run"):
            gemv.linear(x, w)
    finally:
        gemv.SWITCH.set(old)


@pytest.fixture
def triton_gemv():
    old = gemv.SWITCH.set("triton")
    yield
    gemv.SWITCH.set(old)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(2560, 4096), (6144, 2560), (37, 1000), (5, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_the_float64_product_and_cublas(triton_gemv, dtype, rows, n, k, bias):
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    got = gemv.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * scale
    blas = F.linear(x, w, b)
    assert (got.double() - blas.double()).abs().max().item() <= 2 * TOL[dtype] * scale
    assert torch.equal(gemv.linear(x, w, b), got)  # no timing in the result


@cuda
@pytest.mark.gpu
def test_rows_beyond_the_kernel_and_strided_inputs_go_to_cublas(triton_gemv):
    w = torch.randn(64, 128, device="cuda")
    x = torch.randn(gemv.MAX_ROWS + 1, 128, device="cuda")
    assert not gemv.gemv_fast(x, w)  # even when forced: more rows are cuBLAS's
    assert torch.equal(gemv.linear(x, w), F.linear(x, w))
    gemv.SWITCH.set("auto")
    xt = torch.randn(128, 2, device="cuda").T  # last dim strided: "auto" falls back to cuBLAS
    assert not gemv.gemv_fast(xt, w)
    assert torch.equal(gemv.linear(xt, w), F.linear(xt, w))


@cuda
@pytest.mark.gpu
def test_a_graph_replay_is_bitwise_the_eager_launch(triton_gemv):
    w = torch.randn(6144, 2560, device="cuda").to(torch.bfloat16)
    x = torch.randn(1, 2560, device="cuda").to(torch.bfloat16)
    eager = gemv.linear(x, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        gemv.linear(x, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.linear(x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), eager.view(torch.uint8))


@cuda
@pytest.mark.gpu
def test_decoding_with_the_kernel_keeps_the_tokens_and_replays_graphs(tmp_path):
    """tiny in float32, greedy, batch 1-4 decode graphs: the kernel in every projection at those sizes;
    tokens equal cuBLAS's and logprobs agree to float32 accumulation error."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[5 + i, 17, 99, 4 + 3 * i] for i in range(3)]
    runs = {}
    for backend in ("torch", "triton"):
        old = gemv.SWITCH.set(backend)
        try:
            llm = engram.LLM("tiny", tier="gpu", dtype=torch.float32, cache_dir=str(tmp_path), max_num_seqs=4)
            runs[backend] = llm.generate(prompts, params, use_tqdm=False)
            assert llm.engine.stats()["graph_replays"] > 0
        finally:
            gemv.SWITCH.set(old)
    for a, b in zip(runs["torch"], runs["triton"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.logprob == pytest.approx(lb.logprob, abs=1e-4)
