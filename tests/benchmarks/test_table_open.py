"""benchmarks/table_open.py on the CPU: real tables written to disk, opened per tier and page-cache state."""
import argparse
import json

import pytest

from benchmarks import table_open


def run(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    table_open.add_arguments(p)
    return table_open.run(p.parse_args(argv))


def test_table_open_writes_every_cell(tmp_path, capsys):
    out = tmp_path / "open.json"
    assert run(["--gib", "0.004", "--tiers", "host,gpu", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    points = doc["result"]["points"]
    assert [(p["tier"], p["cache"]) for p in points] == [("host", "cold"), ("host", "warm"), ("gpu", "cold"),
                                                          ("gpu", "warm")]
    for p in points:
        assert p["rows"] == int(0.004 * (1 << 30)) // 256
        assert 0 < p["open_s"] <= p["open_to_rows_s"] and p["GBps"] > 0
        assert p["rows"] * (256 + 8) <= p["table_bytes"] < p["rows"] * (256 + 8) + (64 << 10)  # + file padding
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".engram-bench-open-")], "table not removed"
    assert "open_to_rows_s" in capsys.readouterr().out


def test_table_open_rejects_unknown_tier(tmp_path):
    with pytest.raises(SystemExit, match="--tiers: 'disk'"):
        run(["--gib", "0.001", "--tiers", "disk", "--workdir", str(tmp_path)])
