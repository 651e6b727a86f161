"""`engram bench ab` end to end on real shell commands: numbers, JSON fields, wall times, setup services.

Each test runs the real CLI in a subprocess (``python -m engram.cli``), reads the result JSON it wrote and
checks the verdict against what the commands were built to show.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from engram.bench.ab import json_field, parse_sample


def engram_ab(tmp_path, *args: str, check: bool = True) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "ab.json"
    p = subprocess.run([sys.executable, "-m", "engram.cli", "bench", "ab", "--out", str(out), "--quiet", *args],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if check:
        assert p.returncode == 0, p.stderr
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_bench_lists_ab():
    p = subprocess.run([sys.executable, "-m", "engram.cli", "bench", "--help"], capture_output=True, text=True)
    assert p.returncode == 0 and "ab" in p.stdout and "A/B two shell commands" in p.stdout


def test_two_commands_printing_numbers(tmp_path):
    plot = tmp_path / "runs.png"
    p, doc = engram_ab(tmp_path, "--a", "echo 100", "--b", "echo starting; echo 95", "--repeats", "10",
                       "--plot", str(plot))
    res = doc["result"]
    assert res["verdict"].startswith("B faster by 5.00 % (95 % CI 5.00…5.00 %)")
    assert res["samples"] == {"A": [100.0] * 10, "A'": [100.0] * 10, "B": [95.0] * 10}
    assert [r["arm"] for r in res["runs"][3:9]] == ["A", "A'", "B", "B", "A'", "A"]  # after 3 warm-ups
    assert doc["config"]["a"] == "echo 100" and "commit" in doc["git"] and doc["machine"]["python"]
    assert "verdict: B faster by 5.00 %" in p.stdout and f"result: {tmp_path / 'ab.json'}" in p.stdout
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_json_field_and_throughput_direction(tmp_path):
    a = "echo '{\"runs\": [{\"tok_s\": 200}]}'"
    b = "echo log line; echo '{\"runs\": [{\"tok_s\": 220}]}'"
    _, doc = engram_ab(tmp_path, "--a", a, "--b", b, "--field", "$.runs[0].tok_s", "--higher-is-better",
                       "--repeats", "4", "--order", "abab", "--warmup", "0")
    res = doc["result"]
    assert res["verdict"].startswith("B faster by 10.00 %"), res["verdict"]
    assert res["config"]["order"] == "abab" and len(res["runs"]) == 12


def test_wall_time_of_real_processes(tmp_path):
    _, doc = engram_ab(tmp_path, "--a", "sleep 0.02", "--b", "sleep 0.12", "--wall-time", "--repeats", "4",
                       "--warmup", "0", "--no-aa")
    res = doc["result"]
    assert res["verdict"].startswith("B slower by"), res["verdict"]
    assert res["stats"]["B"]["min"] >= 0.12 and res["stats"]["A"]["min"] >= 0.02
    assert "A'" not in res["samples"]


def _service(tmp_path, name: str, value: int) -> tuple[str, str, str]:
    """A background 'server' that records its pid, publishes a value, then lives until stopped."""
    d = tmp_path / name
    d.mkdir()
    pids, val = shlex.quote(str(d / "pids")), shlex.quote(str(d / "value"))
    setup = f"echo $$ >> {pids}; echo {value} > {val}.tmp && mv {val}.tmp {val}; exec sleep 120"
    return setup, f"test -f {val}", f"cat {val}"


@pytest.mark.parametrize("restart", [False, True])
def test_setup_services_and_restarts(tmp_path, restart):
    a_setup, a_ready, a_cmd = _service(tmp_path, "a", 50)
    b_setup, b_ready, b_cmd = _service(tmp_path, "b", 40)
    args = ["--a", a_cmd, "--b", b_cmd, "--a-setup", a_setup, "--a-ready", a_ready, "--b-setup", b_setup,
            "--b-ready", b_ready, "--repeats", "4"]
    _, doc = engram_ab(tmp_path, *args, *(["--restart"] if restart else []))
    assert doc["result"]["verdict"].startswith("B faster by 20.00 %")
    a_pids = (tmp_path / "a" / "pids").read_text().split()
    b_pids = (tmp_path / "b" / "pids").read_text().split()
    # segments with 4 abba rounds: A | A' | BB | A' | AA | A' | BB | A' | A -> A (and A') 7 starts, B 2
    assert (len(a_pids), len(b_pids)) == ((7, 2) if restart else (1, 1))
    assert sum(r["round"] < 0 for r in doc["result"]["runs"]) == (9 if restart else 3)
    for pid in a_pids + b_pids:  # every service was stopped
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)


def test_failures_name_the_arm_and_the_cause(tmp_path):
    p, _ = engram_ab(tmp_path, "--a", "echo 1", "--b", "echo oops >&2; exit 3", check=False)
    assert p.returncode == 1 and "arm B: `echo oops >&2; exit 3` exited with 3" in p.stderr and "oops" in p.stderr
    p, _ = engram_ab(tmp_path, "--a", "echo fast", "--b", "echo 1", check=False)
    assert p.returncode == 1 and "arm A: `echo fast` last line of stdout is not a number: 'fast'" in p.stderr
    p, _ = engram_ab(tmp_path, "--a", "echo 1", "--b", "echo 1", "--restart", check=False)
    assert p.returncode == 2 and "--restart needs --a-setup or --b-setup" in p.stderr
    p, _ = engram_ab(tmp_path, "--a", "echo 1", "--b", "echo 1", "--repeats", "5", check=False)
    assert p.returncode == 2 and "ABConfig.repeats=5 must be even" in p.stderr
    p, _ = engram_ab(tmp_path, "--a", "echo 1", "--b", "echo 1", "--a-setup", "exit 4", "--a-ready", "false",
                     check=False)
    assert p.returncode == 1 and "arm A: setup `exit 4` exited with 4 before it was ready" in p.stderr
    pids = tmp_path / "slow.pids"
    p, _ = engram_ab(tmp_path, "--a", "echo 1", "--b", "echo 1", "--b-setup", f"echo $$ > {pids}; exec sleep 60",
                     "--b-ready", "false", "--ready-timeout", "0.5", check=False)
    assert p.returncode == 1 and "arm B: `false` did not succeed within --ready-timeout 0.5 s" in p.stderr
    with pytest.raises(ProcessLookupError):  # the service that never became ready was stopped too
        os.kill(int(pids.read_text()), 0)


def test_parse_sample_and_json_paths():
    doc = {"a": {"b": [1, {"c": 2.5}]}, "x": "7", "flag": True}
    assert json_field(doc, "$.a.b[1].c") == 2.5 and json_field(doc, "a.b.1.c") == 2.5
    assert json_field(doc, "$.a.b[0]") == 1
    with pytest.raises(ValueError, match=r"no 'd' under"):
        json_field(doc, "a.d")
    assert parse_sample("warming up\n 12.5 \n\n", None) == 12.5
    assert parse_sample('{"x": "7"}', "x") == 7.0
    assert parse_sample('log\n{"a": {"b": [3]}}\n', "$.a.b[0]") == 3.0
    with pytest.raises(ValueError, match="not a number"):
        parse_sample('{"flag": true}', "flag")
    with pytest.raises(ValueError, match="printed nothing"):
        parse_sample("\n", None)
    with pytest.raises(ValueError, match="not finite"):
        parse_sample("nan", None)


def test_bench_dispatcher_skips_missing_modules_only(monkeypatch):
    import argparse

    from engram.commands import bench

    monkeypatch.setattr(bench, "BENCHES", {"ab": "engram.bench.ab", "nope": "engram.bench.not_built_yet"})
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["ab", "--a", "echo 1", "--b", "echo 2"])
    assert args._run.__module__ == "engram.bench.ab"
    with pytest.raises(SystemExit):
        parser.parse_args(["nope"])
    # a bench whose import fails on something else (a missing dependency) is not hidden
    monkeypatch.setattr(bench, "BENCHES", {"broken": "engram.no_such_package.bench"})
    with pytest.raises(ModuleNotFoundError):
        bench.add_arguments(argparse.ArgumentParser())
