"""N-gram hashing: compressed token ids -> global row ids of each Engram layer's table.

At position p, column (order n, head h): R = XOR over s = 0..n-1 of id[p-s] * m[s]; row = R mod prime +
column offset (EngramConfig.primes / column_offsets / multipliers). Positions before the sequence start
use the compressed pad id. A DEAD token (compressed id -1) is sticky: once the lookback from p reaches a
DEAD token, that slot and every older slot use the pad id; at a DEAD position itself the fusion gate is 0
(``dead_mask``). Everything is vectorized int64 torch and runs unchanged on CPU and CUDA; products never
overflow because multipliers are bounded by (2**63-1) // compressed_vocab_size.

A sequence processed in chunks carries a *lookback*: its last ``max_ngram_size - 1`` compressed ids
(DEAD kept as -1), oldest first, pad-filled at the start. Hashing chunk by chunk with lookbacks equals
hashing the whole sequence.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engram.config import EngramConfig

if TYPE_CHECKING:
    from engram.tokenizer import CompressedTokenizer

DEAD = -1


class NgramHasher:
    """Row ids for every Engram layer of ``cfg``. ``pad_id`` is the *compressed* pad id; ``from_tokenizer``
    derives it from ``cfg.pad_token_id`` and the model's compressed tokenizer."""

    def __init__(self, cfg: EngramConfig, pad_id: int):
        if not 0 <= pad_id < cfg.compressed_vocab_size:
            raise ValueError(f"pad_id={pad_id} is outside the compressed vocab [0, {cfg.compressed_vocab_size})")
        self.cfg = cfg
        self.pad_id = int(pad_id)
        self.window = cfg.max_ngram_size - 1  # lookback length
        self._consts: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_tokenizer(cls, cfg: EngramConfig, compressed_tokenizer: "CompressedTokenizer") -> "NgramHasher":
        """The hasher of ``cfg`` for text compressed by ``compressed_tokenizer``. The one place of the
        compressed-pad-id rule: ``pad_id = compress([cfg.pad_token_id])[0]`` (the raw pad id's compressed id;
        never DEAD, whatever ``cfg.dead_token_ids`` holds). ValueError when the tokenizer's compressed size is
        not ``cfg.compressed_vocab_size`` (``CompressedTokenizer.check_config``: every row id would move) or
        ``cfg.pad_token_id`` is not one of its raw ids."""
        compressed_tokenizer.check_config(cfg)
        if not cfg.pad_token_id < compressed_tokenizer.vocab_size:
            raise ValueError(f"engram.pad_token_id={cfg.pad_token_id}: outside the tokenizer's "
                             f"{compressed_tokenizer.vocab_size} raw ids")
        return cls(cfg, pad_id=int(compressed_tokenizer.compress([cfg.pad_token_id])[0]))

    # ----------------------------------------------------------------- constants per layer and device
    def _layer_consts(self, layer_id: int, device: torch.device):
        key = (layer_id, device)
        if key not in self._consts:
            cfg = self.cfg
            mult = torch.tensor(cfg.multipliers(layer_id), dtype=torch.int64, device=device)  # [max_ngram]
            primes = torch.tensor(cfg.primes(layer_id), dtype=torch.int64, device=device)  # [n_cols]
            offsets = torch.tensor(cfg.column_offsets(layer_id), dtype=torch.int64, device=device)  # [n_cols]
            self._consts[key] = (mult, primes, offsets)
        return self._consts[key]

    def initial_lookback(self, num_seqs: int = 1, device: torch.device | str = "cpu") -> torch.Tensor:
        """Lookback of sequences that have not started: pad ids, [S, max_ngram_size - 1]."""
        return torch.full((num_seqs, self.window), self.pad_id, dtype=torch.int64, device=device)

    # ----------------------------------------------------------------- core
    def _undead(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [..., max_ngram] compressed ids, slot s = position p - s (DEAD = -1) -> the ids each slot
        hashes: pad from the first DEAD slot on (sticky). The same for every layer."""
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
        idx = torch.arange(t, device=x.device).unsqueeze(1) + self.window - torch.arange(self.window + 1, device=x.device)
        windows = ext[:, idx]  # [B, T, max_ngram]
        return self._hash_ids(self._undead(windows), layer_id)

    def hash_packed(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, lookback: torch.Tensor,
                    layer_id: int) -> torch.Tensor:
        """Packed form for the engine: ids [T] (all sequences' new tokens back to back), cu_seqlens [S+1],
        lookback [S, max_ngram-1] (each sequence's ids before this chunk) -> row ids [T, n_cols]."""
        windows = self.packed_windows(ids, cu_seqlens, lookback)
        return self._hash_ids(self._undead(windows), layer_id)

    def hash_packed_all(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                        lookback: torch.Tensor) -> dict[int, torch.Tensor]:
        """``hash_packed`` for every Engram layer: {layer_id: [T, n_cols]} (windows built and undead once)."""
        return self.hash_step(ids, cu_seqlens, lookback)[0]

    def hash_step(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                  lookback: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """One engine step: (``hash_packed_all``, ``next_lookback``) from a single packed buffer."""
        ext, tok_pos = self._packed_ext(ids, cu_seqlens, lookback)
        windows = ext[tok_pos.unsqueeze(1) - torch.arange(self.window + 1, device=ids.device)]  # [T, max_ngram]
        clean = self._undead(windows)
        rows = {lid: self._hash_ids(clean, lid) for lid in self.cfg.layer_ids}
        return rows, self._lookback_from_ext(ext, cu_seqlens.to(ids.device, torch.int64))

    def packed_windows(self, ids: torch.Tensor, cu_seqlens: torch.Tensor, lookback: torch.Tensor) -> torch.Tensor:
        """[T, max_ngram] windows of a packed batch: slot s holds the id at position p - s of its sequence."""
        ext, tok_pos = self._packed_ext(ids, cu_seqlens, lookback)
        return ext[tok_pos.unsqueeze(1) - torch.arange(self.window + 1, device=ids.device)]  # [T, max_ngram]

    def next_lookback(self, lookback: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Lookbacks after appending each sequence's packed ``ids`` chunk: [S, max_ngram-1]."""
        ext, _ = self._packed_ext(ids, cu_seqlens, lookback)
        return self._lookback_from_ext(ext, cu_seqlens.to(ids.device, torch.int64))

    def _lookback_from_ext(self, ext: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        """The last W entries of each sequence's [lookback | tokens] segment of ``ext`` (it ends at
        cu[s+1] + W*(s+1)); a zero-length chunk leaves exactly its old lookback there -> [S, W]."""
        w = self.window
        first = cu[1:] + w * torch.arange(cu.numel() - 1, device=ext.device)  # [S]
        return ext[first.unsqueeze(1) + torch.arange(w, device=ext.device)]  # [S, W]

    def _packed_ext(self, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                    lookback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For each sequence [its lookback (W) | its new tokens] back to back -> (ext [T + W*S], tok_pos [T]):
        token j of the packed batch sits at ext[tok_pos[j]] = ext[j + W*(seq + 1)]."""
        if ids.dim() != 1:
            raise ValueError(f"hash_packed() expects packed [T] ids, got shape {tuple(ids.shape)}")
        device = ids.device
        cu = cu_seqlens.to(device, torch.int64)
        s = cu.numel() - 1
        self._check_lookback(lookback, s)
        t = ids.numel()
        if int(cu[-1]) != t or int(cu[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={t}, got {cu.tolist()}")
        w = self.window
        lens = cu[1:] - cu[:-1]  # [S]
        seq_of_tok = torch.repeat_interleave(torch.arange(s, device=device), lens, output_size=t)  # [T]
        ext = torch.empty(t + w * s, dtype=torch.int64, device=device)
        tok_pos = torch.arange(t, device=device) + w * (seq_of_tok + 1)
        ext[tok_pos] = ids.to(torch.int64)
        lb_pos = (cu[:-1] + w * torch.arange(s, device=device)).unsqueeze(1) + torch.arange(w, device=device)
        ext[lb_pos.reshape(-1)] = lookback.to(device, torch.int64).reshape(-1)
        return ext, tok_pos

    def _check_lookback(self, lookback: torch.Tensor, num_seqs: int) -> None:
        if tuple(lookback.shape) != (num_seqs, self.window):
            raise ValueError(f"lookback must be [{num_seqs}, {self.window}] (max_ngram_size-1 ids per sequence), "
                             f"got {tuple(lookback.shape)}")


def dead_mask(compressed_ids: torch.Tensor) -> torch.Tensor:
    """Positions whose own token is DEAD (the fusion forces their gate to 0): bool, same shape."""
    return compressed_ids == DEAD
