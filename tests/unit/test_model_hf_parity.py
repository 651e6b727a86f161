"""Our decoder and loader against transformers' own Llama / Qwen2 / Qwen3 on a random checkpoint saved by
transformers (no Engram): same logits. Skipped where transformers is not installed (the GPU machine has it)."""
from __future__ import annotations

import shutil

import pytest
import torch

from engram.model.loader import load_model
from engram.model.presets import TOKENIZER_FILE
from tests.oracles.reference import prefill_logits

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=5000.0)


def _hf_model(arch: str, tie: bool):
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[arch]
    if not hasattr(transformers, names[1]):
        pytest.skip(f"transformers {transformers.__version__} has no {names[1]}")
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    cfg = getattr(transformers, names[0])(**SHAPE, tie_word_embeddings=tie, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, names[1])(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: perturb them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_logits_match_transformers(tmp_path, arch, tie):
    hf = _hf_model(arch, tie)
    ckpt = tmp_path / arch
    hf.save_pretrained(ckpt, safe_serialization=True)
    shutil.copy(TOKENIZER_FILE, ckpt / "tokenizer.json")
    ours = load_model(ckpt, dtype="float32", device="cpu", cache_dir=tmp_path / "cache", progress=False)
    assert ours.engram_config is None and ours.model_config.architecture == arch
    assert ours.model_config.rope_theta == 5000.0
    ids = ours.tokenizer.encode("def add(a, b):\n    return a + b  # the sum of two numbers").ids
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()  # [T, vocab]
    got = prefill_logits(ours, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
