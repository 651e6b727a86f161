"""Config names: the layouts shipped with the package, and the one resolver of a config name or path.

Every command that reads a config (``engram plan-pp CONFIG``, ``engram inspect --preset/--config``) resolves
it through ``resolve_config``, so each accepts every name any command accepts (``config_names()``):

- shipped layouts, ``<name>.json`` in this folder (numbers only, as in the public configs):
  ``deepseek-v4.1-flash`` (40 layers, V4.1 KV / index / candidate sharing, Engram at layers 1 and 14) and
  ``paper-demo`` (DeepSeek's Engram demo: 30 layers, Engram at layers 1 and 15). These files are the only
  copy of those numbers: ``EngramConfig.preset`` reads its layouts of the same names from them.
- model presets (``engram.model.presets``: tiny, small, 4b-like, 8b-like): their config.json fields.
  ``tiny`` is also an Engram preset; the model preset carries exactly that Engram layout.

A name wins over a file or directory of the same name, as in ``load_model``. This module imports nothing
from engram at import time (engram.config imports it), and torch only when a model preset is asked for.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent
SHIPPED = ("deepseek-v4.1-flash", "paper-demo")  # CONFIG_DIR/<name>.json


def shipped_config_path(name: str) -> Path:
    """The file of a shipped layout; ValueError for another name."""
    if name not in SHIPPED:
        raise ValueError(f"config name {name!r} is not a shipped layout; shipped: {list(SHIPPED)}")
    return CONFIG_DIR / f"{name}.json"


def config_names() -> tuple[str, ...]:
    """Every config name a command accepts, sorted: the shipped layouts and the model presets (which cover
    every Engram preset of engram.config.PRESETS; the tests hold that)."""
    from engram.model.presets import MODEL_PRESETS

    return tuple(sorted({*SHIPPED, *MODEL_PRESETS}))


def named_config(name: str) -> dict[str, Any]:
    """The config.json fields of a config name: a shipped layout's file as written, or a model preset's
    ``ModelConfig.to_hf_dict()``. ValueError listing the names for any other name."""
    from engram.config import read_config_json

    if name in SHIPPED:
        return read_config_json(shipped_config_path(name))
    from engram.model.presets import MODEL_PRESETS, preset_config

    if name in MODEL_PRESETS:
        return preset_config(name).to_hf_dict()
    raise ValueError(f"config name {name!r} is unknown; known: {list(config_names())}")


def resolve_config(spec: str | os.PathLike, option: str) -> dict[str, Any]:
    """A command's config argument as a config dict: a config name (``named_config``), else a config.json
    or a directory holding one (read, with errors naming the file). ``option`` names the argument in the
    ValueError raised when ``spec`` is neither (e.g. ``CONFIG`` or ``--config``)."""
    from engram.config import read_config_json

    text = os.fspath(spec)
    if text in config_names():
        return named_config(text)
    if os.path.exists(text):
        return read_config_json(text)
    raise ValueError(f"{option}={text!r}: no such file or directory, and not a config name "
                     f"{list(config_names())}")
