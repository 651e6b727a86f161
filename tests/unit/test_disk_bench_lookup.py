"""`engram bench lookup`: a tiny run per tier writes JSON whose numbers are consistent with each other."""
from __future__ import annotations

import json

import pytest

from engram.cli import main


def run_bench(tmp_path, *extra):
    out = tmp_path / "r.json"
    rc = main(["bench", "lookup", "--random-rows", "3000", "--dim", "64", "--workdir", str(tmp_path),
               "--batch-sizes", "16,200", "--seconds", "0.05", "--rounds", "2", "--out", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_disk_bench_reports_raw_and_table_cells(tmp_path, capsys):
    doc = run_bench(tmp_path, "--tier", "disk", "--io", "direct,buffered", "--queue-depths", "2",
                    "--cache-rows", "0,512", "--raw-pages", "32", "--ops", "gather")
    cells = doc["result"]["cells"]
    raw = [c for c in cells if c["mode"] == "raw"]
    table = [c for c in cells if c["mode"] == "gather"]
    assert len(raw) == 2 and len(table) == 2 * 2 * 2 * 2  # io x cache x dist x batch
    for c in table:
        assert c["rows_per_s"] > 0 and c["us_per_batch_p50"] > 0 and c["batches"] >= 2
        assert c["GB_per_s"] == pytest.approx(c["rows_per_s"] * (64 + 2) / 1e9)  # 64 fp8 values + 2 scales
        if c["cache_rows"] == 0:
            # 64-B rows, 64 per page: a page read serves at least one and at most 64 distinct rows
            assert 1.0 <= c["page_amp"] <= 64.0 and c["hit_rate"] is None
        else:
            assert 0.0 <= c["hit_rate"] <= 1.0
    summary = doc["result"]["summary"]
    assert {(s["io"], s["op"]) for s in summary} == {("direct", "gather"), ("buffered", "gather")}
    assert all(s["reader_over_raw"] > 0 and s["table_batch"] == 200 for s in summary)
    assert doc["config"]["reader_backend"] in ("c", "python") and doc["config"]["table_rows"] == 3000
    assert "reader_over_raw" in capsys.readouterr().out
    assert not any(p.name.startswith(".engram-bench") for p in tmp_path.iterdir())  # table deleted


def test_disk_bench_both_ops_summarized(tmp_path):
    doc = run_bench(tmp_path, "--tier", "disk", "--io", "buffered", "--queue-depths", "4", "--dists", "uniform",
                    "--raw-pages", "32")
    assert [c["mode"] for c in doc["result"]["cells"]] == ["raw", "gather_raw", "gather_raw", "gather", "gather"]
    assert [s["op"] for s in doc["result"]["summary"]] == ["gather_raw", "gather"]


def test_gpu_tier_bench_runs_without_disk_columns(tmp_path):
    doc = run_bench(tmp_path, "--tier", "gpu", "--dists", "uniform", "--ops", "gather_raw")
    cells = doc["result"]["cells"]
    assert len(cells) == 2 and all(c["mode"] == "gather_raw" and "read_ops_per_s" not in c for c in cells)
    assert doc["result"]["summary"] == []


def test_needs_exactly_one_table_source(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "lookup", "--tier", "disk"])
