"""benchmarks/serve_ab.py end to end on the CPU: one round of A, B, A' of `engram bench serve` against real tiny
servers, each arm's server started with the shared ``--serve-args`` and then its own options, the summary's medians
and ratios computed from the arms' own results; the ``--serve-args`` split and a bad ``--rounds``."""
from __future__ import annotations

import json

import pytest

from benchmarks import serve_ab

pytestmark = pytest.mark.timeout(300)

BENCH = ["--model", "tiny", "--threads", "1", "--input-len", "20:40", "--output-len", "3:6", "--num-prompts", "4",
         "--warmup", "1", "--concurrency", "2", "--no-roofline"]


def test_one_round_runs_a_b_a_prime_with_each_arms_server_options(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "engram-cache"))
    out = tmp_path / "summary.json"
    rc = serve_ab.main(["--rounds", "1", "--a-serve-args", "--max-waiting 7", "--b-serve-args=--prompt-prefetch",
                        "--dir", str(tmp_path), "--out", str(out), "--", *BENCH, "--serve-args=--max-model-len 512"])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["serve_args"] == "--max-model-len 512" and "--serve-args=--max-model-len 512" not in \
        summary["bench_args"]
    own = {"A": ["--max-waiting", "7"], "B": ["--prompt-prefetch"], "A'": ["--max-waiting", "7"]}
    for arm, file in (("A", "A-0.json"), ("B", "B-0.json"), ("A'", "A2-0.json")):
        doc = json.loads((tmp_path / file).read_text())
        assert doc["config"]["server_args"][-2 - len(own[arm]):] == ["--max-model-len", "512", *own[arm]], arm
        result = doc["result"]
        assert result["errors"] == 0 and result["requests"] == 4, (arm, result.get("error_samples"))
        [row] = summary["rounds"][arm]
        assert row["exit_status"] == 0 and row["output_tokens_per_s"] == result["output_tokens_per_s"] > 0
        assert summary["median"][arm]["output_tokens_per_s"] == row["output_tokens_per_s"]
    med = summary["median"]
    for ratio, (x, y) in (("B/A", ("B", "A")), ("A'/A", ("A'", "A"))):
        assert summary[ratio]["tpot_p50_s"] == pytest.approx(med[x]["tpot_p50_s"] / med[y]["tpot_p50_s"])


def test_serve_args_split_from_the_bench_options():
    rest, shared = serve_ab.split_serve_args(["--model", "tiny", "--serve-args", "--tier host", "--concurrency", "4"])
    assert rest == ["--model", "tiny", "--concurrency", "4"] and shared == "--tier host"
    assert serve_ab.split_serve_args(["--model", "tiny"]) == (["--model", "tiny"], "")


def test_rounds_below_one_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        serve_ab.main(["--rounds", "0", "--dir", str(tmp_path), "--out", str(tmp_path / "s.json"), "--", *BENCH])
    assert e.value.code == 2 and "--rounds=0 must be >= 1" in capsys.readouterr().err
