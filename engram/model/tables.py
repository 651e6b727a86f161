"""Engram tables of a loaded model: where they are cached, how preset tables are made, how they open.

Both kinds go through the store's converter (``engram.store.convert``, what ``engram convert`` runs):
preset tables are ``convert_random`` tables (valid random MXFP8 bytes, seeded per layer), generated once
per (layer fingerprints, row dtype, seed) into ``<cache>/tables/random-<key>/layer<L>`` with a progress
bar and reused afterwards; checkpoint tables are ``convert_safetensors`` copies of the checkpoint's
``[model.]layers.L.engram.embed.{weight,scale}`` tensors, made once into
``<cache>/tables/<name>-<key>/layer_<L>`` with a key derived from the checkpoint files. The cache root
is ``cache_dir``, else ``$ENGRAM_CACHE_DIR``, else ``~/.cache/engram``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from engram.config import EngramConfig
from engram.store.convert import convert_random, convert_safetensors, layer_dir
from engram.store.format import MANIFEST, read_manifest
from engram.store.kernels.reference import ROW_TORCH_DTYPES
from engram.store.load import load_table
from engram.store.options import StoreOptions
from engram.store.upgrade import add_checksums
from engram.tokenizer import cache_root as tokenizer_cache_root

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


def generate_random_table(directory: Path, cfg: EngramConfig, layer_id: int, seed: int,
                          progress: bool = True) -> None:
    """Write layer ``layer_id``'s random table (store's ``convert_random``; bytes depend only on the
    layout, the seed and the layer)."""
    convert_random(directory, cfg.table_rows(layer_id), cfg.head_dim, seed=seed * 65_537 + layer_id,
                   row_dtype=cfg.row_dtype, layer_id=layer_id, config=cfg, progress=progress)


def ensure_preset_tables(cfg: EngramConfig, seed: int, cache_dir=None, progress: bool = True) -> dict[int, Path]:
    """Generate the missing random tables of a preset layout (and give cached ones written before table
    format 2 their page checksums); returns layer id -> table directory."""
    dirs = preset_table_dirs(cfg, seed, cache_dir)
    for lid, d in dirs.items():
        if not (d / MANIFEST).is_file():
            generate_random_table(d, cfg, lid, seed, progress=progress)
        else:
            add_checksums(d, progress=progress)  # a no-op on a current table
    return dirs


def checkpoint_table_dirs(checkpoint: Path, cfg: EngramConfig, cache_dir=None) -> dict[int, Path]:
    """Cache directories of a checkpoint's converted tables, keyed by its safetensors files (name, size,
    mtime) and the layout, so a changed checkpoint converts again."""
    files = sorted(checkpoint.glob("*.safetensors"))
    ident = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = _digest({"checkpoint": str(checkpoint.resolve()), "files": ident, "layout": cfg.to_dict()})
    root = cache_root(cache_dir) / "tables" / f"{checkpoint.resolve().name}-{key}"
    return {lid: layer_dir(root, lid) for lid in cfg.layer_ids}


def open_tables(dirs: dict[int, Path], cfg: EngramConfig, tier: str = "gpu", device=None,
                options: StoreOptions | Mapping[str, Any] | None = None) -> dict[int, Any]:
    """Open each layer's table on ``tier`` with the same ``options``, checking it against the layout's
    fingerprint. ``options``: a StoreOptions, or a mapping of StoreOptions.KEYS validated by
    ``StoreOptions.from_dict`` (an unknown key raises ValueError listing the known ones) before any table
    opens; None means the defaults."""
    from engram.store import open_table

    opts = options if isinstance(options, StoreOptions) else StoreOptions.from_dict(options)
    return {lid: open_table(d, tier=tier, device=device, expect=cfg.fingerprint(lid), options=opts)
            for lid, d in dirs.items()}


def convert_checkpoint_tables(checkpoint: Path, dirs: dict[int, Path], cfg: EngramConfig,
                              progress: bool = True) -> None:
    """Convert the tables of the layers in ``dirs`` that are not there yet from the checkpoint's
    safetensors (store's ``convert_safetensors``, sizes checked against ``cfg``), and give the ones cached
    before table format 2 their page checksums. All ``dirs`` share one parent, as ``checkpoint_table_dirs``
    makes them."""
    todo = [lid for lid, d in dirs.items() if not (d / MANIFEST).is_file()]
    for lid, d in dirs.items():
        if lid not in todo:
            add_checksums(d, progress=progress)  # cached before table format 2: add page checksums (else no-op)
    if todo:
        root = next(iter(dirs.values())).parent
        convert_safetensors([checkpoint], root, layers=todo, config=cfg, progress=progress)


def read_table_tensors(directory: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A whole table back as checkpoint tensors: values [rows, dim] in the row dtype (float8_e4m3fn for
    MXFP8) and scales float8_e8m0fnu [rows, dim/32] (None for other dtypes). Reads the files into RAM
    (store's ``load_table``, CRC-checked)."""
    m = read_manifest(directory)
    raw, scales = load_table(m)  # uint8 [rows, row_stride], uint8 [rows, scale_cols] | None
    values = raw[:, : m.value_bytes].contiguous().view(ROW_TORCH_DTYPES[m.row_dtype])  # [rows, dim]
    return values, None if scales is None else scales.view(torch.float8_e8m0fnu)
