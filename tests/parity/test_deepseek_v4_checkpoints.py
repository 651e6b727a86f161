"""DeepSeek-V4 checkpoints as published: the official tensor names (no ``model.`` prefix, ``embed.weight``,
``hc_head_fn``), FP8 block-scaled weights (``quantization_config``, ue8m0 ``.scale`` and float32 ``weight_scale_inv``)
against the float64 reference holding the same dequantized values, and every refusal naming its field or tensor."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from tests.parity.deepseek_v4_fixtures import Pair, prompt, rel_err  # noqa: E402

from engram.model.loader import load_model  # noqa: E402

BLOCK = (16, 8)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4ck"), None)


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _rewrite(pair, tmp_path, tensors, config_changes=None):
    from safetensors.torch import save_file

    out = tmp_path / "ck"
    out.mkdir(parents=True)
    shutil.copy(pair.path / "tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((pair.path / "config.json").read_text())
    cfg.update(config_changes or {})
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _load(path, tmp_path):
    return load_model(path, dtype="float64", device="cpu", cache_dir=tmp_path / "cache", progress=False)


def _quantize(w: torch.Tensor, ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [O, I] -> (E4M3 values, block scales, the dequantized weight), scales 2^ceil(log2(amax / 448))."""
    bo, bi = BLOCK
    o, i = w.shape
    rows, cols = -(-o // bo), -(-i // bi)
    pad = torch.zeros(rows * bo, cols * bi, dtype=torch.float64)
    pad[:o, :i] = w
    amax = pad.view(rows, bo, cols, bi).abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))  # [rows, cols]
    full = scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    values = (w / full).to(torch.float8_e4m3fn)
    stored = (torch.log2(scale) + 127).to(torch.uint8).view(torch.float8_e8m0fnu) if ue8m0 else scale.float()
    return values, stored, values.double() * full


def test_official_names_load_the_same_model(pair, tmp_path):
    renames = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
               "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
    tensors = {renames.get(k, k[len("model."):] if k.startswith("model.") else k): v
               for k, v in _tensors(pair.path).items()}
    assert "layers.0.attn.wq_a.weight" in tensors and "head.weight" in tensors
    tensors["mtp.0.emb.weight"] = torch.zeros(2, 2)  # multi-token prediction layers are skipped
    ours = _load(_rewrite(pair, tmp_path, tensors), tmp_path)
    for (name, a), b in zip(ours.model.state_dict().items(), pair.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_fp8_block_scaled_weights_match_the_reference_with_the_same_values(pair, tmp_path):
    tensors = _tensors(pair.path)
    ref_sd = pair.ref.state_dict()
    dequantized = {}
    for n, (key, w) in enumerate(sorted(tensors.items())):
        if w.dim() != 2 or not key.endswith(".weight") or "embed" in key or "norm" in key or key == "head.weight":
            continue
        ue8m0 = n % 2 == 0
        values, scale, deq = _quantize(w.double(), ue8m0)
        tensors[key] = values
        tensors[key[:-len("weight")] + ("scale" if ue8m0 else "weight_scale_inv")] = scale
        dequantized[key] = deq
    assert len(dequantized) > 60 and any(k.endswith("experts.3.w2.weight") for k in dequantized)
    path = _rewrite(pair, tmp_path, tensors, {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK),
        "activation_scheme": "dynamic", "expert_dtype": "fp8"}})
    ours = _load(path, tmp_path)
    ref = pair.ref
    saved = {k: v.clone() for k, v in ref_sd.items()}
    try:
        with torch.no_grad():  # the reference gets the dequantized values under its own names
            sd = ours.model.state_dict()
            for ref_name, t in _ref_order(ref_sd, sd):
                assert t.shape == ref_sd[ref_name].shape, ref_name
                ref_sd[ref_name].copy_(t)
            ids = prompt(300, seed=7)
            want = pair.ref_logits(ids, [])
    finally:
        with torch.no_grad():
            for k, v in saved.items():
                ref_sd[k].copy_(v)
    from engram.model.deepseek_v4.decoder import pack_sequences

    step = pack_sequences([ids], [0])
    step.logits_indices = torch.arange(len(ids))
    with torch.no_grad():
        got = ours.model.head(ours.model(step, [ours.model.empty_cache()])[0])
    assert rel_err(got, want) <= 1e-12
    assert rel_err(got, pair.ref_logits(ids, [])) > 1e-6  # the quantization did change the model


def _ref_order(ref_sd, ours_sd):
    """Our tensors in the reference state dict's order (both follow the module order; experts are merged there)."""
    out = []
    ours = dict(ours_sd)
    for name, t in ref_sd.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):
            base = f"model.layers.{layer}.ffn.experts"
            n = t.shape[0]
            merged = torch.stack([torch.cat([ours[f"{base}.{e}.w1.weight"], ours[f"{base}.{e}.w3.weight"]])
                                  for e in range(n)])
            out.append((name, merged))
        elif name.endswith("experts.down_proj"):
            base = f"model.layers.{layer}.ffn.experts"
            out.append((name, torch.stack([ours[f"{base}.{e}.w2.weight"] for e in range(t.shape[0])])))
        else:
            out.append((name, ours[_our_name(name)]))
    return out


def _our_name(ref_name: str) -> str:
    """transformers' module name -> ours (the reverse of its checkpoint renaming)."""
    from engram.model.deepseek_v4.checkpoint import canonical

    pairs = [("self_attn.compressor.indexer.scorer.weights_proj", "attn.indexer.weights_proj"),
             ("self_attn.compressor.indexer.q_b_proj", "attn.indexer.wq_b"),
             ("self_attn.compressor.indexer.", "attn.indexer.compressor."), ("self_attn.", "attn."), ("mlp.", "ffn."),
             ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"), ("attn_hc.", "hc_attn_"),
             ("ffn_hc.", "hc_ffn_"), ("sinks", "attn_sink"), ("kv_norm", "norm"), ("position_bias", "ape"),
             ("q_a_proj", "wq_a"), ("q_b_proj", "wq_b"), ("kv_proj", "wkv"), ("gate_proj", "wgate"),
             ("o_a_proj", "wo_a"), ("o_b_proj", "wo_b"), ("q_a_norm", "q_norm"), ("e_score_correction_bias", "bias"),
             ("shared_experts.wgate", "shared_experts.w1"), ("shared_experts.down_proj", "shared_experts.w2"),
             ("shared_experts.up_proj", "shared_experts.w3")]
    for a, b in pairs:
        ref_name = ref_name.replace(a, b)
    return canonical(ref_name)


@pytest.mark.parametrize("changes, error, needle", [
    ({"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4"}}, NotImplementedError,
     "quantization_config.expert_dtype='fp4'"),
    ({"quantization_config": {"quant_method": "awq"}}, NotImplementedError, "quantization_config.quant_method='awq'"),
    ({"compress_ratios": [0, 4, 2, 4], "layer_types": None}, ValueError, "compress_ratios=[0, 4, 2, 4]: ratio 2"),
    ({"kv_source_layer_ids": [0, 2]}, ValueError, "kv_source_layer_ids=[0, 2]: DeepSeek-V4.1 attention"),
    ({"index_source_layer_ids": [1, 3]}, ValueError, "index_source_layer_ids=[1, 3]"),
    ({"candidate_topk_blocks": 8}, ValueError, "candidate_topk_blocks=8"),
    ({"num_key_value_heads": 2}, ValueError, "num_key_value_heads=2"),
    ({"layer_types": ["sliding_attention"] * 3}, ValueError, "has 3 entries but num_hidden_layers=4"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, NotImplementedError, "rope_type='longrope'"),
])
def test_refused_configs_name_the_field(pair, tmp_path, changes, error, needle):
    with pytest.raises(error, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        _load(_rewrite(pair, tmp_path, _tensors(pair.path), changes), tmp_path)


def test_legacy_compress_ratios_read_as_layer_types(pair, tmp_path):
    changes = {"compress_ratios": [0, 4, 128, 4], "layer_types": None,
               "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}}
    ours = _load(_rewrite(pair, tmp_path, _tensors(pair.path), changes), tmp_path)
    assert ours.model_config.layer_types == pair.ours.model_config.layer_types


def test_bad_tensors_are_named(pair, tmp_path):
    tensors = _tensors(pair.path)
    tensors["model.layers.1.attn.wq_a.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'model.layers.1.attn.wq_a.weight' has shape \[3, 3\], expected \[32, 64\]"):
        _load(_rewrite(pair, tmp_path / "a", tensors), tmp_path / "a")
    tensors = _tensors(pair.path)
    del tensors["model.layers.2.ffn.gate.bias"]
    tensors["model.layers.0.attn.wq_a.weight"] = tensors["model.layers.0.attn.wq_a.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="missing tensors: \\['model.layers.2.ffn.gate.bias'\\]"):
        _load(_rewrite(pair, tmp_path / "b", tensors), tmp_path / "b")
    tensors["model.layers.2.ffn.gate.bias"] = torch.zeros(4)
    with pytest.raises(ValueError, match="'model.layers.0.attn.wq_a.weight' is torch.float8_e4m3fn but has no block"):
        _load(_rewrite(pair, tmp_path / "c", tensors), tmp_path / "c")
