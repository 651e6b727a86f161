"""Fused Triton small ops against their torch references (skipped without CUDA), odd sizes, fp32 and bf16
against float64; the fused residual-add + norm and rope + KV write bitwise equal to the unfused fast ops
they replace; the backend switch."""
from __future__ import annotations

import pytest
import torch

from engram.model.layers import fused

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def reference(fn, *args):
    old = fused.set_backend("torch")
    try:
        return fn(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
    finally:
        fused.set_backend(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n", [(1, 64), (7, 1000), (300, 2560), (3, 5120)])
def test_rms_norm(dtype, m, n):
    g = torch.Generator(device=CUDA).manual_seed(m * n)
    x = (3 * torch.randn(m, n, generator=g, device=CUDA)).to(dtype)
    w = torch.randn(n, generator=g, device=CUDA).to(dtype)
    got = fused.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel(got, reference(fused.rms_norm, x, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,heads,hd,normed", [(1, 32, 128, True), (9, 8, 128, True), (5, 5, 64, False),
                                               (300, 3, 16, True), (2, 1, 256, False)])
def test_norm_rope(dtype, t, heads, hd, normed):
    g = torch.Generator(device=CUDA).manual_seed(t * heads * hd)
    x = torch.randn(t, heads, hd, generator=g, device=CUDA).to(dtype)
    w = torch.randn(hd, generator=g, device=CUDA).to(dtype) if normed else None
    ang = torch.rand(t, 1, hd // 2, generator=g, device=CUDA) * 100
    ang = torch.cat((ang, ang), -1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    got = fused.norm_rope(x, w, 1e-6, cos, sin)
    ref = reference(fused.norm_rope, x, w, 1e-6, cos, sin)
    assert got.dtype == dtype and rel(got, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n", [(1, 64), (7, 1000), (300, 2560), (3, 5120)])
def test_add_rms_norm_is_bitwise_the_add_then_the_norm(dtype, m, n):
    g = torch.Generator(device=CUDA).manual_seed(m + n)
    x, r = ((3 * torch.randn(m, n, generator=g, device=CUDA)).to(dtype) for _ in range(2))
    w = torch.randn(n, generator=g, device=CUDA).to(dtype)
    s, y = fused.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s.view(torch.uint8), (x + r).view(torch.uint8))
    assert torch.equal(y.view(torch.uint8), fused.rms_norm(x + r, w, 1e-6).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,heads,hd,normed", [(1, 8, 128, True), (37, 8, 128, True), (5, 5, 64, False)])
def test_norm_rope_store_writes_what_norm_rope_returns_at_the_slots(dtype, t, heads, hd, normed):
    g = torch.Generator(device=CUDA).manual_seed(t * heads)
    qkv = torch.randn(t, 3 * heads, hd, generator=g, device=CUDA).to(dtype)
    k, v = qkv[:, heads:2 * heads], qkv[:, 2 * heads:]  # strided views, as the packed projection gives
    w = torch.randn(hd, generator=g, device=CUDA).to(dtype) if normed else None
    ang = torch.rand(t, 1, hd // 2, generator=g, device=CUDA) * 100
    cos, sin = (f(torch.cat((ang, ang), -1)).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(4 * t, generator=g, device=CUDA)[:t]
    k_cache, v_cache = (torch.full((4 * t, heads, hd), 7.0, dtype=dtype, device=CUDA) for _ in range(2))
    fused.norm_rope_store(k, v, w, 1e-6, cos, sin, k_cache, v_cache, slots)
    want_k, want_v = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    want_k[slots], want_v[slots] = fused.norm_rope(k, w, 1e-6, cos, sin), v
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,q_heads,heads,hd,normed", [(1, 32, 8, 128, True), (37, 32, 8, 128, True),
                                                       (5, 12, 5, 64, False), (3, 4, 4, 16, True)])
def test_norm_rope_qk_store_is_bitwise_the_two_launches(dtype, t, q_heads, heads, hd, normed):
    g = torch.Generator(device=CUDA).manual_seed(t * heads + q_heads)
    qkv = torch.randn(t, q_heads + 2 * heads, hd, generator=g, device=CUDA).to(dtype)
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads:q_heads + heads], qkv[:, q_heads + heads:]  # the packed views
    wq, wk = ((torch.randn(hd, generator=g, device=CUDA).to(dtype) if normed else None) for _ in range(2))
    ang = torch.rand(t, 1, hd // 2, generator=g, device=CUDA) * 100
    cos, sin = (f(torch.cat((ang, ang), -1)).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(4 * t, generator=g, device=CUDA)[:t]
    caches = [torch.full((4 * t, heads, hd), 7.0, dtype=dtype, device=CUDA) for _ in range(4)]
    got_q = fused.norm_rope_qk_store(q, k, v, wq, wk, 1e-6, cos, sin, caches[0], caches[1], slots)
    want_q = fused.norm_rope(q, wq, 1e-6, cos, sin)
    fused.norm_rope_store(k, v, wk, 1e-6, cos, sin, caches[2], caches[3], slots)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    ref = reference(fused.norm_rope, q, wq, 1e-6, cos, sin)
    assert rel(got_q, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 9728), (17, 1000), (64, 12288)])
def test_silu_mul(dtype, shape):
    g = torch.Generator(device=CUDA).manual_seed(shape[0])
    a = (4 * torch.randn(shape, generator=g, device=CUDA)).to(dtype)
    b = torch.randn(shape, generator=g, device=CUDA).to(dtype)
    assert rel(fused.silu_mul(a, b), reference(fused.silu_mul, a, b)) < TOL[dtype]


def test_backend_switch():
    x = torch.randn(4, 64, device=CUDA)
    w = torch.ones(64, device=CUDA)
    old = fused.set_backend("torch")
    try:
        assert not fused._fast(x)
    finally:
        fused.set_backend(old)
    assert fused._fast(x) and not fused._fast(x.double())
    with pytest.raises(ValueError, match="not one of"):
        fused.set_backend("cuda")
    assert torch.isfinite(fused.rms_norm(x, w, 1e-6)).all()
