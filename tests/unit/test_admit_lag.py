"""scripts/admit_lag.py: a step's rows cached one step late are missed again by the next step only."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from engram.bench.serving_trace import LayerTrace

spec = importlib.util.spec_from_file_location("admit_lag", Path(__file__).parents[2] / "scripts" / "admit_lag.py")
admit_lag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(admit_lag)


def trace(steps: list[list[int]]) -> LayerTrace:
    rows = np.concatenate([np.array(s, dtype=np.int64) for s in steps])
    bounds = np.cumsum([0] + [len(s) for s in steps])
    return LayerTrace(1, 1000, rows, np.zeros_like(rows), bounds, np.ones(len(steps), dtype=np.int64),
                      rows[:, None], 1)


def test_late_caching_misses_a_row_again_only_at_the_next_step():
    # rows 1-3 read at step 0, again at steps 1 and 2; row 9 at step 0, again at step 2
    t = trace([[1, 2, 3, 9], [1, 2, 3], [1, 2, 3, 9], [4]])
    assert admit_lag.misses_per_step(t, 64, 8, "lru", lag=0).tolist() == [4, 0, 0, 1]
    # cached a step late: step 1 misses 1-3 again; step 2 finds everything (step 0's rows cached after
    # step 1's split, step 1's own misses after step 2's)
    assert admit_lag.misses_per_step(t, 64, 8, "lru", lag=1).tolist() == [4, 3, 0, 1]
