"""CompressedTokenizer: maps raw token ids onto a smaller id space where tokens that normalize to the same text share
one id ("Hello"/" hello"). Each token is decoded alone and keyed by ``token_key``; new ids follow first appearance over
ascending raw ids. The map is cached on disk by a SHA-256 of the tokenizer (and MAP_VERSION) with a checksum; a cache
that fails to load or check is rebuilt with a warning."""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from engram import envs

# Bump when the key rules change: cached maps of older rules are then ignored.
MAP_VERSION = "v1"
_SENTINEL = "\ue000"


def cache_root() -> Path:
    """Directory for engram's caches (``ENGRAM_CACHE_DIR``, default ~/.cache/engram: engram/envs.py)."""
    return envs.cache_dir()


def build_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex("[ \t\r\n]+"), " "),
        normalizers.Replace(Regex("^ $"), _SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SENTINEL, " "),
    ])


def token_key(text: str, raw_token: str | None, normalizer: normalizers.Normalizer) -> str:
    """The key a decoded token is grouped by: its text after NFKC, NFD, StripAccents, Lowercase, whitespace runs -> " "
    (a lone space kept) and Strip; the raw token string when the decode holds U+FFFD (a partial UTF-8 byte); the
    original text when the normalization is empty."""
    if "\ufffd" in text:
        return raw_token if raw_token is not None else text
    norm = normalizer.normalize_str(text)
    return norm if norm else text


def build_map(tokenizer: Tokenizer) -> np.ndarray:
    """Raw id -> compressed id (int64 [vocab]) for a tokenizers.Tokenizer."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    normalizer = build_normalizer()
    ids: dict[str, int] = {}
    out = np.empty(vocab, dtype=np.int64)
    for tid, text in enumerate(texts):
        key = token_key(text, tokenizer.id_to_token(tid), normalizer)
        out[tid] = ids.setdefault(key, len(ids))
    return out


def cache_path(key: str) -> Path:
    """The cache file of the map of a tokenizer whose content key (SHA-256 hex) is ``key``."""
    return cache_root() / "compressed_tokenizer" / f"{key[:32]}.npz"


def map_checksum(key: str, mapping: np.ndarray) -> np.ndarray:
    """uint8 [32]: SHA-256 of the content key and the map's bytes (little-endian int64), stored with the map."""
    data = np.ascontiguousarray(mapping, dtype="<i8").tobytes()
    return np.frombuffer(hashlib.sha256(key.encode() + data).digest(), dtype=np.uint8)


def write_cached_map(path: Path, key: str, mapping: np.ndarray) -> None:
    """Write ``mapping`` and its checksum to ``path`` (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}.npz")
    np.savez(tmp, map=mapping, check=map_checksum(key, mapping))
    os.replace(tmp, path)


def read_cached_map(path: Path, key: str) -> tuple[np.ndarray | None, str]:
    """(the cached map, "") when ``path`` holds an int64 map whose checksum matches ``key``, else (None, why): any read
    error makes the cache unusable, never fatal."""
    try:
        with np.load(path, allow_pickle=False) as z:
            mapping, check = z["map"], z["check"]
    except Exception as e:  # noqa: BLE001 - see the docstring; the checksum below guards what does load
        return None, f"cannot be read ({type(e).__name__}: {e})"
    if mapping.ndim != 1 or mapping.dtype != np.int64:
        return None, f"holds a {mapping.dtype} array of shape {mapping.shape}, not an int64 map"
    if not np.array_equal(check, map_checksum(key, mapping)):
        return None, "does not match its checksum (damaged, or not this tokenizer's map)"
    return mapping, ""


class CompressedTokenizer:
    """``tok(ids)`` -> compressed ids of the same shape and kind (torch, numpy, list or int)."""

    def __init__(self, mapping: np.ndarray):
        self.map = np.ascontiguousarray(mapping, dtype=np.int64)  # [vocab] raw id -> compressed id
        self._map_t = torch.from_numpy(self.map)
        self._size = int(self.map.max()) + 1 if self.map.size else 0

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_file(cls, path: str | os.PathLike, use_cache: bool = True) -> "CompressedTokenizer":
        """Build from a tokenizer.json; the map is cached under ``cache_root()/compressed_tokenizer``."""
        data = Path(path).read_bytes()
        return cls._cached(data, lambda: Tokenizer.from_str(data.decode("utf-8")), use_cache)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, use_cache: bool = True) -> "CompressedTokenizer":
        """Build from a tokenizers.Tokenizer or a transformers fast tokenizer (its Rust backend is used)."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not isinstance(backend, Tokenizer):
            raise TypeError(f"need a tokenizers.Tokenizer or a fast HF tokenizer, got {type(tokenizer).__name__}")
        return cls._cached(backend.to_str().encode("utf-8"), lambda: backend, use_cache)

    @classmethod
    def _cached(cls, content: bytes, load, use_cache: bool) -> "CompressedTokenizer":
        key = hashlib.sha256(MAP_VERSION.encode() + content).hexdigest()
        path = cache_path(key)
        if use_cache and path.exists():
            mapping, why = read_cached_map(path, key)
            if mapping is not None:
                return cls(mapping)
            warnings.warn(f"engram: compressed-tokenizer cache {path} is unusable: it {why}; rebuilding it",
                          RuntimeWarning, stacklevel=3)
        mapping = build_map(load())
        if use_cache:
            try:
                write_cached_map(path, key, mapping)
            except OSError:
                pass  # a read-only cache dir only costs a rebuild next time
        return cls(mapping)

    # ----------------------------------------------------------------- use
    def __len__(self) -> int:
        """Size of the compressed id space."""
        return self._size

    @property
    def vocab_size(self) -> int:
        """Raw ids covered."""
        return int(self.map.size)

    def check_config(self, cfg) -> None:
        """ValueError unless this tokenizer yields exactly ``cfg.compressed_vocab_size`` ids."""
        if len(self) != cfg.compressed_vocab_size:
            raise ValueError(
                f"compressed tokenizer has {len(self)} ids but engram.compressed_vocab_size="
                f"{cfg.compressed_vocab_size}: the multipliers depend on it, so every row id would be silently "
                f"rehashed and the tables would be read at the wrong rows. Use the tokenizer the tables were "
                f"built for.")

    def __call__(self, ids):
        return self.compress(ids)

    def compress(self, ids, dead_token_ids=()):
        """Raw ids -> compressed ids, same shape and kind; raw ids in ``dead_token_ids`` become -1 (DEAD)."""
        if isinstance(ids, torch.Tensor):
            flat = ids.reshape(-1).to("cpu", torch.int64)
            self._range_check(flat.numpy())
            out = self._map_t[flat]
            if dead_token_ids:
                out = torch.where(torch.isin(flat, torch.tensor(list(dead_token_ids))), -1, out)
            return out.reshape(ids.shape).to(ids.device)
        if isinstance(ids, (int, np.integer)):
            return int(self.compress(np.asarray([ids]), dead_token_ids)[0])
        arr = np.asarray(ids, dtype=np.int64)
        self._range_check(arr)
        out = self.map[arr]
        if dead_token_ids:
            out = np.where(np.isin(arr, np.asarray(list(dead_token_ids))), -1, out)
        if isinstance(ids, np.ndarray):
            return out
        return out.tolist()

    def _range_check(self, arr: np.ndarray) -> None:
        if arr.size and (arr.min() < 0 or arr.max() >= self.map.size):
            bad = int(arr[(arr < 0) | (arr >= self.map.size)].flat[0])
            raise IndexError(f"token id {bad} is outside the tokenizer's {self.map.size} ids")
