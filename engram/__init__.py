"""engram: serve language models with Engram conditional memory.

The public names (docs/design.md, "Public API") are imported lazily so that ``import engram`` and
``engram --help`` stay fast.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "EngramConfig": "engram.config",
    "CompressedTokenizer": "engram.tokenizer",
    "NgramHasher": "engram.hashing",
    "Engram": "engram.module",
    "EngramEmbedding": "engram.module",
    "LLM": "engram.engine.llm",
    "SamplingParams": "engram.engine.sampling_params",
}
_SUBMODULES = {"quant", "store", "hashing", "config", "tokenizer", "module", "model", "engine",
               "parallel", "server", "bench"}

__all__ = sorted(_LAZY) + ["quant", "store"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"engram.{name}")
    raise AttributeError(f"module 'engram' has no attribute {name!r}")
