"""Small ops with a fused CUDA path, one signature each: ``rms_norm``, ``add_rms_norm``, ``norm_rope``,
``norm_rope_store``, ``norm_rope_qk_store``, ``silu_mul``. The torch code is the reference (any device and dtype); on
CUDA for bf16 / fp16 / fp32 the Triton kernels of fused_triton.py take over. ``set_backend`` or
``ENGRAM_KERNELS=fused=torch`` forces the reference; "triton" insists on the fast path."""
from __future__ import annotations


import torch
import torch.nn.functional as F

from engram.fast_path import FastPathSwitch, importable
from engram.model.layers.split_linear import Partials

SWITCH = FastPathSwitch("fused-op backend", "fused")
FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# The fused v41 Engram gate (fused_triton.engram_gate_v41) has its own switch ("gate" in ENGRAM_KERNELS):
# its parity test is tests/gpu/test_fused_gate.py.
GATE_SWITCH = FastPathSwitch("Engram gate backend", "gate")


def engram_gate_fast(x: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether ``Engram._forward_v41`` takes the fused gate kernel for these tensors."""
    can_run = (x.is_cuda and x.dtype in FAST_DTYPES and x.stride(-1) == 1 and kv.stride(-1) == 1
               and importable("engram.model.layers.fused_triton"))
    return GATE_SWITCH.fast(can_run, f"{x.dtype} on {x.device}")


def set_backend(name: str) -> str:
    """Select "auto", "torch" (reference) or "triton"; returns the old one."""
    return SWITCH.set(name)


def _fast(x: torch.Tensor) -> bool:
    can_run = x.is_cuda and x.dtype in FAST_DTYPES and importable("engram.model.layers.fused_triton")
    return SWITCH.fast(can_run, f"{x.dtype} on {x.device}")


def fast_rms_norm(x: torch.Tensor) -> bool:
    """Whether ``fused_triton.rms_norm`` (x * rsqrt(mean(x^2) + eps) * w in float32, rounded once) takes ``x`` under
    this switch: DeepSeek-V4's norms (model/deepseek_v4/mhc.py), whose reference rounds as that kernel does, call it
    directly."""
    return _fast(x) and x.stride(-1) == 1


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama/Qwen RMSNorm over the last dim: statistics in float32 (float64 stays float64), weight last."""
    if _fast(x) and x.stride(-1) == 1:
        from engram.model.layers import fused_triton

        return fused_triton.rms_norm(x, w, eps)
    dtype = x.dtype
    xf = x if dtype == torch.float64 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, r: torch.Tensor | Partials, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + r, rms_norm(x + r)) in one launch on the fast path (the sum rounded to x's dtype before the norm, bitwise
    the reference's). ``r`` may be a projection's float32 partials (split_linear.Partials), summed first as
    ``Partials.total`` does."""
    if isinstance(r, Partials):
        if (_fast(x) and x.dim() == 2 and x.stride(-1) == 1 and r.parts.is_contiguous() and r.dtype == x.dtype
                and r.shape == x.shape):
            from engram.model.layers import fused_triton

            return fused_triton.add_rms_norm(x, r.parts, w, eps, parts=True)
        r = r.total()
    if _fast(x) and x.stride(-1) == 1 and r.stride(-1) == 1 and r.dtype == x.dtype and r.shape == x.shape:
        from engram.model.layers import fused_triton

        return fused_triton.add_rms_norm(x, r, w, eps)
    s = x + r
    return s, rms_norm(s, w, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]: per-head RMSNorm with weight ``w`` (skipped when None), then rotary embedding with
    cos/sin [T, 1, hd] ("rotate half", HF layout) -> same shape and dtype."""
    hd = x.shape[-1]
    if _fast(x) and x.stride(-1) == 1 and hd & (hd - 1) == 0 and hd >= 2:
        from engram.model.layers import fused_triton

        return fused_triton.norm_rope(x, w, eps, cos.reshape(cos.shape[0], hd), sin.reshape(sin.shape[0], hd))
    if w is not None:
        x = rms_norm(x, w, eps)
    return x * cos + rotate_half(x) * sin


def _kv_store_fast(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the fused rope + KV write can run: the fast path's device and dtypes, unit last strides, a
    power-of-two head dim, caches contiguous and of the inputs' dtype."""
    hd = k.shape[-1]
    return (_fast(k) and k.stride(-1) == 1 and v.stride(-1) == 1 and hd & (hd - 1) == 0 and hd >= 2
            and k_cache.dtype == k.dtype == v.dtype == v_cache.dtype and k_cache.is_contiguous()
            and v_cache.is_contiguous())


def norm_rope_store(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """A step's KV write: ``k_cache[slots] = norm_rope(k)``, ``v_cache[slots] = v``; k, v [T, heads, hd], caches [rows,
    heads, hd] (a flat view), slots [T] int64 (all valid). One launch on the fast path, bitwise ``norm_rope``."""
    hd = k.shape[-1]
    if _kv_store_fast(k, v, k_cache, v_cache):
        from engram.model.layers import fused_triton

        fused_triton.norm_rope_store(k, v, w, eps, cos.reshape(cos.shape[0], hd), sin.reshape(sin.shape[0], hd),
                                     k_cache, v_cache, slots)
        return
    k_cache.index_copy_(0, slots, norm_rope(k, w, eps, cos, sin).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def norm_rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor | None,
                       wk: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Returns ``norm_rope(q, wq, ...)`` and does ``norm_rope_store(k, v, wk, ...)``; one launch on the fast path."""
    hd = q.shape[-1]
    if _kv_store_fast(k, v, k_cache, v_cache) and q.stride(-1) == 1 and q.dtype == k.dtype:
        from engram.model.layers import fused_triton

        return fused_triton.norm_rope_qk_store(q, k, v, wq, wk, eps, cos.reshape(cos.shape[0], hd),
                                               sin.reshape(sin.shape[0], hd), k_cache, v_cache, slots)
    norm_rope_store(k, v, wk, eps, cos, sin, k_cache, v_cache, slots)
    return norm_rope(q, wq, eps, cos, sin)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(g) * u."""
    if _fast(g) and g.shape == u.shape and g.stride(-1) == 1 and u.stride(-1) == 1:
        from engram.model.layers import fused_triton

        cols = g.shape[-1]
        if g.dim() == 2 or (g.is_contiguous() and u.is_contiguous()):
            return fused_triton.silu_mul(g.reshape(-1, cols), u.reshape(-1, cols)).view(g.shape)
    return F.silu(g) * u
