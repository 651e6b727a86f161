"""The small-batch GEMV (gemv_triton.gemv) behind ``linear`` against the float64 product and cuBLAS on CUDA
(skipped without a GPU): every launch of ``config_for`` and the default, with and without programmatic
dependent launch (bitwise the same), eager and replayed from a graph, and an engine's tokens.

Parity: the kernel accumulates in float32 in a fixed order and rounds once, so its outputs agree with the
float64 product to float32 accumulation error plus one rounding to the output dtype; cuBLAS agrees with it
to the same tolerance. A graph replay is bitwise the eager launch; two launches are bitwise equal. The
switch's dispatch on any machine: tests/unit/test_gemv_dispatch.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import engram
from engram.engine.sampling_params import SamplingParams
from engram.model.layers import gemv, pdl

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [cuda, pytest.mark.gpu]
# relative to the largest |output|: float32 accumulation over K, then one rounding to the output dtype
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


@pytest.fixture
def triton_gemv():
    old = gemv.SWITCH.set("triton")
    yield
    gemv.SWITCH.set(old)


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") * k ** -0.5).to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(2560, 4096), (6144, 2560), (19456, 2560), (2560, 9728), (37, 1000), (5, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_the_float64_product_and_cublas(triton_gemv, dtype, rows, n, k, bias):
    x, w, b = _operands(rows, n, k, dtype, bias)
    got = gemv.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * scale
    blas = F.linear(x, w, b)
    assert (got.double() - blas.double()).abs().max().item() <= 2 * TOL[dtype] * scale
    assert torch.equal(gemv.linear(x, w, b), got)  # no timing in the result


def test_the_measured_launches_are_used_for_their_shapes():
    from engram.model.layers import gemv_triton

    for (n, k), cfg in gemv_triton.CONFIGS.items():
        assert gemv_triton.config_for(n, k) is cfg
    assert gemv_triton.config_for(37, 1000) is gemv_triton.DEFAULT


@pytest.mark.parametrize("n,k", [(2560, 4096), (6144, 2560), (37, 1000)])
def test_pdl_changes_no_bit_eager_or_in_a_graph(triton_gemv, monkeypatch, n, k):
    """With PDL the GEMV is scheduled while the RMSNorm that writes its x (itself launched with PDL, so it
    releases the GEMV at its start) still runs, and loads its weight's first chunk before waiting for it:
    the outputs are bitwise those without PDL, eager and replayed from a graph, and equal the GEMV of the
    norm's output computed on its own."""
    from engram.model.layers import fused

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    _, w, _ = _operands(1, n, k, torch.bfloat16, False)
    src = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    norm_w = torch.rand(k, device="cuda").to(torch.bfloat16) + 0.5
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "ENABLED", on)

        def step():
            torch.cuda._sleep(20_000)  # a long kernel in front, so the norm and the GEMV queue up behind it
            return gemv.linear(fused.rms_norm(src, norm_w, 1e-6), w)

        eager = step()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.uint8), eager.view(torch.uint8))
        alone = gemv.linear(fused.rms_norm(src, norm_w, 1e-6).clone(), w)
        assert torch.equal(eager.view(torch.uint8), alone.view(torch.uint8))
        outs[on] = eager
    assert torch.equal(outs[True].view(torch.uint8), outs[False].view(torch.uint8))


def test_decoding_with_the_kernel_keeps_the_tokens_and_replays_graphs(tmp_path):
    """tiny in float32, greedy, batch 1-4 decode graphs: the kernel in every layer projection at those sizes;
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
