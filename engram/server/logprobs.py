"""Log probabilities in the two OpenAI response shapes (docs/server.md), from the engine's ``TokenLogprobs``.

A token whose bytes are not UTF-8 is written ``"bytes:\\xe2\\x80"``, so distinct tokens never share a string
and a top-k dict always has k keys. Bytes are exact for byte-level BPE and added tokens; for other tokenizers
they are the UTF-8 of the token decoded alone.
"""
from __future__ import annotations

import codecs
import json
from typing import Any, NamedTuple

LOGPROB_FLOOR = -9999.0  # lower logprobs (-inf: JSON has none) are reported as this, as vLLM does


class Scored(NamedTuple):
    """One token to report."""

    token_id: int
    logprob: float | None  # None: the first prompt token (nothing predicts it)
    top: list[tuple[int, float]] | None  # the step's most likely (token id, logprob), most likely first
    in_text: bool  # its characters are part of the choice's text (not a special token the detokenizer skips)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


class TokenStrings:
    """Bytes, OpenAI string and special-ness of each token id of a ``tokenizers.Tokenizer`` (memoized)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(json.loads(tokenizer.to_str()).get("decoder"))
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special = {i for i, t in added.items() if t.special}
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._compute_bytes(token_id)
        return b

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self._tokenizer.id_to_token(token_id) or ""
        if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        """The token as OpenAI writes it: its text, or ``bytes:\\xNN...`` when its bytes are not UTF-8."""
        t = self._text.get(token_id)
        if t is None:
            b = self.bytes(token_id)
            try:
                t = b.decode("utf-8")
            except UnicodeDecodeError:
                t = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._text[token_id] = t
        return t

    def special(self, token_id: int) -> bool:
        return token_id in self._special


class TokenIdStrings:
    """``TokenStrings`` for ``return_tokens_as_token_ids`` (vLLM's request field): a token's string is
    ``"token_id:N"``; its bytes (chat's ``bytes``, the legacy ``text_offset``) and special-ness stay the token's
    own, so offsets still index the choice's text."""

    def __init__(self, strings: TokenStrings):
        self._strings = strings

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def bytes(self, token_id: int) -> bytes:
        return self._strings.bytes(token_id)

    def special(self, token_id: int) -> bool:
        return self._strings.special(token_id)


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def prompt_scored(prompt_token_ids: list[int], prompt_logprobs: list | None) -> list[Scored]:
    """The prompt's tokens: the first one unscored, the others with their ``TokenLogprobs`` from the engine."""
    scored = [Scored(prompt_token_ids[0], None, None, True)]
    for tl in (prompt_logprobs or [None])[1:]:
        scored.append(Scored(tl.token_id, tl.logprob, tl.top, True))
    return scored


def generated_scored(strings: TokenStrings, logprobs: list) -> list[Scored]:
    """Generated tokens from their ``TokenLogprobs``; special tokens are not in the text (the detokenizer
    skips them)."""
    return [Scored(tl.token_id, tl.logprob, tl.top, not strings.special(tl.token_id)) for tl in logprobs]


class LegacyLogprobs:
    """One completion choice's ``logprobs`` object with ``k`` alternatives per token, built by one ``add()`` per
    response or per streamed chunk: ``text_offset`` continues across calls, so a stream's pieces concatenate."""

    def __init__(self, strings: TokenStrings, k: int):
        self.strings, self.k = strings, k
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # the text's characters so far
        self._chars = 0

    def add(self, scored: list[Scored]) -> dict[str, list]:
        s = self.strings
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok in scored:
            out["tokens"].append(s.text(tok.token_id))
            out["token_logprobs"].append(None if tok.logprob is None else _floor(tok.logprob))
            out["top_logprobs"].append(None if tok.top is None else
                                       {s.text(t): _floor(lp) for t, lp in tok.top[:self.k]})
            out["text_offset"].append(self._chars)
            if tok.in_text:
                self._chars += len(self._decoder.decode(s.bytes(tok.token_id)))
        return out


def chat_logprobs(strings: TokenStrings, scored: list[Scored], k: int) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content`` entries of generated tokens, ``k`` alternatives each."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": strings.text(token_id), "logprob": _floor(logprob), "bytes": list(strings.bytes(token_id))}

    return [{**one(tok.token_id, tok.logprob), "top_logprobs": [one(t, lp) for t, lp in (tok.top or [])[:k]]}
            for tok in scored]
