"""engram.server.prompt: the characters-per-token bound holds for any text (so a prompt refused by its length
before tokenizing could never have fit), is withheld where it cannot be proven, and encode() is encode()."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from engram.model.presets import TOKENIZER_FILE
from engram.server.prompt import chars_per_token_bound, encode, too_long

TINY = Tokenizer.from_file(str(TOKENIZER_FILE))
TINY_BOUND = chars_per_token_bound(TINY)


def _bpe(normalizer=None, pre_tokenizer=None, fuse_unk=False) -> Tokenizer:
    """A char-level BPE with a few long merges, so tokens cover several characters."""
    chars = "abcdefghijklmnopqrstuvwxyz \u03c9\u1fa7"
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["[UNK]"] = len(vocab)
    merges = []
    for word in ("ab", "abc", "abcd"):
        left, right = word[:-1], word[-1]
        merges.append((left, right))
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="[UNK]", fuse_unk=fuse_unk))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return tok


def test_tiny_byte_level_bound_is_its_longest_token():
    assert TINY_BOUND == max(len(t) for t in TINY.get_vocab(with_added_tokens=True)) == 32


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=400) | st.text(alphabet=" \n\t.a", min_size=1, max_size=400))
def test_bound_holds_for_any_text_and_encode_matches(text):
    ids = encode(TINY, text)
    assert ids == TINY.encode(text).ids
    assert len(ids) * TINY_BOUND >= len(text)


def test_nfc_bound_covers_four_code_points_composing_into_one():
    tok = _bpe(normalizers.NFC())
    bound = chars_per_token_bound(tok)
    assert bound == 5 * 4  # longest vocabulary string ("[UNK]"), times NFC's worst shrink
    text = "\u03c9\u0314\u0342\u0345" * 50  # omega + 3 marks -> U+1FA7: 4 characters, one token
    assert len(tok.encode(text).ids) == 50 and 50 * bound >= len(text)


@pytest.mark.parametrize("tok", [
    _bpe(normalizers.Replace("  ", " ")),  # shrinks without bound
    _bpe(normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])),
    _bpe(pre_tokenizer=pre_tokenizers.Whitespace()),  # drops whitespace
    _bpe(fuse_unk=True),  # one [UNK] for any run of unknown characters
], ids=["replace", "nfc+strip", "whitespace", "fuse_unk"])
def test_no_bound_where_it_cannot_be_proven(tok):
    assert chars_per_token_bound(tok) is None


def test_no_bound_for_wordpiece(minilm_tokenizer_path):
    assert chars_per_token_bound(Tokenizer.from_file(str(minilm_tokenizer_path))) is None


def test_too_long_names_the_limit():
    assert too_long(64, 32, 2) is None and too_long(10**9, None, 2) is None
    assert "at least 3 tokens" in too_long(65, 32, 2) and "max_model_len=2" in too_long(65, 32, 2)
