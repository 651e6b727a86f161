"""benchmarks/v4_kernel_count.py on the CPU: one batched V4 decode step of v4-small-like's depth counted by part (the
torch reference path); the mHC collapse holds at least its Sinkhorn arithmetic (32 calls x 39 normalisations x 3
kernels); the parts add up to the total; calls are the measured step's; the JSON is what it printed."""
from __future__ import annotations

import json

from benchmarks import v4_kernel_count


def test_counts_one_decode_step_by_part(tmp_path, capsys):
    out = tmp_path / "count.json"
    assert v4_kernel_count.main(["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["layers"] == 16 and res["sinkhorn_iters"] == 20 and res["batch"] == 1
    parts = res["parts"]
    assert sum(parts.values()) == res["kernels"] and max(parts, key=parts.get) == "mhc collapse"
    assert parts["mhc collapse"] >= 2 * 16 * (2 * 20 - 1) * 3
    assert {"compressor", "indexer", "moe", "rms norm", "mhc expand"} <= set(parts)
    calls = res["calls"]  # the measured step's calls only: two per layer, one compressor a HCA layer and two a CSA
    assert calls["mhc collapse"] == calls["mhc expand"] == 32 and calls["moe"] == 16 and calls["compressor"] == 21
    assert res["commit"]
    assert f"{res['kernels']} kernels in one decode step" in capsys.readouterr().out
