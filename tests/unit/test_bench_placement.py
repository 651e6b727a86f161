"""`engram bench placement` on the CPU with the tiny preset: the arms' engines run interleaved in one
process over the same corpus windows, every sample is a positive tok/s whose sequences emitted exactly
their forced ids, each arm's engine is built from its own engram_config and engine overrides, the result
JSON holds what the docs promise, and a bad arm stops the command before anything loads. Disk arms with
per-arm table options: the raw read rate at the depth their steps read at, per-sample table counters, hit
rates cold and warm and the bound against the host arm. Also ``measure_decode(..., forced=...)``."""
import json
import math
import types

import numpy as np
import pytest
import torch

from engram.bench import engine_steps, forced_windows, stats
from engram.bench.disk_bound import NO_HOST_ARM
from engram.cli import main
from engram.config import parse_bytes

FAST = ["--batch-sizes", "1,2", "--context-len", "16", "--decode-steps", "4", "--warmup-tokens", "2",
        "--repeats", "2", "--warmup", "0", "--quiet"]


def _tiny_engine(**limits):
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.model.loader import random_model
    from engram.model.presets import preset_config

    loaded = random_model(preset_config("tiny"), progress=False)
    cfg = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128, **limits})
    return LLMEngine(loaded, cfg, torch.device("cpu"), torch.float32)


# ----------------------------------------------------------------- forced decoding in measure_decode
def test_measure_decode_emits_the_forced_ids_and_refuses_a_short_list():
    engine = _tiny_engine()
    prompts = engine_steps.prompt_ids(2, 10, 4096, seed=1)
    max_tokens = engine_steps.decode_max_tokens(2, 10, 64, 2, 3, 0)
    forced = engine_steps.prompt_ids(2, max_tokens, 4096, seed=99)
    t = engine_steps.measure_decode(engine, prompts, steps=3, warmup_tokens=2, forced=forced)
    # 20 prompt tokens prefill in one step: 2 warm-up tokens, then 3 timed ones, each of them forced
    assert t.token_ids == [f[:5] for f in forced] and len(t.wall_s) == 3
    assert t.lookup_exposed_s > 0.0  # the CPU stages every step before its forward and waits
    assert not engine.has_unfinished()
    free = engine_steps.measure_decode(engine, prompts, steps=3, warmup_tokens=2)
    assert free.token_ids != t.token_ids  # without forcing the random model emits its own tokens

    short = [forced[0], forced[1][:max_tokens - 1]]
    with pytest.raises(ValueError, match=r"forced\[1\] \(prompt 1\)"):
        engine_steps.measure_decode(engine, prompts, steps=3, warmup_tokens=2, forced=short)
    with pytest.raises(ValueError, match="2 prompts"):
        engine_steps.measure_decode(engine, prompts, steps=3, warmup_tokens=2, forced=forced[:1])
    assert not engine.has_unfinished()


# ----------------------------------------------------------------- pieces
def test_windows_are_contiguous_stretches_of_the_stream_and_wrap():
    stream = np.arange(100, 130)  # 30 ids
    w = forced_windows.cut_windows(stream, 3, 8, 4)
    assert w.offsets == [0, 10, 20]
    assert w.prompts[1] == list(range(110, 118)) and w.forced[1] == list(range(118, 122))
    assert w.prompts[2] == list(range(120, 128)) and w.forced[2] == [128, 129, 100, 101]  # wraps around
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        forced_windows.corpus_stream([(np.array([1, 2]), np.array([4096]))], 4096)


def test_check_forced_names_the_arm_sequence_and_position():
    win = forced_windows.Windows([0, 5], [[1], [2]], [[7, 8, 9], [4, 5, 6]])
    ok = types.SimpleNamespace(token_ids=[[7, 8], [4, 5, 6]])
    assert forced_windows.check_forced(ok, win, 2, "A") == 5
    with pytest.raises(forced_windows.OutputMismatch, match="arm B: sequence 1 emitted id 9 at position 1"):
        forced_windows.check_forced(types.SimpleNamespace(token_ids=[[7, 8], [4, 9]]), win, 2, "B")
    with pytest.raises(forced_windows.OutputMismatch, match="sequence 0 generated 2 ids, fewer than 3"):
        forced_windows.check_forced(ok, win, 3, "A")


@pytest.mark.parametrize("option, text, message", [
    ("--b", '{"tier": "host", "cache_rows": 5}', r"--b\[1\]: unknown key 'cache_rows'"),
    ("--b", '{"tier": "tape"}', r"--b\[1\]: key 'tier'='tape' must be one of"),
    ("--b", '{"engine": {}}', r"--b\[1\]: key 'tier'=None must be one of"),
    ("--b", '{"tier": "disk", "engram_config": {"cache_rowz": 5}}',
     r"--b\[1\]: engram_config has unknown key\(s\) \['cache_rowz'\]"),
    ("--b", '{"tier": "disk", "engram_config": {"queue_depth": 0}}',
     r"--b\[1\]: engram_config.queue_depth=0: must be in"),
    ("--b", '{"tier": "disk", "engram_config": [1]}', r"--b\[1\]: key 'engram_config'=\[1\] must be a JSON object"),
    ("--a", '{"tier": "host", "engram_config": {"io": "mmap"}}', r"--a: engram_config.io='mmap': must be one of"),
    ("--b", '{"tier": "gpu", "engram_config": {"lookup_overlap": 1}}',
     r"--b\[1\]: engram_config.lookup_overlap=1: must be true or false"),
    ("--b", '{"tier": "gpu", "engram_config": {"table_rows": 5}}',
     r"--b\[1\]: engram_config.table_rows is shared by every arm: set it in --engram-config"),
    ("--b", '{"tier": "disk", "engine": {"async_scheduling": "yes"}}',
     r"--b\[1\]: engine.async_scheduling='yes': must be true, false or null"),
    ("--b", '{"tier": "gpu", "engine": {"enforce_eagre": true}}',
     r"--b\[1\]: engine.enforce_eagre is not an EngineConfig"),
    ("--b", '{"tier": "gpu", "engine": {"max_num_seqs": 4}}',
     r"--b\[1\]: engine.max_num_seqs is set for every arm by the command's options"),
    ("--b", '{"tier": "gpu", "engine": [1]}', r"--b\[1\]: key 'engine'=\[1\] must be a JSON object"),
    ("--a", '{"tier": "gpu", "device": "cuda"}', r"--a: unknown key 'device'"),
    ("--a", '["gpu"]', r"--a: expected a JSON object"),
])
def test_a_bad_arm_stops_the_command_before_anything_loads(monkeypatch, option, text, message):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the arms were checked")

    monkeypatch.setattr("engram.model.loader.random_model", no_load)
    argv = ["bench", "placement", *FAST, option, text]
    if option == "--b":
        argv = ["bench", "placement", *FAST, "--b", '{"tier": "host"}', option, text]
        message = message.replace(r"--b\[1\]", r"--b\[2\]")  # the second --b
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_shared_options_are_checked_and_leave_the_tier_to_the_arms(monkeypatch):
    monkeypatch.setattr("engram.model.loader.random_model", None)  # never reached
    with pytest.raises(SystemExit, match="--engram-config: key 'cpu_offload' is the tier"):
        main(["bench", "placement", *FAST, "--engram-config", '{"cpu_offload": true}'])
    with pytest.raises(SystemExit, match="--engram-config: .*unknown key"):
        main(["bench", "placement", *FAST, "--engram-config", '{"tabel_rows": 5}'])
    # an arm's table options are checked over the shared ones: sorted_min_rows must stay >= staged_min_rows
    with pytest.raises(SystemExit, match=r"^--b\[1\]: engram_config.advanced.sorted_min_rows=100: must be >= 200"):
        main(["bench", "placement", *FAST, "--engram-config", '{"advanced": {"staged_min_rows": 200}}',
              "--b", '{"tier": "host", "engram_config": {"advanced": {"sorted_min_rows": 100}}}'])
    with pytest.raises(SystemExit, match=r"^--b\[2\]: .*tables_in_memory=true: tier 'disk' serves tables"):
        main(["bench", "placement", *FAST, "--engram-config", '{"tables_in_memory": true}',
              "--a", '{"tier": "host"}', "--b", '{"tier": "gpu"}', "--b", '{"tier": "disk"}'])
    with pytest.raises(SystemExit, match="--kv-cache-memory: '8 parsecs' is not a positive byte count"):
        main(["bench", "placement", *FAST, "--kv-cache-memory", "8 parsecs"])


def test_parse_bytes():
    assert parse_bytes("8GiB", "--kv") == 8 << 30 and parse_bytes("512M", "--kv") == 512 << 20
    assert parse_bytes("12345", "--kv") == 12345
    with pytest.raises(ValueError, match="--kv: '8 parsecs'"):
        parse_bytes("8 parsecs", "--kv")
    import argparse

    from engram.commands.options import add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)  # serve / generate take the same units
    assert p.parse_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 << 30
    assert p.parse_args([]).kv_cache_memory is None
    with pytest.raises(SystemExit, match="--kv-cache-memory: '0'"):
        p.parse_args(["--kv-cache-memory", "0"])


# ----------------------------------------------------------------- the command
def test_placement_bench_runs_both_tiers_interleaved_and_writes_every_field(tmp_path, capsys):
    out, png = tmp_path / "placement.json", tmp_path / "runs.png"
    rc = main(["bench", "placement", *FAST, "--out", str(out), "--plot", str(png), "--kv-cache-memory", "64MiB"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["runs-b1-batch1.png", "runs-b1-batch2.png"]
    doc = json.loads(out.read_text())
    assert doc["name"] == "placement-tiny" and doc["config"]["model"] is None
    res = doc["result"]
    a, b = {"tier": "gpu"}, {"tier": "host"}  # the defaults
    assert res["arms"] == {"A": a, "B": [b]}
    assert res["model"]["name"] == "tiny" and res["model"]["device"] == "cpu"
    assert set(res["tables"]) == {"gpu", "host"}
    assert {t["type"] for t in res["tables"]["gpu"].values()} == {"GpuTable"}
    assert {t["type"] for t in res["tables"]["host"].values()} == {"HostTable"}
    assert all(t["bytes"] > 0 for tier in res["tables"].values() for t in tier.values())
    assert res["kv_cache_memory"]["bytes"] == 64 << 20
    assert len(set(res["kv_cache_memory"]["kv_blocks"].values())) == 1  # one budget, the same KV cache for both
    assert set(res["engine_configs"]) == {json.dumps(a), json.dumps(b)}
    assert res["corpus"]["path"] == "bench/corpus/natural-v1.jsonl" and len(res["corpus"]["sha256"]) == 64
    assert set(res["windows"]) == {"1", "2"} and res["windows"]["2"]["token_stats"]["distinct_tokens"] > 10

    comps = res["comparisons"]
    assert [(c["batch"], c["b_index"], c["a"], c["b"]) for c in comps] == [(1, 1, a, b), (2, 1, a, b)]
    for c in comps:
        ab = c["ab"]
        assert ab["arms"] == {"A": f"A: {json.dumps(a)}", "A'": f"A: {json.dumps(a)}", "B": f"B: {json.dumps(b)}"}
        assert ab["config"]["higher_is_better"] is True and set(ab["comparisons"]) == {"B/A", "A'/A"}
        assert ab["verdict"] and len(ab["runs"]) == 6 and all(len(x) == 2 for x in ab["samples"].values())
        assert len(c["samples"]) == 6 and [s["label"] for s in c["samples"]] == ["A", "A'", "B", "B", "A'", "A"]
        for s in c["samples"]:
            assert s["tok_s"] > 0 and s["steps"] == 4 and s["graph_replays"] == 0  # no CUDA graphs on the CPU
            assert s["lookup_exposed_s"] > 0.0  # the CPU stages every step before its forward and waits
            assert s["tokens_checked"] >= c["batch"] * (2 + 4)  # every emitted id was its forced id
            assert s["tok_s"] == pytest.approx(c["batch"] * 4 / s["wall_s"])
            assert s["hit_rate"] is None  # no hot-row cache
        assert set(c["arm_stats"]) == {"A", "A'", "B"} and c["arm_stats"]["B"]["n"] == 2
        assert c["arm_stats"]["B"]["tok_s_median"] == pytest.approx(
            sum(s["tok_s"] for s in c["samples"] if s["label"] == "B") / 2)
    printed = capsys.readouterr().out
    assert "tok/s A" in printed and "A/A CI" in printed and f"result: {out}" in printed


def test_each_arm_is_an_engine_built_from_its_own_typed_configs(tmp_path, monkeypatch):
    """Arms that differ in engram_config (lookup_overlap, a table option) and engine (EngineConfig fields) get
    one engine each, built from the shared settings with exactly their own overrides; no module state is
    flipped, so the engines exist side by side in the one process."""
    from engram.engine import engine as engine_mod

    built = []
    real_init = engine_mod.LLMEngine.__init__

    def spy(self, loaded, config, *a, **k):
        built.append((loaded.tier, loaded.lookup_overlap, loaded.store_options.cache_rows, config))
        real_init(self, loaded, config, *a, **k)

    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", spy)
    a = {"tier": "host"}
    b1 = {"tier": "host", "engram_config": {"cache_rows": 64, "lookup_overlap": False},  # keys as the record sorts them
          "engine": {"async_scheduling": True, "max_graph_batch": 8}}
    b2 = {"tier": "gpu", "engine": {"enforce_eager": True}}
    out = tmp_path / "p.json"
    assert main(["bench", "placement", *FAST, "--batch-sizes", "1", "--a", json.dumps(a), "--b", json.dumps(b1),
                 "--b", json.dumps(b2), "--b", json.dumps(a), "--out", str(out)]) == 0
    assert len(built) == 3  # the repeated arm A reuses A's engine
    (ta, oa, ca, ea), (t1, o1, c1, e1), (t2, o2, c2, e2) = built
    assert (ta, oa, ca) == ("host", True, 0) and (t1, o1, c1) == ("host", False, 64)
    assert (t2, o2, c2) == ("gpu", True, 0)
    assert ea.async_scheduling is None and ea.max_graph_batch == 256 and not ea.enforce_eager
    assert e1.async_scheduling is True and e1.max_graph_batch == 8 and not e1.enforce_eager
    assert e2.enforce_eager is True and e2.async_scheduling is None
    assert ea.max_num_seqs == e1.max_num_seqs == e2.max_num_seqs and ea.kv_cache_memory == e2.kv_cache_memory
    res = json.loads(out.read_text())["result"]
    assert res["arms"]["B"] == [b1, b2, a]
    assert res["placements"]["arms"] == {json.dumps(a): "host", json.dumps(b1): 'host {"cache_rows": 64}',
                                          json.dumps(b2): "gpu"}
    assert res["engine_configs"][json.dumps(b1)]["async_scheduling"] is True


def test_engines_built_for_more_sequences_than_the_largest_batch(tmp_path):
    """--max-num-seqs sizes every arm's engine (its scheduler, default KV budget) beyond the batches it
    measures, so a batch-1 run can use engines built like those of a batch-64 run; fewer is refused."""
    with pytest.raises(SystemExit, match=r"--max-num-seqs=1 must be at least the largest batch \(2\)"):
        main(["bench", "placement", *FAST, "--max-num-seqs", "1"])
    out = tmp_path / "p.json"
    assert main(["bench", "placement", *FAST, "--batch-sizes", "1", "--max-num-seqs", "4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["result"]
    assert res["engine_config"]["max_num_seqs"] == 4 and [c["batch"] for c in res["comparisons"]] == [1]
    one = tmp_path / "one.json"  # the default budget grows with the sequences the engines are built for
    assert main(["bench", "placement", *FAST, "--batch-sizes", "1", "--out", str(one)]) == 0
    small = json.loads(one.read_text())["result"]
    assert small["engine_config"]["max_num_seqs"] == 1
    assert res["kv_cache_memory"]["bytes"] > small["kv_cache_memory"]["bytes"]


# ----------------------------------------------------------------- disk arms
DISK_FAST = ["--batch-sizes", "1,2", "--context-len", "16", "--decode-steps", "4", "--warmup-tokens", "2",
             "--repeats", "2", "--warmup", "1", "--quiet", "--raw-read-seconds", "0.05", "--raw-read-pages", "64",
             "--raw-read-sample-seconds", "0.02"]


def test_bad_raw_read_options_stop_before_loading(monkeypatch):
    monkeypatch.setattr("engram.model.loader.random_model", None)  # never reached
    with pytest.raises(SystemExit, match=r"--raw-read-seconds=0.0 must be > 0"):
        main(["bench", "placement", *DISK_FAST, "--raw-read-seconds", "0"])
    with pytest.raises(SystemExit, match=r"--raw-read-sample-seconds=-1.0 >= 0"):
        main(["bench", "placement", *DISK_FAST, "--raw-read-sample-seconds", "-1"])


def test_disk_arms_record_raw_reads_counters_hit_rates_and_the_bound(tmp_path, capsys):
    from engram.model.presets import preset_config

    out, cache = tmp_path / "disk.json", tmp_path / "cache"
    host = {"tier": "host"}
    plain = {"tier": "disk", "engram_config": {"io": "buffered"}, "engine": {"async_scheduling": True}}
    cached = {"tier": "disk", "engram_config": {"cache_rows": 500, "io": "buffered"}}
    rc = main(["bench", "placement", *DISK_FAST, "--out", str(out), "--kv-cache-memory", "64MiB",
               "--cache-dir", str(cache), "--a", json.dumps(host), "--b", json.dumps(plain), "--b", json.dumps(cached)])
    assert rc == 0
    assert len(list((cache / "tables").glob("*/*/manifest.json"))) == 2  # the preset's tables, in --cache-dir
    res = json.loads(out.read_text())["result"]
    assert res["arms"] == {"A": host, "B": [plain, cached]}
    assert [c["async_scheduling"] for c in res["engine_configs"].values()] == [None, True, None]
    names = ["host", 'disk {"io": "buffered"}', 'disk {"cache_rows": 500, "io": "buffered"}']
    assert list(res["tables"]) == names == list(res["placements"]["store_options"])
    assert {t["type"] for t in res["tables"][names[1]].values()} == {"DiskTable"}
    assert {t["cache_bytes"] > 0 for t in res["tables"][names[2]].values()} == {True}
    assert res["placements"]["store_options"][names[2]]["cache_rows"] == 500
    assert res["placements"]["store_options"][names[1]]["io"] == "buffered"
    assert res["settings"]["raw_read_seconds"] == 0.05 and res["settings"]["bound_factor"] == 1.1

    tiny = preset_config("tiny").engram
    rows_per_step = len(tiny.layer_ids) * tiny.n_cols  # per sequence: every Engram layer's rows of one token
    comps = res["comparisons"]
    assert [(c["batch"], c["b_index"]) for c in comps] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for c in comps:
        raw = c["raw_reads"]["B"]
        assert set(c["raw_reads"]) == set(c["disk"]) == {"B"}  # A is on the host tier: no raw reads for it
        assert raw["read_ops_per_s"] > 0 and raw["io"] == "buffered" and raw["cold"] is True
        assert raw["queue_depth"] == 64 and raw["calls"] >= 1 and raw["pages_per_call"] == 64
        assert raw["read_ops_per_s"] == pytest.approx(raw["calls"] * 64 / raw["seconds"])
        with_cache = c["b_index"] == 2
        for smp in c["samples"]:
            t = smp["tables"]
            assert t["rows"] == c["batch"] * 4 * rows_per_step  # the timed steps' lookups only
            assert smp["step_ms"] == pytest.approx(smp["wall_s"] / 4 * 1e3)
            steps = smp["steps_ms"]  # every timed step, and its spread
            assert len(steps) == 4 and sum(steps) == pytest.approx(smp["wall_s"] * 1e3, abs=4e-3)
            assert smp["step_ms_p50"] == pytest.approx(sorted(steps)[1] / 2 + sorted(steps)[2] / 2, abs=1e-3)
            assert smp["step_ms_max"] == pytest.approx(max(steps), abs=1e-3)
            assert smp["slow_steps"] == sum(x > 2 * smp["step_ms_p50"] + 1e-3 for x in steps)
            assert smp["read_ops_per_step"] == t["read_ops"] / 4
            assert smp["raw_read_ops_per_s"] is smp["raw_read_ops_per_s_after"] is None  # buffered io: no raw
            # reads beside the samples
            if smp["label"] != "B":
                assert smp["hit_rate"] is None and t["disk_rows"] == 0  # the host tier: no cache, no disk
            elif not with_cache:
                assert smp["hit_rate"] is None and t["hits"] == t["misses"] == 0
                assert t["disk_rows"] == t["rows"] and 0 < t["read_ops"] <= t["disk_rows"]
                assert t["bytes_read"] == t["read_ops"] * 4096
            else:
                assert t["hits"] + t["misses"] == t["rows"] and t["disk_rows"] == t["misses"]
                assert smp["hit_rate"] == pytest.approx(t["hits"] / t["rows"]) and 0 <= smp["hit_rate"] <= 1
        d = c["disk"]["B"]
        mine = [x for x in c["samples"] if x["label"] == "B"]
        recorded = [x for x in mine if x["round"] >= 0]
        assert [x["round"] for x in mine][0] == -1 and len(recorded) == 2
        assert d["arm"] == c["b"] and d["placement"] == names[c["b_index"]]
        assert d["fresh_tables"] is (c["batch"] == 1)  # the cache and counters live on across batch sizes
        assert d["hit_rate_cold_warmup"] == mine[0]["hit_rate"] and d["hit_rate_cold"] == recorded[0]["hit_rate"]
        assert d["read_ops_per_step_median"] == pytest.approx(sorted(x["read_ops_per_step"] for x in recorded)[1] / 2
                                                              + sorted(x["read_ops_per_step"] for x in recorded)[0] / 2)
        if with_cache:
            assert 0 <= d["hit_rate_cold_warmup"] <= d["hit_rate_warm"] <= 1
            if c["batch"] == 1:  # an empty cache: almost every row missed; the same windows then hit
                assert d["hit_rate_cold_warmup"] < 0.5 < d["hit_rate_warm"]
        else:
            assert d["hit_rate_cold_warmup"] is d["hit_rate_cold"] is d["hit_rate_warm"] is None
        # the bound, against A on the host tier in the same comparison
        host_ms = [x["step_ms"] for x in c["samples"] if x["label"] in ("A", "A'") and x["round"] >= 0]
        disk_ms = [x["step_ms"] for x in recorded]
        assert d["host_arm"] == host and d["host_source"] == "same comparison" and d["bound_note"] is None
        assert d["host_step_ms_median"] == pytest.approx(sorted(host_ms)[1] / 2 + sorted(host_ms)[2] / 2)
        assert d["step_ms_median"] == pytest.approx(sum(disk_ms) / 2)
        assert d["step_ms_p50_median"] == pytest.approx(sum(x["step_ms_p50"] for x in recorded) / 2)
        assert d["slow_steps"] == sum(x["slow_steps"] for x in recorded)
        bound = d["host_step_ms_median"] + d["read_ops_per_step_median"] / raw["read_ops_per_s"] * 1e3
        assert d["bound_ms"] == pytest.approx(bound) and d["ratio"] == pytest.approx(d["step_ms_median"] / bound)
        assert d["target_met"] is (d["ratio"] <= 1.1)
        assert d["raw_read_ops_per_s_samples_median"] is d["ratio_paired"] is d["paired_target"] is None
        assert d["raw_read_ops_per_s_after_median"] is d["ratio_bracketed"] is d["bracketed_target"] is None
        # the floor: one lookup's reads (read ops per step over the arm's two tables) as a raw call
        lr = d["lookup_reads"]
        if d["read_ops_per_step_median"] == 0:  # every row a cache hit: no lookup read anything
            assert lr is None and d["floor_ms"] is None
        else:
            assert lr["pages"] == math.ceil(d["read_ops_per_step_median"] / 2) and lr["calls"] >= 1
            assert lr["us_per_call_p50"] > 0
            assert d["floor_ms"] == pytest.approx(d["host_step_ms_median"] + lr["us_per_call_p50"] / 1e3)
            assert d["floor_ratio"] == pytest.approx(d["step_ms_median"] / d["floor_ms"])
    assert comps[0]["disk"]["B"]["read_ops_per_step_median"] > 0  # without a cache every step reads the disk
    b = comps[1]["arm_stats"]["B"]  # the cached arm's summary over its recorded samples
    assert b["hit_rate_median"] == comps[1]["disk"]["B"]["hit_rate_warm"]
    assert b["read_ops_per_step_median"] == comps[1]["disk"]["B"]["read_ops_per_step_median"]
    printed = capsys.readouterr().out
    assert "raw reads/s" in printed and "bound ms" in printed and "target ratio <= 1.1" in printed
    assert "paired ratio" in printed and "raw reads/s, samples" in printed and "B hit rate" in printed
    assert "floor ms" in printed and "floor = host step ms + one lookup's reads as a raw call" in printed


def test_an_o_direct_disk_arm_is_held_to_the_rate_measured_right_before_each_sample(tmp_path):
    out = tmp_path / "paired.json"
    direct = {"tier": "disk", "engram_config": {"cache_rows": 500, "io": "direct"}}
    rc = main(["bench", "placement", *DISK_FAST, "--batch-sizes", "1", "--out", str(out), "--kv-cache-memory",
               "64MiB", "--cache-dir", str(tmp_path / "cache"), "--a", '{"tier": "host"}',
               "--b", json.dumps(direct)])
    assert rc == 0
    res = json.loads(out.read_text())["result"]
    (c,) = res["comparisons"]
    if c["raw_reads"]["B"]["io"] != "direct":
        pytest.skip("this file system refuses O_DIRECT (the reader fell back to buffered io)")
    assert res["settings"]["raw_read_sample_seconds"] == 0.02
    d = c["disk"]["B"]
    for smp in c["samples"]:  # raw reads right before and right after every sample of the disk arm, warm-ups too
        for key in ("raw_read_ops_per_s", "raw_read_ops_per_s_after"):
            assert (smp[key] is None) is (smp["label"] != "B")
            assert smp[key] is None or smp[key] > 0
    recorded = [x for x in c["samples"] if x["label"] == "B" and x["round"] >= 0]
    rates = [x["raw_read_ops_per_s"] for x in recorded]
    assert d["raw_read_ops_per_s_samples_median"] == pytest.approx(sum(rates) / 2)
    # each recorded sample against the host step plus its own reads at the rate measured right before it
    paired = [x["step_ms"] / (d["host_step_ms_median"] + x["read_ops_per_step"] / x["raw_read_ops_per_s"] * 1e3)
              for x in recorded]
    assert d["ratio_paired"] == pytest.approx(sum(paired) / 2)
    lo, hi = d["ratio_paired_ci"]  # the bootstrap interval of that median, and the verdict it gives
    assert (lo, hi) == pytest.approx(stats.median_ci(paired, stats.ABConfig(**res["settings"]["ab"])))
    assert min(paired) <= lo <= d["ratio_paired"] <= hi <= max(paired)
    assert d["paired_target"] == ("met" if hi <= 1.1 else "missed" if lo > 1.1 else "undecided")
    # and against both rates: its reads charged the mean of their time at the rate before and at the rate after
    after = [x["raw_read_ops_per_s_after"] for x in recorded]
    assert d["raw_read_ops_per_s_after_median"] == pytest.approx(sum(after) / 2)
    bracketed = [x["step_ms"] / (d["host_step_ms_median"] + x["read_ops_per_step"] * 1e3
                                 * (1 / x["raw_read_ops_per_s"] + 1 / x["raw_read_ops_per_s_after"]) / 2)
                 for x in recorded]
    assert d["ratio_bracketed"] == pytest.approx(sum(bracketed) / 2)
    lo, hi = d["ratio_bracketed_ci"]
    assert (lo, hi) == pytest.approx(stats.median_ci(bracketed, stats.ABConfig(**res["settings"]["ab"])))
    assert d["bracketed_target"] == ("met" if hi <= 1.1 else "missed" if lo > 1.1 else "undecided")


def test_disk_arm_without_a_host_arm_says_the_bound_is_not_computed(tmp_path, capsys):
    out = tmp_path / "disk.json"
    rc = main(["bench", "placement", *DISK_FAST, "--batch-sizes", "1", "--out", str(out), "--kv-cache-memory",
               "64MiB", "--cache-dir", str(tmp_path / "cache"), "--a", '{"tier": "gpu"}',
               "--b", '{"tier": "disk", "engram_config": {"io": "buffered"}}', "--raw-read-sample-seconds", "0"])
    assert rc == 0
    (c,) = json.loads(out.read_text())["result"]["comparisons"]
    d = c["disk"]["B"]
    assert d["bound_ms"] is d["ratio"] is d["target_met"] is d["host_step_ms_median"] is None
    # no reads before the samples (turned off): nothing to pair them with
    assert {x["raw_read_ops_per_s"] for x in c["samples"]} == {x["raw_read_ops_per_s_after"] for x in c["samples"]} \
        == {None}
    assert d["raw_read_ops_per_s_samples_median"] is d["ratio_paired"] is d["paired_target"] is None
    assert d["ratio_bracketed"] is d["bracketed_target"] is None
    assert d["bound_note"] == NO_HOST_ARM and d["raw_read_ops_per_s"] > 0
    assert NO_HOST_ARM in capsys.readouterr().out


@pytest.fixture(scope="module")
def read_depths(tmp_path_factory):
    """One placement run, batches 1 and 2, over O_DIRECT disk arms whose read queue holds two steps' worth of
    one token's ids: A with the reader's depth of 2 x n_cols, B1 the same over buffered reads. Returns
    ({(batch, b_index, label): the raw rate's queue depth}, whether A read with O_DIRECT through per-thread
    AIO queues here, the reader's depth, the tables)."""
    from engram.model.presets import preset_config
    from engram.store.reader import queue_per_thread

    tmp_path = tmp_path_factory.mktemp("read-depths")
    out = tmp_path / "depths.json"
    n_cols = preset_config("tiny").engram.n_cols
    direct = {"tier": "disk", "engram_config": {"io": "direct", "queue_depth": 2 * n_cols}}
    shared = {"tier": "disk", "engram_config": {"io": "buffered", "queue_depth": 2 * n_cols}}
    rc = main(["bench", "placement", *DISK_FAST, "--out", str(out), "--kv-cache-memory", "64MiB", "--cache-dir",
               str(tmp_path / "cache"), "--a", json.dumps(direct), "--b", json.dumps(shared)])
    assert rc == 0
    comps = json.loads(out.read_text())["result"]["comparisons"]
    depth = {(c["batch"], c["b_index"], label): c["raw_reads"][label]["queue_depth"] for c in comps
             for label in ("A", "B")}
    direct_io = comps[0]["raw_reads"]["A"]["io"] == "direct" and queue_per_thread("direct")
    return depth, direct_io, 2 * n_cols, len(preset_config("tiny").engram.layer_ids)


def test_a_disk_arm_is_held_to_the_depth_its_steps_read_at(read_depths):
    """A batch-1 step's ids do not fill the read queue, so one table's reads are in flight at a time: the raw
    rate behind the bound is taken at the reader's depth. At batch 2 they fill it and the tables read side by
    side (engine/lookup.py ``reads_together``); with O_DIRECT each table's thread keeps its own AIO queue full,
    so the step keeps tables x depth reads in flight and the rate is taken there (disk_bound.read_depth).
    Buffered reads share one pool, which stays at the reader's depth however many tables read."""
    depth, direct, reader_depth, tables = read_depths
    assert tables >= 2 and len(depth) == 4
    assert depth == {(1, 1, "A"): reader_depth, (2, 1, "A"): reader_depth * (tables if direct else 1),
                     (1, 1, "B"): reader_depth, (2, 1, "B"): reader_depth}
