"""Presets (shapes, sizes, deterministic weights), ModelConfig validation and the built-in tokenizer."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from engram.config import EngramConfig
from engram.model.decoder import EngramDecoder
from engram.model.loader import build_model
from engram.model.model_config import ModelConfig
from engram.model.presets import (BOS, COMPRESSED_VOCAB, EOS, PAD, TOKENIZER_FILE, TOKENIZER_VOCAB,
                                  init_random_weights, preset_config)

REPO = Path(__file__).resolve().parents[2]


def _meta_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        model = EngramDecoder(cfg)
    return sum(p.numel() for p in model.parameters())


def test_preset_shapes_and_sizes():
    small = preset_config("small")
    assert 80e6 < _meta_params(small) < 120e6
    four, eight = preset_config("4b-like"), preset_config("8b-like")
    for cfg, (h, inter, tied) in ((four, (2560, 9728, True)), (eight, (4096, 12288, False))):  # Qwen3-4B / 8B
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.tie_word_embeddings) == (h, inter, tied)
        assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (36, 32, 8, 128)
        assert cfg.padded_vocab_size == 151936 and cfg.vocab_size == TOKENIZER_VOCAB
        e = cfg.engram
        assert e.layer_ids == (1, 15) and e.n_cols == 24 and e.head_dim == 256 and e.row_dtype == "mxfp8"
        assert e.row_bytes == 264
    dense = _meta_params(four) - sum(2560 * 24 * 256 * 2 + 2 * 2560 for _ in (1, 15))
    assert 3.9e9 < dense < 4.1e9  # Qwen3-4B: 4.02 B parameters
    assert 8.0e9 < _meta_params(eight) < 8.4e9  # Qwen3-8B: 8.19 B


def test_table_rows_option():
    cfg = preset_config("4b-like", table_rows=240_000)
    rows = cfg.engram.table_rows(1)
    assert 240_000 <= rows < 240_000 + 24 * 200  # 24 primes just above 10000 each
    assert preset_config("8b-like").engram.table_rows(15) >= 1 << 20
    with pytest.raises(ValueError, match="table_rows=10"):
        preset_config("4b-like", table_rows=10)
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        preset_config("huge")


def test_weights_are_deterministic_per_seed():
    cfg = preset_config("tiny")
    a, b, c = (build_model(cfg, torch.float32, torch.device("cpu")) for _ in range(3))
    init_random_weights(a, 0)
    init_random_weights(b, 0)
    init_random_weights(c, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"])
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied
    assert torch.equal(sa["model.layers.0.input_layernorm.weight"], torch.ones(64))
    assert not torch.equal(sa["model.layers.1.attn_hc.res_weight"], torch.eye(2))  # streams are mixed


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_heads=3), "model.num_kv_heads=3: must divide num_heads=4"),
    (dict(head_dim=15), "model.head_dim=15: must be even"),
    (dict(kv_source_layer_ids=(1, 2)), r"^kv_source_layer_ids=\[1, 2\]: layer 0 has no preceding kv source$"),
    (dict(kv_source_layer_ids=(0, 7)), r"kv_source_layer_ids=\[0, 7\]: layer 7 is out of range \[0, 4\)"),
    (dict(kv_source_layer_ids=(0, 2.0)), r"kv_source_layer_ids=\[0, 2.0\]: entry 2.0 is not an int"),
    (dict(kv_source_layer_ids=(0, True)), r"kv_source_layer_ids=\[0, True\]: entry True is not an int"),
    (dict(hc_mult=1), "engram.hc_mult=2 != hc_mult=1"),
    (dict(eos_token_id=5000), "model.eos_token_id=5000: must be in \\[0, vocab_size=4096\\)"),
    (dict(architecture="gpt2"), "model.architecture='gpt2'"),
    (dict(padded_vocab_size=100), "model.padded_vocab_size=100"),
])
def test_model_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        preset_config("tiny").replace(**change)


def test_model_config_hf_round_trip_and_kv_sources():
    cfg = preset_config("tiny").replace(kv_source_layer_ids=(0, 2), chat_template=None)
    back = ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict())), name="tiny")
    assert back == cfg.replace(init_seed=0)
    assert [cfg.kv_source(i) for i in range(4)] == [0, 0, 2, 2] and cfg.kv_layers == (0, 2)
    qwen2 = ModelConfig.from_hf_dict({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8,
                                      "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16})
    assert qwen2.attention_bias and not qwen2.qk_norm and qwen2.engram is None and qwen2.head_dim == 4
    v5 = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "intermediate_size": 16,
                                   "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert v5.rope_theta == 1e6 and v5.qk_norm
    with pytest.raises(NotImplementedError, match="RoPE type 'llama3'"):
        ModelConfig.from_hf_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "intermediate_size": 16,
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_builtin_tokenizer_matches_tiny_layout():
    from tokenizers import Tokenizer

    from engram.tokenizer import CompressedTokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_FILE))
    assert tok.get_vocab_size() == TOKENIZER_VOCAB
    assert [tok.token_to_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")] == [BOS, EOS, PAD]
    text = "Return a list of the words in the string, using sep as the delimiter. Ünïcode ok"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless
    assert len(CompressedTokenizer.from_file(TOKENIZER_FILE)) == COMPRESSED_VOCAB
    tiny = EngramConfig.preset("tiny")
    assert (tiny.compressed_vocab_size, tiny.pad_token_id) == (COMPRESSED_VOCAB, PAD)


def test_train_tokenizer_script_is_deterministic():
    spec = importlib.util.spec_from_file_location("train_tokenizer", REPO / "tools" / "train_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    texts = [d for p in mod.stdlib_files()[:40] for d in mod.docstrings(p)]
    a, b = mod.train(texts, 600), mod.train(texts, 600)
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 600
    assert a.token_to_id("<|pad|>") == PAD
