"""engram.bench.stats and engram.bench.report on synthetic arms with known answers.

The synthetic arms share one run counter, so a planted drift depends on the order the runner really
used; noise comes from seeded numpy Generators, so every case is reproducible.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engram.bench import report
from engram.bench.stats import (AA_LABEL, ABConfig, Arm, analyze, block_means, compare, median_ci, plot_runs,
                                run_interleaved, schedule, timed, verdict)


class Bench:
    """Two synthetic arms: sample = base * (1 + drift * run_index) * (1 + noise * N(0, 1))."""

    def __init__(self, seed: int, noise: float = 0.0, drift: float = 0.0):
        self.rng = np.random.default_rng(seed)
        self.noise, self.drift, self.t = noise, drift, 0
        self.calls: list[str] = []

    def arm(self, name: str, base: float) -> Arm:
        def measure() -> float:
            self.t += 1
            self.calls.append(name)
            return base * (1 + self.drift * self.t) * (1 + self.noise * self.rng.standard_normal())
        return Arm(name, measure)


def run(a_base: float, b_base: float, seed: int = 0, noise: float = 0.0, drift: float = 0.0, **cfg):
    bench = Bench(seed, noise, drift)
    cfg.setdefault("warmup", 0)
    return run_interleaved(bench.arm("a", a_base), bench.arm("b", b_base), ABConfig(**cfg)), bench


def test_schedule_abba_is_palindromic_in_blocks_and_abab_is_not():
    seq = schedule(["A", "A'", "B"], 4, "abba")
    assert [label for label, _ in seq] == ["A", "A'", "B", "B", "A'", "A"] * 2
    assert [r for _, r in seq] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert [label for label, _ in schedule(["A", "B"], 3, "abab")] == ["A", "B"] * 3
    # every arm's mean position inside a block is the same under abba, not under abab
    for order, equal in (("abba", True), ("abab", False)):
        pos = {}
        for i, (label, _) in enumerate(schedule(["A", "A'", "B"], 2, order)):
            pos.setdefault(label, []).append(i)
        means = {np.mean(p) for p in pos.values()}
        assert (len(means) == 1) == equal, (order, pos)


@pytest.mark.parametrize("seed", range(8))
def test_identical_arms_give_no_difference(seed):
    res, _ = run(1.0, 1.0, seed=seed, noise=0.02, repeats=20)
    assert res.verdict.startswith("no difference detectable"), res.verdict
    ab = res.comparisons["B/A"]
    assert ab.ci_lo <= 0.0 <= ab.ci_hi or max(abs(ab.ci_lo), abs(ab.ci_hi)) <= \
        max(abs(res.comparisons["A'/A"].ci_lo), abs(res.comparisons["A'/A"].ci_hi))


@pytest.mark.parametrize("seed", range(4))
def test_planted_five_percent_shift_is_found_with_its_sign(seed):
    faster, _ = run(1.0, 0.95, seed=seed, noise=0.005, repeats=10)  # B takes 5 % less time
    assert faster.verdict.startswith("B faster by"), faster.verdict
    ab = faster.comparisons["B/A"]
    assert ab.ci_lo <= ab.estimate <= ab.ci_hi < 0
    assert abs(ab.estimate + 0.05) < 0.01
    slower, _ = run(1.0, 1.05, seed=seed, noise=0.005, repeats=10)
    assert slower.verdict.startswith("B slower by"), slower.verdict
    assert abs(slower.comparisons["B/A"].estimate - 0.05) < 0.01
    # the same samples read as a throughput: more is better, so 5 % more is faster
    thru, _ = run(1.0, 1.05, seed=seed, noise=0.005, repeats=10, higher_is_better=True)
    assert thru.verdict.startswith("B faster by"), thru.verdict
    assert thru.comparisons["B/A"].estimate == slower.comparisons["B/A"].estimate


def test_abba_cancels_planted_linear_drift_and_abab_does_not():
    # noise-free: 2 % drift per run, arms identical. ABBA: every block's paired ratio is exactly 1.
    abba, _ = run(1.0, 1.0, drift=0.02, repeats=10, order="abba")
    ab = abba.comparisons["B/A"]
    assert abba.verdict.startswith("no difference detectable"), abba.verdict
    assert abs(ab.estimate) < 1e-12 and abs(ab.ci_lo) < 1e-12 and abs(ab.ci_hi) < 1e-12
    assert not abba.warnings
    # ABAB: B always runs after A, so the same drift reads as "B slower", and the A/A control says so too
    abab, _ = run(1.0, 1.0, drift=0.02, repeats=10, order="abab")
    assert abab.verdict.startswith("B slower by"), abab.verdict
    assert any("A/A control differs" in w for w in abab.warnings), abab.warnings
    # with noise and a real 5 % gain on top of the drift, ABBA still recovers it
    res, _ = run(1.0, 0.95, seed=3, noise=0.003, drift=0.01, repeats=20)
    assert res.verdict.startswith("B faster by"), res.verdict
    assert abs(res.comparisons["B/A"].estimate + 0.05) < 0.005
    assert res.stats["A"].rel_iqr > 0.1  # the drift is far larger than the effect, per arm


def test_bootstrap_is_reproducible_with_its_seed():
    rng = np.random.default_rng(7)
    a, b = 1 + 0.03 * rng.standard_normal(16), 1.02 + 0.03 * rng.standard_normal(16)
    c1 = compare(b, a, ABConfig(repeats=16, seed=11))
    c2 = compare(b, a, ABConfig(repeats=16, seed=11))
    c3 = compare(b, a, ABConfig(repeats=16, seed=12))
    assert (c1.ci_lo, c1.ci_hi) == (c2.ci_lo, c2.ci_hi)
    assert (c1.ci_lo, c1.ci_hi) != (c3.ci_lo, c3.ci_hi)
    assert c1.estimate == c3.estimate  # the point estimate does not depend on the bootstrap
    assert c1.block_ratios == pytest.approx(list(block_means(b, 2) / block_means(a, 2)))


def test_median_ci_brackets_the_median_and_narrows_with_the_spread():
    cfg = ABConfig(seed=3)
    assert median_ci([1.07] * 10, cfg) == (1.07, 1.07)  # no spread, no width
    rng = np.random.default_rng(5)
    wide, narrow = 1 + 0.1 * rng.standard_normal(20), 1 + 0.01 * rng.standard_normal(20)
    lo, hi = median_ci(wide, cfg)
    assert lo < np.median(wide) < hi and median_ci(wide, cfg) == (lo, hi)  # reproducible with its seed
    nlo, nhi = median_ci(narrow, cfg)
    assert nhi - nlo < (hi - lo) / 5
    # compare's interval is median_ci of its block ratios
    a, b = 1 + 0.03 * rng.standard_normal(16), 1.02 + 0.03 * rng.standard_normal(16)
    c = compare(b, a, ABConfig(repeats=16, seed=3))
    assert (c.ci_lo + 1, c.ci_hi + 1) == pytest.approx(median_ci(c.block_ratios, ABConfig(repeats=16, seed=3)))


def test_unstable_machine_warns_through_the_aa_control():
    rng = np.random.default_rng(0)
    a = 1 + 0.002 * rng.standard_normal(10)
    samples = {"A": a, AA_LABEL: a * 1.03, "B": a * 1.02}  # the "same" arm differs by 3 %
    res = analyze(samples, ABConfig(repeats=10))
    assert any("not stable enough" in w for w in res.warnings)
    # B/A's +2 % lies inside the A/A envelope of ~3 %, so no claim is made
    assert res.verdict.startswith("no difference detectable"), res.verdict


def test_verdict_without_control_and_with_few_blocks_says_so():
    res, _ = run(1.0, 0.9, repeats=4, aa=False)
    assert AA_LABEL not in res.samples and list(res.comparisons) == ["B/A"]
    assert res.verdict.startswith("B faster by 10.00 %"), res.verdict
    assert any("no A/A control" in w for w in res.warnings)
    assert any("only 2 blocks" in w for w in res.warnings)


def test_restart_starts_one_fresh_service_per_segment():
    events, live = [], set()

    def arm(name: str) -> Arm:
        def start():
            assert not live, f"{name} started while {live} still up"
            live.add(name)
            events.append(f"start {name}")

        def stop():
            live.discard(name)
            events.append(f"stop {name}")

        def measure():
            assert live == {name}
            events.append(f"run {name}")
            return 1.0
        return Arm(name, measure, start, stop)

    res = run_interleaved(arm("a"), arm("b"), ABConfig(repeats=4, warmup=1, restart=True))
    # segments: A | A' | B B | A' | A A | A' | B B | A' | A  -> 9 starts, each followed by a warm-up
    assert events.count("start a") == 7 and events.count("start b") == 2
    assert events.count("stop a") == 7 and events.count("stop b") == 2 and not live
    assert sum(r.round < 0 for r in res.runs) == 9
    assert all(len(x) == 4 for x in res.samples.values())

    events.clear()
    def logged(name: str) -> Arm:
        return Arm(name, lambda: 1.0, lambda: events.append(f"start {name}"), lambda: events.append(f"stop {name}"))
    shared = run_interleaved(logged("a"), logged("b"), ABConfig(repeats=4, warmup=2))
    assert events == ["start a", "start b", "stop b", "stop a"]
    assert [r.arm for r in shared.runs if r.round < 0] == ["A", "A", AA_LABEL, AA_LABEL, "B", "B"]


def test_failing_arm_names_itself_and_stops_services():
    stopped = []

    def boom():
        raise RuntimeError("engine crashed")
    with pytest.raises(RuntimeError, match="engine crashed") as info:
        run_interleaved(Arm("a", lambda: 1.0, stop=lambda: stopped.append("a")),
                        Arm("b", boom, stop=lambda: stopped.append("b")), ABConfig(repeats=2, warmup=0))
    assert any("arm B ('b'), round 0" in n for n in info.value.__notes__)
    assert sorted(stopped) == ["a", "b"]


def test_bad_samples_and_config_raise_naming_the_field():
    with pytest.raises(ValueError, match="arm B: samples must be finite and > 0"):
        compare([1.0, 0.0], [1.0, 1.0], ABConfig(repeats=2))
    with pytest.raises(ValueError, match=r"arm A' has 8 samples but ABConfig.repeats=10"):
        analyze({"A": [1.0] * 10, "A'": [1.0] * 8, "B": [1.0] * 10}, ABConfig(repeats=10))
    with pytest.raises(ValueError, match="samples lack arm 'B'"):
        analyze({"A": [1.0] * 2}, ABConfig(repeats=2))
    with pytest.raises(ValueError, match="arm B has 3 rounds but arm A has 2"):
        compare([1.0, 1.0, 1.0], [1.0, 1.0], ABConfig(repeats=2))
    for kwargs, field in (({"order": "aabb"}, "order"), ({"repeats": 5}, "repeats=5"),
                          ({"repeats": 1, "order": "abab"}, "repeats=1"), ({"warmup": -1}, "warmup"),
                          ({"confidence": 1.0}, "confidence"), ({"n_boot": 10}, "n_boot")):
        with pytest.raises(ValueError, match=f"ABConfig.{field}"):
            ABConfig(**kwargs)
    ABConfig(repeats=5, order="abab")  # odd is fine when a block is one round


def test_timed_measures_wall_time():
    import time
    t = timed(lambda: time.sleep(0.01))()
    assert 0.009 < t < 1.0


def test_result_json_table_and_plot(tmp_path):
    res, _ = run(1.0, 0.95, seed=1, noise=0.005, repeats=6, warmup=1)
    doc = res.to_dict()
    assert doc["verdict"] == res.verdict and len(doc["runs"]) == 3 * 6 + 3
    assert doc["samples"]["B"] == [r["value"] for r in doc["runs"] if r["arm"] == "B" and r["round"] >= 0]
    table = res.table()
    assert "B/A" in table and "A'/A" in table and f"verdict: {res.verdict}" in table
    path = report.write_result("ab-test", {"what": "synthetic"}, doc, results_dir=tmp_path)
    assert path.parent == tmp_path and path.name.endswith("-ab-test.json")
    saved = json.loads(path.read_text())
    assert saved["result"]["comparisons"]["B/A"]["estimate"] == res.comparisons["B/A"].estimate
    assert set(saved) == {"name", "date", "git", "machine", "config", "result"}
    assert saved["machine"]["cpu_count"] >= 1 and set(saved["git"]) == {"commit", "dirty"}
    again = report.write_result("ab-test", {}, {}, results_dir=tmp_path)
    assert again != path  # two runs in one second do not overwrite each other
    plot_runs(res, str(tmp_path / "runs.png"))
    assert (tmp_path / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_table_aligns_and_rejects_bad_names(tmp_path):
    text = report.format_table([{"arm": "A", "ms": 1.5}, {"arm": "long name", "ms": 12.25, "extra": None}])
    lines = text.splitlines()
    assert lines[0].split() == ["arm", "ms", "extra"]
    assert lines[2].startswith("A ") and lines[3].startswith("long name")
    assert lines[2].index("1.5") + 3 == lines[3].index("12.25") + 5  # right-aligned numbers
    with pytest.raises(ValueError, match="result name='../x'"):
        report.result_path("../x")
    with pytest.raises(TypeError, match="JSON cannot store"):
        report.write_result("x", {"bad": object()}, {}, results_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_a_run_without_out_writes_to_the_temporary_directory_not_the_working_tree(tmp_path, monkeypatch):
    import tempfile

    from engram.cli import main

    assert report.RESULTS_DIR == Path(tempfile.gettempdir()) / "engram-bench"
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "tmp")  # where the default lands, for this test
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert main(["bench", "ab", "--a", "echo 1", "--b", "echo 1", "--repeats", "2", "--warmup", "0", "--no-aa"]) == 0
    assert list(work.iterdir()) == [] and [p.name[-8:] for p in (tmp_path / "tmp").iterdir()] == ["-ab.json"]


def test_verdict_words_follow_the_ci_not_the_estimate():
    from engram.bench.stats import Comparison
    aa = Comparison("A'", "A", 0.0, -0.01, 0.01, 0.95, 10)
    inside = Comparison("B", "A", -0.02, -0.03, -0.005, 0.95, 10)  # excludes 0 but reaches into A/A noise
    assert verdict(inside, aa)[0].startswith("no difference detectable")
    assert verdict(inside, None)[0].startswith("B faster by 2.00 % (95 % CI 0.50…3.00 %)")


def test_git_commit_comes_from_the_environment_when_set_even_inside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_COMMIT", "abc123")  # a copied tree's .git may be stale: the named commit wins
    assert report.git_commit(cwd=tmp_path) == {"commit": "abc123", "dirty": None}
    assert report.git_commit() == {"commit": "abc123", "dirty": None}
    monkeypatch.delenv("ENGRAM_COMMIT")
    assert report.git_commit(cwd=tmp_path)["commit"] is None  # not a checkout, nothing named
    if (Path(report.__file__).resolve().parents[2] / ".git").exists():  # run from a checkout: its own HEAD
        inside = report.git_commit()
        assert len(inside["commit"]) == 40 and inside["dirty"] in (True, False)
