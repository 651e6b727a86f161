"""Engram tables of a loaded model: where they are cached, how preset tables are made, how they open. Preset tables are
``convert_random`` tables generated once per (layer fingerprints, row dtype, seed) into
``<cache>/tables/random-<key>/layer<L>``; checkpoint tables are ``convert_safetensors`` copies made once into
``<cache>/tables/<name>-<key>/layer_<L>``. Presets may instead build them in memory (``open_random_tables``)."""
from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Mapping

import torch

from engram.config import EngramConfig
from engram.store import convert
from engram.store.base import Tier
from engram.store.convert import convert_random, convert_safetensors, layer_dir
from engram.store.format import ITEMSIZE, MANIFEST, TableManifest, read_manifest, row_stride
from engram.store.kernels.reference import ROW_TORCH_DTYPES
from engram.store.build import RowChunks, build_table
from engram.store.load import load_table
from engram.store.options import StoreOptions
from engram.store.placement import place_table
from engram.store.shared_preflight import check_shared
from engram.store.upgrade import add_checksums
from engram.tokenizer import cache_root as tokenizer_cache_root
from engram.store import open_table

GENERATOR_VERSION = 2  # bump when generate_random_table changes what it writes


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else the project's cache root ($ENGRAM_CACHE_DIR, else ~/.cache/engram)."""
    return Path(cache_dir) if cache_dir is not None else tokenizer_cache_root()


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def preset_table_dirs(cfg: EngramConfig, seed: int, cache_dir=None) -> dict[int, Path]:
    """Where the random tables of this layout and seed live (one directory per Engram layer)."""
    # Only what decides the bytes: each layer's fingerprint (primes, rows, dims), row dtype, seed.
    layout = {"fingerprints": [cfg.fingerprint(l) for l in cfg.layer_ids], "row_dtype": cfg.row_dtype}
    key = _digest({"layout": layout, "seed": seed, "generator": GENERATOR_VERSION})
    root = cache_root(cache_dir) / "tables" / f"random-{key}"
    return {lid: root / f"layer{lid}" for lid in cfg.layer_ids}  # the server tests find tables by this name


def layer_seed(seed: int, layer_id: int) -> int:
    """The generator seed of layer ``layer_id``'s random table in a preset model of ``seed``."""
    return seed * 65_537 + layer_id


def generate_random_table(directory: Path, cfg: EngramConfig, layer_id: int, seed: int,
                          progress: bool = True) -> None:
    """Write layer ``layer_id``'s random table (``convert_random``: bytes depend only on layout, seed and layer)."""
    convert_random(directory, cfg.table_rows(layer_id), cfg.head_dim, seed=layer_seed(seed, layer_id),
                   row_dtype=cfg.row_dtype, layer_id=layer_id, config=cfg, progress=progress)


def random_rows(rows: int, dim: int, seed: int, row_dtype: str = "mxfp8") -> RowChunks:
    """``convert_random``'s rows as ``RowChunks`` (same chunks and generators: bitwise the file's)."""
    if row_dtype not in ITEMSIZE:
        raise ValueError(f"row_dtype={row_dtype!r} must be one of {sorted(ITEMSIZE)}")
    step = convert.random_chunk_rows(dim, row_dtype)
    local = threading.local()

    def make(k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = min(rows, (k + 1) * step) - k * step
        if row_dtype != "mxfp8":
            return convert.random_chunk(seed, k, n, dim, row_dtype, None)[0].view(torch.uint8), None  # [n, value_bytes]
        if not hasattr(local, "buf"):  # this worker's scratch, as convert_random's ring
            local.buf = convert.random_chunk_buffers(rows, dim)
        return convert.random_chunk(seed, k, n, dim, row_dtype, local.buf)  # uint8 [n, dim], uint8 [n, dim/32]

    return RowChunks(step, make)


def random_manifest(cfg: EngramConfig, layer_id: int, seed: int) -> TableManifest:
    """The manifest ``generate_random_table`` would write, no files, path ``memory:random-seed<S>/layer<L>``."""
    dim = cfg.head_dim
    return TableManifest(path=Path(f"memory:random-seed{seed}") / f"layer{layer_id}", rows=cfg.table_rows(layer_id),
                         dim=dim, row_dtype=cfg.row_dtype, row_stride=row_stride(dim * ITEMSIZE[cfg.row_dtype]),
                         files={}, layer_id=layer_id, fingerprint=cfg.fingerprint(layer_id),
                         meta={"source": "random", "seed": layer_seed(seed, layer_id), "in_memory": True})


def open_random_table(cfg: EngramConfig, layer_id: int, seed: int, tier: str = "gpu", device=None,
                      options: StoreOptions | None = None, progress: bool = True):
    """Layer ``layer_id``'s preset random table built in memory on tier "gpu" or "host" (the tier's usual table, rows
    bitwise the file's); ``options`` as for ``open_table``. Tier "disk" is refused."""
    tier = Tier.parse(tier)
    m = random_manifest(cfg, layer_id, seed)
    if tier is Tier.DISK:
        raise ValueError(f"{m.path}: tier 'disk' serves tables from their files; a table built in memory goes "
                         "on tier 'gpu' or 'host'")
    opts = options if options is not None else StoreOptions()
    build = functools.partial(build_table, m, random_rows(m.rows, m.dim, layer_seed(seed, layer_id), m.row_dtype))
    return place_table(m, tier, device, opts, progress, build=build)


def open_random_tables(cfg: EngramConfig, seed: int, tier: str = "gpu", device=None,
                       options: StoreOptions | Mapping[str, Any] | None = None,
                       progress: bool = True, layers=None) -> dict[int, Any]:
    """Every Engram layer's ``open_random_table`` (``layers``: only these); ``options`` as for ``open_tables``."""
    opts = options if isinstance(options, StoreOptions) else StoreOptions.from_dict(options)
    ids = cfg.layer_ids if layers is None else tuple(layers)
    if opts.shared_memory:  # every layer's shared copy must fit before the first is built
        check_shared([random_manifest(cfg, lid, seed) for lid in ids], tier, opts)
    return {lid: open_random_table(cfg, lid, seed, tier, device, opts, progress) for lid in ids}


def ensure_preset_tables(cfg: EngramConfig, seed: int, cache_dir=None, progress: bool = True) -> dict[int, Path]:
    """Generate a preset layout's missing random tables (page checksums added to format-1 ones) -> layer -> dir."""
    dirs = preset_table_dirs(cfg, seed, cache_dir)
    for lid, d in dirs.items():
        if not (d / MANIFEST).is_file():
            generate_random_table(d, cfg, lid, seed, progress=progress)
        else:
            add_checksums(d, progress=progress)  # a no-op on a current table
    return dirs


def checkpoint_table_dirs(checkpoint: Path, cfg: EngramConfig, cache_dir=None) -> dict[int, Path]:
    """Cache directories of a checkpoint's tables, keyed by its safetensors (name, size, mtime) and the layout."""
    files = sorted(checkpoint.glob("*.safetensors"))
    ident = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = _digest({"checkpoint": str(checkpoint.resolve()), "files": ident, "layout": cfg.to_dict()})
    root = cache_root(cache_dir) / "tables" / f"{checkpoint.resolve().name}-{key}"
    return {lid: layer_dir(root, lid) for lid in cfg.layer_ids}


def open_tables(dirs: dict[int, Path], cfg: EngramConfig, tier: str = "gpu", device=None,
                options: StoreOptions | Mapping[str, Any] | None = None) -> dict[int, Any]:
    """Open each layer's table on ``tier`` with the same ``options`` (validated first), fingerprint checked."""
    opts = options if isinstance(options, StoreOptions) else StoreOptions.from_dict(options)
    if opts.shared_memory:  # every layer's shared copy must fit before the first is loaded
        check_shared([read_manifest(d) for d in dirs.values()], tier, opts)
    return {lid: open_table(d, tier=tier, device=device, expect=cfg.fingerprint(lid), options=opts)
            for lid, d in dirs.items()}


def convert_checkpoint_tables(checkpoint: Path, dirs: dict[int, Path], cfg: EngramConfig,
                              progress: bool = True) -> None:
    """Convert the missing tables of ``dirs`` (one parent) from the checkpoint; page checksums added to format 1."""
    todo = [lid for lid, d in dirs.items() if not (d / MANIFEST).is_file()]
    for lid, d in dirs.items():
        if lid not in todo:
            add_checksums(d, progress=progress)  # cached before table format 2: add page checksums (else no-op)
    if todo:
        root = next(iter(dirs.values())).parent
        convert_safetensors([checkpoint], root, layers=todo, config=cfg, progress=progress)


def read_table_tensors(directory: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A whole table as checkpoint tensors (values in the row dtype, scales float8_e8m0fnu | None), CRC-checked."""
    m = read_manifest(directory)
    raw, scales = load_table(m)  # uint8 [rows, row_stride], uint8 [rows, scale_cols] | None
    values = raw[:, : m.value_bytes].contiguous().view(ROW_TORCH_DTYPES[m.row_dtype])  # [rows, dim]
    return values, None if scales is None else scales.view(torch.float8_e8m0fnu)
