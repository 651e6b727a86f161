"""V4Config: the shape of a DeepSeek-V4 decoder (``model_type`` deepseek_v4, or deepseek_v41 with only the V4 fields
used), read from an HF ``config.json`` as transformers' ``DeepseekV4Config`` reads it (``layer_types`` or the legacy
``compress_ratios`` 0 / 4 / 128; ``mlp_layer_types`` or ``num_hash_layers``; ``rope_parameters`` flat or nested
``main`` / ``compress``), plus the ``engram_*`` fields. V4.1's own attention (other compress ratios, KV / index /
candidate sharing) is refused by name: no public reference defines it. Validated in ``__post_init__``."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from engram.config import EngramConfig, hf_text_config
from engram.model.deepseek_v4.rope import RopeSpec
from engram.model.model_config import check_layers_and_token_ids
from engram.model.sharing_fields import field_error

ARCHITECTURES = ("deepseek_v4", "deepseek_v41")
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "sigmoid", "softmax")
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy per-layer compress_ratios V4 ships
_REFUSED = ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks")
_V41_WHY = ("DeepSeek-V4.1 attention (cross-layer KV / index sharing, candidate blocks, compress ratios other than "
            "0 / 4 / 128) has no public reference implementation, so the runtime does not implement it")


@dataclass(frozen=True)
class V4Config:
    name: str  # checkpoint directory name or preset name
    vocab_size: int  # ids that get logits (compute_logits returns [N, vocab_size])
    hidden_size: int  # H
    num_layers: int  # decoder layers (MTP layers are not built)
    num_heads: int  # query heads; one shared key=value head
    head_dim: int  # per-head dim of q and of the shared kv (512 in V4)
    q_lora_rank: int  # low-rank query: wq_a H -> q_lora_rank, wq_b -> heads * head_dim
    o_groups: int  # grouped output projection: groups of heads
    o_lora_rank: int  # per-group intermediate width
    layer_types: tuple[str, ...]  # per layer, one of LAYER_TYPES
    mlp_layer_types: tuple[str, ...]  # per layer, "hash_moe" (token-id routed) | "moe"
    main_rope: RopeSpec  # sliding-window layers
    compress_rope: RopeSpec  # layers with a compressor (their attention, compressor and indexer)
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # every expert's and the shared expert's inner width
    csa_ratio: int = 4  # tokens per compressed entry in compressed_sparse_attention
    hca_ratio: int = 128  # tokens per compressed entry in heavily_compressed_attention
    sliding_window: int = 128  # keys a query sees, itself included
    index_n_heads: int = 64  # lightning indexer heads
    index_head_dim: int = 128
    index_topk: int = 512  # compressed entries a CSA query keeps
    scoring_func: str = "sqrtsoftplus"  # router scores
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0  # clamp of the gate (above) and up (both sides) pre-activations
    hc_mult: int = 4  # mHC residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    bos_token_id: int | None = 0
    eos_token_id: int | None = 1
    pad_token_id: int | None = None
    engram: EngramConfig | None = None  # Engram layers (v41, applied to the hc_mult streams before attention)
    quantization: dict[str, Any] | None = field(default=None, compare=False)  # config.json quantization_config
    chat_template: str | None = None
    architecture: str = "deepseek_v4"
    tie_word_embeddings: bool = False  # never in V4; read by the engine's shared code
    padded_vocab_size: int | None = None  # embedding / head / tid2eid rows; None = vocab_size

    def __post_init__(self) -> None:
        for f in ("layer_types", "mlp_layer_types"):
            object.__setattr__(self, f, tuple(getattr(self, f)))
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"model.{name}={getattr(self, name)!r}: {why}")

        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups",
                  "o_lora_rank", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "csa_ratio",
                  "hca_ratio", "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                  "hc_sinkhorn_iters", "max_position_embeddings"):
            if getattr(self, f) < 1:
                raise bad(f, "must be >= 1")
        for f, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_TYPES)):
            types = getattr(self, f)
            if len(types) != self.num_layers:
                raise bad(f, f"has {len(types)} entries but num_hidden_layers={self.num_layers}")
            wrong = [t for t in types if t not in allowed]
            if wrong:
                raise bad(f, f"entry {wrong[0]!r} is not one of {allowed}")
        if self.padded_vocab_size < self.vocab_size:
            raise bad("padded_vocab_size", f"must be >= vocab_size={self.vocab_size}")
        if self.num_heads % self.o_groups:
            raise bad("o_groups", f"must divide num_attention_heads={self.num_heads}")
        rope = self.main_rope.dim
        if rope % 2 or not 0 < rope <= min(self.head_dim, self.index_head_dim) or self.compress_rope.dim != rope:
            raise ValueError(f"model.qk_rope_head_dim={rope}: must be even, > 0 and <= head_dim={self.head_dim} and "
                             f"index_head_dim={self.index_head_dim}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise bad("num_experts_per_tok", f"must be <= n_routed_experts={self.n_routed_experts}")
        if self.scoring_func not in SCORING:
            raise bad("scoring_func", f"must be one of {SCORING}")
        e = self.engram
        if e is not None:
            if e.variant != "v41" or e.hc_mult != self.hc_mult or e.hidden_size != self.hidden_size:
                raise bad("engram", f"DeepSeek-V4 carries v41 Engram on its hc_mult={self.hc_mult} streams of "
                                    f"hidden_size={self.hidden_size}; got variant {e.variant!r}, hc_mult "
                                    f"{e.hc_mult}, hidden_size {e.hidden_size}")
        check_layers_and_token_ids(self, bad)

    # ----------------------------------------------------------------- derived
    def ratio(self, layer_id: int) -> int:
        """Tokens per compressed entry of a layer; 0 for a sliding-window layer."""
        return {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[self.layer_types[layer_id]]

    @property
    def engram_layer_ids(self) -> tuple[int, ...]:
        return () if self.engram is None else self.engram.layer_ids

    def replace(self, **changes: Any) -> "V4Config":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], name: str = "checkpoint") -> "V4Config":
        """Build from a config.json dict (``hf_text_config``); ValueError naming a missing, bad or refused field."""
        hf = hf_text_config(raw)
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(f"config.json model_type={arch!r} is not a DeepSeek-V4 type {ARCHITECTURES}")
        for key in _REFUSED:
            off = {"candidate_source_layer_id": -1, "candidate_topk_blocks": 0}.get(key)
            if hf.get(key) is not None and hf[key] != off:
                raise field_error(key, hf[key], _V41_WHY)

        def need(key: str) -> Any:
            if key not in hf:
                raise ValueError(f"config.json field {key!r} is required (model_type {arch})")
            return hf[key]

        def expect(key: str, want: Any) -> None:
            if key in hf and hf[key] is not None and hf[key] != want:
                raise field_error(key, hf[key], f"DeepSeek-V4 is built with {key}={want!r} only")

        for key, want in (("num_key_value_heads", 1), ("n_shared_experts", 1), ("norm_topk_prob", True),
                          ("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False),
                          ("tie_word_embeddings", False)):
            expect(key, want)
        n = int(need("num_hidden_layers"))
        head_dim = int(need("head_dim"))
        rates = dict(hf.get("compress_rates") or {})
        csa = int(hf.get("compress_rate_csa", rates.get(CSA, 4)))
        hca = int(hf.get("compress_rate_hca", rates.get(HCA, 128)))
        eos = hf.get("eos_token_id", 1)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        engram = EngramConfig.from_hf_config(hf) if "engram_layer_ids" in hf else None
        main, compress = _rope_specs(hf, head_dim)
        rows = int(need("vocab_size"))
        return cls(
            name=name, vocab_size=int(hf.get("engram_logit_vocab_size", rows)), padded_vocab_size=rows,
            hidden_size=int(need("hidden_size")), num_layers=n,
            num_heads=int(need("num_attention_heads")), head_dim=head_dim, q_lora_rank=int(need("q_lora_rank")),
            o_groups=int(need("o_groups")), o_lora_rank=int(need("o_lora_rank")),
            layer_types=_layer_types(hf, n), mlp_layer_types=_mlp_layer_types(hf, n),
            main_rope=main, compress_rope=compress, n_routed_experts=int(need("n_routed_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")), csa_ratio=csa, hca_ratio=hca,
            sliding_window=int(hf.get("sliding_window", 128)), index_n_heads=int(hf.get("index_n_heads", 64)),
            index_head_dim=int(hf.get("index_head_dim", 128)), index_topk=int(hf.get("index_topk", 512)),
            scoring_func=hf.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(hf.get("swiglu_limit", 10.0)), hc_mult=int(hf.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)), hc_eps=float(hf.get("hc_eps", 1e-6)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            bos_token_id=hf.get("bos_token_id", 0), eos_token_id=eos, pad_token_id=hf.get("pad_token_id"),
            engram=engram, quantization=hf.get("quantization_config"), architecture=arch,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json fields that ``from_hf_dict`` reads back to an equal config (all but ``name`` and
        ``chat_template``): transformers' DeepseekV4Config spelling (``layer_types``, ``mlp_layer_types``,
        ``compress_rates``, ``rope_parameters`` nested main / compress), ``vocab_size`` = the embedding rows and
        ``engram_logit_vocab_size`` = the ids that get logits, plus the ``engram_*`` fields (the model's own
        ``hidden_size`` / ``hc_mult`` / ``rms_norm_eps`` win over the Engram config's)."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": self.architecture,
            "vocab_size": self.padded_vocab_size, "engram_logit_vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": 1, "head_dim": self.head_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "layer_types": list(self.layer_types), "mlp_layer_types": list(self.mlp_layer_types),
            "compress_rates": {CSA: self.csa_ratio, HCA: self.hca_ratio}, "qk_rope_head_dim": self.main_rope.dim,
            "rope_theta": self.main_rope.theta, "compress_rope_theta": self.compress_rope.theta,
            "rope_parameters": {"main": _rope_dict(self.main_rope), "compress": _rope_dict(self.compress_rope)},
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": 1,
            "num_experts_per_tok": self.num_experts_per_tok, "moe_intermediate_size": self.moe_intermediate_size,
            "sliding_window": self.sliding_window, "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk, "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor, "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False, "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.quantization is not None:
            out["quantization_config"] = dict(self.quantization)
        return out if self.engram is None else {**self.engram.to_hf_fields(), **out}


def _layer_types(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    """Explicit ``layer_types`` > legacy ``compress_ratios`` (0 / 4 / 128 only) > transformers' default (two HCA layers,
    then CSA and HCA alternating)."""
    if hf.get("layer_types") is not None:
        types = hf["layer_types"]
        if not isinstance(types, list):
            raise field_error("layer_types", types, f"must be a list of {LAYER_TYPES}")
        return tuple(types[:n])
    ratios = hf.get("compress_ratios")
    if ratios is not None:
        if not isinstance(ratios, list) or len(ratios) < n:
            raise field_error("compress_ratios", ratios, f"must list one ratio per layer (num_hidden_layers={n})")
        other = sorted({r for r in ratios[:n] if r not in _RATIO_TYPES}, key=repr)
        if other:
            raise field_error("compress_ratios", ratios, f"ratio {other[0]!r}: {_V41_WHY}")
        return tuple(_RATIO_TYPES[r] for r in ratios[:n])
    return tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])


def _mlp_layer_types(hf: dict[str, Any], n: int) -> tuple[str, ...]:
    if hf.get("mlp_layer_types") is not None:
        return tuple(hf["mlp_layer_types"][:n])
    k = int(hf.get("num_hash_layers", 3))
    return tuple(["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k))


def _rope_specs(hf: dict[str, Any], head_dim: int) -> tuple[RopeSpec, RopeSpec]:
    """(main, compress) from ``rope_parameters`` (or ``rope_scaling``): nested by label, or one flat dict whose scaling
    applies to the compress layers only, as transformers' DeepseekV4Config folds it."""
    if hf.get("qk_rope_head_dim") is not None:
        dim = int(hf["qk_rope_head_dim"])
    else:
        dim = int(head_dim * float(hf.get("partial_rotary_factor") or 64 / 512))
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
    else:
        flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
        compress = {**flat, "rope_theta": hf.get("compress_rope_theta", 160000.0)}
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)  # V4 does not scale cos / sin by YaRN's mscale
    return _spec(main, dim, "main"), _spec(compress, dim, "compress")


def _spec(p: dict[str, Any], dim: int, label: str) -> RopeSpec:
    kind = p.get("rope_type", p.get("type", "default"))
    where = f"rope_parameters[{label!r}]"
    if "rope_theta" not in p:
        raise ValueError(f"config.json {where} has no rope_theta")
    if kind == "default":
        return RopeSpec(theta=float(p["rope_theta"]), dim=dim)
    if kind != "yarn":
        raise NotImplementedError(f"config.json {where} rope_type={kind!r}: only 'default' and 'yarn' are implemented")
    for key in ("factor", "original_max_position_embeddings"):
        if p.get(key) is None:
            raise ValueError(f"config.json {where} (yarn) needs {key!r}")
    if p.get("mscale") or p.get("mscale_all_dim"):
        raise NotImplementedError(f"config.json {where}: yarn mscale / mscale_all_dim are not implemented")
    return RopeSpec(theta=float(p["rope_theta"]), dim=dim, kind="yarn", factor=float(p["factor"]),
                    original_max_position_embeddings=int(p["original_max_position_embeddings"]),
                    beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                    attention_factor=float(p.get("attention_factor", _yarn_mscale(float(p["factor"])))),
                    truncate=bool(p.get("truncate", True)))


def _yarn_mscale(factor: float) -> float:
    """YaRN's default attention factor, used where a nested yarn entry names none."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _rope_dict(spec: RopeSpec) -> dict[str, Any]:
    """A RopeSpec as a nested ``rope_parameters`` entry ``_spec`` reads back."""
    if spec.kind == "default":
        return {"rope_type": "default", "rope_theta": spec.theta}
    return {"rope_type": spec.kind, "rope_theta": spec.theta, "factor": spec.factor,
            "original_max_position_embeddings": spec.original_max_position_embeddings,
            "beta_fast": spec.beta_fast, "beta_slow": spec.beta_slow, "attention_factor": spec.attention_factor,
            "truncate": spec.truncate}
