"""The layouts shipped with the package (data only: the commands' resolver of config names is
engram/commands/config_names.py).

- shipped layouts, ``<name>.json`` in this folder (numbers only, as in the public configs):
  ``deepseek-v4.1-flash`` (40 layers, V4.1 KV / index / candidate sharing, Engram at layers 1 and 14) and
  ``paper-demo`` (DeepSeek's Engram demo: 30 layers, Engram at layers 1 and 15). These files are the only
  copy of those numbers: ``EngramConfig.preset`` reads its layouts of the same names from them.

This module imports nothing from engram (engram.config imports it).
"""
from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent
SHIPPED = ("deepseek-v4.1-flash", "paper-demo")  # CONFIG_DIR/<name>.json


def shipped_config_path(name: str) -> Path:
    """The file of a shipped layout; ValueError for another name."""
    if name not in SHIPPED:
        raise ValueError(f"config name {name!r} is not a shipped layout; shipped: {list(SHIPPED)}")
    return CONFIG_DIR / f"{name}.json"
