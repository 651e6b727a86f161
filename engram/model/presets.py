"""Built-in model presets and their deterministic random weights. ``tiny`` (CPU tests; 4 layers, hc_mult 2, Engram at
[1, 3]), ``small`` (~100 M parameters), ``4b-like`` / ``8b-like`` (Qwen3-4B / 8B dense shapes, Engram at [1, 15],
V4.1-shaped MXFP8 tables, Qwen3's padded vocab), ``v4-small-like`` (below). Weights are a pure function of preset and
seed (and, for the large ones drawn on the device, of its type): each parameter has a generator seeded by the seed and
its name.

``v4-small-like``: DeepSeek-V4-Flash's per-layer shapes (every width, head count, LoRA rank, output group, indexer size,
compress ratio, RoPE, hc_mult and its 129280-row vocab) at 16 of its 43 layers and 32 of its 256 routed experts (16.5 B
parameters, 33 GB in bf16: one H200 holds it with room for caches and tables), V4.1-shaped Engram tables at layers 1
and 8, the built-in tokenizer (its 4096 ids get logits). ``v4_preset_config`` builds its V4Config through
``V4Config.from_hf_dict`` (the checkpoints' reader) from the Flash fields ``FLASH`` with the reductions ``SMALL``;
keyword overrides of the same config.json keys give the same preset at another size (the CPU tests' scaled-down one).
``random_v4_model`` builds it empty in its dtype on the target device (no float32 copy, nothing written to disk) and
``init_v4_random_weights`` fills every parameter and buffer, by the dense presets' generator scheme."""
from __future__ import annotations

import zlib
from pathlib import Path

import torch
from torch import nn

from typing import Any

from engram.config import EngramConfig
from engram.model.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from engram.model.deepseek_v4.decoder import DeepseekV4Model
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
DEFAULT_LARGE_TABLE_ROWS = 1 << 20  # rows per Engram layer of 4b-like / 8b-like / v4-small-like unless overridden

MODEL_PRESETS = ("tiny", "small", "4b-like", "8b-like", "v4-small-like")
TABLE_ROWS_PRESETS = ("4b-like", "8b-like", "v4-small-like")  # those whose table_rows is overridable


def _v41_tables(hidden: int, hc_mult: int, layer_ids: tuple[int, ...], table_rows: int) -> EngramConfig:
    """V4.1-shaped layout (orders 2..4, 8 heads, 256-d MXFP8) of about ``table_rows`` rows a layer (prime base / 24)."""
    n_cols = 3 * 8
    if table_rows < n_cols * 2:
        raise ValueError(f"table_rows={table_rows}: need at least {n_cols * 2} rows (24 columns)")
    return EngramConfig(layer_ids=layer_ids, max_ngram_size=4, n_heads=8, head_dim=256,
                        vocab_size=table_rows // n_cols, compressed_vocab_size=COMPRESSED_VOCAB,
                        pad_token_id=PAD, hidden_size=hidden, hc_mult=hc_mult, rms_norm_eps=1e-6,
                        variant="v41", row_dtype="mxfp8")


def preset_config(name: str, table_rows: int | None = None, seed: int = 0):
    """ModelConfig of a preset (a ``V4Config`` for v4-small-like: ``v4_preset_config``). ``table_rows`` (rows per Engram
    layer) applies to TABLE_ROWS_PRESETS."""
    if name in V4_PRESETS:
        return v4_preset_config(name, table_rows=table_rows, seed=seed)
    common = dict(vocab_size=TOKENIZER_VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                  chat_template=CHAT_TEMPLATE, init_seed=seed, architecture="qwen3", qk_norm=True)
    if table_rows is not None and name in ("tiny", "small"):
        raise ValueError(f"table_rows applies to {', '.join(TABLE_ROWS_PRESETS)}; preset {name!r} has a fixed layout")
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


# ----------------------------------------------------------------- DeepSeek-V4
V4_PRESETS = ("v4-small-like",)

# DeepSeek-V4-Flash's config.json fields. All but two are transformers' DeepseekV4Config() defaults (5.24; the test
# compares); set by hand where the defaults are not Flash's: the layer pattern (flash_layer_types; the defaults'
# is V4-Pro's, HCA HCA then CSA / HCA) and the YaRN scaling of the compress RoPE (the defaults' is plain).
FLASH: dict[str, Any] = {
    "model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "sliding_window": 128, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "compress_rates": {CSA: 4, HCA: 128}, "qk_rope_head_dim": 64, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "num_hash_layers": 3, "max_position_embeddings": 1048576, "bos_token_id": BOS, "eos_token_id": EOS,
    # by hand: YaRN on the compressed layers (factor 16 over the 64 K pre-training context)
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                        "beta_fast": 32, "beta_slow": 1},
}
# What v4-small-like reduces: depth (43 -> 16: sliding x2, then CSA / HCA alternating, the first 3 hash-routed MoE;
# 16 is the fewest layers whose bf16 cache page at block_size 16 holds an HCA compressor's float32 state, cache_layout),
# routed experts (256 -> 32, top-6 kept) and the positions (1 M -> 64 K, the pre-training context: the engine sizes a
# sequence's caches by it, 64 sequences of 1 M tokens would take 156 GB). docs/model.md states why and the size.
SMALL: dict[str, Any] = {"num_hidden_layers": 16, "n_routed_experts": 32, "max_position_embeddings": 65536}
V4_SMALL_TABLE_LAYERS = (1, 8)  # a sliding hash-MoE layer and the first of the second half (V4.1-Flash: 1 and 14 of 40)


def flash_layer_types(n: int) -> list[str]:
    """DeepSeek-V4-Flash's attention pattern cut to ``n`` layers: two sliding-window layers, then compressed sparse
    (ratio 4) and heavily compressed (ratio 128) alternating (its compress_ratios 0, 0, 4, 128, 4, 128, ...)."""
    return [SLIDING if i < 2 else CSA if i % 2 == 0 else HCA for i in range(n)]


def v4_preset_config(name: str, table_rows: int | None = None, seed: int = 0,
                     engram_layer_ids: tuple[int, ...] = V4_SMALL_TABLE_LAYERS, **overrides: Any) -> V4Config:
    """The V4Config of a V4 preset: ``FLASH`` with ``SMALL`` and then ``overrides`` (config.json keys, e.g.
    ``hidden_size=64``) applied, Flash's layer and MLP patterns at the resulting depth, Engram (V4.1-shaped MXFP8
    tables of about ``table_rows`` rows a layer, default DEFAULT_LARGE_TABLE_ROWS) at ``engram_layer_ids``, the
    built-in tokenizer's ids getting logits out of the padded vocab. ``seed`` does not enter the config (the weights
    and tables take it); it is accepted for ``preset_config``'s signature. ValueError for an unknown name or a shape
    V4Config refuses."""
    if name not in V4_PRESETS:
        raise ValueError(f"unknown DeepSeek-V4 preset {name!r}; known: {V4_PRESETS}")
    hf = {**FLASH, **SMALL, **overrides}
    n = int(hf["num_hidden_layers"])
    hf.setdefault("layer_types", flash_layer_types(n))
    hf.setdefault("engram_logit_vocab_size", TOKENIZER_VOCAB)
    hf.setdefault("pad_token_id", PAD)
    rows = DEFAULT_LARGE_TABLE_ROWS if table_rows is None else int(table_rows)
    cfg = V4Config.from_hf_dict(hf, name=name)
    return cfg.replace(engram=_v41_tables(cfg.hidden_size, cfg.hc_mult, tuple(engram_layer_ids), rows),
                       chat_template=CHAT_TEMPLATE)


def random_v4_model(cfg: V4Config, dtype: torch.dtype, device: torch.device | str, seed: int,
                    on_device: bool | None = None) -> DeepseekV4Model:
    """A DeepseekV4Model of ``cfg`` with ``init_v4_random_weights(seed)``: made on the meta device, cast to ``dtype``
    (transformers' float32 pieces kept float32), allocated uninitialised on ``device`` and filled there, so no
    float32 copy of the model exists; eval mode, no grads."""
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
    model = model.to(dtype)
    model.keep_fp32()
    model = model.to_empty(device=torch.device(device))
    init_v4_random_weights(model, seed, on_device)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_v4_random_weights(model: DeepseekV4Model, seed: int, on_device: bool | None = None) -> None:
    """Fill every parameter and buffer of ``model`` deterministically (each from its own generator, seeded by ``seed``
    and its name; draws in float32, cast to the tensor's dtype), on the CPU unless ``on_device`` or, by default, more
    than HOST_INIT_MAX_PARAMS parameters. Norm weights 1; linears, embedding, head, router and mHC ``fn`` N(0, 0.02),
    the output projections (``wo_b``, experts' ``w2``) N(0, 0.02 / sqrt(2 layers)); what transformers initialises to
    0 randomised as the parity fixtures do: ``attn_sink``, compressor ``ape`` and mHC ``base`` N(0, 0.5), router
    ``bias`` N(0, 0.1); mHC ``scale`` 1 + N(0, 0.1); hash-MoE ``tid2eid``: each row ``num_experts_per_tok`` distinct
    expert ids in [0, n_routed_experts); Engram as in the dense presets (``q/k_weight`` 1 + N(0, 0.1), ``wkv`` scaled
    so its output has std ~0.08 over the random preset tables)."""
    cfg = model.config
    out_std = 0.02 / (2 * cfg.num_layers) ** 0.5
    e = cfg.engram
    engram_std = 0.4 * 0.02 / (e.n_cols * e.head_dim) ** 0.5 if e is not None else 0.02
    if on_device is None:
        on_device = sum(p.numel() for p in model.parameters()) > HOST_INIT_MAX_PARAMS
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        gen_device = t.device if on_device else torch.device("cpu")
        g = _param_generator(seed, name, gen_device)

        def normal(std: float, mean: float = 0.0) -> None:
            t.copy_(torch.empty(t.shape, dtype=torch.float32, device=gen_device).normal_(mean, std, generator=g))

        leaf = name.rpartition(".")[2]
        if leaf == "tid2eid":  # a random permutation's first k entries: k distinct ids in [0, E) per token
            keys = torch.rand(t.shape[0], cfg.n_routed_experts, generator=g, device=gen_device)
            t.copy_(keys.argsort(dim=-1, stable=True)[:, : t.shape[1]])
        elif name.endswith("gate.bias"):
            normal(0.1)
        elif name.endswith("norm.weight"):
            t.fill_(1.0)
        elif ".engram." in name and leaf in ("q_weight", "k_weight"):
            normal(0.1, 1.0)
        elif ".engram." in name:
            normal(engram_std)  # wkv: v ~ N(0, 0.08) for the store's random rows (RMS ~ 11)
        elif leaf in ("attn_sink", "ape") or leaf.endswith("_base"):
            normal(0.5)
        elif leaf.endswith("_scale"):
            normal(0.1, 1.0)
        elif name.endswith(("wo_b.weight", "experts.w2", "shared_experts.w2.weight")):
            normal(out_std)
        else:
            normal(0.02)
