"""CompressedTokenizer against an independent Python implementation of the key rules (unicodedata + re)."""
import hashlib
import json
import re
import unicodedata
import warnings

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engram import tokenizer
from engram.config import EngramConfig
from engram.tokenizer import CompressedTokenizer

# Unicode White_Space, which Rust's char::is_whitespace (tokenizers' Strip) uses.
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_STRIP = re.compile(f"^[{_WS}]+|[{_WS}]+$")


def reference_key(text: str, raw: str | None) -> str:
    if "\ufffd" in text:
        return raw
    s = unicodedata.normalize("NFKC", text)
    s = unicodedata.normalize("NFD", s)
    s = "".join(c for c in s if unicodedata.category(c) not in ("Mn", "Mc", "Me"))  # tokenizers: is_combining_mark
    s = s.lower()
    s = re.sub("[ \t\r\n]+", " ", s)
    s = "\ue000" if s == " " else s
    s = _STRIP.sub("", s).replace("\ue000", " ")
    return s if s else text


def reference_map(tok: Tokenizer) -> np.ndarray:
    keys: dict[str, int] = {}
    n = tok.get_vocab_size(with_added_tokens=True)
    return np.array([keys.setdefault(reference_key(tok.decode([i], skip_special_tokens=False), tok.id_to_token(i)),
                                     len(keys)) for i in range(n)])


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE trained here, offline, on text with accents, full-width forms and odd whitespace."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["Hello hello HELLO Ｈｅｌｌｏ héllo café CAFÉ naïve ﬁne fine", "tab\there  two  spaces\nnewline",
            "日本語のテキスト 中文 한국어", "x\x0by\u2028z", "emoji 🙂 🙃 ünïcödé"] * 50
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|pad|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    return tok


def test_bpe_matches_reference(bpe_tokenizer):
    ct = CompressedTokenizer.from_tokenizer(bpe_tokenizer, use_cache=False)
    np.testing.assert_array_equal(ct.map, reference_map(bpe_tokenizer))
    assert len(ct) < bpe_tokenizer.get_vocab_size()


def test_real_wordpiece_tokenizer_matches_reference(minilm_tokenizer_path):
    ct = CompressedTokenizer.from_file(minilm_tokenizer_path, use_cache=False)
    tok = Tokenizer.from_file(str(minilm_tokenizer_path))
    np.testing.assert_array_equal(ct.map, reference_map(tok))
    assert ct.vocab_size == 30522 and len(ct) == 30317


def _wordlevel(words):
    vocab = {w: i for i, w in enumerate(words)}
    return Tokenizer(models.WordLevel(vocab=vocab, unk_token=words[0]))


def test_edge_cases():
    words = ["[UNK]", "Ｈｅｌｌｏ", "hello", "HELLO", "café", "cafe", " ", "\t", "\n\n", "\x0b", "\u2028",
             "\u0301", "a\u0301", "á", "x\u2028y", "x y", "ﬁ", "fi"]
    tok = _wordlevel(words)
    ct = CompressedTokenizer.from_tokenizer(tok, use_cache=False)
    c = dict(zip(words, ct(list(range(len(words))))))
    assert c["Ｈｅｌｌｏ"] == c["hello"] == c["HELLO"]          # full-width + case fold
    assert c["café"] == c["cafe"] and c["a\u0301"] == c["á"]  # accents stripped
    assert c[" "] == c["\t"] == c["\n\n"]                    # lone whitespace keeps one space
    assert c["\x0b"] != c[" "] and c["\u2028"] != c[" "]      # not in the folded set: empty -> own text
    assert c["\x0b"] != c["\u2028"]
    assert c["\u0301"] not in (c[" "], c["\x0b"])              # empty normalization keys on the original
    assert c["x\u2028y"] != c["x y"]
    assert c["ﬁ"] == c["fi"]
    np.testing.assert_array_equal(ct.map, reference_map(tok))


def test_partial_utf8_byte_tokens_key_on_raw_token(bpe_tokenizer):
    ct = CompressedTokenizer.from_tokenizer(bpe_tokenizer, use_cache=False)
    partial = [i for i in range(bpe_tokenizer.get_vocab_size())
               if "\ufffd" in bpe_tokenizer.decode([i], skip_special_tokens=False)]
    assert len(partial) > 10
    compressed = ct(partial)
    # distinct raw byte tokens must not collapse onto one "\ufffd" key
    assert len(set(compressed)) == len({bpe_tokenizer.id_to_token(i) for i in partial})


def test_kinds_shapes_dead_and_range():
    ct = CompressedTokenizer(np.array([0, 1, 1, 2, 0]))
    assert len(ct) == 3 and ct.vocab_size == 5
    t = torch.tensor([[0, 1], [2, 3]])
    assert torch.equal(ct(t), torch.tensor([[0, 1], [1, 2]]))
    assert ct(np.array([4, 3])).tolist() == [0, 2] and isinstance(ct(np.array([1])), np.ndarray)
    assert ct([1, 2]) == [1, 1] and ct(3) == 2
    assert ct.compress(t, dead_token_ids=(2,)).tolist() == [[0, 1], [-1, 2]]
    assert ct.compress([2, 4], dead_token_ids=(2,)) == [-1, 0]
    with pytest.raises(IndexError, match="token id 5"):
        ct([5])


def test_size_check_explains_rehashing():
    ct = CompressedTokenizer(np.arange(10))
    ct.check_config(EngramConfig.preset("tiny").replace(compressed_vocab_size=10))
    with pytest.raises(ValueError, match="silently rehashed"):
        ct.check_config(EngramConfig.preset("tiny").replace(compressed_vocab_size=11))


def test_disk_cache_round_trip(tmp_path, monkeypatch, bpe_tokenizer):
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path))
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe_tokenizer.to_str())
    first = CompressedTokenizer.from_file(path)
    cached = list((tmp_path / "compressed_tokenizer").glob("*.npz"))
    assert len(cached) == 1
    key = hashlib.sha256(tokenizer.MAP_VERSION.encode() + path.read_bytes()).hexdigest()
    assert cached[0] == tokenizer.cache_path(key)
    tokenizer.write_cached_map(cached[0], key, np.zeros(3, dtype=np.int64))  # a valid entry for this key
    assert len(CompressedTokenizer.from_file(path)) == 1  # proves the second load reads the cache file
    cached[0].write_bytes(b"garbage")  # a damaged cache is rebuilt, not trusted
    with pytest.warns(RuntimeWarning, match="cannot be read"):
        np.testing.assert_array_equal(CompressedTokenizer.from_file(path).map, first.map)
    edited = json.loads(path.read_text())
    edited["added_tokens"].append({"id": 600, "content": "<|new|>", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(edited))
    assert CompressedTokenizer.from_file(path).vocab_size == first.vocab_size + 1  # new content, new key


@pytest.mark.parametrize("tamper", ["shuffled", "other-key", "wrong-dtype"])
def test_valid_but_wrong_cached_map_is_rebuilt(tmp_path, monkeypatch, bpe_tokenizer, tamper):
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path))
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe_tokenizer.to_str())
    first = CompressedTokenizer.from_file(path)
    (cached,) = (tmp_path / "compressed_tokenizer").glob("*.npz")
    with np.load(cached) as z:
        good, check = z["map"], z["check"]
    if tamper == "shuffled":  # same values and shape, another order: only the checksum tells
        bad = np.random.default_rng(0).permutation(good)
        assert not np.array_equal(bad, good)
        np.savez(cached, map=bad, check=check)
        why = "does not match its checksum"
    elif tamper == "other-key":  # a consistent entry, but made for another tokenizer's content
        tokenizer.write_cached_map(cached, "0" * 64, good[::-1].copy())
        why = "does not match its checksum"
    else:
        np.savez(cached, map=good.astype(np.int32), check=check)
        why = "not an int64 map"
    with pytest.warns(RuntimeWarning, match=why):
        rebuilt = CompressedTokenizer.from_file(path)
    np.testing.assert_array_equal(rebuilt.map, first.map)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry was written back and is trusted again
        np.testing.assert_array_equal(CompressedTokenizer.from_file(path).map, first.map)
