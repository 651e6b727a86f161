"""One text_config rule (engram.config.hf_text_config) for the three config.json readers: EngramConfig,
ModelConfig and the PP sharing graph read the same fields from flat, nested and mixed configs."""
import json

import pytest

from engram.config import EngramConfig, hf_text_config
from engram.commands.config_names import named_config
from engram.model.model_config import ModelConfig
from engram.model.presets import preset_config
from engram.parallel.pp_graph import sharing_graph

# The tiny model with KV sharing, as a flat config.json.
MODEL = preset_config("tiny").replace(kv_source_layer_ids=(0, 2), chat_template=None)
FLAT = MODEL.to_hf_dict()
ENGRAM_KEYS = [k for k in FLAT if k.startswith("engram_") and k != "engram_logit_vocab_size"]


def _split(top_keys):
    """FLAT with ``top_keys`` at the top level and every other field under text_config."""
    return {**{k: FLAT[k] for k in top_keys}, "text_config": {k: v for k, v in FLAT.items() if k not in top_keys}}


LAYOUTS = {
    "flat": FLAT,
    "nested": {"architectures": ["Wrapper"], "text_config": dict(FLAT)},
    # the V4.1-style split: Engram fields at the top, the decoder under text_config
    "engram at the top": _split(ENGRAM_KEYS),
    # the other way round: decoder fields at the top, Engram and KV sharing under text_config
    "decoder at the top": _split([k for k in FLAT if k not in ENGRAM_KEYS and k != "kv_source_layer_ids"]),
    # a wrapper whose own hidden_size / num_hidden_layers must not shadow the text model's
    "wrapper fields shadowed": {"hidden_size": 1152, "num_hidden_layers": 27, "vision_config": {"hidden_size": 1152},
                                "text_config": dict(FLAT)},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_three_readers_agree(layout, tmp_path):
    raw = LAYOUTS[layout]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for source in (raw, tmp_path, tmp_path / "config.json"):
        fields = hf_text_config(source)
        assert {k: fields.get(k) for k in FLAT} == FLAT  # plus the wrapper's own fields, if any
        engram = EngramConfig.from_hf_config(source)
        graph = sharing_graph(source)
        assert engram == MODEL.engram
        assert (graph.num_layers, graph.kv_sources, graph.engram_layers) == (4, (0, 2), MODEL.engram.layer_ids)
    model = ModelConfig.from_hf_dict(raw, name="tiny")
    assert model == MODEL.replace(init_seed=0) and model.engram == engram
    assert graph.kv_source_of(3) == model.kv_source(3) == 2


def test_text_config_fields_win_and_top_level_fields_fill_in():
    raw = {"model_type": "wrapper", "image_token_id": 7, "hidden_size": 1,
           "text_config": {"model_type": "qwen3", "hidden_size": 64}}
    assert hf_text_config(raw) == {"model_type": "qwen3", "image_token_id": 7, "hidden_size": 64}
    assert raw["text_config"] == {"model_type": "qwen3", "hidden_size": 64}  # the input is not changed
    assert hf_text_config({"a": 1, "text_config": None}) == {"a": 1}


def test_v41_image_token_at_the_top_level_is_the_dead_token():
    fields = named_config("deepseek-v4.1-flash")
    nested = {"image_token_id": fields["image_token_id"],
              "text_config": {k: v for k, v in fields.items() if k != "image_token_id"}}
    assert EngramConfig.from_hf_config(nested) == EngramConfig.preset("deepseek-v4.1-flash")
    assert EngramConfig.from_hf_config(nested).dead_token_ids == (129264,)
    assert sharing_graph(nested) == sharing_graph(fields)


def test_text_config_must_be_an_object():
    for reader in (hf_text_config, EngramConfig.from_hf_config, sharing_graph,
                   lambda raw: ModelConfig.from_hf_dict(raw)):
        with pytest.raises(ValueError, match=r"^text_config=\[1\]: must be a JSON object"):
            reader({"text_config": [1]})
