"""benchmarks/plot_paper.py over a committed `engram bench paper` result: the bars are the headline arms then the
paper's H800 arms, the pair rows carry the result's own estimate and intervals, and a non-paper JSON is refused by
name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import plot_paper

RESULT = Path(__file__).resolve().parents[2] / "bench/results/2026-12-04-paper-4b-7c256ab.json"


def test_groups_and_pairs_come_from_the_result_and_the_paper():
    data = plot_paper.load(str(RESULT))
    got = plot_paper.groups([data], ["ours"])
    assert [g[0] for g in got] == ["ours", "paper 4B, H800"]
    assert got[0][1] == {arm: h["tok_s"] for arm, h in data["result"]["headline"].items()}
    assert got[1][1] == {"none": 9031.62, "host": 8858.28}
    (label, est, lo, hi, aa_lo, aa_hi), = plot_paper.pairs([data], ["ours"])
    ab = data["result"]["comparisons"][0]["ab"]["comparisons"]
    assert label == "gpu:host (ours)" and (est, lo, hi) == (ab["B/A"]["estimate"], ab["B/A"]["ci_lo"], ab["B/A"]["ci_hi"])
    assert lo < est < hi and aa_lo < 0 < aa_hi


def test_plot_writes_a_png_and_refuses_other_results(tmp_path):
    out = tmp_path / "paper.png"
    assert plot_paper.main([str(RESULT), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "serve.json"
    other.write_text(json.dumps({"name": "serve", "result": {}}))
    with pytest.raises(SystemExit, match="serve.json: not an `engram bench paper` result"):
        plot_paper.main([str(other), "--out", str(out)])
    with pytest.raises(SystemExit, match="--label given 2 times for 1 results"):
        plot_paper.main([str(RESULT), "--label", "a", "--label", "b", "--out", str(out)])
