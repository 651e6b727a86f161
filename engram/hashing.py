"""N-gram hashing: compressed token ids -> global row ids of each Engram layer's table. At position p, column (order n,
head h): R = XOR over s = 0..n-1 of id[p-s] * m[s]; row = R mod prime + column offset (multipliers <= (2**63-1) //
compressed_vocab_size, so products never overflow). Positions before the start use the pad id; a DEAD token (-1) is
sticky: once the lookback reaches it, that slot and every older one use the pad id, and the gate is 0 at it
(``dead_mask``). A chunked sequence carries a lookback (its last max_ngram_size - 1 ids), so chunked hashing equals
whole hashing."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from engram.config import EngramConfig

if TYPE_CHECKING:
    from engram.tokenizer import CompressedTokenizer

DEAD = -1


class _HashTables(NamedTuple):
    """Every layer's hash constants stacked in ``cfg.layer_ids`` order; column (order n, head h) is [n - 2, h]."""
    mult: np.ndarray  # [L, max_ngram] int64 multipliers, slot s = position p - s
    primes: np.ndarray  # [L, W, H] int64
    offsets: np.ndarray  # [L, W, H] int64 first table row of each column


class NgramHasher:
    """Row ids for every Engram layer of ``cfg``; ``pad_id`` is the *compressed* pad id (``from_tokenizer``)."""

    def __init__(self, cfg: EngramConfig, pad_id: int):
        if not 0 <= pad_id < cfg.compressed_vocab_size:
            raise ValueError(f"pad_id={pad_id} is outside the compressed vocab [0, {cfg.compressed_vocab_size})")
        self.cfg = cfg
        self.pad_id = int(pad_id)
        self.window = cfg.max_ngram_size - 1  # lookback length
        self._consts: dict[tuple, tuple[torch.Tensor, ...]] = {}  # per (layer id | "pending", device)

    @classmethod
    def from_tokenizer(cls, cfg: EngramConfig, compressed_tokenizer: "CompressedTokenizer") -> "NgramHasher":
        """The hasher of ``cfg`` for text compressed by ``compressed_tokenizer``;
        ``pad_id = compress([cfg.pad_token_id])[0]`` (never DEAD). ValueError when the tokenizer's compressed size is
        not ``cfg.compressed_vocab_size`` or ``cfg.pad_token_id`` is not one of its raw ids."""
        compressed_tokenizer.check_config(cfg)
        if not cfg.pad_token_id < compressed_tokenizer.vocab_size:
            raise ValueError(f"engram.pad_token_id={cfg.pad_token_id}: outside the tokenizer's "
                             f"{compressed_tokenizer.vocab_size} raw ids")
        return cls(cfg, pad_id=int(compressed_tokenizer.compress([cfg.pad_token_id])[0]))

    # ----------------------------------------------------------------- constants per layer and device
    @functools.cached_property
    def _tables(self) -> _HashTables:
        """The one read of the config's multipliers, primes and column offsets (built on first use)."""
        cfg, shape = self.cfg, (len(self.cfg.layer_ids), self.window, self.cfg.n_heads)
        return _HashTables(
            mult=np.array([cfg.multipliers(lid) for lid in cfg.layer_ids], dtype=np.int64),
            primes=np.array([cfg.primes(lid) for lid in cfg.layer_ids], dtype=np.int64).reshape(shape),
            offsets=np.array([cfg.column_offsets(lid) for lid in cfg.layer_ids], dtype=np.int64).reshape(shape))

    def _layer_consts(self, layer_id: int, device: torch.device):
        """(multipliers [max_ngram], primes [n_cols], column offsets [n_cols]) of a layer as int64 tensors."""
        key = (layer_id, device)
        if key not in self._consts:
            i, tab = self.cfg.layer_ids.index(layer_id), self._tables
            self._consts[key] = tuple(torch.from_numpy(a[i].reshape(-1).copy()).to(device)
                                      for a in (tab.mult, tab.primes, tab.offsets))
        return self._consts[key]

    def initial_lookback(self, num_seqs: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
        """Lookback of sequences that have not started: pad ids, [S, max_ngram_size - 1]."""
        return torch.full((num_seqs, self.window), self.pad_id, dtype=torch.int64, device=device)

    # ----------------------------------------------------------------- core
    def _undead(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [..., max_ngram] (slot s = position p - s) -> ids each slot hashes: pad from the first DEAD slot."""
        dead = (windows == DEAD).to(torch.int8).cummax(dim=-1).values.bool()  # slot s is dead if any slot <= s is
        return torch.where(dead, self.pad_id, windows)

    def _hash_ids(self, ids: torch.Tensor, layer_id: int) -> torch.Tensor:
        """``_undead`` windows [..., max_ngram] -> row ids [..., n_cols] of one layer."""
        mult, primes, offsets = self._layer_consts(layer_id, ids.device)
        terms = ids * mult  # [..., max_ngram]; fits int64 by the multiplier bound
        cols = []
        acc = terms[..., 0]
        for n in self.cfg.orders:  # tiny static loop over orders (2..max_ngram), not over tokens
            acc = acc ^ terms[..., n - 1]
            cols.append(acc.unsqueeze(-1).expand(*acc.shape, self.cfg.n_heads))
        mixed = torch.cat(cols, dim=-1)  # [..., n_cols]
        return torch.remainder(mixed, primes) + offsets

    def hash(self, compressed_ids: torch.Tensor, layer_id: int, lookback: torch.Tensor | None = None) -> torch.Tensor:
        """compressed_ids LongTensor [B, T] (DEAD = -1), optional lookback [B, max_ngram-1] -> [B, T, n_cols]."""
        if compressed_ids.dim() != 2:
            raise ValueError(f"hash() expects [B, T] ids, got shape {tuple(compressed_ids.shape)}")
        x = compressed_ids.to(torch.int64)
        b, t = x.shape
        if lookback is None:
            lookback = self.initial_lookback(b, x.device)
        self._check_lookback(lookback, b)
        ext = torch.cat([lookback.to(x.device, torch.int64), x], dim=1)  # [B, W + T]
        # windows[b, p, s] = id at position p - s
        idx = (torch.arange(t, device=x.device).unsqueeze(1) + self.window
               - torch.arange(self.window + 1, device=x.device))
        windows = ext[:, idx]  # [B, T, max_ngram]
        return self._hash_ids(self._undead(windows), layer_id)

    def hash_packed(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, lookback: torch.Tensor,
                    layer_id: int) -> torch.Tensor:
        """ids [T] (sequences back to back), cu_seqlens [S+1], lookback [S, max_ngram-1] -> row ids [T, n_cols]."""
        windows = self.packed_windows(ids, cu_seqlens, lookback)
        return self._hash_ids(self._undead(windows), layer_id)

    def hash_packed_all(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                        lookback: torch.Tensor) -> dict[int, torch.Tensor]:
        """``hash_packed`` for every Engram layer: {layer_id: [T, n_cols]} (windows built and undead once)."""
        return self.hash_step(ids, cu_seqlens, lookback)[0]

    def hash_step(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  lookback: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """One engine step: ids [T] (DEAD = -1), cu_seqlens [S+1], lookback [S, max_ngram-1] -> ({layer_id: [T,
        n_cols]}, next lookback [S, max_ngram-1]), int64 on the ids' device. All-CPU inputs take ``_hash_step_numpy``,
        anything else ``hash_step_reference``; bitwise equal."""
        if ids.device.type == cu_seqlens.device.type == lookback.device.type == "cpu":
            return self._hash_step_numpy(ids, cu_seqlens, lookback)
        return self.hash_step_reference(ids, cu_seqlens, lookback)

    def hash_step_reference(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                            lookback: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """``hash_step`` in torch ops on any device: the reference of ``_hash_step_numpy``."""
        ext, tok_pos = self._packed_ext(ids, cu_seqlens, lookback)
        windows = ext[tok_pos.unsqueeze(1) - torch.arange(self.window + 1, device=ids.device)]  # [T, max_ngram]
        clean = self._undead(windows)
        rows = {lid: self._hash_ids(clean, lid) for lid in self.cfg.layer_ids}
        return rows, self._lookback_from_ext(ext, cu_seqlens.to(ids.device, torch.int64))

    def _hash_step_numpy(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                         lookback: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """``hash_step_reference`` in numpy for CPU tensors (int64 wraps and ``np.remainder``'s sign match torch), every
        layer in one pass; outputs share memory with numpy arrays."""
        x = ids.numpy().astype(np.int64, copy=False)
        cu = cu_seqlens.numpy().astype(np.int64, copy=False)
        lb = lookback.numpy().astype(np.int64, copy=False)
        self._check_packed(x, cu, lb)
        t, w = x.shape[0], self.window
        small = t <= _SMALL_STEP  # small steps: fewest numpy calls; big ones: passes over contiguous rows
        win_idx, lb_idx = (_gather_index_small if small else _gather_index)(cu.tobytes(), w)
        src = np.concatenate((lb.reshape(-1), x))  # [S*W + T]: every lookback, then every new token
        windows = src[win_idx]  # [max_ngram, T]: row k holds the ids at positions p - k
        if t and windows.min() < 0:  # sticky DEAD: slot k is pad when any slot <= k is DEAD
            dead = windows == DEAD
            _prefix(np.logical_or, dead, small)
            windows[dead] = self.pad_id
        tab = self._tables
        mixed = windows * tab.mult[:, :, None]  # [L, max_ngram, T]
        _prefix(np.bitwise_xor, mixed.transpose(1, 0, 2), small)  # slot n - 1 becomes order n's XOR
        rows = np.empty((len(tab.mult), t, w, self.cfg.n_heads), dtype=np.int64)  # [L, T, n_cols] in column order
        np.remainder(mixed[:, 1:].transpose(0, 2, 1)[..., None], tab.primes[:, None], out=rows)
        rows += tab.offsets[:, None]
        rows = rows.reshape(len(tab.mult), t, self.cfg.n_cols)
        return ({lid: torch.from_numpy(rows[i]) for i, lid in enumerate(self.cfg.layer_ids)},
                torch.from_numpy(src[lb_idx]))

    # ----------------------------------------------------------------- tokens not read yet (async scheduling)
    def pending_partials(self, before: np.ndarray) -> np.ndarray:
        """Host half of the row ids of tokens only the device has: ``before`` [P, W] int64 (the compressed ids of the W
        positions before each, oldest first, pad-filled, DEAD = -1) -> [L, P, n_cols] int64 (cfg layer order): per
        column (order n, head h) the XOR over s = 1..n-1 of the sticky-DEAD-padded id at p - s times m[s]."""
        p, w = before.shape
        if w != self.window:
            raise ValueError(f"pending_partials: expected [P, {self.window}] ids, got {tuple(before.shape)}")
        windows = np.ascontiguousarray(before[:, ::-1].T)  # [W, P]: row s - 1 holds slot s (position p - s)
        if windows.size and windows.min() < 0:
            dead = np.logical_or.accumulate(windows == DEAD, axis=0)
            windows[dead] = self.pad_id
        tab = self._tables
        terms = np.bitwise_xor.accumulate(windows[None] * tab.mult[:, 1:, None], axis=1)  # [L, W, P]: slots 1..s
        heads = self.cfg.n_heads
        out = np.broadcast_to(terms.transpose(0, 2, 1)[..., None], (len(tab.mult), p, w, heads))  # order n at n - 2
        return np.ascontiguousarray(out).reshape(len(tab.mult), p, w * heads)

    def hash_pending(self, compressed: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
        """Device half: ``compressed`` [P] int64 (DEAD = -1) and ``partials`` [L, P, n_cols] on one device -> row ids
        [L, P, n_cols], bitwise ``hash_step``'s; a DEAD token pads its whole window. No host synchronisation."""
        m0, pad_mixed, primes, offsets = self._pending_consts(compressed.device)
        c = compressed.reshape(1, -1, 1)
        mixed = torch.where(c == DEAD, pad_mixed, (c * m0) ^ partials)
        return torch.remainder(mixed, primes) + offsets

    def _pending_consts(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(m[0] [L, 1, 1], all-pad window's XOR [L, 1, n_cols], primes [L, 1, n_cols], offsets [L, 1, n_cols])."""
        key = ("pending", device)
        if key not in self._consts:
            tab, heads, n_layers = self._tables, self.cfg.n_heads, len(self._tables.mult)
            pad_terms = np.bitwise_xor.accumulate(self.pad_id * tab.mult, axis=1)[:, 1:]  # [L, W]: order n at n - 2
            pad_mixed = np.repeat(pad_terms, heads, axis=1)  # [L, n_cols]
            consts = (tab.mult[:, :1, None], pad_mixed[:, None], tab.primes.reshape(n_layers, 1, -1),
                      tab.offsets.reshape(n_layers, 1, -1))
            self._consts[key] = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in consts)
        return self._consts[key]

    def packed_windows(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, lookback: torch.Tensor) -> torch.Tensor:
        """[T, max_ngram] windows of a packed batch: slot s holds the id at position p - s of its sequence."""
        ext, tok_pos = self._packed_ext(ids, cu_seqlens, lookback)
        return ext[tok_pos.unsqueeze(1) - torch.arange(self.window + 1, device=ids.device)]  # [T, max_ngram]

    def next_lookback(self, lookback: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Lookbacks after appending each sequence's packed ``ids`` chunk: [S, max_ngram-1]."""
        ext, _ = self._packed_ext(ids, cu_seqlens, lookback)
        return self._lookback_from_ext(ext, cu_seqlens.to(ids.device, torch.int64))

    def _lookback_from_ext(self, ext: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """The last W entries of each sequence's [lookback | tokens] segment of ``ext`` -> [S, W]."""
        w = self.window
        first = cu[1:] + w * torch.arange(cu.numel() - 1, device=ext.device)  # [S]
        return ext[first.unsqueeze(1) + torch.arange(w, device=ext.device)]  # [S, W]

    def _packed_ext(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                    lookback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence's [lookback (W) | new tokens] back to back -> (ext [T + W*S], tok_pos [T])."""
        device = ids.device
        cu = cu_seqlens.to(device, torch.int64)
        self._check_packed(ids, cu, lookback)
        s, t, w = cu.numel() - 1, ids.numel(), self.window
        lens = cu[1:] - cu[:-1]  # [S]
        seq_of_tok = torch.repeat_interleave(torch.arange(s, device=device), lens, output_size=t)  # [T]
        ext = torch.empty(t + w * s, dtype=torch.int64, device=device)
        tok_pos = torch.arange(t, device=device) + w * (seq_of_tok + 1)
        ext[tok_pos] = ids.to(torch.int64)
        lb_pos = (cu[:-1] + w * torch.arange(s, device=device)).unsqueeze(1) + torch.arange(w, device=device)
        ext[lb_pos.reshape(-1)] = lookback.to(device, torch.int64).reshape(-1)
        return ext, tok_pos

    def _check_packed(self, ids, cu_seqlens, lookback) -> None:
        """ValueError unless ids is [T], cu_seqlens runs from 0 to T and lookback is [S, W] (tensors or arrays)."""
        if ids.ndim != 1:
            raise ValueError(f"hash_packed() expects packed [T] ids, got shape {tuple(ids.shape)}")
        self._check_lookback(lookback, cu_seqlens.shape[0] - 1)
        t = ids.shape[0]
        if int(cu_seqlens[-1]) != t or int(cu_seqlens[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {cu_seqlens.tolist()}")

    def _check_lookback(self, lookback: torch.Tensor, num_seqs: int) -> None:
        if tuple(lookback.shape) != (num_seqs, self.window):
            raise ValueError(f"lookback must be [{num_seqs}, {self.window}] (max_ngram_size-1 ids per sequence), "
                             f"got {tuple(lookback.shape)}")


def _prefix(op: np.ufunc, a: np.ndarray, small: bool) -> None:
    """In place along axis 0: a[k] = op(a[k - 1], a[k]) (one ``accumulate`` when small, a call per row when big)."""
    if small:
        op.accumulate(a, axis=0, out=a)
    else:
        for k in range(1, a.shape[0]):
            op(a[k - 1], a[k], out=a[k])


def _gather_index(cu_bytes: bytes, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Where ``_hash_step_numpy`` reads from ``[lookback.ravel() | ids]``: (window index [W+1, T], next-lookback index
    [S, W]), a pure function of cu_seqlens and W, memoized (read-only arrays)."""
    cu = np.frombuffer(cu_bytes, dtype=np.int64)
    s, t = cu.shape[0] - 1, int(cu[-1])
    lens = cu[1:] - cu[:-1]
    lb_pos = (cu[:-1] + w * np.arange(s))[:, None] + np.arange(w)  # [S, W] each lookback in ext
    tok_pos = np.arange(t) + w * (np.repeat(np.arange(s), lens) + 1)  # [T] each token in ext
    ext = np.empty(t + w * s, dtype=np.int64)
    ext[lb_pos] = np.arange(s * w).reshape(s, w)
    ext[tok_pos] = np.arange(s * w, s * w + t)
    win_idx, lb_idx = ext[tok_pos - np.arange(w + 1)[:, None]], ext[lb_pos + lens[:, None]]
    win_idx.flags.writeable = lb_idx.flags.writeable = False
    return win_idx, lb_idx


_SMALL_STEP = 256  # steps of at most this many tokens (every decode step) reuse their gather index
_gather_index_small = functools.lru_cache(maxsize=1024)(_gather_index)  # <= 16 KB an entry at W = 3: <= 16 MB


def dead_mask(compressed_ids: torch.Tensor) -> torch.Tensor:
    """Positions whose own token is DEAD (the fusion forces their gate to 0): bool, same shape."""
    return compressed_ids == DEAD
