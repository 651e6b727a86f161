"""CRC32C (Castagnoli), the checksum of every page of ``values.bin`` (page_crc.py): ``crc32c(data, crc=0)`` continues
like zlib.crc32, ``crc32c_pages(buf, page_size)`` gives uint32 [pages]. C (csrc/crc32c.h, in engram.store._pread_pool:
SSE4.2 or slicing-by-8), with a numpy fallback of the same values (one warning; ``set_backend("numpy")`` in tests); not
a PyPI package, since the GPU machine installs offline with ``--no-deps``."""
from __future__ import annotations

import functools

import numpy as np

from engram.fast_path import FastPathSwitch

try:
    from engram.store import _pread_pool as _c
except ImportError as _e:  # no C extension: the numpy fallback serves
    _c = None
    _IMPORT_ERROR: str | None = str(_e)
else:
    _IMPORT_ERROR = None

POLY = 0x82F63B78  # reflected Castagnoli polynomial
BACKENDS = ("auto", "c", "numpy")
SWITCH = FastPathSwitch(
    "crc32c backend", None, BACKENDS, fast="c", available=lambda: _c is not None,
    missing=f"the C CRC32C in engram.store._pread_pool is not built: {_IMPORT_ERROR}",
    fallback_warning=f"engram: the C CRC32C is not built ({_IMPORT_ERROR}); page checksums use the much "
                     "slower numpy implementation (reinstall with a C compiler)")


def set_backend(name: str) -> str:
    """Choose "auto" (C when built), "c" (required) or "numpy"; returns the previous choice."""
    return SWITCH.set(name)


def implementation() -> str:
    """What computes checksums now: "sse4.2", "table" (the portable C loop) or "numpy"."""
    return _c.crc32c_impl() if _use_c() else "numpy"


def _use_c() -> bool:
    """Whether C computes this call's checksums (the first numpy fallback under "auto" warns, at the public caller)."""
    return SWITCH.use_fast(stacklevel=3)


@functools.cache
def _byte_table() -> np.ndarray:
    """uint32 [256]: the register after one byte b from register 0."""
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(POLY), t >> 1).astype(np.uint32)
    return t


@functools.cache
def _position_tables(n: int) -> tuple[np.ndarray, int]:
    """For blocks of ``n`` bytes: G uint32 [n, 256] (byte value v at position j's contribution to the register) and K
    (the CRC32C of n zeros); CRC32C is affine over GF(2): crc(block) = K ^ xor_j G[j, block[j]]."""
    t0 = _byte_table()
    g = np.empty((n, 256), dtype=np.uint32)
    g[n - 1] = t0
    for j in range(n - 2, -1, -1):  # one more zero byte after position j
        prev = g[j + 1]
        g[j] = t0[prev & 0xFF] ^ (prev >> 8)
    reg = np.uint32(0xFFFFFFFF)
    for _ in range(n):
        reg = t0[reg & 0xFF] ^ (reg >> np.uint32(8))
    return g, int(reg ^ np.uint32(0xFFFFFFFF))


def _numpy_pages(blocks: np.ndarray) -> np.ndarray:
    """CRC32C of each row of uint8 [P, n] (vectorized over rows and positions: one table lookup per byte)."""
    p, n = blocks.shape
    g, k = _position_tables(n)
    flat, base = g.reshape(-1), np.arange(n, dtype=np.int32) * 256  # G[j, v] = flat[j * 256 + v]
    out = np.empty(p, dtype=np.uint32)
    step = max(1, (1 << 22) // n)  # rows per pass: bounds the [rows, n] temporaries to 16 MiB
    for a in range(0, p, step):
        idx = blocks[a:a + step].astype(np.int32)
        idx += base
        v = np.take(flat, idx)  # [rows, n] uint32 contributions
        while v.shape[1] % 2 == 0 and v.shape[1] > 1:  # halving xors run vectorized (a reduce along rows does not)
            h = v.shape[1] // 2
            v = v[:, :h] ^ v[:, h:]
        out[a:a + step] = np.bitwise_xor.reduce(v, axis=1) ^ np.uint32(k)
    return out


def _numpy_update(crc: int, data: np.ndarray) -> int:
    t0 = _byte_table()
    reg = (crc ^ 0xFFFFFFFF) & 0xFFFFFFFF
    for b in data.tolist():
        reg = int(t0[(reg ^ b) & 0xFF]) ^ (reg >> 8)
    return reg ^ 0xFFFFFFFF


def crc32c(data, crc: int = 0) -> int:
    """CRC32C of ``data`` (bytes-like) continuing from ``crc`` (0 to start)."""
    if _use_c():
        return _c.crc32c(data, crc)
    arr = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
    if crc == 0 and arr.size:
        return int(_numpy_pages(arr.reshape(1, -1))[0])
    return _numpy_update(crc, arr)


def crc32c_pages(buf, page_size: int) -> np.ndarray:
    """uint32 [len(buf) // page_size]: each page's CRC32C (bytes-like, array or CPU tensor); ValueError unless pages."""
    if hasattr(buf, "numpy"):
        buf = buf.numpy()
    arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    arr = arr.reshape(-1).view(np.uint8)
    if page_size < 1 or arr.size % page_size:
        raise ValueError(f"a buffer of {arr.size} bytes is not whole pages of {page_size} bytes")
    n = arr.size // page_size
    if _use_c():
        out = np.empty(n, dtype=np.uint32)
        _c.crc32c_pages(arr, page_size, out)
        return out
    return _numpy_pages(arr.reshape(n, page_size)) if n else np.empty(0, dtype=np.uint32)
