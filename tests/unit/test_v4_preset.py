"""The ``v4-small-like`` preset (engram/model/presets.py): DeepSeek-V4-Flash's per-layer shapes (against
transformers' DeepseekV4Config defaults where those are Flash's), the layer pattern, Engram inside the depth, its size
counted on the meta device against docs/model.md; and the same preset machinery at a scaled-down shape
(``v4_preset_config`` overrides, through ``preset_config``'s place in the loader) served by ``engram.LLM``,
``engram generate`` and ``engram bench engine`` on the CPU: weights a pure function of preset and seed, greedy tokens
equal for one seed and different for another, ``tid2eid`` ids distinct and in range."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import engram
from benchmarks.v4_kernel_count import V4_COUNT_SHAPE
from engram.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from engram.model.loader import model_size
from engram.model.presets import (DEFAULT_LARGE_TABLE_ROWS, FLASH, MODEL_PRESETS, SMALL, TOKENIZER_VOCAB,
                                  flash_layer_types, preset_config, random_v4_model, v4_preset_config)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "model.md"
# the scaled-down shape: every width small, the depth, pattern and Engram layers of the full preset
SCALED = V4_COUNT_SHAPE  # the kernel count (benchmarks/v4_kernel_count.py) runs the same shape
SCALED_ROWS = 24 * 60
PROMPTS = ["def add(a, b):", "Engram tables are " * 6]


def scaled(seed: int = 0) -> V4Config:
    return v4_preset_config("v4-small-like", table_rows=SCALED_ROWS, seed=seed, **SCALED)


# ----------------------------------------------------------------- the full preset
def test_full_preset_is_flash_per_layer():
    cfg = preset_config("v4-small-like")
    assert "v4-small-like" in MODEL_PRESETS and isinstance(cfg, V4Config) and cfg.architecture == "deepseek_v4"
    # per-layer shapes: V4-Flash's
    assert (cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank) == (
        4096, 64, 512, 1024, 8, 1024)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (64, 128, 512, 128)
    assert (cfg.csa_ratio, cfg.hca_ratio, cfg.hc_mult, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        4, 128, 4, 6, 2048)
    assert (cfg.main_rope.dim, cfg.main_rope.theta, cfg.main_rope.kind) == (64, 10000.0, "default")
    c = cfg.compress_rope
    assert (c.theta, c.kind, c.factor, c.original_max_position_embeddings, c.attention_factor) == (
        160000.0, "yarn", 16.0, 65536, 1.0)
    assert cfg.padded_vocab_size == 129280 and cfg.vocab_size == TOKENIZER_VOCAB
    # reduced: depth, routed experts, positions
    assert (cfg.num_layers, cfg.n_routed_experts, cfg.max_position_embeddings) == (16, 32, 65536)
    assert cfg.layer_types == tuple(flash_layer_types(16)) and {SLIDING, CSA, HCA} <= set(cfg.layer_types)
    assert cfg.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA)
    assert cfg.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 13
    e = cfg.engram
    assert e.layer_ids == (1, 8) and max(e.layer_ids) < cfg.num_layers and e.layer_ids[-1] >= cfg.num_layers // 2
    assert (e.variant, e.hc_mult, e.n_cols, e.head_dim, e.row_dtype, e.row_bytes) == ("v41", 4, 24, 256, "mxfp8", 264)
    assert min(e.table_rows(lid) for lid in e.layer_ids) >= DEFAULT_LARGE_TABLE_ROWS
    rows = preset_config("v4-small-like", table_rows=240_000).engram.table_rows(1)
    assert 240_000 <= rows < 240_000 + 24 * 200
    back = V4Config.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())), name=cfg.name)
    assert back.replace(chat_template=cfg.chat_template) == cfg


def test_flash_fields_are_transformers_defaults_but_two():
    transformers = pytest.importorskip("transformers")
    d = transformers.DeepseekV4Config().to_dict()
    by_hand = {"rope_parameters"}  # the defaults' compress RoPE is plain; Flash's is YaRN x16
    same = {k: v for k, v in FLASH.items() if k not in by_hand and k not in ("num_hash_layers", "qk_rope_head_dim")}
    assert {k: d[k] for k in same} == same
    assert d["mlp_layer_types"][:4] == ["hash_moe"] * 3 + ["moe"]  # FLASH's num_hash_layers 3
    assert int(d["head_dim"] * d["partial_rotary_factor"]) == FLASH["qk_rope_head_dim"]
    assert d["rope_parameters"]["compress"]["rope_type"] == "default"
    assert d["layer_types"][:2] == [HCA, HCA] != flash_layer_types(2)  # V4-Pro's pattern; Flash starts sliding x2


def test_size_on_meta_matches_the_docs():
    size = model_size(preset_config("v4-small-like"))
    total = size["parameter_bytes"] + size["buffer_bytes"]
    assert 20e9 <= total <= 40e9  # the documented range: one H200 with room for caches and tables
    text = DOCS.read_text()
    para = text[text.index("**`v4-small-like`**"):]
    para = " ".join(para[:para.index("\n\n")].split())
    m = re.search(r"([\d.]+) B parameters \(([\d.]+) B in routed experts, ([\d.]+) B Engram\), ([\d.]+) GB in bf16",
                  para)
    assert m, "docs/model.md: the v4-small-like paragraph states its size"
    assert [float(x) for x in m.groups()] == [round(size["parameters"] / 1e9, 2),
                                              round(size["routed_expert_parameters"] / 1e9, 2),
                                              round(size["engram_parameters"] / 1e9, 2), round(total / 1e9, 2)]
    assert f"{size['table_bytes'] / 1e6:.1f} MB of tables" in para
    flash = model_size(v4_preset_config("v4-small-like", num_hidden_layers=43, n_routed_experts=256,
                                        engram_layer_ids=(1, 14)))
    flash_b = round((flash["parameters"] - flash["engram_parameters"]) / 1e9, 1)
    assert f"counts {flash_b} B" in para and 283e9 < flash["parameters"] < 286e9  # Flash: 284 B (no MTP layer)
    assert SMALL["n_routed_experts"] >= FLASH["num_experts_per_tok"]


# ----------------------------------------------------------------- the same machinery, scaled down
def test_scaled_weights_are_a_pure_function_of_seed():
    cfg = scaled()
    a, b, c = (random_v4_model(cfg, torch.float64, "cpu", seed) for seed in (0, 0, 1))
    f = random_v4_model(cfg, torch.float32, "cpu", 0)
    sa, sb, sc, sf = ({**dict(m.named_parameters()), **dict(m.named_buffers())} for m in (a, b, c, f))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.equal(sa[k].to(sf[k].dtype), sf[k]) for k in sa)  # drawn in float32 on the CPU, then cast
    bf16 = random_v4_model(cfg, torch.bfloat16, "cpu", 0)  # the meta count is the built model's
    size = model_size(cfg, torch.bfloat16)
    assert size["parameter_bytes"] == sum(p.numel() * p.element_size() for p in bf16.parameters())
    assert size["buffer_bytes"] == sum(b.numel() * b.element_size() for b in bf16.buffers())
    assert bf16.model.norm.weight.dtype == bf16.model.hc_head_fn.dtype == torch.float32  # transformers' fp32 pieces
    assert not torch.equal(sa["model.layers.3.ffn.experts.w13"], sc["model.layers.3.ffn.experts.w13"])
    assert not torch.equal(sa["model.layers.0.ffn.gate.tid2eid"], sc["model.layers.0.ffn.gate.tid2eid"])
    for name, t in sa.items():
        assert torch.isfinite(t.double()).all(), name
        if name.endswith("tid2eid"):
            assert t.shape == (cfg.padded_vocab_size, cfg.num_experts_per_tok)
            assert 0 <= int(t.min()) and int(t.max()) < cfg.n_routed_experts
            assert (t.sort(dim=-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token
        elif name.endswith(("attn_sink", "hc_attn_base", "gate.bias", "compressor.ape")):
            assert t.std() > 0, name  # transformers' init zeros, randomised
        elif name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name


@pytest.fixture
def scaled_preset(monkeypatch):
    """``preset_config("v4-small-like")`` gives the scaled-down shape where the loader and bench engine read it."""
    from engram.model import loader, presets

    real = presets.preset_config

    def fake(name, table_rows=None, seed=0):
        return scaled(seed) if name == "v4-small-like" else real(name, table_rows, seed)

    monkeypatch.setattr(loader, "preset_config", fake)
    monkeypatch.setattr(presets, "preset_config", fake)


def _greedy(seed: int, dtype: str = "float32") -> list[list[int]]:
    llm = engram.LLM("v4-small-like", dtype=dtype, device="cpu", engram_config={"seed": seed})
    assert isinstance(llm.loaded.model_config, V4Config) and llm.loaded.model_config.num_layers == 16
    outs = llm.generate(PROMPTS, engram.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_scaled_llm_greedy_tokens_follow_the_seed(scaled_preset, capsys):
    first, again, other = _greedy(0), _greedy(0), _greedy(1)
    assert first == again and first != other
    assert all(len(t) == 6 and max(t) < TOKENIZER_VOCAB for t in first + other)  # padded rows get no logits
    assert _greedy(0, "float64") == first  # the same weights in float64: the same greedy tokens here
    from engram.cli import main

    capsys.readouterr()
    rc = main(["generate", "v4-small-like", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--max-tokens", "6",
               "--ignore-eos", "--dtype", "float32", "--device", "cpu", "--json", "--no-progress"])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [line["token_ids"] for line in lines[:2]] == first


def test_scaled_bench_engine(scaled_preset, tmp_path, capsys):
    from engram.cli import main

    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--models", "v4-small-like", "--tiers", "gpu", "--batch-sizes", "2",
               "--context-len", "16", "--decode-steps", "2", "--warmup-tokens", "1", "--profile-steps", "0",
               "--prefill-shapes", "1x16", "--prefill-repeats", "1", "--device", "cpu", "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())["result"]
    points = result["points"]
    assert {(p["arm"], p["phase"]) for p in points} == {("engram/gpu", "decode"), ("engram/gpu", "prefill"),
                                                      ("engram-off", "decode"), ("engram-off", "prefill")}
    assert all(p["ms_wall"] > 0 for p in points)
    # decode points against the V4 roofline (bench/v4_roofline.py), the routed experts probed; prefill without one
    decode = [p for p in points if p["phase"] == "decode"]
    assert all(p["roofline_ms"] > 0 and len(p["routed_experts"]) == 16 for p in decode)
    on, off = sorted(decode, key=lambda p: p["arm"] != "engram/gpu")
    assert on["engram_bytes"] > 0 == off["engram_bytes"] and on["weight_bytes"] > off["weight_bytes"]
    assert all(p["roofline_ms"] is None for p in points if p["phase"] == "prefill")
    assert any("no hf-peer points" in w for w in result["warnings"])


def test_bench_serve_skips_the_serving_roofline():
    from engram.bench.serve_load import model_config

    cfg, reason = model_config("v4-small-like")
    assert cfg is None and "deepseek_v4" in reason
    assert model_config("tiny")[0] == preset_config("tiny")
