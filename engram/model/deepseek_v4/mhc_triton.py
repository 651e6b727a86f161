"""DeepSeek-V4's mHC collapse on CUDA in Triton (``HyperConnection.collapse``'s fast path, mhc.py): after one GEMM of
the streams with ``fn`` (cuBLAS), one launch per call does the rest for every token: the streams' RMS statistic, the
pre / post / comb mixes, the softmax, all Sinkhorn-Knopp rounds and the collapsed block input. The torch reference
takes ~140 small kernels for the same (39 normalisations of a 4 x 4 matrix at 20 rounds, each three kernels): at
decode, where every one of them is a few microseconds on the GPU, that was over half of a V4 step's kernels.

The GEMM runs on the unnormalised float32 streams and the kernel scales its result by the RMS factor (the reference
normalises first): equal in exact arithmetic, float32 rounding apart. Everything else computes in float32 as the
reference does, with its operations in its order; sums run in another order. CUDA only; importing needs triton (the
interpreter, ``TRITON_INTERPRET=1``, runs it on CPU tensors)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _collapse_kernel(H, MIX, BASE, SCALE, X, POST, COMB, eps, norm_eps, s_ht, s_hk, s_mt, s_xt, HIDDEN: tl.constexpr,
                     HC: tl.constexpr, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    k = tl.arange(0, HC)
    c = tl.arange(0, BLOCK)
    rows = H + t * s_ht + k[:, None] * s_hk  # token t's hc streams
    squares = tl.zeros([HC, BLOCK], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK):
        m = (start + c) < HIDDEN
        v = tl.load(rows + start + c[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        squares += v * v
    r = tl.rsqrt(tl.sum(tl.sum(squares, 1), 0) / (HC * HIDDEN) + norm_eps)  # rms_norm of the flattened streams
    mix = MIX + t * s_mt
    s_pre, s_post, s_comb = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
    pre = tl.sigmoid(tl.load(mix + k) * r * s_pre + tl.load(BASE + k)) + eps
    post = 2 * tl.sigmoid(tl.load(mix + HC + k) * r * s_post + tl.load(BASE + HC + k))
    ij = k[:, None] * HC + k[None, :]  # comb[i, j]
    logits = tl.load(mix + 2 * HC + ij) * r * s_comb + tl.load(BASE + 2 * HC + ij)
    e = tl.exp(logits - tl.max(logits, 1)[:, None])
    comb = e / tl.sum(e, 1)[:, None] + eps  # softmax over j, then + eps
    comb = comb / (tl.sum(comb, 0)[None, :] + eps)  # columns once
    for _ in tl.static_range(ITERS - 1):  # then rows, columns
        comb = comb / (tl.sum(comb, 1)[:, None] + eps)
        comb = comb / (tl.sum(comb, 0)[None, :] + eps)
    tl.store(POST + t * HC + k, post)
    tl.store(COMB + t * HC * HC + ij, comb)
    for start in range(0, HIDDEN, BLOCK):  # x = sum_k pre_k h_k, the streams read again (from L2)
        m = (start + c) < HIDDEN
        v = tl.load(rows + start + c[None, :], mask=m[None, :], other=0.0).to(tl.float32)
        x = tl.sum(pre[:, None] * v, 0)
        tl.store(X + t * s_xt + start + c, x.to(X.dtype.element_ty), mask=m)


def collapse(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, H] (hc a power of two, last dim contiguous), ``fn`` [(2+hc)*hc, hc*H] / ``base`` [(2+hc)*hc] /
    ``scale`` [3] float32 -> (block input [T, H] in h's dtype, post [T, hc], comb [T, hc, hc] float32), as
    ``HyperConnection.collapse``."""
    t, hc, hidden = h.shape
    mix = torch.mm(h.reshape(t, hc * hidden).float(), fn.t())  # [T, (2+hc)*hc], unnormalised
    x = torch.empty(t, hidden, dtype=h.dtype, device=h.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=h.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=h.device)
    if t:
        block = min(triton.next_power_of_2(hidden), max(16, 4096 // hc))
        _collapse_kernel[(t,)](h, mix, base, scale, x, post, comb, eps, norm_eps, h.stride(0), h.stride(1),
                               mix.stride(0), x.stride(0), HIDDEN=hidden, HC=hc, ITERS=iters, BLOCK=block,
                               num_warps=4)
    return x, post, comb
