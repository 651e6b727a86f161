"""``paged_attention``: attention of a step's queries over the paged KV cache, one function, two paths. The torch path
(``paged_attention_reference``) is the reference and float64 oracle: decode sequences in one batched call over KV padded
to the longest, longer chunks one sequence at a time (SDPA, causal mask offset by the cached tokens). On CUDA for bf16 /
fp16 / fp32 the Triton kernels (paged_attention_triton.py) read K/V in place. ``set_backend`` or
``ENGRAM_KERNELS=attention=torch`` forces the reference; "triton" insists on the fast path."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engram.fast_path import FastPathSwitch, importable
from engram.model.kv_cache import KVCache

SWITCH = FastPathSwitch("attention backend", "attention")
FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PREFILL_BLOCK_M = 64  # queries per program of the Triton prefill kernel (AttentionMetadata tiles by it)


def set_backend(name: str) -> str:
    """Select "auto" (Triton on CUDA where it applies), "torch" (reference) or "triton"; returns the old one."""
    return SWITCH.set(name)


def uses_triton(q: torch.Tensor) -> bool:
    """Whether ``paged_attention`` takes the Triton path for these queries."""
    eligible = q.is_cuda and q.dtype in FAST_DTYPES and importable("engram.model.layers.paged_attention_triton")
    return SWITCH.fast(eligible,
                       f"{q.dtype} queries on {q.device} (needs CUDA, triton and one of {FAST_DTYPES})")


def paged_attention(q: torch.Tensor, kv: KVCache, layer_id: int, meta, scale: float) -> torch.Tensor:
    """q [T, nh, hd] -> attention output [T, nh, hd] over the cache of ``layer_id`` (meta: AttentionMetadata)."""
    if not uses_triton(q):
        return paged_attention_reference(q, kv, layer_id, meta, scale)
    from engram.model.layers import paged_attention_triton as tri

    out = torch.empty_like(q)
    k_cache, v_cache = kv.k[layer_id], kv.v[layer_id]
    if meta.decode_seqs is not None:
        tri.decode(q, k_cache, v_cache, meta.block_tables, meta.decode_seqs, meta.decode_tokens, meta.decode_lens,
                   meta.decode_max_len, out, scale)
    if meta.prefill_tiles is not None:
        seqs, starts, q_lens, ctx = meta.prefill_index.unbind(0)
        tiles, m0 = meta.prefill_tiles.unbind(0)
        tri.prefill(q, k_cache, v_cache, meta.block_tables, tiles, m0, seqs, starts, q_lens, ctx,
                    PREFILL_BLOCK_M, out, scale)
    return out


def paged_attention_reference(q: torch.Tensor, kv: KVCache, layer_id: int, meta,
                    scale: float) -> torch.Tensor:
    """The torch reference: q [T, nh, hd] -> [T, nh, hd] over the cache of ``layer_id``."""
    out = torch.empty_like(q)
    groups = q.shape[1] // kv.n_kv_heads
    if meta.decode_seqs is not None:
        o = _decode_batched(q, kv, layer_id, meta, scale, groups)  # [D, nh, hd]
        if meta.prefill_index is not None and not meta.starts:  # a graph's padded layout: empty entries write nothing
            live = meta.decode_lens > 0
            out[meta.decode_tokens[live]] = o[live]
        else:
            out[meta.decode_tokens] = o
    for row, start, q_len, ctx in _prefill_entries(meta):
        k, v = kv.read(layer_id, meta.block_tables[row], ctx)  # [ctx, n_kv, hd] each
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


def _prefill_entries(meta) -> list[tuple[int, int, int, int]]:
    """(block-table row, first token, new tokens, KV length) of each sequence with several new tokens: from the host
    lists, or (a graph's padded layout, which has none) read back from ``prefill_index``."""
    if meta.starts:
        rows = zip(range(len(meta.starts)), meta.starts, meta.q_lens, meta.context_lens)
    elif meta.prefill_index is not None:
        rows = zip(*meta.prefill_index.tolist())
    else:
        return []
    return [r for r in rows if r[2] > 1]


def _decode_batched(q: torch.Tensor, kv: KVCache, layer_id: int, meta, scale: float,
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


