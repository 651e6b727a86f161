"""Built-in model presets and their deterministic random weights. ``tiny`` (CPU tests; 4 layers, hc_mult 2, Engram at
[1, 3]), ``small`` (~100 M parameters), ``4b-like`` / ``8b-like`` (Qwen3-4B / 8B dense shapes, Engram at [1, 15],
V4.1-shaped MXFP8 tables, Qwen3's padded vocab). Weights are a pure function of preset and seed (and, for the large ones
drawn on the device, of its type): each parameter has a generator seeded by the seed and its name."""
from __future__ import annotations

import zlib
from pathlib import Path

import torch
from torch import nn

from engram.config import EngramConfig
from engram.model.layers.norm import RMSNorm
from engram.model.model_config import ModelConfig
from engram.model.layers.hyper_connections import HyperConnection
from engram.module import Engram

ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_FILE = ASSETS / "tokenizer.json"
TOKENIZER_VOCAB = 4096  # ids of the built-in tokenizer (<|bos|> 0, <|eos|> 1, <|pad|> 2)
COMPRESSED_VOCAB = 2901  # its compressed vocabulary (EngramConfig.preset("tiny") uses the same)
BOS, EOS, PAD = 0, 1, 2
# Jinja (HF-style, rendered by engram.server.chat): one "<|role|>" line per message, then the prompt.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
DEFAULT_LARGE_TABLE_ROWS = 1 << 20  # rows per Engram layer of 4b-like / 8b-like unless overridden

MODEL_PRESETS = ("tiny", "small", "4b-like", "8b-like")


def _v41_tables(hidden: int, hc_mult: int, layer_ids: tuple[int, ...], table_rows: int) -> EngramConfig:
    """V4.1-shaped layout (orders 2..4, 8 heads, 256-d MXFP8) of about ``table_rows`` rows a layer (prime base / 24)."""
    n_cols = 3 * 8
    if table_rows < n_cols * 2:
        raise ValueError(f"table_rows={table_rows}: need at least {n_cols * 2} rows (24 columns)")
    return EngramConfig(layer_ids=layer_ids, max_ngram_size=4, n_heads=8, head_dim=256,
                        vocab_size=table_rows // n_cols, compressed_vocab_size=COMPRESSED_VOCAB,
                        pad_token_id=PAD, hidden_size=hidden, hc_mult=hc_mult, rms_norm_eps=1e-6,
                        variant="v41", row_dtype="mxfp8")


def preset_config(name: str, table_rows: int | None = None, seed: int = 0) -> ModelConfig:
    """ModelConfig of a preset. ``table_rows`` (rows per Engram layer) applies to 4b-like / 8b-like."""
    common = dict(vocab_size=TOKENIZER_VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                  chat_template=CHAT_TEMPLATE, init_seed=seed, architecture="qwen3", qk_norm=True)
    if table_rows is not None and name in ("tiny", "small"):
        raise ValueError(f"table_rows applies to 4b-like / 8b-like; preset {name!r} has a fixed layout")
    if name == "tiny":
        eng = EngramConfig.preset("tiny")
        if eng.compressed_vocab_size != COMPRESSED_VOCAB or eng.pad_token_id != PAD:
            raise ValueError("engram.config PRESETS['tiny'] no longer matches the built-in tokenizer "
                             f"(compressed vocab {COMPRESSED_VOCAB}, pad id {PAD})")
        return ModelConfig(name=name, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                           intermediate_size=128, rope_theta=10000.0, max_position_embeddings=2048,
                           tie_word_embeddings=True, hc_mult=2, engram=eng, **common)
    if name == "small":
        eng = EngramConfig(layer_ids=(1, 6), max_ngram_size=3, n_heads=8, head_dim=64, vocab_size=(6007, 7001),
                           compressed_vocab_size=COMPRESSED_VOCAB, pad_token_id=PAD, hidden_size=768, hc_mult=2,
                           variant="v41", row_dtype="mxfp8")
        return ModelConfig(name=name, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64,
                           intermediate_size=2560, rope_theta=10000.0, max_position_embeddings=4096,
                           tie_word_embeddings=True, hc_mult=2, engram=eng, **common)
    rows = DEFAULT_LARGE_TABLE_ROWS if table_rows is None else int(table_rows)
    if name == "4b-like":  # Qwen3-4B
        return ModelConfig(name=name, padded_vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32,
                           num_kv_heads=8, head_dim=128, intermediate_size=9728, rope_theta=1e6,
                           max_position_embeddings=40960, tie_word_embeddings=True,
                           engram=_v41_tables(2560, 1, (1, 15), rows), **common)
    if name == "8b-like":  # Qwen3-8B
        return ModelConfig(name=name, padded_vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                           num_kv_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1e6,
                           max_position_embeddings=40960, tie_word_embeddings=False,
                           engram=_v41_tables(4096, 1, (1, 15), rows), **common)
    raise ValueError(f"unknown model preset {name!r}; known: {MODEL_PRESETS} (or a checkpoint directory)")


HOST_INIT_MAX_PARAMS = 500_000_000  # up to this size weights are drawn on the CPU (same on every device)


def _param_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int, on_device: bool | None = None) -> None:
    """Fill every parameter deterministically (norms 1, biases 0, linears N(0, 0.02) with output and Engram projections
    scaled, gate weights 1 + N(0, 0.1), hyper-connections near a plain residual), on the CPU unless ``on_device`` or, by
    default, more than HOST_INIT_MAX_PARAMS parameters."""
    cfg = model.config
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    engram_std = 0.02 / (cfg.engram.n_cols * cfg.engram.head_dim) ** 0.5 if cfg.engram is not None else 0.02
    if on_device is None:
        on_device = sum(p.numel() for p in model.parameters()) > HOST_INIT_MAX_PARAMS
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        in_engram = ".engram" in f".{mname}"
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:  # a tied lm_head keeps the embedding's values
                continue
            seen.add(id(p))
            name = f"{mname}.{pname}"
            gen_device = p.device if on_device else torch.device("cpu")
            g = _param_generator(seed, name, gen_device)

            def normal(std: float, mean: float = 0.0) -> None:
                p.copy_(torch.empty(p.shape, dtype=torch.float32, device=gen_device).normal_(mean, std, generator=g))

            if pname == "bias":
                p.zero_()
            elif isinstance(mod, (RMSNorm, nn.RMSNorm)):
                p.fill_(1.0)
            elif isinstance(mod, Engram) and pname in ("q_weight", "k_weight"):
                normal(0.1, 1.0)
            elif isinstance(mod, HyperConnection):
                if pname == "res_weight":
                    normal(0.05)
                    p.add_(torch.eye(p.shape[0], dtype=p.dtype, device=p.device))
                else:
                    normal(0.1, 1.0 / cfg.hc_mult if pname == "in_weight" else 1.0)
            elif isinstance(mod, nn.Linear) and in_engram:
                normal(engram_std * 0.4)  # v ~ N(0, 0.08) for the store's random rows (RMS ~ 11)
            elif isinstance(mod, nn.Linear) and mname.endswith(("o_proj", "down_proj")):
                normal(out_std)
            else:
                normal(0.02)
