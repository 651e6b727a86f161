"""Hashing a token the host has not read: the host half (``pending_partials``, from the ids before it) and
the device half (``hash_pending``, with the token) give bitwise the row ids ``hash_step`` gives, DEAD ids
(in the window and as the token itself) included, for every Engram layer."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.config import EngramConfig
from engram.hashing import DEAD, NgramHasher


def _configs():
    tiny = EngramConfig.preset("tiny")
    yield tiny
    yield EngramConfig(layer_ids=(1, 6, 9), max_ngram_size=4, n_heads=3, head_dim=32, vocab_size=(1009, 2003, 977),
                       compressed_vocab_size=tiny.compressed_vocab_size, pad_token_id=2, hidden_size=32, hc_mult=1)


@pytest.mark.parametrize("cfg", list(_configs()), ids=lambda c: f"ngram{c.max_ngram_size}")
def test_pending_halves_equal_hash_step(cfg):
    h = NgramHasher(cfg, pad_id=2)
    rng = np.random.default_rng(0)
    w = h.window
    seqs, befores, last = [], [], []
    for _ in range(300):
        n = int(rng.integers(1, 3 * w + 2))
        ids = rng.integers(0, cfg.compressed_vocab_size, n)
        ids[rng.random(n) < 0.15] = DEAD
        seqs.append(ids)
        befores.append(([h.pad_id] * w + ids[:-1].tolist())[-w:])
        last.append(int(ids[-1]))
    flat = torch.from_numpy(np.concatenate(seqs))
    cu = torch.tensor(np.cumsum([0] + [len(s) for s in seqs]))
    rows, _ = h.hash_step_reference(flat, cu, h.initial_lookback(len(seqs)))
    want = torch.stack([rows[lid][cu[1:] - 1] for lid in cfg.layer_ids])  # [L, P, n_cols] at each last token
    partials = torch.from_numpy(h.pending_partials(np.array(befores, dtype=np.int64)))
    got = h.hash_pending(torch.tensor(last), partials)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_pending_partials_checks_the_window():
    h = NgramHasher(EngramConfig.preset("tiny"), pad_id=2)
    with pytest.raises(ValueError, match=r"expected \[P, 2\]"):
        h.pending_partials(np.zeros((3, 5), dtype=np.int64))
