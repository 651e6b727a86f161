"""ModelConfig: the shape of a dense decoder (Llama / Qwen2 / Qwen3) plus its Engram layout. Reads and writes those
families' HF ``config.json`` fields (through ``hf_text_config``) and EngramConfig's ``engram_*``, plus ``hc_mult`` and
``kv_source_layer_ids`` (validated by ``sharing_fields.source_layer_ids``, the PP planner's rule and messages).
DeepSeek-V4.1 attention fields are refused. Validated in ``__post_init__`` (ValueError naming field and value)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from engram.config import EngramConfig, hf_text_config
from engram.model.sharing_fields import field_error, source_layer_ids, v41_attention_field

ARCHITECTURES = ("llama", "qwen2", "qwen3")


def check_layers_and_token_ids(cfg: Any, bad: Callable[[str, str], ValueError]) -> None:
    """Checks every decoder config shares: Engram layers inside ``num_layers``, special token ids inside the vocab;
    ``bad(field, why)`` makes the error."""
    e = cfg.engram
    if e is not None and e.layer_ids[-1] >= cfg.num_layers:
        raise bad("engram", f"engram.layer_ids={e.layer_ids} reach past num_layers={cfg.num_layers}")
    for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, f)
        if v is not None and not 0 <= v < cfg.vocab_size:
            raise bad(f, f"must be in [0, vocab_size={cfg.vocab_size})")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shape: ``vocab_size`` ids get logits, ``padded_vocab_size`` rows exist in the embedding and LM head."""

    name: str  # preset name or checkpoint directory name
    architecture: str  # "llama" | "qwen2" | "qwen3" (tensor names and config.json model_type)
    vocab_size: int  # ids that get logits (compute_logits returns [N, vocab_size])
    hidden_size: int  # H
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA); divides num_heads
    head_dim: int  # per-head dim (even: RoPE rotates halves)
    intermediate_size: int  # SwiGLU inner size
    padded_vocab_size: int | None = None  # embedding / LM-head rows; None = vocab_size
    rope_theta: float = 10000.0  # RoPE base
    rms_norm_eps: float = 1e-6  # eps of every RMSNorm in the decoder
    max_position_embeddings: int = 4096  # longest sequence the engine may schedule
    tie_word_embeddings: bool = False  # LM head shares the embedding matrix
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE
    attention_bias: bool = False  # bias on q/k/v (Qwen2: always, o_proj never; Llama/Qwen3: on o_proj too)
    hc_mult: int = 1  # hyper-connection residual streams; 1 = plain residual
    kv_source_layer_ids: tuple[int, ...] | None = None  # layers owning a KV cache (0 first); None = every layer
    engram: EngramConfig | None = None  # Engram layout (applied before each Engram layer's attention)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    chat_template: str | None = None  # HF-style Jinja chat template (tokenizer_config.json on save/load)
    init_seed: int = 0  # seed of deterministic random weights (presets)

    def __post_init__(self) -> None:
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if isinstance(self.kv_source_layer_ids, list):
            object.__setattr__(self, "kv_source_layer_ids", tuple(self.kv_source_layer_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"model.{name}={getattr(self, name)!r}: {why}")

        if self.architecture not in ARCHITECTURES:
            raise bad("architecture", f"must be one of {ARCHITECTURES}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "hc_mult", "max_position_embeddings"):
            if getattr(self, f) < 1:
                raise bad(f, "must be >= 1")
        if self.padded_vocab_size < self.vocab_size:
            raise bad("padded_vocab_size", f"must be >= vocab_size={self.vocab_size}")
        if self.num_heads % self.num_kv_heads:
            raise bad("num_kv_heads", f"must divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise bad("head_dim", "must be even (RoPE rotates two halves)")
        if not self.rope_theta > 0:
            raise bad("rope_theta", "must be > 0")
        # the planner's rule and message; every layer takes part in sharing here, so layer 0 is a source
        source_layer_ids(self.kv_source_layer_ids, "kv_source_layer_ids", "kv", self.num_layers)
        e = self.engram
        if e is not None:
            if e.hidden_size != self.hidden_size:
                raise bad("engram", f"engram.hidden_size={e.hidden_size} != hidden_size={self.hidden_size}")
            if e.hc_mult != self.hc_mult:
                raise bad("engram", f"engram.hc_mult={e.hc_mult} != hc_mult={self.hc_mult}")
        check_layers_and_token_ids(self, bad)

    # ----------------------------------------------------------------- derived
    def kv_source(self, layer_id: int) -> int:
        """The layer whose KV cache ``layer_id`` reads: itself if it owns one, else the nearest earlier source."""
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer {layer_id} outside [0, num_layers={self.num_layers})")
        if self.kv_source_layer_ids is None:
            return layer_id
        return max(s for s in self.kv_source_layer_ids if s <= layer_id)

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """Layers that own a KV cache (what KVCache allocates)."""
        return tuple(range(self.num_layers)) if self.kv_source_layer_ids is None else self.kv_source_layer_ids

    @property
    def engram_layer_ids(self) -> tuple[int, ...]:
        return () if self.engram is None else self.engram.layer_ids

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- HF config.json
    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "qwen3": "Qwen3ForCausalLM"}[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.padded_vocab_size,
            "engram_logit_vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "hc_mult": self.hc_mult,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.kv_source_layer_ids is not None:
            out["kv_source_layer_ids"] = list(self.kv_source_layer_ids)
        if self.engram is not None:
            out.update(self.engram.to_hf_fields())
        return out

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "checkpoint") -> "ModelConfig":
        """Build from a config.json dict (``hf_text_config``); ValueError naming a missing field, an unsupported
        model_type or a DeepSeek-V4.1 attention field."""
        hf = hf_text_config(raw)
        arch = hf.get("model_type", "llama")
        if arch not in ARCHITECTURES:
            raise ValueError(f"config.json model_type={arch!r} is not supported; known: {ARCHITECTURES}")
        v41 = v41_attention_field(hf)
        if v41 is not None:
            raise field_error(v41, hf[v41], "DeepSeek-V4.1 attention (compressed KV, indexer, candidate blocks) "
                                            "is not implemented by the runtime decoder; `engram plan-pp` plans it")

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"config.json field {key!r} is required (model_type {arch})")
            return hf[key]

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        padded = int(need("vocab_size"))
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers v5 / v4 spelling
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise NotImplementedError(f"config.json RoPE type {rope_type!r} is not supported (only plain RoPE)")
        theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
        engram = EngramConfig.from_hf_config(hf) if "engram_layer_ids" in hf else None
        src = hf.get("kv_source_layer_ids")
        return cls(
            name=name, architecture=arch, vocab_size=int(hf.get("engram_logit_vocab_size", padded)),
            padded_vocab_size=padded, hidden_size=hidden, num_layers=int(need("num_hidden_layers")),
            num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads", heads)),
            head_dim=int(hf.get("head_dim") or hidden // heads), intermediate_size=int(need("intermediate_size")),
            rope_theta=float(theta), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=arch == "qwen3",
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")), hc_mult=int(hf.get("hc_mult", 1)),
            kv_source_layer_ids=src, engram=engram,
            bos_token_id=hf.get("bos_token_id"), eos_token_id=eos, pad_token_id=hf.get("pad_token_id"),
        )
