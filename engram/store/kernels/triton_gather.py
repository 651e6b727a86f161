"""Triton gather of packed table rows, with MXFP8 dequant fused: the fast path behind ``gather_rows``. One kernel serves
the HBM table and the pinned host table (over UVA): programs take tiles of BLOCK_R ids (LaunchConfig), load rows with
16-byte vector loads (8 when the stride is not a multiple of 16), prefetch the next tile's ids, dequantize in fp32 and
store ``dtype`` rows. ``dst`` (output row per id) and ``runs`` (first position of each run of equal sorted ids; the rest
skipped) let uva.py gather sorted, deduplicated ids and scatter them back. Bitwise equal to reference.gather_rows (exact
fp32 dequant, round-to-nearest-even cast). CUDA only; importing needs triton."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.store.kernels.launch_config import LaunchConfig, spread_programs
from engram.store.kernels.reference import ROW_TORCH_DTYPES

ROW_KINDS = {"mxfp8": 0, "bf16": 1, "fp16": 2, "fp32": 3}
OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


CONFIG = LaunchConfig()
_SM_COUNT: dict[int, int] = {}


class HostPointer:
    """A pinned host tensor as Triton sees an argument: its UVA address (the host address for memory registered as
    mapped on 64-bit Linux) and element dtype."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype = t.dtype
        self._t = t  # keeps the memory alive for the launch
        self._ptr = t.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


def kernel_arg(t: torch.Tensor):
    return t if t.is_cuda else HostPointer(t)


_RESIDENT: dict[tuple, int] = {}  # programs of one compiled kernel that fit on an SM at once
_FIRST_GUESS = 4


def _resident_programs(compiled, num_warps: int) -> int:
    """Programs per SM allowed by the compiled kernel's registers and shared memory (Hopper limits:
    64 K registers allocated per warp in units of 256, 64 warps, 32 blocks, 227 KiB shared memory)."""
    try:
        regs = max(int(compiled.n_regs), 1)
        shared = int(getattr(compiled.metadata, "shared", 0))
    except (AttributeError, TypeError):  # a Triton without these fields: stay with the first guess
        return _FIRST_GUESS
    per_warp = -(-regs * 32 // 256) * 256
    fit = min((65536 // per_warp) // num_warps, 64 // num_warps, 32, (227 << 10) // shared if shared else 32)
    return max(1, fit)


def _launch(kernel, n_tiles: int, device: torch.device, cfg: LaunchConfig, args: tuple, consts: dict) -> None:
    """Launch ``kernel`` over ``n_tiles`` tiles: one program per tile, or a persistent grid of SMs x programs_per_sm
    (-1: the compiled kernel's resident count); capped at ``max_programs`` and spread by ``tiles_per_program``."""
    if cfg.programs_per_sm == 0:
        programs = n_tiles
    else:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        key = (kernel.fn.__name__, cfg.num_warps, tuple(sorted(consts.items())))
        per_sm = cfg.programs_per_sm if cfg.programs_per_sm > 0 else _RESIDENT.get(key, _FIRST_GUESS)
        programs = min(n_tiles, _SM_COUNT[idx] * per_sm)
    programs = min(programs, spread_programs(n_tiles, cfg.tiles_per_program))
    if cfg.max_programs:
        programs = min(programs, cfg.max_programs)
    compiled = kernel[(max(1, programs),)](*args, **consts, num_warps=cfg.num_warps)
    if cfg.programs_per_sm == -1 and key not in _RESIDENT:
        _RESIDENT[key] = _resident_programs(compiled, cfg.num_warps)


@triton.jit
def _tile_rows(ids_ptr, runs_ptr, r, n, HAS_RUNS: tl.constexpr):
    """Table rows of positions r (int64), -1 past the end or (HAS_RUNS) where r is not first of its run."""
    m = r < n
    if HAS_RUNS:
        m = m & (tl.load(runs_ptr + r, mask=m, other=0) == r)
    return tl.where(m, tl.load(ids_ptr + r, mask=m, other=0).to(tl.int64), -1)


@triton.jit
def _gather_rows_kernel(values_ptr, scales_ptr, ids_ptr, dst_ptr, runs_ptr, out_ptr, n,
                        V_STRIDE: tl.constexpr, S_STRIDE: tl.constexpr, OUT_STRIDE: tl.constexpr,
                        DIM: tl.constexpr, NB: tl.constexpr, ROW_KIND: tl.constexpr, OUT_KIND: tl.constexpr,
                        CAST_VIA_F32: tl.constexpr, SCALE_U64: tl.constexpr, BLOCK_R: tl.constexpr,
                        HAS_DST: tl.constexpr, HAS_RUNS: tl.constexpr, STREAM: tl.constexpr):
    # Tiles are [BLOCK_R ids, NB blocks of 32 values, 32]; NB is DIM/32 rounded up to a power of two.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n, BLOCK_R)
    ar = tl.arange(0, BLOCK_R)
    blk = tl.arange(0, NB)
    j = tl.arange(0, 32)
    col = blk[None, :, None] * 32 + j[None, None, :]  # [1, NB, 32] value index in the row
    cmask = col < DIM
    row = _tile_rows(ids_ptr, runs_ptr, pid * BLOCK_R + ar, n, HAS_RUNS)  # [BLOCK_R] int64, -1 = skip
    for tile in range(pid, n_tiles, nprog):
        # The next tile's ids load while this tile's rows are in flight (one dependent latency fewer).
        row_n = _tile_rows(ids_ptr, runs_ptr, (tile + nprog) * BLOCK_R + ar, n, HAS_RUNS)
        r = tile * BLOCK_R + ar
        in_range = r < n
        rmask = in_range & (row >= 0)
        if HAS_DST:
            dst = tl.load(dst_ptr + r, mask=in_range, other=0).to(tl.int64)
        else:
            dst = r.to(tl.int64)
        m3 = rmask[:, None, None] & cmask  # [BLOCK_R, NB, 32]
        vrow = values_ptr + row[:, None, None] * V_STRIDE  # uint8* of each row
        if ROW_KIND == 0:
            v = tl.load(vrow + col, mask=m3, other=0, eviction_policy="evict_first" if STREAM else "")
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            if SCALE_U64:  # the 8 scale bytes of a 256-value row as one 8-byte load
                w = tl.load((scales_ptr + row * S_STRIDE).to(tl.pointer_type(tl.int64)), mask=rmask, other=0)
                sb = ((w[:, None] >> (blk[None, :] * 8).to(tl.int64)) & 0xFF).to(tl.int32)  # [BLOCK_R, NB]
            else:
                sb = tl.load(scales_ptr + row[:, None] * S_STRIDE + blk[None, :],
                             mask=rmask[:, None] & (blk[None, :] * 32 < DIM), other=127).to(tl.int32)
            # 2**(b-127) is the fp32 whose exponent field is b (b=0 gives +0.0); b=255 is E8M0 NaN.
            f = (sb << 23).to(tl.float32, bitcast=True)
            f = tl.where(sb == 255, float("nan"), f)
            y = v * f[:, :, None]
        elif ROW_KIND == 1:
            y = tl.load(vrow.to(tl.pointer_type(tl.bfloat16)) + col, mask=m3, other=0,
                        eviction_policy="evict_first" if STREAM else "")
        elif ROW_KIND == 2:
            y = tl.load(vrow.to(tl.pointer_type(tl.float16)) + col, mask=m3, other=0,
                        eviction_policy="evict_first" if STREAM else "")
        else:
            y = tl.load(vrow.to(tl.pointer_type(tl.float32)) + col, mask=m3, other=0,
                        eviction_policy="evict_first" if STREAM else "")
        if CAST_VIA_F32:
            y = y.to(tl.float32)  # bf16 <-> fp16 goes through fp32, as torch's cast does
        optr = out_ptr + dst[:, None, None] * OUT_STRIDE + col
        if OUT_KIND == 0:
            tl.store(optr, y.to(tl.bfloat16), mask=m3, cache_modifier=".cs" if STREAM else "")
        elif OUT_KIND == 1:
            tl.store(optr, y.to(tl.float16), mask=m3, cache_modifier=".cs" if STREAM else "")
        else:
            tl.store(optr, y.to(tl.float32), mask=m3, cache_modifier=".cs" if STREAM else "")
        row = row_n


@triton.jit
def _gather_units_kernel(values_ptr, ids_ptr, dst_ptr, runs_ptr, out_ptr, n,
                         V_STRIDE: tl.constexpr, OUT_STRIDE: tl.constexpr, UNITS: tl.constexpr,
                         UNITS_P2: tl.constexpr, BLOCK_R: tl.constexpr, HAS_DST: tl.constexpr,
                         HAS_RUNS: tl.constexpr, COPY_DUPS: tl.constexpr):
    """Raw rows of UNITS words (strides in words). With COPY_DUPS it fills the rows a runs-gather skipped:
    out[dst[i]] = out[dst[runs[i]]] for every i with runs[i] != i (values_ptr is then out)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n, BLOCK_R)
    u = tl.arange(0, UNITS_P2)
    umask = u[None, :] < UNITS
    for tile in range(pid, n_tiles, nprog):
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < n
        if COPY_DUPS:
            src = tl.load(runs_ptr + r, mask=rmask, other=0)
            rmask = rmask & (src != r)
            row = tl.load(dst_ptr + src, mask=rmask, other=0).to(tl.int64)
        else:
            if HAS_RUNS:
                rmask = rmask & (tl.load(runs_ptr + r, mask=rmask, other=0) == r)
            row = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
        if HAS_DST:
            dst = tl.load(dst_ptr + r, mask=rmask, other=0).to(tl.int64)
        else:
            dst = r.to(tl.int64)
        m = rmask[:, None] & umask
        w = tl.load(values_ptr + row[:, None] * V_STRIDE + u[None, :], mask=m, other=0)
        tl.store(out_ptr + dst[:, None] * OUT_STRIDE + u[None, :], w, mask=m)


_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_bytes(*byte_counts: int) -> int:
    """Largest word (8, 4, 2, 1 bytes) dividing every count: row strides and base addresses."""
    for w in (8, 4, 2, 1):
        if all(c % w == 0 for c in byte_counts):
            return w
    return 1


def _check_values(values: torch.Tensor) -> None:
    if values.dtype != torch.uint8 or values.dim() != 2 or values.stride(1) != 1:
        raise ValueError(f"values must be uint8 [R, stride] with unit column stride, got {values.dtype} "
                         f"shape {tuple(values.shape)} strides {values.stride()}")


def _check_table(values: torch.Tensor, scales: torch.Tensor | None, row_dtype: str, dim: int) -> None:
    _check_values(values)
    if row_dtype not in ROW_KINDS:
        raise ValueError(f"row_dtype={row_dtype!r} is not one of {tuple(ROW_KINDS)}")
    itemsize = ROW_TORCH_DTYPES[row_dtype].itemsize
    if dim * itemsize > values.shape[1]:
        raise ValueError(f"dim={dim} {row_dtype} needs {dim * itemsize} B per row, values rows have {values.shape[1]}")
    if row_dtype == "mxfp8":
        if dim % 32:
            raise ValueError(f"mxfp8 rows need dim % 32 == 0, got dim={dim}")
        if scales is None or scales.dim() != 2 or scales.shape[1] < dim // 32 or scales.stride(1) != 1:
            raise ValueError(f"mxfp8 needs scales uint8 [R, {dim // 32}] with unit column stride, got "
                             f"{None if scales is None else (scales.dtype, tuple(scales.shape), scales.stride())}")
    elif (values.data_ptr() | values.stride(0)) % itemsize:
        raise ValueError(f"{row_dtype} rows must be {itemsize}-byte aligned (data_ptr 0x{values.data_ptr():x}, "
                         f"row stride {values.stride(0)})")


def gather_rows(values: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, row_dtype: str, dim: int,
                out: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16, *,
                dst: torch.Tensor | None = None, runs: torch.Tensor | None = None,
                cfg: LaunchConfig | None = None, ids_pinned: bool = False) -> torch.Tensor:
    """Rows ``ids`` of ``values`` (GPU or pinned host) dequantized into ``out`` [M, dim] ``dtype`` on the GPU: row
    ids[i] goes to out[dst[i]] (default i), skipped where runs[i] != i (see copy_duplicates). ``ids``: int32/int64 [N]
    on the GPU, or pinned host memory with ``ids_pinned`` and ``out`` given (the caller vouches for the pinning, which
    cannot be asked during a capture). ``out`` defaults to a new [N, dim] on ids' device."""
    _check_table(values, scales, row_dtype, dim)
    if not ids.is_cuda and not (ids_pinned and ids.device.type == "cpu" and out is not None and dst is None
                                and runs is None):
        raise ValueError(f"ids must be on a CUDA device (or, with ids_pinned and out, in pinned host memory), "
                         f"got {ids.device}")
    if dtype not in OUT_KINDS:
        raise ValueError(f"dtype={dtype} is not one of {tuple(OUT_KINDS)}")
    cfg = cfg or CONFIG
    n = ids.shape[0]
    if out is None:
        out = torch.empty(n, dim, dtype=dtype, device=ids.device)  # [N, dim]
    if out.dtype != dtype or out.dim() != 2 or out.shape[1] != dim or out.stride(1) != 1 or not out.is_cuda:
        raise ValueError(f"out must be a CUDA {dtype} [N, {dim}] with unit column stride, got {out.dtype} "
                         f"shape {tuple(out.shape)} on {out.device}")
    if n == 0:
        return out
    sc = scales if scales is not None else values
    nb = triton.next_power_of_2(triton.cdiv(dim, 32))
    consts = dict(
        V_STRIDE=values.stride(0), S_STRIDE=sc.stride(0), OUT_STRIDE=out.stride(0), DIM=dim, NB=nb,
        ROW_KIND=ROW_KINDS[row_dtype], OUT_KIND=OUT_KINDS[dtype], BLOCK_R=cfg.block_r,
        SCALE_U64=row_dtype == "mxfp8" and nb == 8 and dim == 256 and (sc.data_ptr() | sc.stride(0)) % 8 == 0,
        CAST_VIA_F32=row_dtype in ("bf16", "fp16") and dtype != torch.float32 and ROW_TORCH_DTYPES[row_dtype] != dtype,
        HAS_DST=dst is not None, HAS_RUNS=runs is not None, STREAM=cfg.stream)
    ids_arg = kernel_arg(ids)
    args = (kernel_arg(values), kernel_arg(sc), ids_arg, dst if dst is not None else ids_arg,
            runs if runs is not None else ids_arg, out, n)
    _launch(_gather_rows_kernel, triton.cdiv(n, cfg.block_r), out.device, cfg, args, consts)
    return out


def gather_raw(values: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None, *,
               dst: torch.Tensor | None = None, runs: torch.Tensor | None = None,
               cfg: LaunchConfig | None = None) -> torch.Tensor:
    """Packed bytes of rows ``ids`` into ``out`` uint8 [M, stride] on the GPU (same dst/runs rules)."""
    _check_values(values)
    if not ids.is_cuda:
        raise ValueError(f"ids must be on a CUDA device, got {ids.device}")
    cfg = cfg or CONFIG
    n, width = ids.shape[0], values.shape[1]
    if out is None:
        out = torch.empty(n, width, dtype=torch.uint8, device=ids.device)  # [N, stride]
    if n == 0 or width == 0:
        return out
    w = _word_bytes(width, values.stride(0), values.data_ptr(), out.stride(0), out.data_ptr())
    words_in = values.view(_WORD[w]) if w > 1 else values  # [R, stride / w]
    words_out = out.view(_WORD[w]) if w > 1 else out
    units = width // w
    consts = dict(V_STRIDE=values.stride(0) // w, OUT_STRIDE=out.stride(0) // w, UNITS=units,
                  UNITS_P2=triton.next_power_of_2(units), BLOCK_R=cfg.block_r, HAS_DST=dst is not None,
                  HAS_RUNS=runs is not None, COPY_DUPS=False)
    args = (kernel_arg(words_in), ids, dst if dst is not None else ids, runs if runs is not None else ids,
            words_out, n)
    _launch(_gather_units_kernel, triton.cdiv(n, cfg.block_r), ids.device, cfg, args, consts)
    return out


def copy_duplicates(out: torch.Tensor, dst: torch.Tensor, runs: torch.Tensor,
                    cfg: LaunchConfig | None = None) -> torch.Tensor:
    """For every i with runs[i] != i: out[dst[i]] = out[dst[runs[i]]] (an HBM pass filling a runs-gather's gaps)."""
    cfg = cfg or CONFIG
    n = dst.shape[0]
    if n == 0:
        return out
    row_bytes = out.shape[1] * out.element_size()
    w = _word_bytes(row_bytes, out.stride(0) * out.element_size(), out.data_ptr())
    words = out.view(torch.uint8).view(_WORD[w]) if out.dtype != _WORD[w] else out  # [M, row_bytes / w]
    units = row_bytes // w
    consts = dict(V_STRIDE=words.stride(0), OUT_STRIDE=words.stride(0), UNITS=units,
                  UNITS_P2=triton.next_power_of_2(units), BLOCK_R=cfg.block_r, HAS_DST=True, HAS_RUNS=True,
                  COPY_DUPS=True)
    _launch(_gather_units_kernel, triton.cdiv(n, cfg.block_r), dst.device, cfg, (words, dst, dst, runs, words, n),
            consts)
    return out
