"""Commands do what their own help and defaults promise, on the CPU with the tiny model: `engram inspect --help`
names table paths that exist, `engram bench engine` runs with its default shapes, and `engram bench lookup`
says how long it will take before it starts."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from engram.cli import main

pytestmark = pytest.mark.timeout(600)


def _help(capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as e:
        main([*words, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_inspect_help_names_table_paths_that_exist(capsys, tmp_path):
    from engram import envs
    from engram.config import EngramConfig
    from engram.model.tables import ensure_preset_tables

    ensure_preset_tables(EngramConfig.preset("tiny"), 0, progress=False)  # a preset's tables, as its first use makes
    examples = [line.strip() for line in _help(capsys, "inspect").splitlines() if "inspect --verify" in line]
    assert examples
    for line in examples:
        for command in line.split("&&"):
            argv = shlex.split(command.replace("/tmp/", f"{tmp_path}/"))
            assert argv[0] == "engram", line
            if argv[1] == "inspect":
                where = argv[argv.index("--verify") + 1]
                where = where.replace("~/.cache/engram", str(envs.cache_dir()))
                found = sorted(Path("/").glob(re.sub(r"<[^>]+>", "*", where).lstrip("/")))
                assert found, f"`engram inspect --help` names {argv[argv.index('--verify') + 1]}, which does not exist"
                argv[argv.index("--verify") + 1] = str(found[0])
            assert main(argv[1:]) == 0, command
            capsys.readouterr()


def test_bench_engine_runs_with_its_default_shapes_on_the_tiny_model(tmp_path, capsys):
    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--no-peer", "--no-engram-off", "--tiers", "gpu", "--batch-sizes", "1",
               "--decode-steps", "2", "--warmup-tokens", "1", "--prefill-repeats", "1", "--profile-steps", "0",
               "--threads", "1", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert "--prefill-shapes: the default 1x2048,16x512 does not fit max_position_embeddings=2048" in err, err
    # said before it starts: what it will measure; and after each model how long it took and what is left
    plan = next(line for line in err.splitlines() if line.startswith("bench engine: 1 model(s)"))
    assert "x 1 arm(s) x 3 point(s)" in plan and "1 decode batches of 3 steps" in plan, plan
    assert "bench engine: 1 of 1 models in" in err and "about 0 s left" in err, err
    points = json.loads(out.read_text())["result"]["points"]
    prefills = sorted((p["batch"], p["context"]) for p in points if p["phase"] == "prefill")
    assert prefills == [(1, 2032), (16, 512)], prefills


def test_bench_lookup_says_how_long_it_will_take_before_it_starts(tmp_path, capsys):
    out = tmp_path / "lookup.json"
    rc = main(["bench", "lookup", "--random-rows", "4096", "--tier", "disk", "--seconds", "0.05", "--rounds", "1",
               "--queue-depths", "1,2", "--io", "buffered", "--batch-sizes", "48,96", "--dists", "uniform",
               "--ops", "gather_raw", "--workdir", str(tmp_path), "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    first = err.strip().splitlines()[0]
    assert first.startswith("bench lookup: 2 (io, queue depth) groups x 3 cells x 0.05 s = 0 s timed"), first
    cells = json.loads(out.read_text())["result"]["cells"]
    assert len(cells) == 2 * 3  # what the estimate counted: raw + two batch sizes, per group
