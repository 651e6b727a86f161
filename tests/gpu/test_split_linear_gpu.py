"""split_linear on CUDA (skipped without a GPU): the strided-batched GEMM's float32 partials against the
float64 product, the Triton add + RMSNorm summing them bitwise as ``Partials.total`` and the two-op path do,
and an engine whose layers have one residual stream (the 4b-like shape) replaying decode graphs bitwise equal
to its eager steps with the partials on. The plumbing on the CPU: tests/unit/test_split_linear.py."""
from __future__ import annotations

import pytest
import torch

from engram.engine.sampling_params import SamplingParams
from engram.model.layers import split_linear
from engram.model.layers.fused import add_rms_norm
from engram.model.layers.split_linear import Partials

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(2560, 4096), (2560, 9728), (96, 128)])
def test_partials_are_the_product_over_each_slice(monkeypatch, rows, n, k):
    g = torch.Generator(device=CUDA).manual_seed(rows)
    x = torch.randn(rows, k, device=CUDA, generator=g).bfloat16()
    w = (torch.randn(n, k, device=CUDA, generator=g) / k ** 0.5).bfloat16()
    y = split_linear.linear(x, w)
    assert isinstance(y, Partials) and y.parts.shape == (split_linear.SPLITS, rows, n)
    ks = k // split_linear.SPLITS
    for s in range(split_linear.SPLITS):
        exact = x[:, s * ks:(s + 1) * ks].double() @ w[:, s * ks:(s + 1) * ks].double().t()
        torch.testing.assert_close(y.parts[s].double(), exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y.total().double(), x.double() @ w.double().t(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_add_sums_the_partials_bitwise_as_total(monkeypatch, rows, dtype):
    from engram.model.layers import fused_triton

    g = torch.Generator(device=CUDA).manual_seed(7)
    x = torch.randn(rows, 4096, device=CUDA, generator=g).to(dtype)
    w = (torch.randn(2560, 4096, device=CUDA, generator=g) / 64).to(dtype)
    resid = torch.randn(rows, 2560, device=CUDA, generator=g).to(dtype)
    norm_w = torch.rand(2560, device=CUDA, generator=g).to(dtype)
    y = split_linear.linear(x, w)
    s, normed = add_rms_norm(resid, y, norm_w, 1e-6)  # the Triton kernel's PARTS path
    s_ref, normed_ref = fused_triton.add_rms_norm(resid, y.total(), norm_w, 1e-6)  # the partials summed first
    bits = torch.int16
    assert torch.equal(s.view(bits), s_ref.view(bits)) and torch.equal(normed.view(bits), normed_ref.view(bits))
    plain = resid + y.total()  # the two-op torch reference of the sum
    assert torch.equal(s.view(bits), plain.view(bits))


def test_decode_graphs_replay_bitwise_the_eager_steps_with_partials(monkeypatch):
    """One residual stream (hc_mult 1, the 4b-like shape), bf16, four sequences (a bucket's size, so the
    eager steps run the rows the graph was captured at): tokens and logprobs of graph replays equal the eager
    engine's bitwise, and the decode steps did take the partials."""
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.model.loader import random_model
    from engram.model.presets import preset_config

    from tests.unit.test_split_linear import count_partials

    made = count_partials(monkeypatch)
    loaded = random_model(preset_config("tiny").replace(engram=None, hc_mult=1), dtype=torch.bfloat16,
                          device=CUDA, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [[5 + i, 17, 99, 4 + 3 * i, 8] for i in range(4)]  # a bucket's size: no padded rows
    outs = {}
    for eager in (True, False):
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=4, max_model_len=128, enforce_eager=eager), CUDA,
                           torch.bfloat16)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = (o.outputs[0].token_ids,
                                          [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
        outs[eager] = done
        if not eager:
            assert engine.stats()["graph_replays"] > 0
    assert True in made
    assert outs[True] == outs[False]
