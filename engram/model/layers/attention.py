"""GQA self-attention over a paged KV cache, in plain torch (correctness first, any dtype incl. float64).

A KV-source layer projects K/V for the step's tokens and writes them through ``slot_mapping``; every
layer (source or sharer) then reads its source's cache through ``block_tables``. Decode sequences
(one new token) are attended in one batched, padded call; longer chunks one sequence at a time with a
causal mask offset by the tokens already cached. Head h reads KV head h // (num_heads // num_kv_heads)
(SDPA's enable_gqa: no K/V copies).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engram.model.kv_cache import KVCache
from engram.model.layers.norm import RMSNorm
from engram.model.layers.rope import apply_rope
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

    @classmethod
    def from_step(cls, cu_seqlens: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                  slot_mapping: torch.Tensor, host: "HostLayout | None" = None) -> "AttentionMetadata":
        """The step's layout. With ``host`` (the engine's own numbers) nothing is read back from the device;
        without it (reference builders, tests) offsets and lengths are read in one host sync."""
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
        return meta


@dataclass(frozen=True)
class HostLayout:
    """The step's sequence layout as host numbers (the engine knows them before the step runs)."""

    cu_seqlens: list[int]  # [S+1] token offsets
    context_lens: list[int]  # [S] KV length of each sequence after the step
    all_slots_valid: bool = True  # every token's KV slot is >= 0 (the engine's steps always are)


def paged_attention(q: torch.Tensor, kv: KVCache, layer_id: int, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q [T, nh, hd] -> attention output [T, nh, hd] over the cache of ``layer_id``."""
    out = torch.empty_like(q)
    groups = q.shape[1] // kv.n_kv_heads
    if meta.decode_seqs is not None:
        out[meta.decode_tokens] = _decode_batched(q, kv, layer_id, meta, scale, groups)
    for s, (start, q_len, ctx) in enumerate(zip(meta.starts, meta.q_lens, meta.context_lens)):
        if q_len <= 1:
            continue
        k, v = kv.read(layer_id, meta.block_tables[s], ctx)  # [ctx, n_kv, hd] each
        qs = q[start:start + q_len].transpose(0, 1)  # [nh, q_len, hd]
        ks = k.transpose(0, 1).to(q.dtype)  # [n_kv, ctx, hd]
        vs = v.transpose(0, 1).to(q.dtype)
        if q_len == ctx:  # fresh prefill: plain causal, which lets SDPA pick its flash kernel
            mask = None
        else:
            qpos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)  # [q_len, 1] absolute positions
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [q_len, ctx] causal, offset by cache
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=groups > 1)  # [nh, q_len, hd]
        out[start:start + q_len] = o.transpose(0, 1)
    return out


def _decode_batched(q: torch.Tensor, kv: KVCache, layer_id: int, meta: AttentionMetadata, scale: float,
                    groups: int) -> torch.Tensor:
    """One new token per sequence: pad every sequence's KV to the longest and attend in one call."""
    bs = kv.block_size
    n_blocks = -(-meta.decode_max_len // bs)
    tables = meta.block_tables.index_select(0, meta.decode_seqs)[:, :n_blocks].clamp_min(0)  # [D, nb]; -1 -> 0, masked
    d = tables.shape[0]
    k = kv.k[layer_id][tables].view(d, n_blocks * bs, kv.n_kv_heads, -1)  # [D, Lpad, n_kv, hd]
    v = kv.v[layer_id][tables].view(d, n_blocks * bs, kv.n_kv_heads, -1)
    k = k.transpose(1, 2).to(q.dtype)  # [D, n_kv, Lpad, hd]
    v = v.transpose(1, 2).to(q.dtype)
    valid = torch.arange(n_blocks * bs, device=q.device).unsqueeze(0) < meta.decode_lens.unsqueeze(1)  # [D, Lpad]
    qd = q.index_select(0, meta.decode_tokens).unsqueeze(2)  # [D, nh, 1, hd]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=valid[:, None, None, :], scale=scale,
                                       enable_gqa=groups > 1)  # [D, nh, 1, hd]
    return o.squeeze(2)


class Attention(nn.Module):
    """Llama/Qwen attention block: q/k/v/o projections (+ Qwen2 q/k/v bias, + Qwen3 per-head q/k norm).

    A layer that shares KV (``kv_source != layer_id``) has no k/v projections and reads the source's cache.
    """

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this step's K/V first when the layer owns a cache."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)  # [T, nh, hd]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        if self.owns_kv:
            k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, n_kv, hd]
            v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
            if self.k_norm is not None:
                k = self.k_norm(k)
            kv.write(self.layer_id, meta.slot_mapping, apply_rope(k, cos, sin), v, keep=meta.write_keep)
        o = paged_attention(q, kv, self.kv_source, meta, self.scale)  # [T, nh, hd]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))
