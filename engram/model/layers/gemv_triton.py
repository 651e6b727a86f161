"""Matrix-vector products for a few rows in Triton: ``gemv(x, w, bias)`` = ``x @ w.T + bias`` for x [M, K]
with M <= MAX_ROWS, the decode step's projections at batch 1-4, launched with programmatic dependent launch.

Why a kernel of our own: at batch 1 a projection reads its whole weight to make a few thousand outputs, so
it should run at the copy bandwidth. cuBLAS runs the 4b-like projections at 62-81 % of it inside the step
and splits K for the narrow ones (o, down), adding a reduce kernel per call. A plain Triton GEMV only tied
cuBLAS on the H200 (e4172ae, docs/benchmarks.md); what cuBLAS cannot do from torch is start before the
kernel in front of it ends. Here, launched with PDL (engram/model/layers/pdl.py), each program loads the
first BLOCK_K columns of its weight rows, which no earlier kernel writes, before it waits for the kernel
in front (``griddepcontrol.wait``); only x, that kernel's output, is read after the wait. So the weight
streaming of the first wave of programs overlaps the latency-bound kernel before it (a norm, attention's
combine, SwiGLU), and the kernel after it is released at once.

Each program owns BLOCK_N output columns and streams their weight rows once over K in BLOCK_K chunks, all M
rows of x against each chunk, accumulating in float32 in a fixed order: no split, no atomics, so a result
depends only on (x, w) and the launch configuration (``config_for``: the launch per 4b-like shape measured
best on the H200, DEFAULT elsewhere), never on timing or on PDL. Results equal the float64 product within
float32 accumulation error (the parity test's tolerance), not cuBLAS bitwise: a sequence decoded at batch 1
(this kernel) and at batch 16 (cuBLAS) differ in rounding, as two cuBLAS kernels for two batch sizes already
do (the determinism policy tests batch composition in float64). Only CUDA; importing needs triton.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engram.model.layers.fused_triton import pdl_enter
from engram.model.layers.pdl import launch_options

MAX_ROWS = 4  # rows of x this kernel takes; more go to cuBLAS (whose tiles then fill the tensor cores)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 8  # output columns (weight rows) per program
    block_k: int = 512  # weight elements per row per loop iteration (the first chunk is loaded before the wait)
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig.{name}={v} must be a power of two")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"GemvConfig.num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")


DEFAULT = GemvConfig()
# (N, K) -> the launch that was fastest for that 4b-like projection in the H200 sweep of e4172ae
# (scripts/bench_gemv.py there; bench/results/2026-12-01-gemv-sweep*-e4172ae.log)
CONFIGS = {
    (6144, 2560): GemvConfig(8, 1024, 4),  # packed q/k/v
    (2560, 4096): GemvConfig(4, 4096, 8),  # o
    (19456, 2560): GemvConfig(8, 512, 4),  # packed gate/up
    (2560, 9728): GemvConfig(4, 2048, 8),  # down
}


def config_for(n: int, k: int) -> GemvConfig:
    """The launch for a weight of N rows of K: the measured one for a 4b-like shape, else DEFAULT."""
    return CONFIGS.get((n, k), DEFAULT)


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, s_xm, s_wn, s_ym, HAS_BIAS: tl.constexpr, M_P2: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_P2)
    rk = tl.arange(0, BLOCK_K)
    nmask = rn < N
    mmask = rm < M
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)  # masked rows read row 0 (always there), then are dropped
    w_rows = W + rn_safe[:, None] * s_wn  # [BLOCK_N, 1]
    # the first chunk of the weight, which no earlier kernel writes: loaded before waiting for that kernel
    if EVEN_K:
        w = tl.load(w_rows + rk[None, :])
    else:
        w = tl.load(w_rows + rk[None, :], mask=(rk < K)[None, :], other=0.0)
    pdl_enter(USE_PDL)  # x is the output of the kernel before: read only after this
    if EVEN_K:
        x = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=mmask[:, None], other=0.0)
    else:
        x = tl.load(X + rm[:, None] * s_xm + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
    acc = tl.zeros((M_P2, BLOCK_N), dtype=tl.float32)
    acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [M_P2, BLOCK_N]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + rk
        if EVEN_K:
            w = tl.load(w_rows + kk[None, :])
            x = tl.load(X + rm[:, None] * s_xm + kk[None, :], mask=mmask[:, None], other=0.0)
        else:
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=kmask[None, :], other=0.0)
            x = tl.load(X + rm[:, None] * s_xm + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * s_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, last dim contiguous), w [N, K] (contiguous rows), bias [N] or None ->
    [M, N] in x's dtype. x, w and bias share one dtype and device. ``config`` (None: ``config_for``)."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} (stride {x.stride()}) and w {tuple(w.shape)} (stride "
                         f"{w.stride()}) need M <= {MAX_ROWS}, equal K and contiguous last dims")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config_for(n, k) if config is None else config
    grid = (triton.cdiv(n, cfg.block_n),)
    _gemv_kernel[grid](x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                       HAS_BIAS=bias is not None, M_P2=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
                       BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps,
                       **launch_options(x.device))
    return y
