"""Weight loading: V4.1 names with an FP8 wkv and 32x32 block scales (dequantized at load), the demo's
names for the paper variant, table tensors skipped, safetensors without reading the table, clear errors."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from engram.config import EngramConfig
from engram.module import Engram
from engram.weights import dequantize_block_fp8, load_engram_weights, read_safetensors, v41_prefix

PREFIX = v41_prefix(1)


def v41_cfg(hc: int = 4) -> EngramConfig:
    # H = 40 and n_cols*head_dim = 4*20 = 80: neither is a multiple of 32, so edge blocks are partial.
    return EngramConfig(layer_ids=(1, 14), max_ngram_size=3, n_heads=2, head_dim=20, vocab_size=101,
                        compressed_vocab_size=50, pad_token_id=0, hidden_size=40, hc_mult=hc, rms_norm_eps=1e-20,
                        variant="v41", row_dtype="bf16")


def quantize_blocks(w: torch.Tensor, block: int = 32):
    """The test's own 32x32 block FP8 quantizer: (fp8 weight, E8M0 scale bytes, exact float32 dequant)."""
    out_f, in_f = w.shape
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(out_f / block), math.ceil(in_f / block), dtype=torch.uint8)
    expect = torch.empty(out_f, in_f)
    for bo in range(scale.shape[0]):
        for bi in range(scale.shape[1]):
            sl = (slice(bo * block, (bo + 1) * block), slice(bi * block, (bi + 1) * block))
            e = math.ceil(math.log2(float(w[sl].abs().max()) / 448.0))
            q[sl] = (w[sl] / 2.0 ** e).to(torch.float8_e4m3fn)
            scale[bo, bi] = e + 127
            expect[sl] = q[sl].to(torch.float32) * 2.0 ** e
    return q, scale, expect


def v41_checkpoint(cfg: EngramConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out_f, in_f = cfg.hidden_size * (cfg.hc_mult + 1), cfg.n_cols * cfg.head_dim
    wkv = torch.randn(out_f, in_f, generator=g) * 0.05
    wkv[:32, :32] *= 1e-3  # a block with a very different scale
    q, scale, expect = quantize_blocks(wkv)
    sd = {
        PREFIX + "wkv.weight": q,
        PREFIX + "wkv.scale": scale.view(torch.float8_e8m0fnu),
        PREFIX + "q_weight": torch.randn(cfg.hc_mult, cfg.hidden_size, generator=g).to(torch.bfloat16),
        PREFIX + "k_weight": torch.randn(cfg.hc_mult, cfg.hidden_size, generator=g).to(torch.bfloat16),
        PREFIX + "embed.weight": torch.zeros(7, cfg.head_dim, dtype=torch.float8_e4m3fn),
        PREFIX + "embed.scale": torch.zeros(7, 1, dtype=torch.float8_e8m0fnu),
        v41_prefix(14) + "q_weight": torch.zeros(1),  # another layer: ignored
        "layers.1.attn.wq.weight": torch.zeros(1),  # not Engram: ignored
    }
    return sd, expect


def test_fp8_wkv_block_scales_dequantized_exactly_at_load():
    cfg = v41_cfg()
    sd, expect = v41_checkpoint(cfg)
    layer = Engram(cfg, 1)
    skipped = load_engram_weights(layer, sd, prefix=PREFIX)
    assert sorted(skipped) == [PREFIX + "embed.scale", PREFIX + "embed.weight"]
    assert layer.wkv.weight.dtype == torch.float32
    assert torch.equal(layer.wkv.weight.detach(), expect)  # FP8 x 2**e is exact in float32
    assert torch.equal(layer.q_weight.detach(), sd[PREFIX + "q_weight"].float())
    assert torch.equal(layer.k_weight.detach(), sd[PREFIX + "k_weight"].float())
    hidden = torch.randn(5, cfg.hc_mult, cfg.hidden_size)
    rows = torch.randn(5, cfg.n_cols, cfg.head_dim)
    dense = Engram(cfg, 1)
    dense.load_state_dict({"wkv.weight": expect, "q_weight": layer.q_weight, "k_weight": layer.k_weight})
    assert torch.equal(layer(hidden, rows), dense(hidden, rows))


@pytest.mark.parametrize("kind", ["uint8", "float32", "alias"])
def test_scale_encodings_agree(kind):
    cfg = v41_cfg(hc=1)
    sd, expect = v41_checkpoint(cfg, seed=3)
    bytes_ = sd[PREFIX + "wkv.scale"].view(torch.uint8)
    if kind == "uint8":
        sd[PREFIX + "wkv.scale"] = bytes_
    elif kind == "float32":
        sd[PREFIX + "wkv.scale"] = torch.exp2(bytes_.float() - 127)
    else:
        sd[PREFIX + "wkv.weight_scale_inv"] = sd.pop(PREFIX + "wkv.scale")
    layer = Engram(cfg, 1)
    load_engram_weights(layer, sd, prefix=PREFIX)
    assert torch.equal(layer.wkv.weight.detach(), expect)


def test_dequantize_block_fp8_edges():
    w = torch.full((33, 40), 3.0).to(torch.float8_e4m3fn)  # 2 x 2 blocks, the last ones partial
    scale = torch.tensor([[127, 0], [128, 126]], dtype=torch.uint8)
    out = dequantize_block_fp8(w, scale)
    assert torch.equal(out[:32, :32], torch.full((32, 32), 3.0))
    assert torch.equal(out[:32, 32:], torch.zeros(32, 8))  # byte 0 -> exactly 0, not 2**-127
    assert torch.equal(out[32:, :32], torch.full((1, 32), 6.0))
    assert torch.equal(out[32:, 32:], torch.full((1, 8), 1.5))
    assert torch.equal(dequantize_block_fp8(w.view(torch.uint8), scale), out)  # raw E4M3 bytes
    with pytest.raises(ValueError, match="scale has shape \\(2, 1\\), expected \\[2, 2\\]"):
        dequantize_block_fp8(w, scale[:, :1], name="wkv.weight")


def test_bf16_wkv_without_scale_and_module_dtype():
    cfg = v41_cfg(hc=2)
    g = torch.Generator().manual_seed(1)
    src = {k: torch.randn(v.shape, generator=g).to(torch.bfloat16) for k, v in Engram(cfg, 1).state_dict().items()}
    layer = Engram(cfg, 1).to(torch.bfloat16)
    load_engram_weights(layer, src)
    for name, value in layer.state_dict().items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, src[name])


def test_errors_name_key_layer_and_shapes():
    cfg = v41_cfg()
    sd, _ = v41_checkpoint(cfg)
    layer = Engram(cfg, 1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    no_scale = {k: v for k, v in sd.items() if not k.endswith("wkv.scale")}
    with pytest.raises(ValueError, match="layer 1 .*layers.1.engram.wkv.weight is torch.float8_e4m3fn but no "
                                         "layers.1.engram.wkv.scale"):
        load_engram_weights(layer, no_scale, prefix=PREFIX)
    bad_scale = dict(sd, **{PREFIX + "wkv.scale": sd[PREFIX + "wkv.scale"][:, :2]})
    with pytest.raises(ValueError, match="layers.1.engram.wkv.weight: scale has shape \\(7, 2\\), expected \\[7, 3\\]"):
        load_engram_weights(layer, bad_scale, prefix=PREFIX)
    bad_q = dict(sd, **{PREFIX + "q_weight": torch.zeros(3, 40)})
    with pytest.raises(ValueError, match="layers.1.engram.q_weight has shape \\(3, 40\\), expected \\[4, 40\\]"):
        load_engram_weights(layer, bad_q, prefix=PREFIX)
    missing = {k: v for k, v in sd.items() if not k.endswith("k_weight")}
    with pytest.raises(ValueError, match="missing \\['layers.1.engram.k_weight'\\]"):
        load_engram_weights(layer, missing, prefix=PREFIX)
    extra = dict(sd, **{PREFIX + "wkv.bias": torch.zeros(200)})
    with pytest.raises(ValueError, match="unexpected \\['layers.1.engram.wkv.bias'\\]"):
        load_engram_weights(layer, extra, prefix=PREFIX)
    dense_with_scale = dict(sd, **{PREFIX + "wkv.weight": torch.zeros(200, 80)})
    with pytest.raises(ValueError, match="block scales only go with FP8"):
        load_engram_weights(layer, dense_with_scale, prefix=PREFIX)
    # Every tensor is checked before any is copied: failed loads leave the module as it was.
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())


def test_paper_variant_loads_demo_names():
    cfg = EngramConfig(layer_ids=(1, 15), max_ngram_size=3, n_heads=2, head_dim=16, vocab_size=101,
                       compressed_vocab_size=50, pad_token_id=0, hidden_size=32, hc_mult=2, rms_norm_eps=1e-5,
                       variant="paper", row_dtype="fp32")
    torch.manual_seed(0)
    src = Engram(cfg, 15)
    with torch.no_grad():
        for p in src.parameters():
            p.uniform_(-1, 1)
    prefix = "model.layers.15.engram."
    sd = {prefix + k: v.to(torch.bfloat16) for k, v in src.state_dict().items()}
    sd[prefix + "multi_head_embedding.embedding.weight"] = torch.zeros(9, 16)
    sd[prefix + "multi_head_embedding.offsets"] = torch.zeros(4, dtype=torch.long)
    layer = Engram(cfg, 15)
    skipped = load_engram_weights(layer, sd, prefix=prefix)
    assert sorted(skipped) == [prefix + "multi_head_embedding.embedding.weight",
                               prefix + "multi_head_embedding.offsets"]
    for name, value in layer.state_dict().items():
        assert torch.equal(value, src.state_dict()[name].to(torch.bfloat16).float()), name


def test_safetensors_reads_projections_but_not_the_table(tmp_path):
    cfg = v41_cfg()
    sd, expect = v41_checkpoint(cfg)
    sd = {k: v.contiguous() for k, v in sd.items()}
    path = tmp_path / "model-00001.safetensors"
    save_file({k: v for k, v in sd.items() if "embed" not in k}, str(path))
    save_file({k: v for k, v in sd.items() if "embed" in k}, str(tmp_path / "model-00002.safetensors"))
    got = read_safetensors([path, tmp_path / "model-00002.safetensors"], PREFIX)
    assert sorted(got) == sorted(PREFIX + k for k in ("wkv.weight", "wkv.scale", "q_weight", "k_weight"))
    assert got[PREFIX + "wkv.weight"].dtype == torch.float8_e4m3fn
    assert got[PREFIX + "wkv.scale"].dtype == torch.float8_e8m0fnu
    layer = Engram(cfg, 1)
    assert load_engram_weights(layer, got, prefix=PREFIX) == []
    assert torch.equal(layer.wkv.weight.detach(), expect)
