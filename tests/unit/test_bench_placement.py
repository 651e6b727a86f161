"""`engram bench placement` on the CPU with the tiny preset: both tiers' engines run interleaved in one
process over the same corpus windows, every sample is a positive tok/s whose sequences emitted exactly
their forced ids, the result JSON holds what the docs promise, and a bad arm stops the command before
anything loads. Also ``measure_decode(..., forced=...)``."""
import json
import types

import numpy as np
import pytest
import torch

from engram.bench import engine_steps, placement_ab
from engram.cli import main
from engram.commands.options import parse_bytes

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
    assert t.token_ids == [f[:5] for f in forced] and len(t.wall_s) == 3 and t.lookup_exposed_s == 0.0
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
    w = placement_ab.cut_windows(stream, 3, 8, 4)
    assert w.offsets == [0, 10, 20]
    assert w.prompts[1] == list(range(110, 118)) and w.forced[1] == list(range(118, 122))
    assert w.prompts[2] == list(range(120, 128)) and w.forced[2] == [128, 129, 100, 101]  # wraps around
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        placement_ab.corpus_stream([(np.array([1, 2]), np.array([4096]))], 4096)


def test_check_forced_names_the_arm_sequence_and_position():
    win = placement_ab.Windows([0, 5], [[1], [2]], [[7, 8, 9], [4, 5, 6]])
    ok = types.SimpleNamespace(token_ids=[[7, 8], [4, 5, 6]])
    assert placement_ab.check_forced(ok, win, 2, "A") == 5
    with pytest.raises(placement_ab.OutputMismatch, match="arm B: sequence 1 emitted id 9 at position 1"):
        placement_ab.check_forced(types.SimpleNamespace(token_ids=[[7, 8], [4, 9]]), win, 2, "B")
    with pytest.raises(placement_ab.OutputMismatch, match="sequence 0 generated 2 ids, fewer than 3"):
        placement_ab.check_forced(ok, win, 3, "A")


@pytest.mark.parametrize("option, text, message", [
    ("--b", '{"tier": "host", "cache_rows": 5}', r"--b\[1\]: unknown key 'cache_rows'"),
    ("--b", '{"tier": "disk"}', r"--b\[1\]: key 'tier'='disk' must be one of"),
    ("--b", '{"lookup_overlap": true}', r"--b\[1\]: key 'tier' is missing"),
    ("--b", '{"tier": "gpu", "lookup_overlap": 1}', r"--b\[1\]: key 'lookup_overlap'=1 must be true or false"),
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


def test_shared_options_leave_the_arms_options_to_the_arms(monkeypatch):
    monkeypatch.setattr("engram.model.loader.random_model", None)  # never reached
    for key in ("lookup_overlap", "cpu_offload"):
        with pytest.raises(SystemExit, match=f"--engram-config: key '{key}' is set per arm"):
            main(["bench", "placement", *FAST, "--engram-config", json.dumps({key: True})])
    with pytest.raises(SystemExit, match="--engram-config: .*unknown key"):
        main(["bench", "placement", *FAST, "--engram-config", '{"tabel_rows": 5}'])


def test_parse_bytes():
    assert parse_bytes("8GiB", "--kv") == 8 << 30 and parse_bytes("512M", "--kv") == 512 << 20
    assert parse_bytes("12345", "--kv") == 12345
    with pytest.raises(SystemExit, match="--kv: '8 parsecs'"):
        parse_bytes("8 parsecs", "--kv")
    import argparse

    from engram.commands.options import add_engine_arguments

    p = argparse.ArgumentParser()
    add_engine_arguments(p)  # serve / generate / check take the same units
    assert p.parse_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 << 30
    assert p.parse_args([]).kv_cache_memory is None


# ----------------------------------------------------------------- the command
def test_placement_bench_runs_both_tiers_interleaved_and_writes_every_field(tmp_path, capsys):
    out, png = tmp_path / "placement.json", tmp_path / "runs.png"
    rc = main(["bench", "placement", *FAST, "--out", str(out), "--plot", str(png), "--kv-cache-memory", "64MiB"])
    assert rc == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["runs-b1-batch1.png", "runs-b1-batch2.png"]
    doc = json.loads(out.read_text())
    assert doc["name"] == "placement-tiny" and doc["config"]["model"] is None
    res = doc["result"]
    a, b = {"tier": "gpu", "lookup_overlap": False}, {"tier": "host", "lookup_overlap": True}  # the defaults
    assert res["arms"] == {"A": a, "B": [b]}
    assert res["model"]["name"] == "tiny" and res["model"]["device"] == "cpu"
    assert set(res["tables"]) == {"gpu", "host"}
    assert {t["type"] for t in res["tables"]["gpu"].values()} == {"GpuTable"}
    assert {t["type"] for t in res["tables"]["host"].values()} == {"HostTable"}
    assert all(t["bytes"] > 0 for tier in res["tables"].values() for t in tier.values())
    assert res["kv_cache_memory"]["bytes"] == 64 << 20 == res["engine_config"]["kv_cache_memory"]
    assert len(set(res["kv_cache_memory"]["kv_blocks"].values())) == 1  # one budget, the same KV cache for both
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
            assert s["lookup_exposed_s"] == 0.0  # no lookup stream on the CPU
            assert s["tokens_checked"] >= c["batch"] * (2 + 4)  # every emitted id was its forced id
            assert s["tok_s"] == pytest.approx(c["batch"] * 4 / s["wall_s"])
        assert set(c["arm_stats"]) == {"A", "A'", "B"} and c["arm_stats"]["B"]["n"] == 2
    printed = capsys.readouterr().out
    assert "tok/s A" in printed and "A/A CI" in printed and f"result: {out}" in printed
