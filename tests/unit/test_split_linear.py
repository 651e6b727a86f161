"""split_linear: small-batch projections as float32 partials summed by the fused add + RMSNorm (CPU, through
``any_device=True``; tests/gpu/test_split_linear_gpu.py runs the CUDA GEMM and the Triton sum)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engram.model.layers import split_linear
from engram.model.layers.fused import add_rms_norm
from engram.model.layers.split_linear import Partials, dense


def count_partials(monkeypatch, real=None, made: list[bool] | None = None) -> list[bool]:
    """Wrap split_linear.linear (or ``real``): the returned list gets, per call, whether it returned Partials."""
    made = [] if made is None else made
    real = real or split_linear.linear

    def counted(*a, **k):
        out = real(*a, **k)
        made.append(isinstance(out, Partials))
        return out

    monkeypatch.setattr(split_linear, "linear", counted)
    return made


REAL_LINEAR = split_linear.linear


def linear_everywhere(enabled: bool):
    """What the layers call, taking the partials path on the CPU too (or, not ``enabled``, never)."""
    def linear(x, weight, bias=None, any_device=False):
        if not enabled:
            return F.linear(x, weight, bias)
        return REAL_LINEAR(x, weight, bias, any_device=True)
    return linear


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(split_linear, "linear", linear_everywhere(True))


def _xw(rows: int, n: int = 48, k: int = 64, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_partials_sum_to_the_product(on_cpu, rows):
    x, w = _xw(rows)
    y = split_linear.linear(x, w)
    assert isinstance(y, Partials) and y.parts.shape == (split_linear.SPLITS, rows, 48)
    assert y.parts.dtype == torch.float32 and y.shape == (rows, 48)
    exact = x.double() @ w.double().t()
    for s in range(split_linear.SPLITS):  # slice s is the product over K columns [s*K/S, (s+1)*K/S)
        ks = 64 // split_linear.SPLITS
        torch.testing.assert_close(y.parts[s].double(), x[:, s * ks:(s + 1) * ks].double()
                                   @ w[:, s * ks:(s + 1) * ks].double().t(), rtol=1e-6, atol=1e-6)
    total = y.total()
    assert total.dtype == torch.bfloat16
    torch.testing.assert_close(total.double(), exact, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(total, F.linear(x, w), rtol=1e-2, atol=1e-2)  # cuBLAS's split differs in bits only
    assert torch.equal(total, (((y.parts[0] + y.parts[1]) + y.parts[2]) + y.parts[3]).to(torch.bfloat16))


def test_where_it_does_not_apply_it_is_f_linear(on_cpu, monkeypatch):
    x, w = _xw(1)
    for args in [(x, w, torch.zeros(48, dtype=torch.bfloat16)),  # a bias
                 (_xw(5)[0], w),  # more than MAX_ROWS rows
                 (x.float(), w.float()),  # float32 weights: cuBLAS's fp32 GEMV has no reduce to save
                 (_xw(1, k=66)[0], _xw(1, k=66)[1])]:  # K not a multiple of SPLITS
        out = split_linear.linear(*args)
        assert isinstance(out, torch.Tensor) and torch.equal(out, F.linear(*args))
    assert isinstance(REAL_LINEAR(x, w), torch.Tensor)  # the CPU takes F.linear unless told


def test_dense_and_the_fused_add_sum_the_partials_like_total(on_cpu):
    x, w = _xw(3)
    y = split_linear.linear(x, w)
    resid = torch.randn(3, 48).to(torch.bfloat16)
    norm_w = torch.rand(48).to(torch.bfloat16)
    s, normed = add_rms_norm(resid, y, norm_w, 1e-6)
    summed = (((y.parts[0] + y.parts[1]) + y.parts[2]) + y.parts[3]).to(torch.bfloat16)  # slices in order
    s_ref = resid + summed
    xf = s_ref.float()
    normed_ref = norm_w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(s.view(torch.int16), s_ref.view(torch.int16))
    assert torch.equal(normed.view(torch.int16), normed_ref.view(torch.int16))
    assert torch.equal(dense(y), summed) and dense(resid) is resid


def test_a_decoder_with_one_stream_hands_partials_on_and_stays_close(on_cpu, monkeypatch):
    """The 4b-like layer shape (one residual stream): at one decode row the o and down projections return
    partials (counted), the fused adds sum them, and the logits stay within bf16 noise of F.linear's."""
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.engine.sampling_params import SamplingParams
    from engram.model.loader import random_model
    from engram.model.presets import preset_config

    cfg = preset_config("tiny").replace(engram=None, hc_mult=1)
    loaded = random_model(cfg, dtype=torch.bfloat16, progress=False)
    made = count_partials(monkeypatch)

    def run(enabled: bool):
        count_partials(monkeypatch, linear_everywhere(enabled), made)
        engine = LLMEngine(loaded, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                           torch.device("cpu"), torch.bfloat16)
        engine.add_request("r", list(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=4, logprobs=5,
                                                                 ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return outs[0]

    made.clear()
    on = run(True)
    assert made.count(True) == 2 * cfg.num_layers * 3  # o and down, every layer, the 3 decode steps (1 row)
    made.clear()
    off = run(False)
    assert True not in made
    a = [lp for lp in on.outputs[0].logprobs]
    b = [lp for lp in off.outputs[0].logprobs]
    assert len(a) == len(b) == 4
    first_a, first_b = a[0], b[0]  # the prefill (10 rows): F.linear both times, so bitwise equal
    assert first_a == first_b
    for la, lb in zip(a[1:], b[1:]):  # decode rows: the same top tokens' logprobs within bf16 noise
        top_a = dict(la.top)
        shared = [(tok, v) for tok, v in lb.top if tok in top_a]
        assert shared
        for tok, v in shared:
            assert abs(top_a[tok] - v) < 0.1, (tok, top_a[tok], v)
