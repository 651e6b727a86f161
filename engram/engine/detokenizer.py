"""Incremental detokenization and stop strings, correct for streaming. Each new token is decoded inside a small window
of the tokens before it (so context-dependent decoders give the text of decoding everything at once); text ending in an
incomplete character (U+FFFD) waits for the next token. The last ``len(longest stop) - 1`` characters are held back from
``visible_text`` until they cannot start a stop."""
from __future__ import annotations

from tokenizers import Tokenizer

PROMPT_CONTEXT = 5  # prompt tokens used as left context for the first generated token
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        ctx = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._ids: list[int] = ctx  # context tail + generated ids
        self._prefix_offset = 0  # window start
        self._read_offset = len(ctx)  # tokens before this are already in ``text``
        self.text = ""  # all generated text so far (stop string already applied)
        self.stopped_by: str | None = None  # the stop string that matched, once one did
        self._emitted = 0  # characters of ``text`` already handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> None:
        """Append one generated token; updates ``text`` and, when a stop string appears, ``stopped_by``."""
        prefix_ids, new_ids = self.push(token_id)
        self.resolve(self._decode(prefix_ids), self._decode(new_ids))

    def push(self, token_id: int) -> tuple[list[int], list[int]]:
        """Append one token -> the two windows (before it, with it) whose decodes ``resolve`` takes (batched a step)."""
        if self.stopped_by is not None:
            raise RuntimeError("add_token after a stop string matched")
        self._ids.append(int(token_id))
        return self._ids[self._prefix_offset:self._read_offset], self._ids[self._prefix_offset:]

    def resolve(self, prefix_text: str, new_text: str) -> None:
        """Take the decodes of ``push``'s windows: extend ``text`` unless a character is still incomplete."""
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return  # incomplete character (or nothing printable yet): wait for more tokens
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        old_len = len(self.text)
        self.text += delta
        self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        if not self.stop:
            return
        start = max(0, old_len - self.hold_back)  # a stop may straddle old and new text
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped_by = s

    def visible_text(self, finished: bool) -> str:
        """Text that can be shown: everything once finished or stopped, else minus the held-back tail."""
        if finished or self.stopped_by is not None or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]

    def take_delta(self, finished: bool) -> str:
        """Visible text not handed out before (the streaming delta)."""
        visible = self.visible_text(finished)
        delta = visible[self._emitted:]
        self._emitted = len(visible)
        return delta


def detokenize_step(tokenizer: Tokenizer, detoks: list[IncrementalDetokenizer], tokens: list[int]) -> None:
    """``add_token`` for many sequences, decoded in this thread (``decode_batch``'s pool costs more than this)."""
    decode = tokenizer.decode
    for d, t in zip(detoks, tokens):
        prefix, full = d.push(t)
        d.resolve(decode(prefix, skip_special_tokens=d.skip_special_tokens),
                  decode(full, skip_special_tokens=d.skip_special_tokens))
