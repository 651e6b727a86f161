"""Row encodings of Engram tables: ``ROW_TORCH_DTYPES`` (each row dtype's torch dtype) and MXFP8, E4M3 values
with one power-of-two (E8M0) scale per block of 32 values.

Quantize, per block: e = ceil(log2(amax / 448)) so that amax / 2**e <= 448 (never saturates); the scale
byte is e + 127 clamped to [1, 254]; an all-zero block stores byte 127. Values are round-to-nearest-even
E4M3 of x / 2**e. Dequantize: value * 2**(byte - 127), except byte 0 (seen in checkpoints), which gives
exactly 0.0 rather than torch's e8m0 reading of 2**-127, and byte 255 (E8M0 NaN), which gives NaN.
All arithmetic is exact up to the final cast, so every implementation (torch, Triton) agrees bitwise.
"""
from __future__ import annotations

import torch

BLOCK = 32
E4M3_MAX = 448.0
# EngramConfig.row_dtype -> the torch dtype of a row's values (MXFP8 values are E4M3, their scales uint8).
ROW_TORCH_DTYPES = {"mxfp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16,
                    "fp32": torch.float32}


def _check_2d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [N, D], got shape {tuple(x.shape)}")


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] (D a multiple of 32, any float dtype) -> (float8_e4m3fn [N, D], uint8 [N, D // 32])."""
    _check_2d(x, "x")
    n, d = x.shape
    if d % BLOCK:
        raise ValueError(f"MXFP8 needs the last dim to be a multiple of {BLOCK}, got {d}")
    if not x.is_floating_point():
        raise ValueError(f"quantize_mxfp8 needs a float tensor, got {x.dtype}")
    xf = x.detach().to(torch.float64).reshape(n, d // BLOCK, BLOCK)  # exact for every float input
    amax = xf.abs().amax(dim=-1)  # [N, D/32]
    nonzero = amax > 0
    safe = torch.where(nonzero, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / E4M3_MAX))
    # log2 may be off by one ulp at exact powers of two: fix e to the smallest with amax <= 448 * 2**e.
    e = torch.where(safe > E4M3_MAX * torch.exp2(e), e + 1, e)
    e = torch.where(safe <= E4M3_MAX * torch.exp2(e - 1), e - 1, e)
    e = torch.where(nonzero, e, torch.zeros_like(e)).clamp(-126, 127)
    scale_bytes = (e + 127).to(torch.uint8)  # [N, D/32]
    scaled = (xf * torch.exp2(-e).unsqueeze(-1)).to(torch.float32)  # exact: power-of-two scaling
    values = scaled.reshape(n, d).to(torch.float8_e4m3fn)  # round to nearest even
    return values, scale_bytes


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """uint8 (or float8_e8m0fnu) scale bytes -> float32 factors 2**(byte - 127); byte 0 -> 0, 255 -> NaN."""
    b = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    b32 = b.to(torch.int32)
    f = torch.exp2((b32 - 127).to(torch.float32))
    f = torch.where(b32 == 0, torch.zeros_like(f), f)
    return torch.where(b32 == 255, torch.full_like(f, float("nan")), f)


def dequantize_mxfp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """values [N, D] float8_e4m3fn (or its uint8 view), scales [N, D // 32] -> [N, D] in ``dtype``."""
    _check_2d(values, "values")
    _check_2d(scales, "scales")
    v = values.view(torch.float8_e4m3fn) if values.dtype == torch.uint8 else values
    n, d = v.shape
    if scales.shape != (n, d // BLOCK) or d % BLOCK:
        raise ValueError(f"scales shape {tuple(scales.shape)} does not match values {tuple(v.shape)} "
                         f"(expected [{n}, {d // BLOCK}])")
    f = scale_factors(scales)  # [N, D/32] fp32
    out = v.to(torch.float32).reshape(n, d // BLOCK, BLOCK) * f.unsqueeze(-1)
    return out.reshape(n, d).to(dtype)
