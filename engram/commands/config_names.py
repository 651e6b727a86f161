"""The one resolver of a config name or path, so every command that reads a config accepts the same names:
the shipped layouts (engram/configs) and the model presets. A name wins over a file of the same name, as in
``load_model``.
"""
from __future__ import annotations

import os
from typing import Any

from engram.config import read_config_json
from engram.configs import SHIPPED, shipped_config_path
from engram.model.presets import MODEL_PRESETS, preset_config


def config_names() -> tuple[str, ...]:
    """Every config name a command accepts, sorted: the shipped layouts and the model presets (which cover
    every Engram preset of engram.config.PRESETS; the tests hold that)."""
    return tuple(sorted({*SHIPPED, *MODEL_PRESETS}))


def named_config(name: str) -> dict[str, Any]:
    """The config.json fields of a config name: a shipped layout's file as written, or a model preset's
    ``ModelConfig.to_hf_dict()``. ValueError listing the names for any other name."""
    if name in SHIPPED:
        return read_config_json(shipped_config_path(name))
    if name in MODEL_PRESETS:
        return preset_config(name).to_hf_dict()
    raise ValueError(f"config name {name!r} is unknown; known: {list(config_names())}")


def resolve_config(spec: str | os.PathLike, option: str) -> dict[str, Any]:
    """A command's config argument as a config dict: a config name (``named_config``), else a config.json
    or a directory holding one (read, with errors naming the file). ``option`` names the argument in the
    ValueError raised when ``spec`` is neither (e.g. ``CONFIG`` or ``--config``)."""
    text = os.fspath(spec)
    if text in config_names():
        return named_config(text)
    if os.path.exists(text):
        return read_config_json(text)
    raise ValueError(f"{option}={text!r}: no such file or directory, and not a config name "
                     f"{list(config_names())}")
