"""Packed q/k/v and gate/up: the layers' parameters become views of one weight (names, state dict and memory
unchanged) and the model computes what it computed before packing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engram.model.layers.packed_linear import pack_linears
from engram.model.loader import build_model
from engram.model.presets import init_random_weights
from tests.oracles.reference import prefill_logits


def test_pack_linears_makes_views_and_keeps_outputs():
    torch.manual_seed(0)
    a, b = nn.Linear(8, 3, bias=True).double(), nn.Linear(8, 5, bias=True).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    before = torch.cat([a(x), b(x)], -1)
    w, bias = pack_linears([a, b])
    assert w.shape == (8, 8) and a.weight.data_ptr() == w.data_ptr() and b.bias.data_ptr() == bias[3:].data_ptr()
    assert torch.allclose(torch.nn.functional.linear(x, w, bias), before, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="share in_features"):
        pack_linears([nn.Linear(8, 3), nn.Linear(7, 3)])


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_packed_model_computes_the_same_logits(qkv_bias):
    from engram.model.loader import load_model

    tiny = load_model("tiny", dtype=torch.float64, device="cpu", progress=False)
    cfg = tiny.model_config.replace(attention_bias=qkv_bias, architecture="qwen2" if qkv_bias else "qwen3",
                                    qk_norm=not qkv_bias)
    model = build_model(cfg, torch.float64, torch.device("cpu"))
    init_random_weights(model, 0)
    loaded = type(tiny)(**{**tiny.__dict__, "model": model, "model_config": cfg})
    ids = tiny.tokenizer.encode("The table store serves rows to every layer").ids
    names = sorted(n for n, _ in model.named_parameters())
    before = prefill_logits(loaded, ids)
    model.pack_projections()
    assert sorted(n for n, _ in model.named_parameters()) == names
    assert torch.allclose(prefill_logits(loaded, ids), before, rtol=0, atol=1e-10)
