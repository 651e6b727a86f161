"""Incremental detokenization for streaming: deltas add up to the full decode; stop strings never leak."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

import engram
from engram.engine.detokenizer import IncrementalDetokenizer

TOKENIZER = Tokenizer.from_file(str(Path(engram.__file__).parent / "model" / "assets" / "tokenizer.json"))
TEXT = "Naïve café — 日本語 😀 tokens: the engine's\tstreaming text, \"quoted\" and spaced   out."


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = []
    for i, t in enumerate(ids):
        detok.add_token(t)
        done = detok.stopped_by is not None or i == len(ids) - 1
        deltas.append(detok.take_delta(done))
        if detok.stopped_by is not None:
            break
    return deltas


def test_deltas_concatenate_to_the_full_decode_with_multibyte_characters():
    prompt = TOKENIZER.encode("Prompt:").ids
    ids = TOKENIZER.encode(TEXT).ids
    assert len(ids) > 20
    deltas = stream(IncrementalDetokenizer(TOKENIZER, prompt, []), ids)
    assert "".join(deltas) == TOKENIZER.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # split UTF-8 characters wait for their last byte


def test_stop_string_is_cut_and_never_streamed():
    ids = TOKENIZER.encode(TEXT).ids
    detok = IncrementalDetokenizer(TOKENIZER, [], ["streaming"])
    deltas = stream(detok, ids)
    assert detok.stopped_by == "streaming"
    assert "".join(deltas) == detok.text == TEXT[: TEXT.index("streaming")]
    assert all("stream" not in d for d in deltas)


def test_stop_string_included_when_asked_and_earliest_stop_wins():
    ids = TOKENIZER.encode(TEXT).ids
    detok = IncrementalDetokenizer(TOKENIZER, [], ["text", "café"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert detok.stopped_by == "café"
    assert "".join(deltas) == "Naïve café"


def test_held_back_tail_is_released_when_finished():
    hold = "xyz-not-there"
    ids = TOKENIZER.encode(TEXT).ids
    detok = IncrementalDetokenizer(TOKENIZER, [], [hold])
    deltas = stream(detok, ids)
    assert detok.stopped_by is None
    before_last = TOKENIZER.decode(ids[:-1])
    assert "".join(deltas[:-1]) == before_last[: len(before_last) - (len(hold) - 1)]
    assert "".join(deltas) == TEXT


def test_batched_step_detokenization_equals_one_token_at_a_time():
    from tokenizers import Tokenizer

    from engram.engine.detokenizer import IncrementalDetokenizer, detokenize_step
    from engram.model.presets import TOKENIZER_FILE

    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    texts = ["The table store serves rows, «ünïcødé» and 漢字 too.", "stop here ### and more",
             "<|eos|> special"]
    seqs = [tok.encode(t).ids for t in texts]
    skips = [True, False, True]  # one batch mixes both settings
    one = [IncrementalDetokenizer(tok, [5, 6], ["###"], skip_special_tokens=k) for k in skips]
    many = [IncrementalDetokenizer(tok, [5, 6], ["###"], skip_special_tokens=k) for k in skips]
    for step in range(max(map(len, seqs))):
        live = [i for i, s in enumerate(seqs) if step < len(s) and one[i].stopped_by is None]
        for i in live:
            one[i].add_token(seqs[i][step])
        detokenize_step(tok, [many[i] for i in live], [seqs[i][step] for i in live])
        for i in live:
            assert (many[i].text, many[i].stopped_by) == (one[i].text, one[i].stopped_by)
    assert one[1].stopped_by == "###" and "漢字" in one[0].text
