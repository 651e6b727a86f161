"""EngramDecoder: a plain, single-device Llama/Qwen-style decoder with Engram before chosen layers' attention.
``forward(step, kv) -> hidden [len(logits_indices), H]`` runs one engine step of packed tokens;
``compute_logits(hidden) -> [N, vocab_size]`` float32. Parameter names are HF's plus ``model.layers.L.engram.*`` and
``model.layers.L.{attn,mlp}_hc.*``. The model never reads a table: each Engram layer asks ``step.engram_rows(L)``.
``keep_layers(model, layers)`` keeps a contiguous range of layers (a pipeline stage's, applied by parallel/pp_stage.py):
the others become parameterless ``LayerGap``s, so layer indices and parameter names stay those of the whole model."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engram.model.inputs import StepInputs
from engram.model.kv_cache import KVCache
from engram.model.layers.attention import Attention, AttentionMetadata
from engram.model.layers.fused import add_rms_norm
from engram.model.layers.split_linear import Partials, dense
from engram.model.layers.hyper_connections import HyperConnection
from engram.model.layers.mlp import MLP
from engram.model.layers.norm import RMSNorm
from engram.model.layers.rope import RotaryEmbedding
from engram.model.model_config import ModelConfig
from engram.module import Engram


class LayerGap(nn.Module):
    """A layer this model does not hold (another pipeline stage runs it): no parameters, never run."""

    engram = None

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id = layer_id

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"layer {self.layer_id} is not held by this model (another pipeline stage runs it)")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id, self.hc_mult = layer_id, cfg.hc_mult
        self.engram = Engram(cfg.engram, layer_id) if layer_id in cfg.engram_layer_ids else None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        if cfg.hc_mult > 1:
            self.attn_hc = HyperConnection(cfg.hc_mult, layer_id)
            self.mlp_hc = HyperConnection(cfg.hc_mult, layer_id)

    def _apply_engram(self, h: torch.Tensor, step: StepInputs) -> torch.Tensor:
        if step.engram_rows is None:
            raise ValueError(f"layer {self.layer_id} is an Engram layer but the step has no engram_rows provider")
        rows = step.engram_rows(self.layer_id)  # [T, n_cols, head_dim]
        state = step.conv_state
        if isinstance(state, dict):
            state = state[self.layer_id]
        out = self.engram(h, rows, dead_mask=step.dead_mask, state=state)  # [T, hc, H]
        return h + out if self.engram.residual_output else out

    def forward(self, h: torch.Tensor, step: StepInputs, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv: KVCache,
                delta: torch.Tensor | Partials | None = None) -> tuple[torch.Tensor, torch.Tensor | Partials | None]:
        """h [T, hc_mult, H] and ``delta`` [T, H] (the previous layer's MLP output not yet added to its single residual
        stream; None: nothing pending) -> (h, delta) of this layer, h + delta its output. With one stream the residual
        adds are fused into the next norm (fused.add_rms_norm), with the sums of the plain adds; at one to four rows the
        o and down projections hand on float32 partials that the fused add sums (split_linear.py), so ``delta`` may
        be a ``Partials``."""
        if delta is not None and (self.engram is not None or self.hc_mult > 1):
            h, delta = h + dense(delta).unsqueeze(1), None  # Engram and hyper-connections read the whole stream
        if self.engram is not None:
            h = self._apply_engram(h, step)
        if self.hc_mult == 1:
            x = h[:, 0]  # [T, H]: plain residual
            if delta is None:
                normed = self.input_layernorm(x)
            else:
                x, normed = add_rms_norm(x, delta, self.input_layernorm.weight, self.input_layernorm.eps)
            x, normed = add_rms_norm(x, self.self_attn(normed, cos, sin, meta, kv, partials=True),
                                     self.post_attention_layernorm.weight,
                                     self.post_attention_layernorm.eps)
            return x.unsqueeze(1), self.mlp(normed, partials=True)
        y = self.self_attn(self.input_layernorm(self.attn_hc.collapse(h)), cos, sin, meta, kv)  # [T, H]
        h = self.attn_hc.expand(h, y)
        y = self.mlp(self.post_attention_layernorm(self.mlp_hc.collapse(h)))
        return self.mlp_hc.expand(h, y), None


@dataclass
class ForwardState:
    """A step's forward between two layers: its inputs, the attention metadata, the RoPE tables, the streams
    ``h`` [T, hc, H] and the pending single-stream MLP output ``delta`` [T, H] (None: nothing pending)."""

    step: StepInputs
    kv: KVCache
    meta: AttentionMetadata
    cos: torch.Tensor
    sin: torch.Tensor
    h: torch.Tensor
    delta: torch.Tensor | Partials | None = None


class DecoderBody(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class EngramDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call again after ``to_empty``)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def held_layers(self) -> range:
        """The layers this model holds: all, or the range ``keep_layers`` kept."""
        held = [layer.layer_id for layer in self.model.layers if not isinstance(layer, LayerGap)]
        return range(held[0], held[-1] + 1)

    def pack_projections(self) -> None:
        """q/k/v and gate/up of every held layer as one GEMM each (parameters become views; names unchanged)."""
        for layer in self.model.layers[self.held_layers.start:self.held_layers.stop]:
            layer.self_attn.pack()
            layer.mlp.pack()

    @property
    def engram_layers(self) -> dict[int, Engram]:
        return {l.layer_id: l.engram for l in self.model.layers if l.engram is not None}

    def forward(self, step: StepInputs, kv: KVCache) -> torch.Tensor:
        """One step of packed tokens -> final-normed hidden of the ``step.logits_indices`` rows [N, H]."""
        state = self.forward_begin(step, kv)
        self.forward_layers(state, 0, len(self.model.layers))
        return self.forward_end(state)

    # The same forward in pieces (``forward`` is begin + every layer + end, so the ops and their results are
    # the same): piecewise CUDA graphs capture a range of layers each (engine/runners/pieces.py).
    def forward_begin(self, step: StepInputs, kv: KVCache, h: torch.Tensor | None = None,
                      delta: torch.Tensor | Partials | None = None) -> "ForwardState":
        """The embedding, RoPE tables and attention metadata of a step: the state before layer 0. ``h`` [T, hc, H]
        and ``delta``: the streams a previous pipeline stage handed on (then no embedding: the state before its cut)."""
        meta = step.attention or AttentionMetadata.from_step(step.cu_seqlens, step.context_lens, step.block_tables,
                                                             step.slot_mapping, step.host_layout)
        if h is None:
            x = self.model.embed_tokens(step.token_ids)  # [T, H]
            h = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, hc, H]: every stream is x
        cos, sin = self.rotary.cos_sin(step.positions, h.dtype)  # [T, 1, hd]
        return ForwardState(step, kv, meta, cos, sin, h, delta)

    def forward_layers(self, state: "ForwardState", lo: int, hi: int) -> "ForwardState":
        """Run layers [lo, hi) on ``state`` (its ``h`` and ``delta`` are replaced by theirs)."""
        for layer in self.model.layers[lo:hi]:
            state.h, state.delta = layer(state.h, state.step, state.cos, state.sin, state.meta, state.kv, state.delta)
        return state

    def forward_end(self, state: "ForwardState") -> torch.Tensor:
        """After the last layer: the final-normed hidden of the ``logits_indices`` rows [N, H]."""
        h = state.h if state.delta is None else state.h + dense(state.delta).unsqueeze(1)
        h = h.index_select(0, state.step.logits_indices)  # [N, hc, H]
        return self.model.norm(h.sum(dim=1) if self.config.hc_mult > 1 else h[:, 0])  # [N, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab_size] (padded vocab rows dropped)."""
        return self.lm_head(hidden)[:, : self.config.vocab_size].float()


def keep_layers(model: EngramDecoder, layers: range) -> EngramDecoder:
    """Keep decoder layers ``layers`` (contiguous) of ``model`` in place: every other layer becomes a ``LayerGap``;
    the embedding stays with layer 0 (and with the last layer when the LM head is tied to it), the final norm and LM
    head with the last layer. Call it on a model built on the meta device, before its weights are made."""
    n = len(model.model.layers)
    if not (isinstance(layers, range) and layers.step == 1 and 0 <= layers.start < layers.stop <= n):
        raise ValueError(f"layers={layers!r}: must be a contiguous range inside [0, {n})")
    for i in range(n):
        if i not in layers:
            model.model.layers[i] = LayerGap(i)
    first, last = layers.start == 0, layers.stop == n
    if not first and not (last and model.config.tie_word_embeddings):
        model.model.embed_tokens = None
    if not last:
        model.model.norm, model.lm_head = None, None
    return model
