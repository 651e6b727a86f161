"""`engram plan-pp` on a DeepSeek-V4 config: each stage's local allocation names exactly the cache groups of its own
layers, the same ``cache_layout`` the engine's block manager and the Worker's pool use for those layers; configs the
runtime does not serve as V4 (V4.1 attention, other models) carry no groups."""
from __future__ import annotations

import json

import pytest
import torch

from engram.cli import main
from engram.model.deepseek_v4.cache_layout import cache_layout
from engram.model.deepseek_v4.config import V4Config
from engram.parallel.pp import PARTITION_ENV, local_allocation, plan_pipeline, served_v4
from tests.parity.deepseek_v4_fixtures import ENGRAM, SHAPE

RAW = dict(SHAPE, model_type="deepseek_v4", **ENGRAM.to_hf_fields())  # sliding, CSA, HCA, CSA


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(RAW))
    return str(path)


@pytest.mark.parametrize("partition", [(1, 3), (2, 2), (3, 1), (1, 1, 2)])
def test_each_stage_names_the_groups_of_its_layers(partition):
    plan = plan_pipeline(RAW, len(partition), partition=partition)
    v4 = V4Config.from_hf_dict(RAW)
    seen = []
    for s, stage in enumerate(plan.stages):
        a = local_allocation(plan, s, block_size=16, cache_dtype=torch.float64)
        want = cache_layout(v4, torch.float64, 16, list(stage.layers))
        assert a.cache_layout == want
        for g in a.cache_layout.groups:
            assert set(g.layers) <= set(stage.layers)
            seen += [(g.name, x) for x in g.layers]
    whole = cache_layout(v4, torch.float64, 16)
    assert sorted(seen) == sorted((g.name, x) for g in whole.groups for x in g.layers)  # nothing lost, nothing twice


def test_cli_prints_and_emits_the_groups(config, capsys):
    assert main(["plan-pp", config, "--pp", "2", "--partition", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers 0-0" in out and "cache groups sliding 0 (pages of" in out
    assert "cache groups sliding 1-3, csa 1, 3, hca 2, state 1-3" in out
    assert main(["plan-pp", config, "--pp", "2", "--partition", "1,3", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert list(stages[0]["cache_groups"]["groups"]) == ["sliding"]
    assert stages[1]["cache_groups"]["groups"]["csa"]["layers"] == [1, 3]
    assert stages[1]["cache_groups"]["groups"]["state"]["pages_per_sequence"] >= 1


def test_other_configs_carry_no_groups(capsys, monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert served_v4(dict(RAW, model_type="deepseek_v41", kv_source_layer_ids=[1])) is None  # V4.1 attention
    assert main(["plan-pp", "deepseek-v4.1-flash", "--pp", "2", "--json"]) == 0
    assert all("cache_groups" not in s for s in json.loads(capsys.readouterr().out)["stages"])
    plan = plan_pipeline({"num_hidden_layers": 4}, 2)
    assert local_allocation(plan, 0).cache_layout is None
    with pytest.raises(ValueError, match="layer_types"):
        served_v4(dict(RAW, layer_types=["sliding_attention"]))  # a bad deepseek_v4 config names its field
