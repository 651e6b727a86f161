"""NgramHasher.hash_step on CPU tensors (the numpy path) is bitwise equal to hash_step_reference (torch ops)."""
import functools
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engram import hashing
from engram.config import EngramConfig
from engram.hashing import DEAD, NgramHasher
from engram.model.presets import preset_config

I64 = (-2**63, 2**63 - 1)
LAYOUTS = ("tiny", "small", "4b-like", "8b-like", "deepseek-v4.1-flash", "paper-demo")


@functools.cache
def hasher(layout: str, pad_id: int) -> NgramHasher:
    cfg = EngramConfig.preset(layout) if layout in ("deepseek-v4.1-flash", "paper-demo") \
        else preset_config(layout).engram
    return NgramHasher(cfg, pad_id=pad_id % cfg.compressed_vocab_size)


def assert_parity(h: NgramHasher, ids: torch.Tensor, cu: torch.Tensor, lb: torch.Tensor) -> None:
    ref_rows, ref_lb = h.hash_step_reference(ids, cu, lb)
    rows, nlb = h.hash_step(ids, cu, lb)
    assert list(rows) == list(ref_rows) == list(h.cfg.layer_ids)
    for lid, r in rows.items():
        assert r.dtype == torch.int64 and r.device.type == "cpu" and r.shape == (ids.numel(), h.cfg.n_cols)
        assert torch.equal(r, ref_rows[lid]), lid
    assert nlb.dtype == torch.int64 and torch.equal(nlb, ref_lb)


def ids_of(vocab: int, wide: bool):
    """In-vocab compressed ids and DEAD; ``wide`` adds any int64 (beyond the vocab the products wrap, negative
    XORs exercise the remainder's sign rule: outside the contract, still bitwise equal)."""
    base = st.one_of(st.integers(0, vocab - 1), st.just(DEAD))
    return st.one_of(base, st.integers(*I64), st.sampled_from(I64)) if wide else base


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_hash_step_numpy_equals_reference(data):
    h = hasher(data.draw(st.sampled_from(LAYOUTS)), data.draw(st.integers(0, 10**6)))
    vocab, w = h.cfg.compressed_vocab_size, h.window
    tok = ids_of(vocab, wide=data.draw(st.booleans()))
    lens = data.draw(st.lists(st.integers(0, 40) | st.just(0), max_size=6))
    ids = data.draw(st.lists(tok, min_size=sum(lens), max_size=sum(lens)))
    lb = data.draw(st.lists(st.lists(tok | st.just(h.pad_id), min_size=w, max_size=w),
                            min_size=len(lens), max_size=len(lens)))
    dtype = data.draw(st.sampled_from([torch.int64, torch.int32])) if all(-2**31 <= v < 2**31 for v in ids) \
        else torch.int64
    small_step = data.draw(st.sampled_from([hashing._SMALL_STEP, 0, 10**9]))  # both sides of the size switch
    with mock.patch.object(hashing, "_SMALL_STEP", small_step):
        assert_parity(h, torch.tensor(ids, dtype=dtype), torch.tensor([0] + lens).cumsum(0),
                      torch.tensor(lb, dtype=torch.int64).reshape(len(lens), w))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("t,s", [(1, 1), (64, 64), (300, 3), (2048, 5)])
def test_big_random_steps(layout, t, s):
    """Decode-like and prefill-like steps of every layout, DEAD sprinkled in ids and lookbacks."""
    h = hasher(layout, 2)
    g = torch.Generator().manual_seed(t * 7 + s)
    ids = torch.randint(0, h.cfg.compressed_vocab_size, (t,), generator=g)
    ids[torch.randint(0, t, (max(1, t // 50),), generator=g)] = DEAD
    cuts = torch.sort(torch.randint(0, t + 1, (s - 1,), generator=g)).values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([t])])
    lb = torch.randint(0, h.cfg.compressed_vocab_size, (s, h.window), generator=g)
    lb[0, -1] = DEAD
    assert_parity(h, ids, cu, lb)


def test_int64_wraparound_and_negative_xor():
    """Ids at the int64 extremes: the products wrap and XORs go negative; both paths wrap and take the floor
    remainder (the divisor's sign) identically."""
    h = hasher("deepseek-v4.1-flash", 2)
    ids = torch.tensor([2**63 - 1, -2**63, -2, 5, 2**62 + 12345, -(2**40), 7, DEAD, 2**63 - 1])
    assert_parity(h, ids, torch.tensor([0, 4, 9]), torch.tensor([[-2**63, 1, 2**63 - 1], [DEAD, -3, 4]]))
    x = ids.numpy()
    assert (x[:2] * h._tables.mult[0, 0]).tolist() != [int(v) * int(h._tables.mult[0, 0]) for v in x[:2]]


def test_cpu_takes_numpy_and_outputs_are_fresh():
    """CPU inputs never reach the torch path; the outputs own their memory: mutating them changes nothing
    of the inputs or of the next call (the memoized gather indices are read-only)."""
    h = hasher("4b-like", 0)
    ids, cu, lb = torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1, 3]), torch.tensor([[1, 2, 3]] * 3)
    ref_rows, ref_lb = h.hash_step_reference(ids, cu, lb)
    with mock.patch.object(NgramHasher, "hash_step_reference", side_effect=AssertionError("torch path")):
        rows, nlb = h.hash_step(ids, cu, lb)
        assert nlb.tolist() == [[2, 3, 5], [1, 2, 3], [3, 6, 7]]
        for r in rows.values():
            r.fill_(-7)
        nlb.fill_(-7)
        assert lb.tolist() == [[1, 2, 3]] * 3 and ids.tolist() == [5, 6, 7]
        rows, nlb = h.hash_step(ids, cu, lb)
    assert all(torch.equal(rows[k], ref_rows[k]) for k in rows) and torch.equal(nlb, ref_lb)


def test_numpy_path_refuses_what_the_reference_refuses():
    h = hasher("tiny", 0)
    bad = [((torch.tensor([[1, 2]]), torch.tensor([0, 2]), h.initial_lookback(1)), "expects packed"),
           ((torch.tensor([1, 2]), torch.tensor([0, 2]), torch.zeros(1, 5, dtype=torch.long)), "lookback must be"),
           ((torch.tensor([1, 2]), torch.tensor([0, 3]), h.initial_lookback(1)), "cu_seqlens must"),
           ((torch.tensor([1, 2]), torch.tensor([1, 2]), h.initial_lookback(1)), "cu_seqlens must")]
    for args, match in bad:
        for fn in (h.hash_step, h.hash_step_reference):
            with pytest.raises(ValueError, match=match):
                fn(*args)


def test_tables_match_the_config():
    """The stacked numpy constants are the config's numbers, in column order, and feed the torch path too."""
    h = hasher("deepseek-v4.1-flash", 2)
    cfg, tab = h.cfg, h._tables
    for i, lid in enumerate(cfg.layer_ids):
        assert tab.mult[i].tolist() == cfg.multipliers(lid)
        assert tab.primes[i].reshape(-1).tolist() == cfg.primes(lid)
        assert tab.offsets[i].reshape(-1).tolist() == cfg.column_offsets(lid)
        mult, primes, offsets = h._layer_consts(lid, torch.device("cpu"))
        assert (mult.tolist(), primes.tolist(), offsets.tolist()) == \
            (cfg.multipliers(lid), cfg.primes(lid), cfg.column_offsets(lid))
    assert np.all(tab.primes > 16_000_000)
