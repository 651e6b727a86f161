"""The speculative A/B of ``engram bench engine --speculative-config`` (bench/spec_ab.py) and the acceptance window of
``engram bench serve`` (bench/serve_counters.py): the forced workloads, a real run on the tiny model (CPU) whose
JSON has both arms, the speedup and the acceptance length, and the window arithmetic."""
from __future__ import annotations

import json

from engram.bench.serve_counters import speculative_window
from engram.bench.spec_ab import SPAN, forced_continuations


def test_workloads_quote_the_prompt_or_follow_the_text():
    prompt, natural = list(range(100, 140)), list(range(500, 540))
    assert forced_continuations([prompt], [natural], "natural") == [natural]
    quote = forced_continuations([prompt], [natural], "quote")[0]
    assert quote[:20] == prompt[20:40] and len(quote) == 40
    summary = forced_continuations([prompt], [natural], "summary")[0]
    assert summary[:SPAN] == quote[:SPAN] and summary[SPAN:2 * SPAN] == natural[SPAN:2 * SPAN]


def test_bench_engine_speculative_run_on_the_cpu(tmp_path, capsys):
    from engram.cli import main

    out = tmp_path / "spec.json"
    rc = main(["bench", "engine", "--models", "tiny", "--tiers", "gpu", "--batch-sizes", "2", "--context-len", "64",
               "--decode-steps", "24", "--threads", "1", "--spec-repeats", "2", "--spec-workload", "quote",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}',
               "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["result"]
    (point,) = result["points"]
    assert point["batch"] == 2 and len(point["samples"]["off"]) == len(point["samples"]["spec"]) == 2
    assert point["acceptance_length"] > 2.0 and point["acceptance_rate"] > 0.7  # quoting: n-gram drafts accepted
    assert point["tok_s_spec"] > 0 and point["tok_s_off"] > 0
    dev = point["device"]  # what each arm's steps did (the CPU: eager, no device clock, no verify graphs)
    assert dev["spec"]["steps"] > 0 and dev["spec"]["steps"] < dev["off"]["steps"], dev
    assert set(dev["spec"]["steps_by_route"]) == {"eager"} and dev["spec"]["verify_graph_replays"] == 0, dev
    assert "acceptance_length" in capsys.readouterr().out


def test_speculative_window():
    before = {"speculative": {"method": "ngram", "num_speculative_tokens": 4, "spec_steps": 10, "draft_tokens": 30,
                              "accepted_tokens": 12}}
    after = {"speculative": {"method": "ngram", "num_speculative_tokens": 4, "spec_steps": 20, "draft_tokens": 70,
                             "accepted_tokens": 32}}
    w = speculative_window(before, after)
    assert (w["spec_steps"], w["draft_tokens"], w["accepted_tokens"]) == (10, 40, 20)
    assert w["acceptance_rate"] == 0.5 and w["acceptance_length"] == 3.0
    assert speculative_window({}, {}) is None
    from engram.bench.report import format_table
    from engram.bench.serve_client import summarize
    from engram.bench.serve_load import format_tables

    text = format_tables({**summarize([], 0.1), "counters": {"skipped": "x"}, "roofline": {"skipped": "x"},
                          "speculative": w}, format_table)
    assert "speculative decoding (ngram, K=4): acceptance length 3.00, 20 of 40 drafts accepted (50.0%)" in text
