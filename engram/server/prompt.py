"""Prompt preparation for the server, off the engine thread: a length bound checked before any tokenizing,
then tokenization that releases the GIL.

``chars_per_token_bound(tokenizer)`` is K such that a text of ``c`` characters always encodes to at least
``c / K`` tokens, or None where no such bound holds; ``too_long(text, bound, max_model_len)`` uses it to refuse
a prompt that cannot fit before spending any time on it. ``encode(tokenizer, text)`` gives the same ids as
``tokenizer.encode(text).ids`` (special tokens added), through ``encode_batch``, which runs without the GIL:
a long prompt tokenizing in a worker thread does not stall the engine thread or the event loop.
"""
from __future__ import annotations

import json
from typing import Any

# How much a normalizer can shrink a text, in characters: NFC / NFKC compose at most 4 code points into one
# (e.g. U+1FA7 = omega + 3 combining marks). A normalizer that can shrink text without bound (Replace, Strip,
# ...) gives no bound at all.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4}
# Pre-tokenizers that keep every character; the others (Whitespace, BertPreTokenizer, ...) drop some.
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "Sequence")


def _shrink(normalizer: dict | None) -> int | None:
    if normalizer is None:
        return 1
    if normalizer.get("type") == "Sequence":
        factor = 1
        for n in normalizer.get("normalizers", []):
            f = _shrink(n)
            if f is None:
                return None
            factor *= f
        return factor
    return _NORMALIZER_SHRINK.get(normalizer.get("type"))


def _keeps_characters(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return False
    return all(_keeps_characters(p) for p in pre.get("pretokenizers", []))


def chars_per_token_bound(tokenizer: Any) -> int | None:
    """K such that a text of ``c`` characters always encodes to at least ``c / K`` tokens, or None where no
    such bound is known: only BPE models (byte-level or not, unknown characters not fused) with no normalizer
    or NFC / NFKC, and pre-tokenizers that keep every character, get one.

    A BPE token covers at most as many characters as its vocabulary string has (a byte-level string has one
    character per byte, and a character is at least one byte), an added token exactly its content; the
    normalizer's worst shrink multiplies that.
    """
    config = json.loads(tokenizer.to_str())
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    shrink = _shrink(config.get("normalizer"))
    if shrink is None or not _keeps_characters(config.get("pre_tokenizer")):
        return None
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * shrink


def too_long(num_chars: int, bound: int | None, max_model_len: int) -> str | None:
    """Why a text of ``num_chars`` characters cannot fit ``max_model_len`` tokens, or None if it may."""
    if bound is None or num_chars <= max_model_len * bound:
        return None
    return (f"the prompt has {num_chars} characters, at least {-(-num_chars // bound)} tokens (one token covers "
            f"at most {bound} characters), more than max_model_len={max_model_len}")


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``, equal to ``tokenizer.encode(text).ids``, computed without holding the GIL."""
    return tokenizer.encode_batch([text])[0].ids
