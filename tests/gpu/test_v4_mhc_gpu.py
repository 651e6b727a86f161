"""DeepSeek-V4's mHC fast paths (model/deepseek_v4/mhc.py) against their torch reference: ``HyperConnection.collapse``
in one Triton launch after its GEMM (mhc_triton.py) and the weighted RMSNorm in the one-launch kernel
(fused_triton.rms_norm), on CUDA (skipped without a GPU); the switch on any machine; and the collapse kernel under
Triton's interpreter on CPU tensors, in a subprocess (skipped where triton does not import).

Parity: the kernel scales the unnormalised GEMM by the RMS factor (the reference normalises first) and sums in another
order: post and comb (float32) agree to 1e-5, the block input to one unit in the last place of its dtype."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engram.fast_path import importable
from engram.model.deepseek_v4 import mhc
from engram.model.deepseek_v4.mhc import HyperConnection, RMSNorm

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
X_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 2 ** -7), torch.float16: (2 ** -10, 2 ** -10)}
SHAPES = [(1, 4, 4096), (64, 4, 4096), (3, 4, 96), (5, 2, 64)]  # (tokens, hc, hidden): Flash's at batch 1 and 64


def hyper(hc: int, hidden: int, iters: int = 20, device: str = "cpu", seed: int = 0) -> HyperConnection:
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    fn = torch.randn(n, hc * hidden, generator=g) * 0.02
    base, scale = torch.randn(n, generator=g) * 0.5, 1 + torch.randn(3, generator=g) * 0.1
    return HyperConnection(fn.to(device), base.to(device), scale.to(device), hc, iters, 1e-6, 1e-6)


def test_the_collapse_kernel_is_on_by_default_where_it_can_run():
    h = torch.zeros(2, 4, 8)
    old = mhc.SWITCH.set("auto")
    try:
        assert not mhc.collapse_fast(h, 4)  # CPU tensors: the reference
        mhc.SWITCH.set("triton")
        with pytest.raises(RuntimeError, match="mHC collapse backend 'triton' cannot run"):
            mhc.collapse_fast(h, 4)
    finally:
        mhc.SWITCH.set(old)


def _close(got, want, dtype):
    x, post, comb = got
    rx, rpost, rcomb = want
    assert x.dtype == rx.dtype == dtype and post.dtype == rpost.dtype == comb.dtype == rcomb.dtype == torch.float32
    rtol, atol = X_TOL[dtype]
    torch.testing.assert_close(x, rx, rtol=rtol, atol=atol)
    torch.testing.assert_close(post, rpost, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, rcomb, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_collapse_kernel_matches_the_reference(shape, dtype):
    t, hc, hidden = shape
    conn = hyper(hc, hidden, device="cuda")
    h = torch.randn(t, hc, hidden, device="cuda").to(dtype)
    old = mhc.SWITCH.set("torch")
    try:
        want = conn.collapse(h)
    finally:
        mhc.SWITCH.set("triton")
    try:
        got = conn.collapse(h)
    finally:
        mhc.SWITCH.set(old)
    _close(got, want, dtype)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weighted_rms_norm_takes_the_fused_kernel(dtype):
    from engram.model.layers import fused

    norm = RMSNorm(4096, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(4096))
    x = torch.randn(64, 4096, device="cuda").to(dtype)
    old = fused.set_backend("torch")
    try:
        want = norm(x)
    finally:
        fused.set_backend(old)
    torch.testing.assert_close(norm(x), want, rtol=X_TOL[dtype][0], atol=X_TOL[dtype][1])


INTERPRETED = textwrap.dedent("""
    import torch
    from engram.model.deepseek_v4 import mhc_triton
    from tests.gpu.test_v4_mhc_gpu import SHAPES, X_TOL, hyper, _close
    for dtype in (torch.bfloat16, torch.float32):
        for t, hc, hidden in SHAPES[2:] + [(2, 4, 4096)]:
            conn = hyper(hc, hidden)
            h = torch.randn(t, hc, hidden).to(dtype)
            _close(mhc_triton.collapse(h, conn.fn, conn.base, conn.scale, conn.iters, conn.eps, conn.norm_eps),
                   conn.collapse(h), dtype)
    print("interpreted ok")
""")


@pytest.mark.skipif(not importable("triton"), reason="needs triton (its interpreter runs the kernel on the CPU)")
def test_collapse_kernel_under_the_triton_interpreter_matches_the_reference():
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "interpreted ok" in r.stdout, r.stderr[-3000:]
