"""The batched static-shape DeepSeek-V4 decode step (engram/model/deepseek_v4/batched_decode.py) against the eager
path, float64 on the CPU: B sequences of different lengths prefilled eagerly, converted to a ``BatchedCache``, then N
decode steps batched and the same steps eagerly; logits equal within 1e-10 and the batched state converts back to the
eager caches. The lengths make a CSA window (ratio 4) and an HCA window (ratio 8 here) close on some steps for some
sequences and not others, the sliding window (W = 32) full for some and filling for others, and the CSA indexer see
fewer than its top-k (8) valid entries for some and more for others. Every slot past the valid counts is filled with
garbage before decoding, so a missing mask shows. Mutations (an entry committed one row late, invalid entries left
unmasked before the top-k, a window slot that is not masked) fail the parity; E_max overflow is refused by name."""
from __future__ import annotations

import pytest
import torch

from engram.model.deepseek_v4 import batched_decode, indexer
from engram.model.deepseek_v4.batched_decode import decode_step
from engram.model.deepseek_v4.batched_state import BatchedCache
from engram.model.deepseek_v4.config import V4Config
from engram.model.deepseek_v4.decoder import DeepseekV4Model, pack_sequences
from tests.parity.deepseek_v4_fixtures import SHAPE, random_decoder

CFG = V4Config.from_hf_dict(dict(SHAPE, model_type="deepseek_v4")).replace(hca_ratio=8)  # S, CSA 4, HCA 8, CSA
LENGTHS = (5, 14, 28, 48, 3)  # mod 4: 1 2 0 0 3; window 31 keys: 28 fills during the steps, 48 is full
STEPS, E_MAX, TOL = 6, 16, 1e-10


@pytest.fixture(scope="module")
def model() -> DeepseekV4Model:
    return random_decoder(CFG)


def _prefill(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]
    _, caches = model(pack_sequences(prompts, [0] * len(prompts)), [model.empty_cache() for _ in prompts])
    tokens = torch.randint(3, CFG.vocab_size, (STEPS, len(LENGTHS)), generator=g)
    return caches, tokens


def _poison(cache: BatchedCache, model) -> None:
    """Garbage into every slot past the valid counts (ring slots, buffer slots, entry rows, unset overlaps)."""
    g = torch.Generator().manual_seed(9)
    pos = cache.positions
    for block, st in zip(model.model.layers, cache.layers):
        ring = block.attn.window - 1
        bad = torch.arange(ring) >= pos.clamp(max=ring).unsqueeze(-1)
        st.window[bad] = 10 * torch.randn(st.window[bad].shape, generator=g, dtype=st.window.dtype)
        for comp, cst in ((getattr(block.attn, "compressor", None), st.compressor),
                          (getattr(getattr(block.attn, "indexer", None), "compressor", None), st.indexer)):
            if cst is None:
                continue
            r = comp.ratio
            for t, valid in ((cst.buffer_kv, pos % r), (cst.buffer_gate, pos % r), (cst.entries, pos // r)):
                bad = torch.arange(t.shape[1]) >= valid.unsqueeze(-1)
                t[bad] = 3 * torch.randn(t[bad].shape, generator=g, dtype=t.dtype)
            if cst.overlap_kv is not None:
                none = pos // r == 0
                cst.overlap_kv[none] = 3 * torch.randn(cst.overlap_kv[none].shape, generator=g, dtype=torch.float64)
                cst.overlap_gate[none] = torch.randn(cst.overlap_gate[none].shape, generator=g, dtype=torch.float64)


def _run(model):
    """(batched logits [STEPS, B, V], eager logits, batched state converted back, eager caches)."""
    caches, tokens = _prefill(model)
    cache = BatchedCache.from_caches(model, caches, E_MAX)
    _poison(cache, model)
    ropes = model.ropes("cpu")
    got, want = [], []
    for s in range(STEPS):
        got.append(model.head(decode_step(model, tokens[s], cache, ropes=ropes)))
        starts = [c.position for c in caches]
        hidden, caches = model(pack_sequences([[t] for t in tokens[s].tolist()], starts), caches)
        want.append(model.head(hidden))
    return torch.stack(got), torch.stack(want), cache.to_caches(model), caches


def _states_equal(a, b) -> None:
    for sa, sb in zip(a, b):
        assert sa.position == sb.position
        for la, lb in zip(sa.layers, sb.layers):
            torch.testing.assert_close(la.window, lb.window, atol=TOL, rtol=0)
            for ca, cb in ((la.compressor, lb.compressor), (la.indexer, lb.indexer)):
                assert (ca is None) == (cb is None)
                if ca is None:
                    continue
                for f in ("buffer_kv", "buffer_gate", "entries", "overlap_kv", "overlap_gate"):
                    ta, tb = getattr(ca, f), getattr(cb, f)
                    assert (ta is None) == (tb is None), f
                    if ta is not None:
                        torch.testing.assert_close(ta, tb, atol=TOL, rtol=0)


def _mismatch(model) -> float:
    got, want, _, _ = _run(model)
    return float((got - want).abs().max())


@torch.no_grad()
def test_the_lengths_cover_closing_and_filling():
    pos = torch.tensor(LENGTHS).unsqueeze(0) + torch.arange(STEPS).unsqueeze(1)  # [STEPS, B]
    for r in (CFG.csa_ratio, CFG.hca_ratio):
        closes = (pos + 1) % r == 0
        assert (closes.any(1) & ~closes.all(1)).any(), f"ratio {r}: no step where some close and others do not"
    full = pos >= CFG.sliding_window - 1
    assert (full.any(1) & ~full.all(1)).all() and (full[-1] & ~full[0]).any()
    entries = pos // CFG.csa_ratio
    assert (entries < CFG.index_topk).any() and (entries > CFG.index_topk).any()


@torch.no_grad()
def test_batched_decode_equals_the_eager_steps(model):
    got, want, back, eager = _run(model)
    assert float((got - want).abs().max()) <= TOL
    _states_equal(back, eager)


@torch.no_grad()
def test_the_conversion_round_trips(model):
    caches, _ = _prefill(model)
    _states_equal(BatchedCache.from_caches(model, caches, E_MAX).to_caches(model), caches)


@torch.no_grad()
def test_an_entry_committed_one_row_late_fails_parity(model, monkeypatch):
    monkeypatch.setattr(batched_decode, "entry_slot", lambda count, e_max: (count + 1).clamp(max=e_max - 1))
    assert _mismatch(model) > 1e-3


@torch.no_grad()
def test_invalid_entries_unmasked_before_topk_fail_parity(model, monkeypatch):
    caches, tokens = _prefill(model)  # the prefill runs unmutated; then every entry row counts as visible
    monkeypatch.setattr(indexer, "visible_entries", lambda positions, ratio: torch.full_like(positions, 10 ** 6))
    cache = BatchedCache.from_caches(model, caches, E_MAX)
    _poison(cache, model)
    got = model.head(decode_step(model, tokens[0], cache))
    hidden, _ = model(pack_sequences([[t] for t in tokens[0].tolist()], [c.position for c in caches]), caches)
    assert float((got - model.head(hidden)).abs().max()) > 1e-3


@torch.no_grad()
def test_an_unmasked_window_slot_fails_parity(model, monkeypatch):
    monkeypatch.setattr(batched_decode, "window_valid",
                        lambda positions, ring: torch.ones(positions.shape[0], ring, dtype=torch.bool))
    assert _mismatch(model) > 1e-3


@torch.no_grad()
def test_entries_past_e_max_are_refused_by_layer_and_sequence(model):
    caches, _ = _prefill(model)
    with pytest.raises(ValueError, match=r"layer 1 \(compressor\): sequence 3 has 12 compressed entries .*E_max=10"):
        BatchedCache.from_caches(model, caches, 10)
