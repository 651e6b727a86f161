"""benchmarks/lfu.py: the exact LFU against its plain-Python reference and a hand trace, and its command."""
import json

import numpy as np
import pytest

from benchmarks import lfu
from benchmarks.lfu import lfu_hits, lfu_reference
from engram.bench.corpus import LengthRange, generate_corpus, load_tokenizer, write_corpus
from engram.bench.hit_rate import cold_warm
from engram.bench.stack_distance import reuse_index

# One access per step: rows 1 1 2 3 1 2 3 3.
HAND = np.array([1, 1, 2, 3, 1, 2, 3, 3])
HAND_BOUNDS = np.arange(HAND.size + 1)


def test_hand_trace_lfu_cold_and_warm():
    dense = reuse_index(HAND)[1]
    for cap, hits in {1: [1, 7], 2: [1, 4, 7], 3: [1, 4, 5, 6, 7]}.items():  # 2: keeps row 1 (count 2), LRU drops it
        assert np.flatnonzero(lfu_hits(dense, HAND_BOUNDS, cap)).tolist() == hits
    lfu2 = cold_warm(lfu_hits(dense, HAND_BOUNDS, 2), np.full(HAND.size, 2), warm_start=4)
    assert (lfu2["cold"]["rate"], lfu2["warm"]["rate"]) == (3 / 8, 2 / 4)


def test_lfu_within_steps_and_overflowing_steps():
    # step 0 reads rows 5 6 7 with room for 2: 5 and 6 are cached, 7 is served uncached; step 1 hits 6,
    # misses 7 and evicts 5 (count 1, older than 6's count 2); step 2 hits 6 and 7.
    rows, bounds = np.array([5, 6, 7, 6, 7, 6, 7]), np.array([0, 3, 5, 7])
    dense = reuse_index(rows)[1]
    assert lfu_hits(dense, bounds, 2).tolist() == [False, False, False, True, False, True, True]
    with pytest.raises(ValueError, match="LFU capacity=0"):
        lfu_hits(dense, bounds, 0)


@pytest.mark.parametrize("fifo_counts,pool_slack", [(32, 65536), (2, 65536), (2, 0)])
def test_lfu_equals_reference_on_random_step_traces(fifo_counts, pool_slack, monkeypatch):
    monkeypatch.setattr(lfu, "FIFO_COUNTS", fifo_counts)  # 2: the hottest-rows pool is used all the time
    monkeypatch.setattr(lfu, "POOL_SLACK", pool_slack)  # 0: and deduplicated at almost every step
    rng = np.random.default_rng(fifo_counts + pool_slack)
    for _ in range(150):
        universe = int(rng.integers(2, 50))
        steps = [np.unique(rng.zipf(1.3, int(rng.integers(0, 10))) % universe) for _ in range(int(rng.integers(1, 30)))]
        rows = np.concatenate(steps).astype(np.int64) * 11 + 4
        bounds = np.concatenate([[0], np.cumsum([s.size for s in steps])])
        cap = int(rng.integers(1, 16))
        np.testing.assert_array_equal(lfu_hits(reuse_index(rows)[1], bounds, cap), lfu_reference(rows, bounds, cap))


def test_lfu_command_writes_rates_per_layer_and_size(tmp_path, capsys):
    corpus, out = tmp_path / "c.jsonl", tmp_path / "lfu.json"
    write_corpus(generate_corpus(3, 0, LengthRange(60, 120), LengthRange(40, 80), load_tokenizer("builtin")), corpus)
    assert lfu.main(["--corpus", str(corpus), "--case", "tiny=builtin", "--sizes", "1,20", "--concurrency", "2",
                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["result"]["rows"]
    assert [r["size %"] for r in rows] == [1.0, 20.0] * (len(rows) // 2) and len(rows) >= 2
    for small, large in zip(rows[::2], rows[1::2]):
        assert 0 <= small["LFU warm"] <= large["LFU warm"] <= 1 and small["layer"] == large["layer"]
    assert "LFU warm" in capsys.readouterr().out
