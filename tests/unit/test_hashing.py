"""NgramHasher against a plain numpy implementation of the spec written here, plus the chunking property."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engram.config import EngramConfig
from engram.hashing import DEAD, NgramHasher, dead_mask


def spec_hash(ids, cfg, layer, pad):
    """Straight from docs/addressing.md: one position, one column at a time (Python ints)."""
    primes, offsets, mult = cfg.primes(layer), cfg.column_offsets(layer), cfg.multipliers(layer)
    out = np.zeros((len(ids), cfg.n_cols), dtype=np.int64)
    for p in range(len(ids)):
        window, dead = [], False
        for s in range(cfg.max_ngram_size):
            tok = ids[p - s] if p - s >= 0 else pad
            dead = dead or tok == DEAD
            window.append(pad if dead else tok)
        col = 0
        for n in cfg.orders:
            r = 0
            for s in range(n):
                r ^= window[s] * mult[s]
            for _ in range(cfg.n_heads):
                out[p, col] = r % primes[col] + offsets[col]
                col += 1
    return out


@pytest.mark.parametrize("preset", ["tiny", "deepseek-v4.1-flash", "paper-demo"])
def test_matches_spec_reference(preset):
    cfg = EngramConfig.preset(preset)
    g = np.random.default_rng(1)
    ids = g.integers(0, cfg.compressed_vocab_size, size=(3, 17))
    ids[1, 5] = DEAD
    ids[2, 0] = DEAD
    ids[2, 16] = DEAD
    h = NgramHasher(cfg, pad_id=2)
    for layer in cfg.layer_ids:
        got = h.hash(torch.from_numpy(ids), layer).numpy()
        for b in range(3):
            np.testing.assert_array_equal(got[b], spec_hash(ids[b].tolist(), cfg, layer, 2))
        assert got.min() >= 0 and got.max() < cfg.table_rows(layer)


def test_v41_golden_first_position():
    """Position 0 of any sequence: every slot but s=0 is pad, so the row follows from the numbers in docs/facts.md."""
    cfg = EngramConfig.preset("deepseek-v4.1-flash")
    m = [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    pad, tok = 2, 12345
    rows = NgramHasher(cfg, pad).hash(torch.tensor([[tok]]), 1)[0, 0]
    r2 = (tok * m[0]) ^ (pad * m[1])
    assert int(rows[0]) == r2 % 16000057
    r4 = r2 ^ (pad * m[2]) ^ (pad * m[3])
    assert int(rows[23]) == r4 % 16000463 + sum(cfg.primes(1)[:23])


def test_dead_is_sticky_and_masked():
    cfg = EngramConfig.preset("tiny")
    h = NgramHasher(cfg, pad_id=0)
    ids = torch.tensor([[5, 6, DEAD, 7, 8, 9]])
    rows = h.hash(ids, 1)
    # position 3 (token 7): slot 1 is DEAD -> slots 1, 2 are pad, same as a sequence starting at 7
    fresh = h.hash(torch.tensor([[7, 8, 9]]), 1)
    assert torch.equal(rows[0, 3:], fresh[0])
    assert dead_mask(ids).tolist() == [[False, False, True, False, False, False]]


def test_packed_equals_batched_and_lookbacks_carry_dead():
    cfg = EngramConfig.preset("tiny")
    h = NgramHasher(cfg, pad_id=0)
    seqs = [torch.tensor([1, 2, 3, DEAD, 4]), torch.tensor([9]), torch.tensor([7, 7, 7, 7])]
    ids = torch.cat(seqs)
    cu = torch.tensor([0, 5, 6, 10])
    lb = h.initial_lookback(3)
    packed = h.hash_packed(ids, cu, lb, 3)
    for i, s in enumerate(seqs):
        assert torch.equal(packed[cu[i]:cu[i + 1]], h.hash(s[None], 3)[0])
    lb2 = h.next_lookback(lb, ids, cu)
    assert lb2.tolist() == [[DEAD, 4], [0, 9], [7, 7]]
    # a zero-length chunk keeps the old lookback
    lb3 = h.next_lookback(lb2, torch.tensor([5]), torch.tensor([0, 0, 1, 1]))
    assert lb3.tolist() == [[DEAD, 4], [9, 5], [7, 7]]
    all_layers = h.hash_packed_all(ids, cu, lb)
    assert torch.equal(all_layers[3], packed) and set(all_layers) == {1, 3}
    step_rows, step_lb = h.hash_step(ids, cu, lb)  # the engine's one-buffer form agrees with both
    assert all(torch.equal(step_rows[l], all_layers[l]) for l in (1, 3)) and torch.equal(step_lb, lb2)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_chunked_with_lookback_equals_whole(data):
    cfg = EngramConfig.preset("tiny").replace(max_ngram_size=4, vocab_size=1009)
    h = NgramHasher(cfg, pad_id=3)
    n = data.draw(st.integers(1, 40))
    toks = data.draw(st.lists(st.one_of(st.integers(0, cfg.compressed_vocab_size - 1), st.just(DEAD)),
                              min_size=n, max_size=n))
    whole = h.hash(torch.tensor([toks]), 1)[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6))))
    bounds = [0] + cuts + [n]
    lb = h.initial_lookback(1)
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        chunk = torch.tensor(toks[a:b], dtype=torch.int64)
        cu = torch.tensor([0, b - a])
        pieces.append(h.hash_packed(chunk, cu, lb, 1))
        lb = h.next_lookback(lb, chunk, cu)
    assert torch.equal(torch.cat(pieces), whole)


def test_bad_shapes():
    h = NgramHasher(EngramConfig.preset("tiny"), pad_id=0)
    with pytest.raises(ValueError, match="lookback must be"):
        h.hash_packed(torch.tensor([1, 2]), torch.tensor([0, 2]), torch.zeros(1, 5, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="cu_seqlens"):
        h.hash_packed(torch.tensor([1, 2]), torch.tensor([0, 3]), h.initial_lookback(1), 1)
    with pytest.raises(ValueError, match="pad_id"):
        NgramHasher(EngramConfig.preset("tiny"), pad_id=10**6)


def test_from_tokenizer_compresses_the_raw_pad_id():
    from engram.tokenizer import CompressedTokenizer

    # raw ids 0..5 -> compressed 0, 1, 1, 2, 0, 3: the raw pad id 2 is compressed id 1, and stays 1 even
    # when it is a DEAD token (the pad is never DEAD)
    ct = CompressedTokenizer(np.array([0, 1, 1, 2, 0, 3]))
    cfg = EngramConfig.preset("tiny").replace(compressed_vocab_size=4, pad_token_id=2, vocab_size=(11, 13))
    h = NgramHasher.from_tokenizer(cfg, ct)
    assert h.pad_id == 1 and h.pad_id != cfg.pad_token_id
    ids = torch.tensor([[3, 0, 2]])
    assert torch.equal(h.hash(ids, 1), NgramHasher(cfg, pad_id=1).hash(ids, 1))
    assert NgramHasher.from_tokenizer(cfg.replace(dead_token_ids=(2,)), ct).pad_id == 1
    assert NgramHasher.from_tokenizer(cfg.replace(pad_token_id=5), ct).pad_id == 3


def test_from_tokenizer_refuses_a_mismatched_tokenizer():
    from engram.tokenizer import CompressedTokenizer

    ct = CompressedTokenizer(np.array([0, 1, 1, 2, 0, 3]))
    cfg = EngramConfig.preset("tiny").replace(compressed_vocab_size=4, vocab_size=(11, 13))
    with pytest.raises(ValueError, match="compressed tokenizer has 4 ids but engram.compressed_vocab_size=5"):
        NgramHasher.from_tokenizer(cfg.replace(compressed_vocab_size=5), ct)
    with pytest.raises(ValueError, match=r"^engram.pad_token_id=6: outside the tokenizer's 6 raw ids$"):
        NgramHasher.from_tokenizer(cfg.replace(pad_token_id=6), ct)


def test_from_tokenizer_of_the_builtin_tokenizer():
    from engram.model.presets import PAD, TOKENIZER_FILE
    from engram.tokenizer import CompressedTokenizer

    ct = CompressedTokenizer.from_file(TOKENIZER_FILE)
    h = NgramHasher.from_tokenizer(EngramConfig.preset("tiny"), ct)
    assert h.pad_id == ct.compress(PAD) and h.cfg == EngramConfig.preset("tiny")


@pytest.mark.gpu
def test_cuda_matches_cpu():
    cfg = EngramConfig.preset("deepseek-v4.1-flash")
    h = NgramHasher(cfg, pad_id=2)
    ids = torch.randint(0, cfg.compressed_vocab_size, (4, 1000))
    ids[0, 10] = DEAD
    for layer in cfg.layer_ids:
        assert torch.equal(h.hash(ids, layer), h.hash(ids.cuda(), layer).cpu())
    cu = torch.tensor([0, 1000, 2500, 4000])
    lb = torch.randint(0, 99092, (3, 3))
    flat = ids.reshape(-1)
    assert torch.equal(h.hash_packed(flat, cu, lb, 14), h.hash_packed(flat.cuda(), cu.cuda(), lb.cuda(), 14).cpu())
    assert torch.equal(h.next_lookback(lb, flat, cu), h.next_lookback(lb.cuda(), flat.cuda(), cu.cuda()).cpu())
