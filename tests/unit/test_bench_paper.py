"""`engram bench paper` on the CPU with the tiny preset, end to end through the CLI: every arm (no Engram, gpu, host,
disk, disk with a hot-row cache) decodes the same seeded forced sequences, the result JSON holds the per-block tok/s,
the ratios with intervals and the A/A control, one full run per arm and the paper's H800 numbers, and the Engram arms'
argmax and logprobs agree bitwise. Also the workload's draw (natural continuations, seeded lengths) and bad options."""
import json

import numpy as np
import pytest

from engram.bench import paper
from engram.bench.corpus import LengthRange
from engram.bench.serve_workload import model_tokenizer, token_stream
from engram.cli import main

FAST = ["--num-seqs", "4", "--block-seqs", "4", "--repeats", "2", "--warmup", "0", "--input-len", "8:24",
        "--output-len", "4:12", "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--cache-rows", "64",
        "--quiet"]


def test_draw_is_seeded_natural_text_with_its_own_continuation():
    stream = token_stream(model_tokenizer("tiny"))
    a = paper.draw(stream, 6, LengthRange(10, 40), LengthRange(3, 9), seed=3)
    assert a == paper.draw(stream, 6, LengthRange(10, 40), LengthRange(3, 9), seed=3)
    assert a != paper.draw(stream, 6, LengthRange(10, 40), LengthRange(3, 9), seed=4)
    text = stream.ids.tolist() * 2  # wrapping
    for s in a:
        assert 10 <= len(s.prompt_ids) <= 40 and 3 <= len(s.forced_ids) <= 9
        whole = s.prompt_ids + s.forced_ids
        starts = np.flatnonzero(stream.ids == whole[0])
        assert any(text[i:i + len(whole)] == whole for i in starts), "forced ids are not the prompt's continuation"


def test_paper_end_to_end_json_and_tier_agreement(tmp_path, capsys):
    out = tmp_path / "paper.json"
    assert main(["bench", "paper", *FAST, "--cache-dir", str(tmp_path / "tables"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    r = doc["result"]
    assert doc["machine"] and doc["config"]["num_seqs"] == 4
    assert list(r["arms"]) == list(paper.ARMS)
    assert r["arms"]["disk-cache"] == {"tier": "disk", "cache_rows": 64}
    pairs = [(c["a"], c["b"]) for c in r["comparisons"]]
    assert pairs == [("none", "gpu"), ("none", "host"), ("none", "disk"), ("none", "disk-cache"), ("gpu", "host")]
    for c in r["comparisons"]:
        ab = c["ab"]
        assert set(ab["samples"]) == {"A", "A'", "B"} and all(len(v) == 2 and min(v) > 0
                                                           for v in ab["samples"].values())
        assert set(ab["comparisons"]) == {"B/A", "A'/A"}
        assert ab["comparisons"]["B/A"]["ci_lo"] <= ab["comparisons"]["B/A"]["ci_hi"]
    assert all(r["headline"][a]["tok_s"] > 0 for a in paper.ARMS)
    assert set(r["headline_ratios"]) == {f"{a}/none" for a in paper.ARMS[1:]}
    assert r["tier_check"]["equal"] and r["tier_check"]["arms"] == list(paper.ARMS[1:])
    assert r["tier_check"]["tokens"] >= 4 * 4
    assert r["paper_h800"]["4b-like"]["none"] == 9031.62 and r["paper_h800"]["8b-like"]["host"] == 6140.02
    assert 4 * 4 <= r["workload"]["output_tokens"] <= 4 * 12
    assert "gpu:host" in printed and "bitwise equal" in printed


def test_tier_check_names_the_first_difference():
    from engram.engine.outputs import CompletionOutput
    from engram.engine.step import TokenLogprobs

    def out(lp: float):
        return CompletionOutput(0, "", [5, 6], logprobs=[TokenLogprobs(5, -1.0, [(5, -1.0)]),
                                                         TokenLogprobs(6, lp, [(7, -0.5)])])
    assert paper.check_tiers({"gpu": [out(-2.0)], "host": [out(-2.0)]})["equal"]
    with pytest.raises(paper.TierMismatch, match="arms gpu and disk: sequence 0 token 1"):
        paper.check_tiers({"gpu": [out(-2.0)], "disk": [out(-2.0000001)]})


@pytest.mark.parametrize("argv, message", [
    (["--arms", "gpu,hots"], "--arms"),
    (["--arms", "gpu,host", "--pairs", "gpu:none"], "--pairs"),
    (["--input-len", "0:5"], "--input-len"),
    (["--repeats", "3"], "repeats"),
    (["--block-seqs", "0"], "--block-seqs"),
])
def test_bad_options_stop_before_anything_loads(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "paper", *FAST, *argv])


def test_every_run_starts_with_an_empty_prefix_cache():
    """A block run twice on one engine (A then A' of a round) finds none of its prompt blocks the second time."""
    import torch

    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.model.loader import random_model
    from engram.model.presets import preset_config

    stream = token_stream(model_tokenizer("tiny"))
    seqs = paper.draw(stream, 3, LengthRange(40, 60), LengthRange(3, 6), seed=1)
    loaded = random_model(preset_config("tiny"), "gpu", torch.float32, torch.device("cpu"), 0, progress=False)
    engine = LLMEngine(loaded, EngineConfig.from_options({"max_num_seqs": 4, "max_num_batched_tokens": 256,
                                                          "max_model_len": 128, "enforce_eager": True}),
                       torch.device("cpu"), torch.float32)
    assert engine.stats()["prefix_cache"]["enabled"]
    first = paper.generate(engine, seqs, "a")[1]
    second = paper.generate(engine, seqs, "b")[1]
    assert engine.stats()["prefix_cache"]["hit_blocks"] == 0
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_a_pair_and_the_headlines_run_in_separate_commands(tmp_path, capsys):
    """--no-headline runs only the pairs; --pairs '' only the headline runs and the tier check (a long experiment in
    two commands, each within a time limit)."""
    base = [*FAST, "--arms", "gpu,host", "--cache-dir", str(tmp_path / "tables")]
    pair_argv = ["bench", "paper", *base, "--pairs", "gpu:host", "--no-headline", "--out", str(tmp_path / "p.json")]
    assert main(pair_argv) == 0
    pair = json.loads((tmp_path / "p.json").read_text())["result"]
    assert [(c["a"], c["b"]) for c in pair["comparisons"]] == [("gpu", "host")]
    assert pair["headline"] == {} and pair["tier_check"] is None
    assert main(["bench", "paper", *base, "--pairs", "", "--out", str(tmp_path / "h.json")]) == 0
    head = json.loads((tmp_path / "h.json").read_text())["result"]
    assert head["comparisons"] == [] and set(head["headline"]) == {"gpu", "host"}
    assert head["tier_check"]["equal"] and "bitwise equal" in capsys.readouterr().out
