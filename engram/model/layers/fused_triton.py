"""Fused small ops on CUDA in Triton, one launch each: ``rms_norm``, ``add_rms_norm``, ``norm_rope`` (Qwen3's per-head
q/k norm then "rotate half", or the rotation alone), ``norm_rope_store`` (into the paged KV cache's slots),
``norm_rope_qk_store``, ``silu_mul`` and ``engram_gate_v41`` (``Engram._forward_v41`` after the projection). Each
computes in float32 and rounds once: within bf16 rounding of the torch reference, not bitwise. CUDA only; importing
needs triton."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.model.layers.pdl import launch_options


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First thing in a kernel launched with PDL (pdl.py): wait until the kernel before finished and its writes are
    visible, then let the next be scheduled. Nothing without USE_PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _rms_norm_kernel(X, W, Y, R, S, n, eps, s_x, s_y, s_r, s_s, s_part, BLOCK: tl.constexpr, ADD: tl.constexpr,
                     PARTS: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < n
    w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait (pdl.py)
    pdl_enter(USE_PDL)
    x = tl.load(X + row * s_x + c, mask=mask, other=0.0)
    if ADD:  # x + r rounded to x's dtype (what torch's add stores), kept, then normalised
        r = tl.load(R + row * s_r + c, mask=mask, other=0.0)
        if PARTS > 0:  # r: float32 partials [PARTS, M, N], summed in order and rounded (Partials.total)
            for i in tl.static_range(1, PARTS):
                r = r + tl.load(R + i * s_part + row * s_r + c, mask=mask, other=0.0)
            r = r.to(x.dtype)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(S + row * s_s + c, x, mask=mask)
    x = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    tl.store(Y + row * s_y + c, (x * r * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_consts(W, COS, SIN, t, s_c, HALF: tl.constexpr, NORM: tl.constexpr):
    """What _norm_rope_rows needs besides its rows, none of it written during a step's layers (so read before the PDL
    wait): the norm weight halves (ones without NORM) and token t's cos/sin halves, float32."""
    c = tl.arange(0, HALF)
    if NORM:
        w1 = tl.load(W + c).to(tl.float32)
        w2 = tl.load(W + HALF + c).to(tl.float32)
    else:
        w1 = tl.full([HALF], 1.0, tl.float32)
        w2 = w1
    cos1 = tl.load(COS + t * s_c + c).to(tl.float32)
    cos2 = tl.load(COS + t * s_c + HALF + c).to(tl.float32)
    sin1 = tl.load(SIN + t * s_c + c).to(tl.float32)
    sin2 = tl.load(SIN + t * s_c + HALF + c).to(tl.float32)
    return w1, w2, cos1, cos2, sin1, sin2


@triton.jit
def _norm_rope_rows(X, Y, V, VY, t, out, heads, eps, s_xt, s_xh, s_yt, s_yh, s_vt, s_vh, w1, w2, cos1, cos2,
                    sin1, sin2, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                    STORE: tl.constexpr):
    """Token t's heads of X: normed (NORM, weight halves w1/w2) and rotated (cos/sin halves of token t) into row
    ``out`` of Y; with STORE, V's row t too. The constants come from _norm_rope_consts."""
    h = tl.arange(0, BLOCK_H)
    hmask = h < heads
    c = tl.arange(0, HALF)
    m = hmask[:, None]
    x1 = tl.load(X + t * s_xt + h[:, None] * s_xh + c[None, :], mask=m, other=0.0).to(tl.float32)  # [H, hd/2]
    x2 = tl.load(X + t * s_xt + h[:, None] * s_xh + HALF + c[None, :], mask=m, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HD + eps)  # [H]
        x1 = x1 * r[:, None] * w1[None, :]
        x2 = x2 * r[:, None] * w2[None, :]
    y1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    y2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(Y + out * s_yt + h[:, None] * s_yh + c[None, :], y1.to(Y.dtype.element_ty), mask=m)
    tl.store(Y + out * s_yt + h[:, None] * s_yh + HALF + c[None, :], y2.to(Y.dtype.element_ty), mask=m)
    if STORE:
        d = tl.arange(0, HD)
        v = tl.load(V + t * s_vt + h[:, None] * s_vh + d[None, :], mask=m, other=0.0)
        tl.store(VY + out * s_yt + h[:, None] * s_yh + d[None, :], v.to(VY.dtype.element_ty), mask=m)


@triton.jit
def _norm_rope_kernel(X, W, COS, SIN, Y, SLOTS, V, VY, heads, eps, s_xt, s_xh, s_yt, s_yh, s_c, s_vt, s_vh,
                      HD: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, NORM: tl.constexpr,
                      STORE: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0)
    out = t
    if STORE:  # rows of the paged cache: the slot of token t (a step input); v goes to the same slot of VY
        out = tl.load(SLOTS + t)
    w1, w2, cos1, cos2, sin1, sin2 = _norm_rope_consts(W, COS, SIN, t, s_c, HALF, NORM)
    pdl_enter(USE_PDL)
    _norm_rope_rows(X, Y, V, VY, t, out, heads, eps, s_xt, s_xh, s_yt, s_yh, s_vt, s_vh, w1, w2, cos1, cos2,
                    sin1, sin2, HD, HALF, BLOCK_H, NORM, STORE)


@triton.jit
def _norm_rope_qk_kernel(Q, WQ, QY, K, WK, SLOTS, V, KC, VC, COS, SIN, q_heads, k_heads, eps,
                         s_qt, s_qh, s_qyt, s_qyh, s_kt, s_kh, s_ct, s_ch, s_vt, s_vh, s_c,
                         HD: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                         NORM_Q: tl.constexpr, NORM_K: tl.constexpr, USE_PDL: tl.constexpr):
    # programs (t, 0): token t's query heads, as _norm_rope_kernel; (t, 1): its key heads into the cache slot
    # and v beside them, as _norm_rope_kernel with STORE. Each runs the same code at the same shapes as the
    # separate launch, so the results are bitwise theirs.
    t = tl.program_id(0)
    if tl.program_id(1) == 0:
        w1, w2, cos1, cos2, sin1, sin2 = _norm_rope_consts(WQ, COS, SIN, t, s_c, HALF, NORM_Q)
        pdl_enter(USE_PDL)
        _norm_rope_rows(Q, QY, Q, QY, t, t, q_heads, eps, s_qt, s_qh, s_qyt, s_qyh, 0, 0, w1, w2, cos1, cos2,
                        sin1, sin2, HD, HALF, BLOCK_HQ, NORM_Q, False)
    else:
        slot = tl.load(SLOTS + t)
        w1, w2, cos1, cos2, sin1, sin2 = _norm_rope_consts(WK, COS, SIN, t, s_c, HALF, NORM_K)
        pdl_enter(USE_PDL)
        _norm_rope_rows(K, KC, V, VC, t, slot, k_heads, eps, s_kt, s_kh, s_ct, s_ch, s_vt, s_vh, w1, w2, cos1,
                        cos2, sin1, sin2, HD, HALF, BLOCK_HK, NORM_K, True)


@triton.jit
def _silu_mul_kernel(G, U, Y, n, cols, s_g, s_u, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    r = i // cols
    c = i % cols
    g = tl.load(G + r * s_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r * s_u + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + i, (g / (1.0 + tl.exp(-g)) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _engram_gate_kernel(X, KV, QW, KW, DEAD, Y, hidden, eps, sqrt_h, s_xt, s_xh, s_kv, s_yt, s_yh,
                        HC: tl.constexpr, BLOCK: tl.constexpr, HAS_DEAD: tl.constexpr):
    t = tl.program_id(0)
    i = tl.program_id(1)  # the branch (hc_mult)
    c = tl.arange(0, BLOCK)
    m = c < hidden
    x = tl.load(X + t * s_xt + i * s_xh + c, mask=m, other=0.0).to(tl.float32)
    k = tl.load(KV + t * s_kv + i * hidden + c, mask=m, other=0.0).to(tl.float32)  # this branch's key
    v = tl.load(KV + t * s_kv + HC * hidden + c, mask=m, other=0.0).to(tl.float32)  # the shared value
    w = (tl.load(QW + i * hidden + c, mask=m, other=0.0).to(tl.float32)
         * tl.load(KW + i * hidden + c, mask=m, other=0.0).to(tl.float32))
    rms_x = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    rms_k = tl.rsqrt(tl.sum(k * k, 0) / hidden + eps)
    d = tl.sum(x * w * k, 0) * rms_x * rms_k / sqrt_h
    sign = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    g = 1.0 / (1.0 + tl.exp(-(sign * tl.sqrt(tl.maximum(tl.abs(d), 1e-6)))))
    if HAS_DEAD:
        g = tl.where(tl.load(DEAD + t) != 0, 0.0, g)
    tl.store(Y + t * s_yt + i * s_yh + c, (x + g * v).to(Y.dtype.element_ty), mask=m)


def engram_gate_v41(x: torch.Tensor, kv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
                    dead_mask: torch.Tensor | None) -> torch.Tensor:
    """x [T, hc, H] (last dim contiguous), kv [T, (hc+1)*H] (the rows' projection, last dim contiguous),
    q_w / k_w [hc, H] contiguous, dead_mask [T] bool or None -> x + g*v [T, hc, H] in x's dtype."""
    num_tokens, hc, hidden = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens:
        _engram_gate_kernel[(num_tokens, hc)](
            x, kv, q_w, k_w, dead_mask if dead_mask is not None else x, y, hidden, eps, float(hidden) ** 0.5,
            x.stride(0), x.stride(1), kv.stride(0), y.stride(0), y.stride(1), HC=hc,
            BLOCK=triton.next_power_of_2(hidden), HAS_DEAD=dead_mask is not None,
            num_warps=4 if hidden <= 2048 else 8)
    return y


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (last dim contiguous) -> same shape and dtype."""
    return _rms_norm(x, None, w, eps)[1]


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float,
                 parts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, r [M, N] (last dims contiguous, x's dtype) -> (x + r, rms_norm(x + r)), one launch. With ``parts``,
    r is float32 partials [P, M, N] (contiguous) of a projection (split_linear.Partials), summed first."""
    return _rms_norm(x, r, w, eps, parts)


def _rms_norm(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float, parts: bool = False):
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = torch.empty_like(x2)
    s = torch.empty_like(x2) if r is not None else y
    if r is None:
        r2 = x2  # not read (ADD is off)
    elif parts:
        r2 = r  # float32 partials [P, M, N]: slice stride r2.stride(0), row stride r2.stride(1)
    else:
        r2 = r.reshape(-1, n)
    s_r = r2.stride(-2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, w, y, r2, s, n, eps, x2.stride(0), y.stride(0), s_r, s.stride(0),
                                         r2.stride(0) if parts else 0, BLOCK=triton.next_power_of_2(n),
                                         ADD=r is not None, PARTS=r2.shape[0] if parts else 0,
                                         num_warps=4 if n <= 2048 else 8, **launch_options(x.device))
    return (s.view(x.shape) if r is not None else None), y.view(x.shape)


def norm_rope(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd] (hd a power of two, last dim contiguous), cos/sin [T, hd] -> rotated (normed) x."""
    t, heads, hd = x.shape
    y = torch.empty_like(x)
    if t:
        _norm_rope_kernel[(t,)](x, w if w is not None else x, cos, sin, y, x, x, y, heads, eps, x.stride(0),
                                x.stride(1), y.stride(0), y.stride(1), cos.stride(0), 0, 0, HD=hd, HALF=hd // 2,
                                BLOCK_H=triton.next_power_of_2(heads), NORM=w is not None, STORE=False, num_warps=4,
                                **launch_options(x.device))
    return y


def norm_rope_store(k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, heads, hd] (last dims contiguous), cos/sin [T, hd], caches [rows, heads, hd] contiguous,
    slots [T] int64 -> k_cache[slots] = norm_rope(k), v_cache[slots] = v."""
    t, heads, hd = k.shape
    if t:
        _norm_rope_kernel[(t,)](k, w if w is not None else k, cos, sin, k_cache, slots, v, v_cache, heads, eps,
                                k.stride(0), k.stride(1), k_cache.stride(0), k_cache.stride(1), cos.stride(0),
                                v.stride(0), v.stride(1), HD=hd, HALF=hd // 2, BLOCK_H=triton.next_power_of_2(heads),
                                NORM=w is not None, STORE=True, num_warps=4, **launch_options(k.device))


def norm_rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, wq: torch.Tensor | None,
                       wk: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``norm_rope(q, wq, ...)`` returned and ``norm_rope_store(k, v, wk, ...)`` done, in one launch; q, k, v
    [T, heads, hd] (last dims contiguous), caches [rows, kv heads, hd] contiguous, slots [T] int64."""
    t, q_heads, hd = q.shape
    k_heads = k.shape[1]
    y = torch.empty_like(q)
    if t:
        _norm_rope_qk_kernel[(t, 2)](q, wq if wq is not None else q, y, k, wk if wk is not None else k, slots, v,
                                     k_cache, v_cache, cos, sin, q_heads, k_heads, eps, q.stride(0), q.stride(1),
                                     y.stride(0), y.stride(1), k.stride(0), k.stride(1), k_cache.stride(0),
                                     k_cache.stride(1), v.stride(0), v.stride(1), cos.stride(0), HD=hd,
                                     HALF=hd // 2, BLOCK_HQ=triton.next_power_of_2(q_heads),
                                     BLOCK_HK=triton.next_power_of_2(k_heads), NORM_Q=wq is not None,
                                     NORM_K=wk is not None, num_warps=4, **launch_options(q.device))
    return y


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for g, u [rows, cols] of one shape with unit column stride (e.g. the two halves of a packed
    gate/up output) -> contiguous [rows, cols]."""
    rows, cols = g.shape
    y = torch.empty(rows, cols, dtype=g.dtype, device=g.device)
    n = rows * cols
    if n:
        _silu_mul_kernel[(triton.cdiv(n, 1024),)](g, u, y, n, cols, g.stride(0), u.stride(0), BLOCK=1024, num_warps=4,
                                                  **launch_options(g.device))
    return y
