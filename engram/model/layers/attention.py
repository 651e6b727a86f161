"""GQA self-attention over a paged KV cache, and the per-step attention layout it reads. A KV-source layer writes its
step's K/V through ``slot_mapping``; every layer reads its source's cache through ``block_tables`` (paged_attention.py).
``AttentionMetadata`` is built once per forward from host numbers, without a host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.kv_cache import KVCache
from engram.model.layers import split_linear
from engram.model.layers.fused import norm_rope, norm_rope_qk_store
from engram.model.layers.norm import RMSNorm
from engram.model.layers.packed_linear import pack_linears
from engram.model.layers.paged_attention import PREFILL_BLOCK_M, paged_attention
from engram.model.layers.split_linear import Partials
from engram.transfer import to_device


@dataclass
class AttentionMetadata:
    """Per-step host-side view of the sequence layout, computed once per forward from host numbers."""

    starts: list[int]  # first packed token of each sequence
    q_lens: list[int]  # new tokens of each sequence
    context_lens: list[int]  # KV length of each sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks] (device)
    slot_mapping: torch.Tensor  # [T] (device)
    write_keep: torch.Tensor | None  # [T'] token rows with a slot >= 0; None: all (the usual case)
    decode_seqs: torch.Tensor | None  # [D] sequences with exactly one new token (batched path)
    decode_tokens: torch.Tensor | None  # [D] their packed token rows
    decode_lens: torch.Tensor | None  # [D] their KV lengths
    decode_max_len: int = 0  # longest KV among them (padded length of the batched call)
    prefill: list[int] | None = None  # sequences with several new tokens (host), None when there are none
    prefill_index: torch.Tensor | None = None  # [4, P] (device): their seq index, first token, q_len, ctx
    prefill_tiles: torch.Tensor | None = None  # [2, NT] (device): (prefill index, first query) of each tile

    @classmethod
    def from_step(cls, cu_seqlens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                  slot_mapping: torch.Tensor, host: "HostLayout | None" = None) -> "AttentionMetadata":
        """The step's layout; with ``host`` (the engine's numbers) nothing is read back, without it one host sync."""
        n = context_lens.shape[0]
        if host is None:
            flat = torch.cat([cu_seqlens.long(), context_lens.long(), (slot_mapping < 0).any().long().view(1)]).tolist()
            host = HostLayout(flat[: n + 1], flat[n + 1: 2 * n + 1], not flat[-1])
        cu, ctx = host.cu_seqlens, host.context_lens
        keep = None if host.all_slots_valid else torch.nonzero(slot_mapping >= 0).squeeze(1)
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        for s, (q, c) in enumerate(zip(q_lens, ctx)):
            if q > c:
                raise ValueError(f"sequence {s}: {q} new tokens but context_lens={c} (must include them)")
        dec = [s for s, q in enumerate(q_lens) if q == 1]
        meta = cls(cu[:-1], q_lens, ctx, block_tables, slot_mapping, keep, None, None, None)
        if dec:
            rows = to_device([dec, [cu[s] for s in dec], [ctx[s] for s in dec]], block_tables.device)  # [3, D]
            meta.decode_seqs, meta.decode_tokens, meta.decode_lens = rows.unbind(0)
            meta.decode_max_len = max(ctx[s] for s in dec)
        pre = [s for s, q in enumerate(q_lens) if q > 1]
        if pre:
            meta.prefill = pre
            if block_tables.device.type == "cuda":  # what the Triton prefill kernel reads
                dev = block_tables.device
                meta.prefill_index = to_device([pre, [cu[s] for s in pre], [q_lens[s] for s in pre],
                                                [ctx[s] for s in pre]], dev)
                tiles = [(j, m0) for j, s in enumerate(pre) for m0 in range(0, q_lens[s], PREFILL_BLOCK_M)]
                meta.prefill_tiles = to_device([[t[0] for t in tiles], [t[1] for t in tiles]], dev)
        return meta


@dataclass(frozen=True)
class HostLayout:
    """The step's sequence layout as host numbers (the engine knows them before the step runs)."""

    cu_seqlens: list[int]  # [S+1] token offsets
    context_lens: list[int]  # [S] KV length of each sequence after the step
    all_slots_valid: bool = True  # every token's KV slot is >= 0 (the engine's steps always are)


class Attention(nn.Module):
    """Llama/Qwen attention: q/k/v/o projections (+ Qwen2 bias, + Qwen3 per-head q/k norm); a KV-sharing layer
    (``kv_source != layer_id``) has no k/v projections."""

    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.kv_source = cfg.kv_source(layer_id)
        self.owns_kv = self.kv_source == layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        h, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=bias)
        if self.owns_kv:
            self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=bias)
            self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        o_bias = bias and cfg.architecture != "qwen2"  # HF: Llama/Qwen3 bias o_proj too, Qwen2 never does
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm and self.owns_kv else None
        self.eps = cfg.rms_norm_eps
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # packed q/k/v weight, once packed

    def pack(self) -> None:
        """Run q/k/v (or q alone on a KV-sharing layer) as one GEMM from now on (packed_linear.py)."""
        if self.owns_kv and self.qkv is None:
            self.qkv = pack_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, partials: bool = False) -> torch.Tensor | Partials:
        """x [T, H] -> [T, H]; writes this step's K/V first when the layer owns a cache. ``partials``: the output
        projection may return split_linear.Partials (for a caller that adds them in a fused norm)."""
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv is not None:
            q, k, v = F.linear(x, *self.qkv).split([nq, nkv, nkv], dim=-1)  # views of one [T, nq + 2 nkv]
        else:
            q = self.q_proj(x)
            k, v = (self.k_proj(x), self.v_proj(x)) if self.owns_kv else (None, None)
        q = q.view(t, self.num_heads, self.head_dim)
        if self.owns_kv:
            k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, n_kv, hd]
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if meta.write_keep is None:  # every slot valid: q's and k's rope and the KV write in one fused op
                q = norm_rope_qk_store(q, k, v, _weight(self.q_norm), _weight(self.k_norm), self.eps, cos, sin,
                                       *kv.flat(self.layer_id), meta.slot_mapping)  # [T, nh, hd]
            else:
                q = norm_rope(q, _weight(self.q_norm), self.eps, cos, sin)
                kv.write(self.layer_id, meta.slot_mapping, norm_rope(k, _weight(self.k_norm), self.eps, cos, sin), v,
                         keep=meta.write_keep)
        else:
            q = norm_rope(q, _weight(self.q_norm), self.eps, cos, sin)  # [T, nh, hd]
        o = paged_attention(q, kv, self.kv_source, meta, self.scale)  # [T, nh, hd]
        o = o.reshape(t, self.num_heads * self.head_dim)
        if partials:
            return split_linear.linear(o, self.o_proj.weight, self.o_proj.bias)
        return self.o_proj(o)


def _weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight
