"""Prompt preparation off the event loop: a length bound checked before tokenizing (``too_long``), then
tokenization that releases the GIL (``encode``), so a long prompt stalls neither the engine nor the event loop.
"""
from __future__ import annotations

import json
from typing import Any

# How much a normalizer can shrink a text: NFC / NFKC compose at most 4 code points into one (U+1FA7); any
# other (Replace, Strip, ...) may shrink it without bound.
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
    such bound is known: only BPE models (unknown characters not fused) with no normalizer or NFC / NFKC,
    and pre-tokenizers that keep every character, get one. Why it holds: a BPE token covers at most as many
    characters as its vocabulary string has, times the normalizer's worst shrink.
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
