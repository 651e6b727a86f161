"""engram.configs: the shipped layout files hold the published numbers, every preset name resolves, and a
name, a file and a directory resolve to the same config."""
import json

import pytest

from engram.config import PRESETS, EngramConfig
from engram.commands.config_names import config_names, named_config, resolve_config
from engram.configs import CONFIG_DIR, SHIPPED, shipped_config_path
from engram.model.presets import MODEL_PRESETS, preset_config

# DeepSeek-V4.1-Flash, as published (text_config of the public checkpoint config), written out here
# independently of the shipped file.
V41_FLASH_PUBLISHED = {
    "num_hidden_layers": 40,
    "hidden_size": 5120,
    "hc_mult": 4,
    "rms_norm_eps": 1e-20,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048,
    "image_token_id": 129264,
    "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 16000000,
    "engram_compressed_vocab_size": 99092,
    "engram_pad_token_id": 2,
}


def test_shipped_v41_file_holds_the_published_numbers_only():
    assert named_config("deepseek-v4.1-flash") == V41_FLASH_PUBLISHED
    cfg = EngramConfig.preset("deepseek-v4.1-flash")
    assert cfg.dead_token_ids == (129264,) and cfg.rms_norm_eps == 1e-20 and cfg.hc_mult == 4
    assert (cfg.variant, cfg.row_dtype, cfg.seed) == ("v41", "mxfp8", 0)


def test_shipped_paper_demo_file_is_the_demo_backbone():
    raw = named_config("paper-demo")
    assert (raw["num_hidden_layers"], raw["hidden_size"], raw["hc_mult"], raw["vocab_size"]) == (30, 1024, 4, 129280)
    cfg = EngramConfig.preset("paper-demo")
    assert cfg.vocab_size == (129280 * 5, 129280 * 5) and cfg.head_dim == 512 // 8 and cfg.row_dtype == "fp32"


def test_shipped_files_live_in_the_package_folder():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.json")) == sorted(SHIPPED)
    for name in SHIPPED:
        assert shipped_config_path(name) == CONFIG_DIR / f"{name}.json"
    with pytest.raises(ValueError, match="config name 'tiny' is not a shipped layout"):
        shipped_config_path("tiny")


def test_every_engram_and_model_preset_is_a_config_name():
    names = set(config_names())
    assert set(PRESETS) <= names and set(MODEL_PRESETS) <= names and set(SHIPPED) <= names
    assert names == set(SHIPPED) | set(MODEL_PRESETS)
    for name in PRESETS:  # the named config carries exactly the Engram preset
        assert EngramConfig.from_hf_config(named_config(name)) == EngramConfig.preset(name)
    for name in MODEL_PRESETS:
        assert EngramConfig.from_hf_config(named_config(name)) == preset_config(name).engram
        assert named_config(name)["num_hidden_layers"] == preset_config(name).num_layers


def test_resolve_name_file_and_directory(tmp_path, monkeypatch):
    path = shipped_config_path("deepseek-v4.1-flash")
    assert resolve_config("deepseek-v4.1-flash", "CONFIG") == resolve_config(path, "CONFIG") == V41_FLASH_PUBLISHED
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    assert resolve_config(tmp_path, "--config") == {"num_hidden_layers": 3}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()  # a name wins over a directory of the same name, as in load_model
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    assert resolve_config("tiny", "CONFIG") == preset_config("tiny").to_hf_dict()
    with pytest.raises(ValueError, match=r"^--config='nope': no such file or directory, and not a config name "
                                         r"\['4b-like', '8b-like', 'deepseek-v4.1-flash', "
                                         r"'paper-demo', 'small', 'tiny', 'v4-small-like'\]$"):
        resolve_config("nope", "--config")
    with pytest.raises(ValueError, match="config name 'nope' is unknown; known: "):
        named_config("nope")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"bad\.json: expected a JSON object, found list"):
        resolve_config("bad.json", "CONFIG")
