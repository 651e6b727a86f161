"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4 and its norms. The residual is ``hc_mult`` streams
h [T, hc, H]. Around each block an ``HyperConnection`` computes, from the rms-normed flattened streams, a collapse
weight ``pre`` [T, hc], an expand weight ``post`` [T, hc] and a mix ``comb`` [T, hc, hc] projected towards
doubly-stochastic by Sinkhorn-Knopp; the block reads ``sum_k pre_k h_k`` and the streams become
``post_k * y + sum_j comb[j, k] h_j``. ``HyperHead`` collapses the streams before the final norm. Parameters and
mixes are float32 (float64 for float64 models); the streams keep the model dtype.

Fast paths on CUDA (bf16 / fp16 / fp32): ``HyperConnection.collapse`` in one Triton launch after its GEMM
(mhc_triton.py; switch "mhc" of ENGRAM_KERNELS), and the weighted ``rms_norm`` in the dense presets' one-launch kernel
(fused_triton.rms_norm, which rounds ``w * x * rsqrt(...)`` once as this reference does; switch "fused"). The torch code
here is the reference (any device and dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engram.fast_path import FastPathSwitch, importable
from engram.model.layers import fused

SWITCH = FastPathSwitch("mHC collapse backend", "mhc")
FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def collapse_fast(h: torch.Tensor, hc: int) -> bool:
    """Whether ``HyperConnection.collapse`` takes the Triton kernel for streams ``h`` of ``hc`` streams."""
    can_run = (h.is_cuda and h.dtype in FAST_DTYPES and h.stride(-1) == 1 and hc & (hc - 1) == 0
               and importable("engram.model.deepseek_v4.mhc_triton"))
    return SWITCH.fast(can_run, f"{h.dtype} streams on {h.device} (hc={hc})")


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype V4's float32 pieces compute in: float32, or float64 for float64 models."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim in the work dtype, returned in x's dtype."""
    if weight is not None and weight.dtype == torch.float32 and fused.fast_rms_norm(x):
        from engram.model.layers import fused_triton

        return fused_triton.rms_norm(x, weight, eps)
    xf = x.to(work_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.to(y.dtype) * y
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """A weighted RMSNorm whose weight stays float32 on low-precision paths (``weight`` in checkpoints)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., hc, hc] positive -> columns normalised once, then ``iters - 1`` rounds of rows then columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection:
    """The mixes of one block, read from a decoder layer's ``hc_{attn,ffn}_{fn,base,scale}`` parameters: ``fn``
    [(2+hc)*hc, hc*H], ``base`` [(2+hc)*hc], ``scale`` [3] (pre, post, comb)."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int, iters: int, eps: float,
                 norm_eps: float):
        self.fn, self.base, self.scale = fn, base, scale
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps

    def collapse(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, hc, H] -> (block input [T, H] in h's dtype, post [T, hc], comb [T, hc, hc]) in the work dtype."""
        hc, wd = self.hc, work_dtype(h.dtype)
        if all(p.dtype == torch.float32 for p in (self.fn, self.base, self.scale)) and collapse_fast(h, hc):
            from engram.model.deepseek_v4 import mhc_triton

            return mhc_triton.collapse(h, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)
        flat = rms_norm(h.flatten(1).to(wd), None, self.norm_eps)  # [T, hc*H]
        mix = F.linear(flat, self.fn.to(wd))  # [T, (2+hc)*hc]
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        base = self.base.to(wd)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        s = self.scale.to(wd)
        pre = torch.sigmoid(pre_w * s[0] + pre_b) + self.eps  # [T, hc]
        post = 2 * torch.sigmoid(post_w * s[1] + post_b)  # [T, hc]
        comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * s[2] + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = sinkhorn(comb, self.iters, self.eps)  # [T, hc, hc]
        x = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, H]
        return x, post, comb

    @staticmethod
    def expand(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """streams h [T, hc, H], block output y [T, H] -> new streams: post_k * y + sum_j comb[j, k] h_j."""
        dt = h.dtype
        return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), h)


def hyper_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               norm_eps: float) -> torch.Tensor:
    """Final collapse: h [T, hc, H] with ``hc_head_{fn [hc, hc*H], base [hc], scale [1]}`` -> [T, H] in h's dtype."""
    wd = work_dtype(h.dtype)
    flat = rms_norm(h.flatten(1).to(wd), None, norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.to(wd)) * scale.to(wd) + base.to(wd)) + eps  # [T, hc]
    return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
