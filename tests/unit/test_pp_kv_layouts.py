"""`engram plan-pp` and the runtime (ModelConfig, load_model) judge a KV-sharing layout by one rule
(engram.model.sharing_fields): the same config is accepted by both or refused by both with the same
message. DeepSeek-V4.1 layouts are planned, and refused by the runtime for the attention it lacks."""
import json

import pytest
import torch

from engram.cli import main
from engram.commands.config_names import named_config
from engram.model.loader import load_model, random_model, save_model
from engram.model.model_config import ModelConfig
from engram.model.presets import preset_config
from engram.parallel.pp import PARTITION_ENV
from engram.model.sharing_fields import source_layer_ids

TINY = preset_config("tiny")  # 4 layers, no KV sharing

ACCEPTED = [[0], [0, 2], [0, 1, 2, 3]]
REFUSED = {  # kv_source_layer_ids -> the message both give
    (2,): "kv_source_layer_ids=[2]: layer 0 has no preceding kv source",
    (): "kv_source_layer_ids=[]: layer 0 has no preceding kv source",
    (1, 2, 3): "kv_source_layer_ids=[1, 2, 3]: layer 0 has no preceding kv source",
    (0, 2, 2): "kv_source_layer_ids=[0, 2, 2]: layer 2 is listed more than once",
    (0, 3, 2): "kv_source_layer_ids=[0, 3, 2]: must be sorted ascending",
    (0, 4): "kv_source_layer_ids=[0, 4]: layer 4 is out of range [0, 4) (num_hidden_layers=4)",
    (0, 2.0): "kv_source_layer_ids=[0, 2.0]: entry 2.0 is not an int",
    (0, True): "kv_source_layer_ids=[0, True]: entry True is not an int",
    (0, "2"): "kv_source_layer_ids=[0, '2']: entry '2' is not an int",
    2: "kv_source_layer_ids=2: must be a list of layer ids",
}


@pytest.fixture(autouse=True)
def _no_env_partition(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)


def _config_dir(tmp_path, kv):
    raw = TINY.to_hf_dict()
    raw["kv_source_layer_ids"] = list(kv) if isinstance(kv, tuple) else kv
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return d, raw


def _plan_pp(path, capsys):
    code = main(["plan-pp", str(path), "--pp", "1", "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kv", list(REFUSED), ids=repr)
def test_refused_by_both_with_the_same_message(kv, tmp_path, capsys):
    d, raw = _config_dir(tmp_path, kv)
    message = REFUSED[kv]
    code, out = _plan_pp(d, capsys)
    assert (code, out) == (2, {"error": message, "error_type": "ValueError"})
    with pytest.raises(ValueError) as from_dict:
        ModelConfig.from_hf_dict(raw)
    with pytest.raises(ValueError) as loading:
        load_model(d, device="cpu", progress=False)  # refused at config.json, before any weight is read
    with pytest.raises(ValueError) as constructed:
        TINY.replace(kv_source_layer_ids=list(kv) if isinstance(kv, tuple) else kv)
    assert str(from_dict.value) == str(loading.value) == str(constructed.value) == message


@pytest.mark.parametrize("kv", ACCEPTED, ids=repr)
def test_accepted_by_both_with_the_same_sources(kv, tmp_path, capsys):
    cfg = TINY.replace(kv_source_layer_ids=tuple(kv))
    ckpt = save_model(tmp_path / "ckpt", random_model(cfg, cache_dir=tmp_path / "cache", progress=False))
    code, plan = _plan_pp(ckpt, capsys)
    assert code == 0
    [stage] = plan["stages"]
    loaded = load_model(ckpt, device="cpu", dtype=torch.float32, cache_dir=tmp_path / "cache", progress=False)
    mcfg = loaded.model_config
    assert mcfg.kv_source_layer_ids == tuple(kv)
    assert stage["kv_cache_layers"] == list(mcfg.kv_layers) == kv  # what the planner allocates, the runtime owns
    pairs = {(s, c) for s, c in plan["edges"]["kv"]}
    assert pairs == {(mcfg.kv_source(layer), layer) for layer in range(4) if mcfg.kv_source(layer) != layer}


def test_v41_layout_is_planned_and_the_runtime_names_the_attention_it_lacks(tmp_path, capsys):
    raw = named_config("deepseek-v4.1-flash")
    assert main(["plan-pp", "deepseek-v4.1-flash", "--pp", "4"]) == 0
    assert "partition: 8,6,6,20" in capsys.readouterr().out
    # the KV layout itself passes the shared rule (layers 0 and 1 are sliding-window only)
    assert source_layer_ids(raw["kv_source_layer_ids"], "kv_source_layer_ids", "kv", 40,
                            tuple(raw["compress_ratios"])) == (2, 8, 14, 20)
    llama = {**TINY.to_hf_dict(), **raw, "model_type": "llama", "num_attention_heads": 40, "intermediate_size": 8}
    with pytest.raises(ValueError, match=r"^compress_ratios=\[0, 0, 2, .*\]: DeepSeek-V4.1 attention \(compressed KV, "
                                         r"indexer, candidate blocks\) is not implemented by the runtime decoder"):
        ModelConfig.from_hf_dict(llama)
    without_ratios = {k: v for k, v in llama.items() if k != "compress_ratios"}
    with pytest.raises(ValueError, match=r"^index_source_layer_ids=\[2, 8, 14, 20, 24, 28, 32, 36\]: DeepSeek-V4.1"):
        ModelConfig.from_hf_dict(without_ratios)
    # without any V4.1 field, [2, 8, 14, 20] is refused by both by the shared rule: layer 0 has no source
    dense = {k: v for k, v in without_ratios.items() if k not in ("index_source_layer_ids", "candidate_source_layer_id",
                                                                   "candidate_topk_blocks")}
    message = "kv_source_layer_ids=[2, 8, 14, 20]: layer 0 has no preceding kv source"
    with pytest.raises(ValueError) as refused:
        ModelConfig.from_hf_dict(dense)
    assert str(refused.value) == message
    (tmp_path / "config.json").write_text(json.dumps(dense))
    assert main(["plan-pp", str(tmp_path), "--pp", "1"]) == 2
    assert capsys.readouterr().err.strip() == f"engram plan-pp: ValueError: {message}"


def test_disabled_candidate_fields_are_not_v41_attention():
    raw = {**TINY.to_hf_dict(), "candidate_source_layer_id": -1, "candidate_topk_blocks": 0, "compress_ratios": None}
    assert ModelConfig.from_hf_dict(raw, name="tiny") == TINY.replace(chat_template=None, init_seed=0)
