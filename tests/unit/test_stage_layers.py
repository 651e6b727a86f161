"""A model of some of a decoder's layers (a pipeline stage's: ``decoder.keep_layers`` through ``load_model(layers=)``)
holds exactly those layers' weights, bitwise the whole model's, refuses to run the others, and ``StageModel`` refuses a
model whose layers are not its stage's."""
from __future__ import annotations

import pytest
import torch

from engram.model.decoder import EngramDecoder, LayerGap, keep_layers
from engram.model.loader import load_model
from engram.model.presets import preset_config
from engram.parallel.pp import Stage
from engram.parallel.pp_stage import StageModel


@pytest.fixture(scope="module")
def whole():
    return load_model("tiny", dtype=torch.float64, device="cpu", progress=False)


@pytest.mark.parametrize("layers", [range(0, 1), range(1, 3), range(3, 4)])
def test_kept_layers_are_the_whole_models(whole, layers):
    stage = load_model("tiny", dtype=torch.float64, device="cpu", progress=False, layers=layers)
    full = dict(whole.model.named_parameters())
    for name, p in stage.model.named_parameters():
        assert torch.equal(p, full[name]), name
    assert stage.model.held_layers == layers
    gaps = [l.layer_id for l in stage.model.model.layers if isinstance(l, LayerGap)]
    assert gaps == [i for i in range(4) if i not in layers]
    assert (stage.model.lm_head is None) == (layers.stop < 4)
    with pytest.raises(RuntimeError, match=f"layer {gaps[0]} is not held by this model"):
        stage.model.model.layers[gaps[0]](None)


@pytest.mark.parametrize("bad", [range(0, 0), range(2, 5), range(0, 4, 2)])
def test_bad_layer_ranges_are_refused(bad):
    with torch.device("meta"):
        model = EngramDecoder(preset_config("tiny"))
    with pytest.raises(ValueError, match="must be a contiguous range inside"):
        keep_layers(model, bad)


def test_stage_model_refuses_another_stages_layers():
    stage = load_model("tiny", dtype=torch.float64, device="cpu", progress=False, layers=range(0, 2))
    with pytest.raises(ValueError, match=r"stage 1 runs layers range\(2, 4\) but the model holds range\(0, 2\)"):
        StageModel(stage.model, Stage(1, 2, 4, 2.0), 2)
