"""The natural-text corpus: stdlib prose extraction, seeded requests with exact token lengths, the
checksummed file, and the committed corpus the published hit-rate numbers use."""
import json
from pathlib import Path

import numpy as np
import pytest

from engram.bench import corpus_source
from engram.bench.corpus import (CorpusError, LengthRange, checksum_path, encode_corpus, generate_corpus,
                                 load_corpus, load_tokenizer, token_stats, write_corpus)
from engram.cli import main

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "bench" / "corpus" / "natural-v1.jsonl"


@pytest.fixture(scope="module")
def builtin():
    return load_tokenizer("builtin")


@pytest.fixture(scope="module")
def small(builtin):
    return generate_corpus(6, seed=3, prompt_tokens=LengthRange(40, 160), continuation_tokens=LengthRange(30, 90),
                           tok=builtin)


def test_is_prose_keeps_sentences_and_drops_code():
    assert corpus_source.is_prose("Return the number of items in the queue, or zero when it is empty.")
    assert not corpus_source.is_prose(">>> len(queue) returns the number of items in the queue")
    assert not corpus_source.is_prose("x = {k: v for k, v in items if v is not None} # [a] | b")
    assert not corpus_source.is_prose("Too short to count.")


def test_file_paragraphs_in_source_order_and_documents_drop_repeats(tmp_path):
    (tmp_path / "a.py").write_text(
        '"""Module text that explains what this small module is for, in words."""\n'
        "# A comment block that says, in plain words, what the next function does\n"
        "# and continues on a second line of the same paragraph.\n"
        "def f():\n"
        '    """Function text: it returns nothing at all, and it does so quickly."""\n'
        "    return None  # trailing comments are code annotations, not prose\n")
    (tmp_path / "b.py").write_text('"""Module text that explains what this small module is for, in words."""\n'
                                   "def broken(:\n")  # a file Python cannot parse has no paragraphs
    (tmp_path / "c.py").write_text('"""Module text that explains what this small module is for, in words."""\n'
                                   '"""x"""\n')
    paras = corpus_source.file_paragraphs(tmp_path, "a.py")
    assert paras == ["Module text that explains what this small module is for, in words.",
                     "A comment block that says, in plain words, what the next function does and continues on a "
                     "second line of the same paragraph.",
                     "Function text: it returns nothing at all, and it does so quickly."]
    assert corpus_source.file_paragraphs(tmp_path, "b.py") == []
    docs = list(corpus_source.documents(["a.py", "b.py", "c.py"], tmp_path))
    assert [rel for rel, _ in docs] == ["a.py"]  # c.py only repeats a.py's module docstring
    assert docs[0][1] == "\n\n".join(paras)


def test_stdlib_files_skip_tests_and_codecs():
    files = corpus_source.stdlib_files()
    assert "json/decoder.py" in files and files == sorted(files)
    assert not [f for f in files if f.startswith(("test/", "encodings/")) or "/tests/" in f]


def test_same_seed_same_bytes_other_seed_other_text(builtin, small):
    again = generate_corpus(6, seed=3, prompt_tokens=LengthRange(40, 160), continuation_tokens=LengthRange(30, 90),
                            tok=builtin)
    assert again.to_bytes() == small.to_bytes()
    other = generate_corpus(6, seed=4, prompt_tokens=LengthRange(40, 160), continuation_tokens=LengthRange(30, 90),
                            tok=builtin)
    assert other.to_bytes() != small.to_bytes()
    assert {r.prompt for r in other.requests}.isdisjoint(r.prompt for r in small.requests)


def test_lengths_are_exact_and_within_the_ranges(builtin, small):
    encoded = encode_corpus(small, builtin)  # raises if a recorded count differs from the text's encoding
    for r, (p, c) in zip(small.requests, encoded):
        assert 40 <= r.prompt_tokens <= 160 and 30 <= r.continuation_tokens <= 90
        assert (p.size, c.size) == (r.prompt_tokens, r.continuation_tokens)
        assert r.prompt[:1].strip() and r.continuation[:1].isspace()  # cut at a word boundary
    assert len({r.prompt_tokens for r in small.requests}) > 3  # drawn, not fixed
    assert small.header["tokens"] == sum(p.size + c.size for p, c in encoded)


def test_requests_follow_the_stream_without_reusing_text(small):
    texts = [r.prompt + r.continuation for r in small.requests]
    assert len(set(texts)) == len(texts)
    for r in small.requests:
        assert r.sources and all(s.endswith(".py") for s in r.sources)


def test_text_is_natural_not_degenerate(builtin, small):
    stats = token_stats(encode_corpus(small, builtin))
    assert stats["top_token_share"] < 0.1
    assert stats["top_4gram_share"] < 0.02
    assert stats["distinct_tokens"] > 0.2 * stats["tokens"] ** 0.9
    stuck = token_stats([(np.full(50, 7), np.full(50, 7))])  # what a random-weight model emits
    assert stuck["top_token_share"] == 1.0 and stuck["top_4gram_share"] == 1.0


def test_write_and_load_round_trip(tmp_path, small):
    path = tmp_path / "c.jsonl"
    digest = write_corpus(small, path)
    assert checksum_path(path).read_text() == f"{digest}  c.jsonl\n"
    loaded = load_corpus(path)
    assert loaded.header == small.header and loaded.requests == small.requests and loaded.sha256 == digest


def test_tampered_or_unrecorded_file_is_refused_by_name(tmp_path, small):
    path = tmp_path / "c.jsonl"
    write_corpus(small, path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match=r"corpus .*c\.jsonl: SHA-256 [0-9a-f]{64} does not match"):
        load_corpus(path)
    checksum_path(path).unlink()
    with pytest.raises(CorpusError, match=r"c\.jsonl: no recorded SHA-256 at .*c\.sha256"):
        load_corpus(path)


def test_malformed_lines_name_the_line_and_field(tmp_path, small):
    path = tmp_path / "bad.jsonl"
    lines = small.to_bytes().decode().splitlines()
    req = json.loads(lines[2])
    req["prompt_tokens"] = "many"
    lines[2] = json.dumps(req)
    path.write_text("\n".join(lines) + "\n")
    import hashlib
    with pytest.raises(CorpusError, match=r"line 3 field 'prompt_tokens'='many': expected int"):
        load_corpus(path, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    path.write_text("\n".join(lines[:3]) + "\n")
    with pytest.raises(CorpusError, match=r"header requests=6 but the file holds 2 request lines"):
        load_corpus(path, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def test_encode_checks_counts_only_for_its_own_tokenizer(builtin, small, minilm_tokenizer_path):
    from dataclasses import replace
    bad = replace(small, requests=[replace(small.requests[0], prompt_tokens=small.requests[0].prompt_tokens + 1)]
                  + small.requests[1:])
    with pytest.raises(CorpusError, match=r"request 0: prompt_tokens=\d+ recorded, but its text encodes to"):
        encode_corpus(bad, builtin)
    other = encode_corpus(small, load_tokenizer(str(minilm_tokenizer_path)))  # same text, its own counts
    assert len(other) == len(small.requests) and all(p.size and c.size for p, c in other)
    assert [p.size for p, _ in other] != [r.prompt_tokens for r in small.requests]


def test_length_range_and_tokenizer_errors_name_the_value():
    assert LengthRange.parse("100:1024") == LengthRange(100, 1024) and LengthRange.parse("64") == LengthRange(64, 64)
    for text in ("1024:100", "a:b", "0:5", "1:2:3"):
        with pytest.raises(ValueError, match=f"--prompt-tokens={text!r}"):
            LengthRange.parse(text, "--prompt-tokens")
    with pytest.raises(ValueError, match=r"tokenizer='pkg:no_such_package_xyz/t.json'"):
        load_tokenizer("pkg:no_such_package_xyz/t.json")
    with pytest.raises(ValueError, match=r"requests=0"):
        generate_corpus(0, 0, LengthRange(10, 20), LengthRange(10, 20), load_tokenizer("builtin"))


def test_cli_writes_corpus_and_checksum(tmp_path, capsys):
    out = tmp_path / "cli.jsonl"
    assert main(["bench", "corpus", "--out", str(out), "--requests", "2", "--seed", "1",
                 "--prompt-tokens", "20:40", "--continuation-tokens", "10"]) == 0
    corpus = load_corpus(out)
    assert [r.continuation_tokens for r in corpus.requests] == [10, 10]
    printed = capsys.readouterr().out
    assert json.loads(printed[: printed.index("\n}\n") + 2])["sha256"] == corpus.sha256
    with pytest.raises(SystemExit, match="--continuation-tokens='x'"):
        main(["bench", "corpus", "--out", str(out), "--continuation-tokens", "x"])


def test_committed_corpus_matches_its_checksum_and_counts(builtin):
    corpus = load_corpus(COMMITTED)
    h = corpus.header
    assert h["requests"] == 512 and h["tokenizer"]["sha256"] == builtin.sha256
    assert h["prompt_tokens"] == {"dist": "uniform", "low": 100, "high": 1024} == h["continuation_tokens"]
    stats = token_stats(encode_corpus(corpus, builtin))  # every recorded count re-checked
    assert stats["tokens"] == h["tokens"] and stats["top_token_share"] < 0.1
    assert 100 <= stats["prompt_tokens_min"] and stats["continuation_tokens_max"] <= 1024
