"""DeepseekV4Model: the DeepSeek-V4 decoder, single-device and plain. ``forward(step, caches) -> (hidden [N, H], new
caches)`` runs one engine step of packed tokens (``StepInputs``: token ids, positions, cu_seqlens, logits_indices,
engram_rows, dead_mask; its paged-KV fields are not read) with one ``SequenceCache`` per packed sequence, and returns
the caches after the step without touching the ones passed in; ``compute_logits(hidden) -> [N, vocab]`` float32.
Layer L: Engram (v41, on the hc streams, at ``engram.layer_ids``) -> mHC collapse -> attn_norm -> attention -> expand
-> collapse -> ffn_norm -> MoE -> expand; then the mHC head, ``norm`` and ``head``. State-dict names are the official
checkpoint's under ``model.`` (``model.layers.L.attn.wq_a.weight``, ``model.embed.weight``, ...) plus ``head.weight``;
the routed experts' parameters are their stacks (``ffn.experts.w13`` / ``w2``, moe.py) behind the per-expert names."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from engram.model.deepseek_v4.attention import Attention, LayerState, SeqSlice
from engram.model.deepseek_v4.cache import SequenceCache
from engram.model.deepseek_v4.config import SLIDING, V4Config
from engram.model.deepseek_v4.mhc import HyperConnection, RMSNorm, hyper_head
from engram.model.deepseek_v4.moe import MoE
from engram.model.deepseek_v4.rope import Rope
from engram.model.inputs import StepInputs
from engram.module import Engram

# Parameters and buffers kept float32 when the model runs in a lower precision (transformers' fp32 modules).
FP32_SUFFIXES = ("norm.weight", "attn_sink", ".ape", "gate.bias", "_fn", "_base", "_scale")


class Block(nn.Module):
    def __init__(self, cfg: V4Config, layer_id: int):
        super().__init__()
        self.layer_id, self.cfg = layer_id, cfg
        self.engram = Engram(cfg.engram, layer_id) if layer_id in cfg.engram_layer_ids else None
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_id)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg, layer_id)
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))

    def _hc(self, site: str) -> HyperConnection:
        c = self.cfg
        return HyperConnection(getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                               getattr(self, f"hc_{site}_scale"), c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps,
                               c.rms_norm_eps)

    def forward(self, h: torch.Tensor, step: StepInputs, rope: Rope, seqs: list[SeqSlice],
                states: list[LayerState]) -> tuple[torch.Tensor, list[LayerState]]:
        """h [T, hc, H] -> (h after this layer, each sequence's new attention state)."""
        new: list[LayerState] = []

        def attend(x: torch.Tensor) -> torch.Tensor:
            y, states_after = self.attn(x, step.positions, rope, seqs, states)
            new.extend(states_after)
            return y

        return self.run(h, step, attend), new

    def run(self, h: torch.Tensor, step: StepInputs, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer around its attention: h [T, hc, H] -> Engram -> collapse -> attn_norm -> ``attend`` ([T, H] ->
        [T, H]) -> expand -> collapse -> ffn_norm -> MoE (step.token_ids) -> expand -> [T, hc, H]. Shared by the
        eager step (``forward``) and the batched decode step (batched_decode.py)."""
        if self.engram is not None:
            if step.engram_rows is None:
                raise ValueError(f"layer {self.layer_id} is an Engram layer but the step has no engram_rows provider")
            h = self.engram(h, step.engram_rows(self.layer_id), dead_mask=step.dead_mask)  # [T, hc, H]
        hc = self._hc("attn")
        x, post, comb = hc.collapse(h)
        h = hc.expand(h, attend(self.attn_norm(x)), post, comb)
        hc = self._hc("ffn")
        x, post, comb = hc.collapse(h)
        return hc.expand(h, self.ffn(self.ffn_norm(x), step.token_ids), post, comb)


class Body(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: V4Config):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False)

    @property
    def engram_layers(self) -> dict[int, Engram]:
        return {b.layer_id: b.engram for b in self.model.layers if b.engram is not None}

    def keep_fp32(self) -> None:
        """Put transformers' float32 pieces (norm weights, mHC, sinks, ape, router bias) back to float32 after a cast
        to a lower precision; a float64 model keeps them float64."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if t.is_floating_point() and t.element_size() < 4 and name.endswith(FP32_SUFFIXES):
                t.data = t.data.float()

    def empty_cache(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> SequenceCache:
        """A fresh SequenceCache for one sequence (default: the embedding's dtype and device)."""
        w = self.model.embed.weight
        return SequenceCache.empty(self, dtype or w.dtype, device or w.device)

    def forward(self, step: StepInputs, caches: list[SequenceCache]) -> tuple[torch.Tensor, list[SequenceCache]]:
        """One step of packed tokens -> (final-normed hidden of the ``logits_indices`` rows [N, H], new caches)."""
        cu = step.cu_seqlens.tolist()
        if len(caches) != len(cu) - 1:
            raise ValueError(f"{len(cu) - 1} packed sequences but {len(caches)} caches")
        starts = step.positions[step.cu_seqlens[:-1]].tolist() if step.num_tokens else []
        for s, (cache, start) in enumerate(zip(caches, starts)):
            if cache.position != start:
                raise ValueError(f"sequence {s}: its cache holds {cache.position} tokens but its chunk starts at "
                                 f"position {start}")
        seqs = [SeqSlice(lo, hi) for lo, hi in zip(cu[:-1], cu[1:])]
        ropes = self.ropes(step.token_ids.device)
        h = self.streams(step.token_ids)
        per_layer = []
        for i, block in enumerate(self.model.layers):
            h, states = block(h, step, ropes[i], seqs, [c.layers[i] for c in caches])
            per_layer.append(states)
        new = [SequenceCache(c.position + (s.hi - s.lo), tuple(layer[j] for layer in per_layer))
               for j, (c, s) in enumerate(zip(caches, seqs))]
        return self.final_norm(h.index_select(0, step.logits_indices)), new

    def ropes(self, device: torch.device | str) -> list[Rope]:
        """Each layer's RoPE tables on ``device``: main for sliding-window layers, compress for the others (one Rope
        object per frequency set, shared)."""
        cfg = self.config
        main, compress = Rope(cfg.main_rope, device), Rope(cfg.compress_rope, device)
        return [main if kind == SLIDING else compress for kind in cfg.layer_types]

    def streams(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [T] -> the hc_mult residual streams [T, hc, H], every stream the token's embedding."""
        x = self.model.embed(token_ids)  # [T, H]
        return x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """Streams [N, hc, H] -> the mHC head's collapse, then ``norm`` -> [N, H]."""
        b, cfg = self.model, self.config
        collapsed = hyper_head(h, b.hc_head_fn, b.hc_head_base, b.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
        return b.norm(collapsed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab_size] (rows past vocab_size, ``padded_vocab_size``'s, dropped)."""
        return self.head(hidden)[:, : self.config.vocab_size].float()


def pack_sequences(chunks: list[list[int]], starts: list[int], engram_rows=None, device: torch.device | str = "cpu",
                   **extra) -> StepInputs:
    """StepInputs of one step from lists (tests, drivers): sequence s feeds ``chunks[s]`` from position
    ``starts[s]``; no paged-KV fields (this model does not read them)."""
    ids = [t for c in chunks for t in c]
    pos = [p + i for c, p in zip(chunks, starts) for i in range(len(c))]
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c))

    def lt(v):
        return torch.tensor(v, dtype=torch.long, device=device)

    return StepInputs(token_ids=lt(ids), positions=lt(pos), cu_seqlens=lt(cu),
                      context_lens=lt([p + len(c) for p, c in zip(starts, chunks)]),
                      block_tables=torch.zeros(len(chunks), 0, dtype=torch.long, device=device),
                      slot_mapping=torch.full((len(ids),), -1, dtype=torch.long, device=device),
                      engram_rows=engram_rows, **extra)
