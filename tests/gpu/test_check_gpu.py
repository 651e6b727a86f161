"""`engram check` on CUDA (skipped without a GPU): the configurations users switch between give the same
outputs on natural-text prompts (serial, concurrent and fixed-prefix probes, greedy, float32).

* CUDA graphs (with asynchronous scheduling) against ``enforce_eager`` and synchronous steps: a replay
  runs at its bucket's padded batch, where cuBLAS may pick other kernels than for the real batch, so
  float32 logits may differ in the last bits; tokens must agree except at near-ties.
* ``lookup_overlap`` on against off: the same kernels run in both (docs/engine.md), so every request must
  be equal, near-ties included.
"""
from __future__ import annotations

import json

import pytest
import torch

from engram.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ARGS = ["--requests", "8", "--max-tokens", "24", "--prefix-tokens", "128"]


def check(tmp_path, a: dict, b: dict) -> tuple[int, dict]:
    out = tmp_path / "check.json"
    code = main(["check", "tiny", "--a", json.dumps(a), "--b", json.dumps(b), *ARGS, "--json", str(out)])
    return code, json.loads(out.read_text())["result"]


def test_graphs_equal_enforce_eager_through_engram_check(tmp_path):
    code, res = check(tmp_path, {"dtype": "float32"},
                      {"dtype": "float32", "enforce_eager": True, "async_scheduling": False})
    assert code == 0 and res["verdict"] in ("equal", "equal up to near-ties"), res["verdict"]
    assert all(p["requests"] == 8 for p in res["probes"])


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_lookup_overlap_on_equals_off_through_engram_check(tmp_path, tier):
    code, res = check(tmp_path, {"tier": tier, "dtype": "float32", "engram_config": {"lookup_overlap": True}},
                      {"tier": tier, "dtype": "float32", "engram_config": {"lookup_overlap": False}})
    assert code == 0 and res["verdict"] == "equal", res["verdict"]
