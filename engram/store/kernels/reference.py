"""Plain torch gather + dequant of packed table rows: the reference every fast kernel must match bitwise. ``values``
uint8 [R, stride] (values then padding), ``scales`` uint8 [R, dim // 32] for MXFP8; any device."""
from __future__ import annotations

import torch

from engram.quant import BLOCK, ROW_TORCH_DTYPES, scale_factors  # noqa: F401 (ROW_TORCH_DTYPES re-exported)


def value_bytes(row_dtype: str, dim: int) -> int:
    """Bytes of one row's values (without padding or scales)."""
    return dim * ROW_TORCH_DTYPES[row_dtype].itemsize


def decode_rows(raw: torch.Tensor, scales: torch.Tensor | None, row_dtype: str, dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """raw uint8 [N, >= value_bytes] + scales uint8 [N, dim/32] (mxfp8 only) -> [N, dim] ``dtype``."""
    n = raw.shape[0]
    vb = raw[:, : value_bytes(row_dtype, dim)].contiguous()
    vals = vb.view(ROW_TORCH_DTYPES[row_dtype])  # [N, dim]
    if row_dtype != "mxfp8":
        return vals.to(dtype)
    f = scale_factors(scales)  # [N, dim/32] fp32
    out = vals.to(torch.float32).reshape(n, dim // BLOCK, BLOCK) * f.unsqueeze(-1)
    return out.reshape(n, dim).to(dtype)


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows ``ids`` (int64 [N], already range-checked) of a packed table, dequantized into ``out`` [N, dim]."""
    ids = ids.to(values.device)
    raw = values.index_select(0, ids)  # [N, stride] uint8
    sc = scales.index_select(0, ids.to(scales.device)) if scales is not None else None
    rows = decode_rows(raw, sc, row_dtype, dim, dtype)
    if out is None:
        return rows
    out.copy_(rows)
    return out


def gather_raw(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Packed bytes of rows ``ids``: uint8 [N, stride]."""
    return values.index_select(0, ids.to(values.device))
