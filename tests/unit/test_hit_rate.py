"""Hit-rate bench: LRU stack distances against a brute-force LRU, hand-computed cold / warm rates, the
serving schedule and traces, and the command end to end."""
import json

import numpy as np
import pytest
import torch

from engram.bench.corpus import LengthRange, generate_corpus, load_tokenizer, write_corpus
from engram.bench.hit_rate import cold_warm, rowcache_hits, summarize, warm_start_of
from engram.bench.serving_trace import LayerTrace, layer_traces, serving_schedule
from engram.bench.stack_distance import lru_hits, previous_access, reuse_index, stack_distances
from engram.cli import main


def brute_lru_distances(trace):
    stack, out = [], []
    for x in trace:
        if x in stack:
            out.append(stack.index(x))
            stack.remove(x)
        else:
            out.append(-1)
        stack.insert(0, x)
    return np.array(out, dtype=np.int64)


def brute_lru_hits(trace, capacity):
    cache, hits = [], []
    for x in trace:
        hits.append(x in cache)
        if x in cache:
            cache.remove(x)
        cache.insert(0, x)
        del cache[capacity:]
    return np.array(hits)


@pytest.mark.parametrize("seed", range(6))
def test_stack_distances_equal_brute_force_lru(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n, ids = int(rng.integers(0, 400)), int(rng.integers(1, 60))
        trace = rng.zipf(1.3, n) % ids * 1_000_003 if seed % 2 else rng.integers(0, ids, n)
        dist = stack_distances(trace)
        np.testing.assert_array_equal(dist, brute_lru_distances(trace.tolist()))
        for cap in (1, 2, 5, 17):
            np.testing.assert_array_equal(lru_hits(dist, cap), brute_lru_hits(trace.tolist(), cap))


def test_reuse_index_and_its_errors():
    trace = np.array([30, 10, 30, 20, 10, 30])
    prev, dense = reuse_index(trace)
    assert prev.tolist() == [-1, -1, 0, -1, 1, 2] and dense.tolist() == [2, 0, 2, 1, 0, 2]
    assert previous_access(np.array([], dtype=np.int64)).size == 0
    big = np.array([2**62, 5, 2**62])  # ids too large for the packed sort key: the argsort path
    assert previous_access(big).tolist() == [-1, -1, 0]
    with pytest.raises(ValueError, match="trace id -3"):
        previous_access(np.array([1, -3]))


# One access per step: rows 1 1 2 3 1 2 3 3. LRU distances -1 0 -1 -1 2 2 2 0.
HAND = np.array([1, 1, 2, 3, 1, 2, 3, 3])
HAND_BOUNDS = np.arange(HAND.size + 1)


def test_hand_trace_lru_cold_and_warm():
    dist = stack_distances(HAND)
    assert dist.tolist() == [-1, 0, -1, -1, 2, 2, 2, 0]
    order = np.full(HAND.size, 2)
    for cap, lru in {1: [1, 7], 2: [1, 7], 3: [1, 4, 5, 6, 7]}.items():
        assert np.flatnonzero(lru_hits(dist, cap)).tolist() == lru
    lru2 = cold_warm(lru_hits(dist, 2), order, warm_start=4)
    assert (lru2["cold"]["rate"], lru2["warm"]["rate"]) == (2 / 8, 1 / 4)


def test_per_order_split_sums_to_the_total():
    rng = np.random.default_rng(0)
    hits, order = rng.random(1000) < 0.4, rng.integers(2, 5, 1000)
    for start in (0, 377):
        s = summarize(hits, order, start)
        assert sum(v["hits"] for v in s["by_order"].values()) == s["hits"] == hits[start:].sum()
        assert sum(v["accesses"] for v in s["by_order"].values()) == s["accesses"] == 1000 - start
        assert s["by_order"]["3"]["hits"] == int(hits[start:][order[start:] == 3].sum())


def test_serving_schedule_admits_in_order_as_slots_free():
    one = serving_schedule(np.array([3, 2]), np.array([2, 1]), concurrency=1)
    # request 0: prompt at step 0, continuation at 1, 2; request 1 admitted at 3: prompt 3, continuation 4
    assert one.admit.tolist() == [0, 3] and one.token_step.tolist() == [0, 0, 0, 1, 2, 3, 3, 4]
    two = serving_schedule(np.array([1, 1, 1]), np.array([3, 1, 1]), concurrency=2)
    # slot of request 1 frees after its one continuation token (step 1): request 2 runs at steps 2, 3
    assert two.admit.tolist() == [0, 0, 2] and two.steps == 4
    assert two.token_step.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert two.tokens_per_step().tolist() == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="concurrency=0"):
        serving_schedule(np.array([1]), np.array([1]), 0)


def _tiny_trace(concurrency=2):
    from engram.config import EngramConfig
    from engram.hashing import NgramHasher
    cfg = EngramConfig.preset("tiny")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 40, n) for n in (7, 5, 9)]
    sched = serving_schedule(np.array([4, 3, 5]), np.array([3, 2, 4]), concurrency)
    hasher = NgramHasher(cfg, pad_id=2)
    return cfg, hasher, seqs, sched, layer_traces(seqs, sched, hasher)


def test_layer_traces_hash_each_request_from_its_start_and_dedupe_per_step():
    cfg, hasher, seqs, sched, traces = _tiny_trace()
    assert [t.layer_id for t in traces] == list(cfg.layer_ids)
    step_of = np.concatenate([[s] * n for s, n in enumerate(np.diff(traces[0].step_bounds))])
    for t in traces:
        alone = np.concatenate([hasher.hash(torch.tensor(s)[None], t.layer_id)[0].numpy() for s in seqs])
        np.testing.assert_array_equal(t.text_rows, alone)
        want = {(int(st), int(r)) for st, row in zip(sched.token_step, alone) for r in row}
        assert {(int(st), int(r)) for st, r in zip(step_of, t.rows)} == want  # each step's distinct rows
        assert all(np.all(np.diff(t.rows[a:b]) > 0) for a, b in zip(t.step_bounds[:-1], t.step_bounds[1:]))
        cols = np.searchsorted(np.asarray(cfg.column_offsets(t.layer_id)), t.rows, side="right") - 1
        np.testing.assert_array_equal(t.order, cols // cfg.n_heads + 2)
        assert t.lookups == sum(s.size for s in seqs) * cfg.n_cols


def test_rowcache_simulation_matches_the_cache_counters():
    from engram.store.cache import RowCache
    *_, traces = _tiny_trace(concurrency=1)
    t = traces[0]
    hits, cap = rowcache_hits(t, 40, "lfu", ways=4)
    cache = RowCache(40, 1, policy="lfu", ways=4)
    for a, b in zip(t.step_bounds[:-1], t.step_bounds[1:]):
        cache.fetch(torch.from_numpy(t.rows[a:b]), lambda ids: (torch.zeros(ids.numel(), 1, dtype=torch.uint8), None))
    assert cap == cache.capacity == 40 and int(hits.sum()) == cache.hits and int((~hits).sum()) == cache.misses


def test_warm_start_is_a_step_boundary():
    t = LayerTrace(layer_id=1, table_rows=10, rows=np.arange(10), order=np.full(10, 2),
                   step_bounds=np.array([0, 4, 7, 10]), tokens_per_step=np.array([1, 1, 1]),
                   text_rows=np.zeros((3, 1)), n_heads=1)
    assert [warm_start_of(t, w) for w in (0, 0.3, 0.5, 0.7, 0.9)] == [0, 4, 7, 7, 10]
    with pytest.raises(ValueError, match="warmup=1"):
        warm_start_of(t, 1)


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hr") / "c.jsonl"
    write_corpus(generate_corpus(4, 0, LengthRange(60, 200), LengthRange(40, 120), load_tokenizer("builtin")), path)
    return path


def test_hit_rate_command_end_to_end(corpus_file, tmp_path, capsys):
    out, png = tmp_path / "hr.json", tmp_path / "hr.png"
    assert main(["bench", "hit-rate", "--corpus", str(corpus_file), "--case", "tiny=builtin",
                 "--case", "deepseek-v4.1-flash=builtin", "--sizes", "0.1,1,5,20", "--rowcache", "lfu",
                 "--ways", "4", "--concurrency", "2", "--out", str(out), "--plot", str(png)]) == 0
    res = json.loads(out.read_text())["result"]
    assert png.stat().st_size > 10_000 and "LRU warm" in capsys.readouterr().out
    tiny, v41 = res["cases"]
    assert tiny["engram"]["compressed_vocab_size_replaced"] is False
    assert v41["engram"]["compressed_vocab_size"] == 2901 and v41["tokenizer"]["compressed_vocab_size"] == 2901
    assert v41["engram"]["layout_compressed_vocab_size"] == 99092 and v41["engram"]["compressed_vocab_size_replaced"]
    assert v41["engram"]["table_rows"] == [384006168, 384016682]
    for case in res["cases"]:
        for layer in case["layers"]:
            inf = layer["infinite_cache"]
            lru = [s["lru"]["cold"]["rate"] for s in layer["sizes"]]
            assert lru == sorted(lru) and lru[-1] <= inf["cold"]["rate"]  # LRU is a stack algorithm
            for s in layer["sizes"]:
                assert "lfu" not in s  # the ideal LFU is benchmarks/lfu.py's
                for key in ("lru", "rowcache_lfu"):
                    for phase in ("cold", "warm"):
                        x = s[key][phase]
                        assert x["rate"] <= inf[phase]["rate"] + 1e-12
                        assert sum(v["accesses"] for v in x["by_order"].values()) == x["accesses"]
                        assert sum(v["hits"] for v in x["by_order"].values()) == x["hits"]
                assert s["lru"]["cold"]["accesses"] == layer["accesses"] <= layer["lookups"]
            last = layer["growth"][-1]  # text order and serving order touch the same rows
            assert last["tokens"] == case["tokens"] and last["distinct_rows"] == layer["distinct_rows"]
            assert 0 < last["per_token"] <= case["engram"]["n_cols"]
            assert sum(last[f"per_token_order_{n}"]
                       for n in case["engram"]["orders"]) == pytest.approx(last["per_token"])


def test_hit_rate_command_errors(corpus_file):
    with pytest.raises(SystemExit, match=r"--case='tiny': expected LAYOUT=TOKENIZER"):
        main(["bench", "hit-rate", "--corpus", str(corpus_file), "--case", "tiny"])
    with pytest.raises(SystemExit, match=r"--sizes='0,5'"):
        main(["bench", "hit-rate", "--corpus", str(corpus_file), "--sizes", "0,5"])
    with pytest.raises(SystemExit, match=r"--rowcache='fifo'"):
        main(["bench", "hit-rate", "--corpus", str(corpus_file), "--rowcache", "fifo"])
    with pytest.raises(SystemExit, match=r"unknown Engram preset 'nope'"):
        main(["bench", "hit-rate", "--corpus", str(corpus_file), "--case", "nope=builtin"])
