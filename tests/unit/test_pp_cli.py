"""`engram plan-pp`: text and JSON plans (exit 0), errors (exit 2), the environment partition, and the
installed entry point run as a fresh process."""
import json
import subprocess
import sys

import pytest

from engram.cli import main
from engram.config import PRESETS, EngramConfig
from engram.commands.config_names import config_names, named_config
from engram.parallel.pp import PARTITION_ENV
from tests.pp_configs import V41_FLASH


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    (tmp_path / "config.json").write_text(json.dumps(V41_FLASH))
    return str(tmp_path / "config.json")


def test_text_plan(config, capsys):
    assert main(["plan-pp", config, "--pp", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "  kv        2 -> 3-7; 8 -> 9-13; 14 -> 15-19; 20 -> 21-39" in out
    assert "  index_k   20 -> 24, 28, 32, 36" in out
    assert "  candidate 20 -> 24, 28, 32, 36" in out
    assert "inputs: Engram layers 1, 14 need the step's token ids and lookbacks" in out
    assert "legal cut points: 1-2, 8, 14, 20" in out
    assert "partition: 8,6,6,20 (planner; largest stage cost 20)" in out
    assert out[-1].startswith("  stage 3: layers 20-39 (cost 20); kv caches 20; index caches 20, 24, 28, 32, 36")


def test_json_plan_with_explicit_partition(config, capsys):
    assert main(["plan-pp", config, "--pp", "2", "--partition", "20,20", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["partition"] == [20, 20] and plan["partition_origin"] == "partition"
    assert plan["legal_cut_points"] == [1, 2, 8, 14, 20]
    assert plan["edges"]["index_k"] == [[20, 24], [20, 28], [20, 32], [20, 36]]
    assert plan["inputs"] == {"token_ids_and_lookbacks": [1, 14]}
    assert [s["layers"] for s in plan["stages"]] == [[0, 20], [20, 40]]
    assert [s["kv_cache_layers"] for s in plan["stages"]] == [[2, 8, 14], [20]]
    assert [s["needs_token_ids"] for s in plan["stages"]] == [True, False]


def test_rejected_cut_exits_2_with_the_error(config, capsys):
    assert main(["plan-pp", config, "--pp", "4", "--partition", "10,10,10,10"]) == 2
    err = capsys.readouterr().err
    assert "  kv source layer 8 (stage 0) -> layer 10 (stage 1)\n" in err
    assert err.rstrip().endswith("suggested partition: 8,6,6,20")


def test_json_error(config, capsys):
    assert main(["plan-pp", config, "--pp", "4", "--partition", "10,10,10,10", "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert out["error_type"] == "NotImplementedError" and "suggested partition: 8,6,6,20" in out["error"]


def test_environment_partition(config, capsys, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "2,6,12,20")
    assert main(["plan-pp", config, "--pp", "4"]) == 0
    assert f"partition: 2,6,12,20 ({PARTITION_ENV}; largest stage cost 20)" in capsys.readouterr().out


def test_config_errors_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**V41_FLASH, "kv_source_layer_ids": [8, 14, 20], "index_source_layer_ids": [8, 14, 20],
                               "candidate_source_layer_id": -1}))
    assert main(["plan-pp", str(bad), "--pp", "2"]) == 2
    assert "kv_source_layer_ids=[8, 14, 20]: layer 2 has no preceding kv source" in capsys.readouterr().err
    assert main(["plan-pp", str(tmp_path / "missing.json"), "--pp", "2"]) == 2
    assert "CONFIG='" in (err := capsys.readouterr().err)
    assert "missing.json': no such file or directory, and not a config name ['4b-like', '8b-like'," in err
    assert main(["plan-pp", str(bad), "--pp", "2", "--layer-costs", "1,x"]) == 2
    assert "--layer-costs='1,x'" in capsys.readouterr().err


def test_costs_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "engram_layer_ids": [0]}))
    assert main(["plan-pp", str(tmp_path), "--pp", "2", "--layer-costs", "3,1,1,1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["partition"] == [1, 3]
    assert main(["plan-pp", str(tmp_path), "--pp", "2", "--engram-cost", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["partition"] == [1, 3]
    assert main(["plan-pp", str(tmp_path), "--pp", "2", "--engram-cost", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["partition"] == [2, 2]


def test_fresh_process(config):
    done = subprocess.run([sys.executable, "-m", "engram.cli", "plan-pp", config, "--pp", "2"],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "partition: 20,20 (planner; largest stage cost 21)" in done.stdout


@pytest.mark.parametrize("name", config_names())
def test_every_config_name(name, capsys, monkeypatch):
    """Every name another command takes (Engram presets, model presets) plans, from its layer count; v4-small-like
    at one stage: two stages of 8 layers hold a bf16 sliding page (block_size 16) smaller than an HCA compressor's
    state, which a page must hold (cache_layout), and plan-pp says so."""
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    pp = "2"
    if name == "v4-small-like":
        assert main(["plan-pp", name, "--pp", "2", "--json"]) == 2
        assert "engine.block_size is too small for DeepSeek-V4's compressor state" in capsys.readouterr().out
        pp = "1"
    assert main(["plan-pp", name, "--pp", pp, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    raw = named_config(name)
    assert plan["num_hidden_layers"] == raw["num_hidden_layers"] and sum(plan["partition"]) == raw["num_hidden_layers"]
    assert plan["inputs"]["token_ids_and_lookbacks"] == raw["engram_layer_ids"]
    if name in PRESETS:
        assert plan["inputs"]["token_ids_and_lookbacks"] == list(EngramConfig.preset(name).layer_ids)


def test_model_preset_name(capsys, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    from engram.model.presets import preset_config

    cfg = preset_config("tiny")
    assert main(["plan-pp", "tiny", "--pp", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sum(plan["partition"]) == cfg.num_layers
    assert plan["inputs"]["token_ids_and_lookbacks"] == list(cfg.engram_layer_ids)
