"""EngramConfig: the layout of a model's Engram memory (which layers, n-gram orders, heads, table sizes).

Everything that decides *where* a row lives is a pure function of this config: the primes (one per hash
column, unique across all layers), the column offsets inside a layer's table, and the per-layer hash
multipliers. Validation happens in ``__post_init__``; errors are ValueError naming the field and value.
The config knows nothing about weights, devices or tiers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from engram.configs import shipped_config_path

VARIANTS = ("v41", "paper")
ROW_DTYPES = ("mxfp8", "bf16", "fp16", "fp32")
MXFP8_BLOCK = 32

# Deterministic Miller-Rabin for n < 3.3e24 (these bases are a proven witness set for 64-bit integers).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic primality test for any n < 3.3e24 (Miller-Rabin with fixed bases)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def parse_json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` as a JSON object; ValueError naming ``where`` (a file or an option) and the position."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    return raw


BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
              "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_bytes(text: str, where: str) -> int:
    """"8589934592", "8GiB", "8G", "512MiB" (binary units, case-insensitive) -> bytes; ValueError naming
    ``where`` (an option) for anything else or for less than one byte."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in BYTE_UNITS or int(float(m.group(1)) * BYTE_UNITS[unit]) < 1:
        raise ValueError(f"{where}: {text!r} is not a positive byte count (e.g. 8589934592, 8GiB, 512MiB)")
    return int(float(m.group(1)) * BYTE_UNITS[unit])


def read_config_json(source: str | os.PathLike | dict) -> dict[str, Any]:
    """A HF-style config as a dict: the dict itself, a config.json path, or a directory holding one."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        return parse_json_object(f.read(), path)


def hf_text_config(source: str | os.PathLike | dict) -> dict[str, Any]:
    """The text model's fields of a HF-style config (dict, config.json path or directory): the top-level fields
    overridden by those under ``text_config`` (multimodal configs such as DeepSeek-V4.1's keep the decoder's there); a
    flat config is read as it is. The one rule every reader uses. Returns a new dict without ``text_config``; ValueError
    when ``text_config`` is not a JSON object."""
    raw = read_config_json(source)
    text = raw.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"text_config={text!r}: must be a JSON object (the text model's fields)")
    out = {k: v for k, v in raw.items() if k != "text_config"}
    out.update(text or {})
    return out


@dataclass(frozen=True)
class EngramConfig:
    """Engram memory layout of one model.

    ``vocab_size`` is the prime-search base: one int for every order, or one value per order
    (2, 3, ..., max_ngram_size). ``pad_token_id`` is a *raw* token id; hashing uses its compressed id.
    """

    layer_ids: tuple[int, ...]  # 0-indexed decoder layers that carry Engram, ascending
    max_ngram_size: int  # orders 2..max_ngram_size are hashed
    n_heads: int  # hash heads (columns) per order
    head_dim: int  # values per table row
    vocab_size: int | tuple[int, ...]  # prime search base, scalar or per order
    compressed_vocab_size: int  # size of the compressed tokenizer's id space
    pad_token_id: int  # raw id used before the sequence start and after a DEAD token
    hidden_size: int  # model hidden size H
    hc_mult: int = 1  # hyper-connection residual streams (v41 gate runs per stream)
    rms_norm_eps: float = 1e-6  # eps of the gate's rms
    seed: int = 0  # multiplier seed
    num_embeddings: tuple[int, ...] | None = None  # rows per layer table (>= prime sum); None = prime sum
    variant: str = "v41"  # "v41" | "paper"
    row_dtype: str = "mxfp8"  # storage dtype of table rows: mxfp8 | bf16 | fp16 | fp32
    dead_token_ids: tuple[int, ...] = ()  # raw ids that break n-grams and force the gate to 0
    kernel_size: int = 4  # paper variant: ShortConv kernel (dilation = max_ngram_size)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(int(x) for x in self.layer_ids))
        if isinstance(self.vocab_size, (list, tuple)):
            object.__setattr__(self, "vocab_size", tuple(int(v) for v in self.vocab_size))
        if self.num_embeddings is not None:
            ne = self.num_embeddings
            ne = (int(ne),) * len(self.layer_ids) if isinstance(ne, int) else tuple(int(v) for v in ne)
            object.__setattr__(self, "num_embeddings", ne)
        object.__setattr__(self, "dead_token_ids", tuple(int(x) for x in self.dead_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, value: Any, why: str) -> ValueError:
            return ValueError(f"engram.{name}={value!r}: {why}")

        if self.variant not in VARIANTS:
            raise bad("variant", self.variant, f"must be one of {VARIANTS}")
        if self.row_dtype not in ROW_DTYPES:
            raise bad("row_dtype", self.row_dtype, f"must be one of {ROW_DTYPES}")
        ids = self.layer_ids
        if not ids:
            raise bad("layer_ids", ids, "at least one Engram layer is required")
        if any(i < 0 for i in ids):
            raise bad("layer_ids", ids, "layer ids must be non-negative")
        if len(set(ids)) != len(ids):
            raise bad("layer_ids", ids, "layer ids must be unique")
        if list(ids) != sorted(ids):
            raise bad("layer_ids", ids, "layer ids must be sorted ascending")
        if self.max_ngram_size < 2:
            raise bad("max_ngram_size", self.max_ngram_size, "must be >= 2 (orders start at 2)")
        for name in ("n_heads", "head_dim", "hidden_size", "hc_mult", "kernel_size"):
            if getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "must be >= 1")
        if self.compressed_vocab_size < 2:
            raise bad("compressed_vocab_size", self.compressed_vocab_size, "must be >= 2")
        if self.row_dtype == "mxfp8" and self.head_dim % MXFP8_BLOCK:
            raise bad("head_dim", self.head_dim, f"MXFP8 rows need a multiple of {MXFP8_BLOCK}")
        if isinstance(self.vocab_size, tuple):
            if len(self.vocab_size) != self.max_ngram_size - 1:
                raise bad("vocab_size", self.vocab_size,
                          f"a per-order list needs {self.max_ngram_size - 1} values (orders 2..{self.max_ngram_size})")
        if any(v < 2 for v in self.order_bases):
            raise bad("vocab_size", self.vocab_size, "prime search bases must be >= 2")
        if not 0 <= self.pad_token_id:
            raise bad("pad_token_id", self.pad_token_id, "must be a non-negative raw token id")
        if not self.rms_norm_eps >= 0:
            raise bad("rms_norm_eps", self.rms_norm_eps, "must be >= 0")
        if self.num_embeddings is not None:
            if len(self.num_embeddings) != len(ids):
                raise bad("num_embeddings", self.num_embeddings, f"needs one value per layer in {ids}")
            for lid, rows in zip(ids, self.num_embeddings):
                need = sum(self.primes(lid))
                if rows < need:
                    raise bad("num_embeddings", self.num_embeddings,
                              f"layer {lid} has {rows} rows but its primes sum to {need}")

    # ----------------------------------------------------------------- derived layout
    @property
    def orders(self) -> tuple[int, ...]:
        """n-gram orders hashed, ascending: (2, ..., max_ngram_size)."""
        return tuple(range(2, self.max_ngram_size + 1))

    @property
    def order_bases(self) -> tuple[int, ...]:
        """Prime search base of each order."""
        if isinstance(self.vocab_size, tuple):
            return self.vocab_size
        return (int(self.vocab_size),) * (self.max_ngram_size - 1)

    @property
    def n_cols(self) -> int:
        """Hash columns per layer: (max_ngram_size - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @cached_property
    def _primes(self) -> dict[int, list[int]]:
        used: set[int] = set()
        out: dict[int, list[int]] = {}
        for lid in self.layer_ids:
            cols: list[int] = []
            for base in self.order_bases:
                cand = base
                for _ in range(self.n_heads):
                    while cand in used or not is_prime(cand):
                        cand += 1
                    used.add(cand)
                    cols.append(cand)
            out[lid] = cols
        return out

    def _check_layer(self, layer_id: int) -> None:
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer (engram.layer_ids={self.layer_ids})")

    def primes(self, layer_id: int) -> list[int]:
        """The n_cols primes of a layer in column order [order-2 heads | order-3 heads | ...]."""
        self._check_layer(layer_id)
        return list(self._primes[layer_id])

    def column_offsets(self, layer_id: int) -> list[int]:
        """First table row of each column: exclusive prefix sum of ``primes(layer_id)``."""
        offsets, acc = [], 0
        for p in self.primes(layer_id):
            offsets.append(acc)
            acc += p
        return offsets

    def table_rows(self, layer_id: int) -> int:
        """Rows of a layer's table: ``num_embeddings`` when given, else the prime sum."""
        self._check_layer(layer_id)
        if self.num_embeddings is not None:
            return self.num_embeddings[self.layer_ids.index(layer_id)]
        return sum(self._primes[layer_id])

    def multipliers(self, layer_id: int) -> list[int]:
        """Odd int64 hash multipliers of a layer, one per lookback slot (max_ngram_size values)."""
        self._check_layer(layer_id)
        bound = (np.iinfo(np.int64).max // self.compressed_vocab_size) // 2
        rng = np.random.default_rng(self.seed + 10007 * layer_id)
        draws = rng.integers(0, max(bound, 1), size=self.max_ngram_size, dtype=np.int64)
        return [int(x) * 2 + 1 for x in draws]

    @property
    def row_bytes(self) -> int:
        """Bytes per stored row (values plus MXFP8 scales)."""
        if self.row_dtype == "mxfp8":
            return self.head_dim + self.head_dim // MXFP8_BLOCK
        return self.head_dim * {"bf16": 2, "fp16": 2, "fp32": 4}[self.row_dtype]

    def table_bytes(self, layer_id: int) -> int:
        return self.table_rows(layer_id) * self.row_bytes

    def fingerprint(self, layer_id: int) -> dict[str, Any]:
        """What a table must match to be used for this layer (stored in its manifest)."""
        return {"layer_id": layer_id, "n_cols": self.n_cols, "head_dim": self.head_dim,
                "primes": self.primes(layer_id), "rows": self.table_rows(layer_id)}

    # ----------------------------------------------------------------- construction
    def replace(self, **changes: Any) -> "EngramConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in dataclasses.fields(self)}

    @classmethod
    def preset(cls, name: str) -> "EngramConfig":
        """``deepseek-v4.1-flash`` (the published layout), ``paper-demo`` (DeepSeek's reference demo),
        ``tiny`` (small tables for CPU tests; pair with the tiny model's tokenizer)."""
        if name not in PRESETS:
            raise ValueError(f"unknown Engram preset {name!r}; known: {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    @classmethod
    def from_hf_config(cls, source: str | os.PathLike | dict) -> "EngramConfig":
        """Read the ``engram_*`` fields (plus hidden_size, hc_mult, rms_norm_eps, image_token_id) of a HF
        config.json (path, directory or dict), flat or under ``text_config`` (``hf_text_config``'s rule).
        Raises ValueError naming the missing field."""
        return cls(**_engram_kwargs(hf_text_config(source)))

    def to_hf_fields(self) -> dict[str, Any]:
        """The ``engram_*`` fields (plus hidden_size, hc_mult, rms_norm_eps) for a config.json."""
        out = {
            "engram_layer_ids": list(self.layer_ids),
            "engram_max_ngram_size": self.max_ngram_size,
            "engram_n_heads": self.n_heads,
            "engram_head_dim": self.head_dim,
            "engram_vocab_size": list(self.vocab_size) if isinstance(self.vocab_size, tuple) else self.vocab_size,
            "engram_compressed_vocab_size": self.compressed_vocab_size,
            "engram_pad_token_id": self.pad_token_id,
            "engram_seed": self.seed,
            "engram_variant": self.variant,
            "engram_row_dtype": self.row_dtype,
            "engram_dead_token_ids": list(self.dead_token_ids),
            "engram_kernel_size": self.kernel_size,
            "hidden_size": self.hidden_size,
            "hc_mult": self.hc_mult,
            "rms_norm_eps": self.rms_norm_eps,
        }
        if self.num_embeddings is not None:
            out["engram_num_embeddings"] = list(self.num_embeddings)
        return out


def _engram_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """EngramConfig keyword arguments from a config's text fields; ValueError naming a missing field. ``engram_pad_id``
    is accepted for ``engram_pad_token_id``; ``image_token_id`` is the DEAD token unless ``engram_dead_token_ids`` are
    given."""
    if "engram_layer_ids" not in hf:
        raise ValueError("config has no engram_layer_ids (looked at the top level and under text_config)")

    def need(key: str) -> Any:
        if key not in hf:
            raise ValueError(f"config field {key!r} is required for an Engram model")
        return hf[key]

    if "engram_pad_token_id" in hf:
        pad = hf["engram_pad_token_id"]
    elif "engram_pad_id" in hf:
        pad = hf["engram_pad_id"]
    else:
        raise ValueError("config field 'engram_pad_token_id' (or 'engram_pad_id') is required")
    vocab = need("engram_vocab_size")
    dead = hf.get("engram_dead_token_ids")
    if dead is None and hf.get("image_token_id") is not None:
        dead = [hf["image_token_id"]]
    variant = hf.get("engram_variant", "v41")
    return dict(
        layer_ids=tuple(need("engram_layer_ids")),
        max_ngram_size=int(need("engram_max_ngram_size")),
        n_heads=int(need("engram_n_heads")),
        head_dim=int(need("engram_head_dim")),
        vocab_size=tuple(vocab) if isinstance(vocab, list) else int(vocab),
        compressed_vocab_size=int(need("engram_compressed_vocab_size")),
        pad_token_id=int(pad),
        hidden_size=int(need("hidden_size")),
        hc_mult=int(hf.get("hc_mult", 1)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        seed=int(hf.get("engram_seed", 0)),
        num_embeddings=hf.get("engram_num_embeddings"),
        variant=variant,
        row_dtype=hf.get("engram_row_dtype", "mxfp8" if variant == "v41" else "fp32"),
        dead_token_ids=tuple(dead or ()),
        kernel_size=int(hf.get("engram_kernel_size", 4)),
    )


def _shipped(name: str) -> dict[str, Any]:
    """EngramConfig keyword arguments of a layout shipped as engram/configs/<name>.json."""
    return _engram_kwargs(hf_text_config(shipped_config_path(name)))


PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeek-V4.1-Flash, as published in its checkpoint config (engram/configs/deepseek-v4.1-flash.json).
    "deepseek-v4.1-flash": _shipped("deepseek-v4.1-flash"),
    # DeepSeek's reference demo of the paper (arXiv 2601.07372): n_embed_per_ngram 512 over 8 heads
    # (engram/configs/paper-demo.json).
    "paper-demo": _shipped("paper-demo"),
    # CPU-friendly: two layers of ~10 K rows each; compressed_vocab_size matches the built-in tokenizer.
    "tiny": dict(
        layer_ids=(1, 3), max_ngram_size=3, n_heads=4, head_dim=32, vocab_size=(1009, 1511),
        compressed_vocab_size=2901, pad_token_id=2, hidden_size=64, hc_mult=2, rms_norm_eps=1e-6,
        variant="v41", row_dtype="mxfp8",
    ),
}
