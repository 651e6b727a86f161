"""Engram tables of a loaded model: where they are cached, how preset tables are generated, how they open.

Preset tables are random (N(0, 1) values, MXFP8 unless the layout says otherwise), generated once per
(layout fingerprint, seed) into ``<cache>/tables/<key>/layer<L>`` with a progress bar and reused after
that; checkpoint tables are converted once from the checkpoint's safetensors through the store's
converter into ``<cache>/tables/<key>/layer<L>`` with a key derived from the checkpoint files.
The cache root is ``cache_dir``, else ``$ENGRAM_CACHE_DIR``, else ``~/.cache/engram``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from engram.config import EngramConfig
from engram.quant import quantize_mxfp8
from engram.store.format import MANIFEST

GENERATOR_VERSION = 1  # bump when generate_random_table changes what it writes
CHUNK_ROWS = 1 << 16
OPEN_OPTIONS = ("cache_rows", "cache_bytes", "cache_policy", "io", "queue_depth")  # passed to open_table
_ROW_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else $ENGRAM_CACHE_DIR, else ~/.cache/engram."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("ENGRAM_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "engram"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def preset_table_dirs(cfg: EngramConfig, seed: int, cache_dir=None) -> dict[int, Path]:
    """Where the random tables of this layout and seed live (one directory per Engram layer)."""
    # Only what decides the bytes: each layer's fingerprint (primes, rows, dims), row dtype, seed.
    layout = {"fingerprints": [cfg.fingerprint(l) for l in cfg.layer_ids], "row_dtype": cfg.row_dtype}
    key = _digest({"layout": layout, "seed": seed, "generator": GENERATOR_VERSION})
    root = cache_root(cache_dir) / "tables" / f"random-{key}"
    return {lid: root / f"layer{lid}" for lid in cfg.layer_ids}


def generate_random_table(directory: Path, cfg: EngramConfig, layer_id: int, seed: int,
                          progress: bool = True) -> None:
    """Write layer ``layer_id``'s table of N(0, 1) rows, chunk by chunk from one CPU generator seeded by
    (seed, layer), so the bytes depend only on the layout and the seed."""
    from engram.store.writer import TableWriter

    rows, dim = cfg.table_rows(layer_id), cfg.head_dim
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * layer_id)
    with TableWriter(directory, rows, dim, cfg.row_dtype, layer_id=layer_id, fingerprint=cfg.fingerprint(layer_id),
                     meta={"source": "random", "seed": seed, "generator": GENERATOR_VERSION},
                     progress=progress, desc=f"engram table layer {layer_id}") as w:
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            x = torch.randn(n, dim, generator=g)  # [n, dim] fp32
            if cfg.row_dtype == "mxfp8":
                w.append(*quantize_mxfp8(x))  # float8_e4m3fn [n, dim], uint8 [n, dim/32]
            else:
                w.append(x.to(_ROW_TORCH[cfg.row_dtype]))


def ensure_preset_tables(cfg: EngramConfig, seed: int, cache_dir=None, progress: bool = True) -> dict[int, Path]:
    """Generate the missing random tables of a preset layout; returns layer id -> table directory."""
    dirs = preset_table_dirs(cfg, seed, cache_dir)
    for lid, d in dirs.items():
        if not (d / MANIFEST).is_file():
            generate_random_table(d, cfg, lid, seed, progress=progress)
    return dirs


def checkpoint_table_dirs(checkpoint: Path, cfg: EngramConfig, cache_dir=None) -> dict[int, Path]:
    """Cache directories of a checkpoint's converted tables, keyed by its safetensors files (name, size,
    mtime) and the layout, so a changed checkpoint converts again."""
    files = sorted(checkpoint.glob("*.safetensors"))
    ident = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = _digest({"checkpoint": str(checkpoint.resolve()), "files": ident, "layout": cfg.to_dict()})
    root = cache_root(cache_dir) / "tables" / f"{checkpoint.resolve().name}-{key}"
    return {lid: root / f"layer{lid}" for lid in cfg.layer_ids}


def open_tables(dirs: dict[int, Path], cfg: EngramConfig, tier: str = "gpu", device=None,
                options: dict[str, Any] | None = None) -> dict[int, Any]:
    """Open each layer's table on ``tier``, checking it against the layout's fingerprint. ``options`` may
    carry open_table's keyword arguments (cache_rows, cache_bytes, cache_policy, io, queue_depth)."""
    from engram.store import open_table

    kwargs = {k: v for k, v in (options or {}).items() if k in OPEN_OPTIONS}
    return {lid: open_table(d, tier=tier, device=device, expect=cfg.fingerprint(lid), **kwargs)
            for lid, d in dirs.items()}


_TABLE_DTYPES = {"mxfp8": (torch.float8_e4m3fn, torch.uint8), "bf16": (torch.bfloat16,), "fp16": (torch.float16,),
                 "fp32": (torch.float32,)}


TensorRef = tuple[Path, str]  # (safetensors file, key in it)


def _layer_table_keys(tensors: dict[str, TensorRef], lid: int) -> tuple[TensorRef, TensorRef | None]:
    base = f"model.layers.{lid}.engram."
    for wkey, skey in (("embed.weight", "embed.scale"), ("multi_head_embedding.embedding.weight", None)):
        if base + wkey in tensors:
            return tensors[base + wkey], tensors.get(base + skey) if skey else None
    raise ValueError(f"checkpoint has no table for Engram layer {lid}: expected tensor "
                     f"'[model.]layers.{lid}.engram.embed.weight' (and embed.scale for MXFP8)")


def convert_checkpoint_tables(tensors: dict[str, tuple[Path, str]], dirs: dict[int, Path], cfg: EngramConfig,
                              progress: bool = True) -> None:
    """Stream each layer's table tensors (``{name: (safetensors file, key)}``) into a store table at
    ``dirs[layer]`` unless one is already there. Raises ValueError naming the tensor and the expected and
    found shape or dtype."""
    for lid, d in dirs.items():
        if not (d / MANIFEST).is_file():
            _convert_layer(tensors, d, cfg, lid, progress)


def _convert_layer(tensors: dict[str, tuple[Path, str]], d: Path, cfg: EngramConfig, lid: int, progress: bool) -> None:
    from contextlib import ExitStack

    from safetensors import safe_open

    from engram.store.writer import TableWriter

    (wfile, wkey), scale_ref = _layer_table_keys(tensors, lid)
    rows, dim = cfg.table_rows(lid), cfg.head_dim
    with ExitStack() as stack:
        fw = stack.enter_context(safe_open(str(wfile), framework="pt"))
        w = fw.get_slice(wkey)
        shape, dtype = tuple(w.get_shape()), _slice_dtype(w)
        if shape != (rows, dim):
            raise ValueError(f"{wfile.name}: tensor {wkey!r} has shape {list(shape)}, expected [{rows}, {dim}] "
                             f"(table_rows({lid}) x head_dim)")
        if dtype not in _TABLE_DTYPES[cfg.row_dtype]:
            raise ValueError(f"{wfile.name}: tensor {wkey!r} has dtype {dtype}, expected {cfg.row_dtype} rows")
        scale_slice = None
        if cfg.row_dtype == "mxfp8":
            if scale_ref is None:
                raise ValueError(f"checkpoint has no '{wkey.rsplit('.', 1)[0]}.scale' for MXFP8 table of layer {lid}")
            fs = stack.enter_context(safe_open(str(scale_ref[0]), framework="pt"))
            scale_slice = fs.get_slice(scale_ref[1])
            if tuple(scale_slice.get_shape()) != (rows, dim // 32):
                raise ValueError(f"{scale_ref[0].name}: tensor {scale_ref[1]!r} has shape "
                                 f"{list(scale_slice.get_shape())}, expected [{rows}, {dim // 32}]")
        with TableWriter(d, rows, dim, cfg.row_dtype, layer_id=lid, fingerprint=cfg.fingerprint(lid),
                         meta={"source": str(wfile)}, progress=progress, desc=f"convert table layer {lid}") as out:
            for start in range(0, rows, CHUNK_ROWS):
                stop = min(rows, start + CHUNK_ROWS)
                vals = w[start:stop]  # [n, dim]
                if cfg.row_dtype == "mxfp8":
                    out.append(vals.view(torch.uint8), scale_slice[start:stop].view(torch.uint8))
                else:
                    out.append(vals)


def _slice_dtype(s) -> torch.dtype:
    names = {"F8_E4M3": torch.float8_e4m3fn, "U8": torch.uint8, "BF16": torch.bfloat16, "F16": torch.float16,
             "F32": torch.float32, "F8_E8M0": torch.float8_e8m0fnu, "F64": torch.float64}
    return names.get(s.get_dtype(), s.get_dtype())


def read_table_tensors(directory: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A whole table back as checkpoint tensors: values [rows, dim] in the row dtype (float8_e4m3fn for
    MXFP8) and scales float8_e8m0fnu [rows, dim/32] (None for other dtypes). Reads the files in RAM."""
    import numpy as np

    from engram.store.format import read_manifest

    m = read_manifest(directory)
    raw = np.fromfile(m.values_path, dtype=np.uint8)[: m.rows * m.row_stride].reshape(m.rows, m.row_stride)
    vals = torch.from_numpy(np.ascontiguousarray(raw[:, : m.value_bytes]))  # [rows, value_bytes] uint8
    torch_dtype = torch.float8_e4m3fn if m.row_dtype == "mxfp8" else _ROW_TORCH[m.row_dtype]
    values = vals.view(torch_dtype)  # [rows, dim]
    if not m.scale_cols:
        return values, None
    sc = np.fromfile(m.scales_path, dtype=np.uint8)[: m.rows * m.scale_cols].reshape(m.rows, m.scale_cols)
    return values, torch.from_numpy(sc.copy()).view(torch.float8_e8m0fnu)
