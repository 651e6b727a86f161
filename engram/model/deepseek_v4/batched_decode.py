"""The batched, static-shape DeepSeek-V4 decode step: one new token for each of B sequences, on a ``BatchedCache``
(batched_state.py) updated in place. Every tensor's shape is fixed by (B, W, ratio, E_max), never by the data, and this
code reads nothing back to the host (no ``.item()`` / ``.tolist()`` / ``nonzero``, no Python branch on a tensor value):
the body a CUDA graph of V4 decode would capture. It reuses the eager modules' weights and functions (``Attention
.project`` / ``sink_probs`` / ``project_out``, ``Compressor.pool``, ``Indexer.select``, ``Block.run``: Engram, mHC,
norms, MoE) and equals the eager path (``DeepseekV4Model.forward`` one token per sequence) to rounding.

Per layer and sequence at position p (the token's):

- the token's key is attended with the valid ring slots (``j < min(p, W-1)``), then written into slot ``p % (W-1)``
  (which held position p-W+1, the oldest, no longer needed by the next query);
- each compressor writes the token's projections into buffer slot ``p % ratio``; every sequence's pooled entry
  (softmax over the slots + ape, overlap halves for CSA, norm, compress RoPE at the window's first position p+1-ratio)
  is computed, and committed at entry row ``p // ratio`` (and the overlap slices replaced) only where the window
  closes on this token (``(p+1) % ratio == 0``): a masked write, so the shapes do not depend on which sequences close;
- attention reads [ring | the new key | entries]: HCA sees entries ``e < (p+1) // ratio``; CSA the indexer's top-k
  over the valid entries (invalid ones scored -inf before the top-k; when fewer than k are valid the extra picks are
  dropped), plus the sink column; then inverse RoPE, grouped ``wo_a``, ``wo_b`` as in the eager path.

Capacity: a window closing past E_max is not written (the masked index write is clamped and dropped, where an
unchecked write would leave the buffer) and ``BatchedCache.to_caches`` refuses the state afterwards; the caller (it
knows the positions on the host) keeps ``p // ratio < E_max`` for the steps it runs.

Not yet capturable as a whole: the MoE's plain expert loop (float64, shapes ``torch._grouped_mm`` refuses) reads the
expert ids to the host; bf16 at aligned shapes takes the grouped path. ``ropes`` (``model.ropes(device)``) should be
built once outside a capture (built per call when not passed)."""
from __future__ import annotations

import torch

from engram.model.deepseek_v4.attention import Attention
from engram.model.deepseek_v4.batched_state import BatchedCache, BatchedCompressorState, BatchedLayerState
from engram.model.deepseek_v4.compressor import Compressor, visible_entries
from engram.model.deepseek_v4.config import CSA, HCA
from engram.model.deepseek_v4.mhc import work_dtype
from engram.model.deepseek_v4.rope import Rope
from engram.model.inputs import StepInputs


def entry_slot(count: torch.Tensor, e_max: int) -> torch.Tensor:
    """The entry row a closing window is written at: the sequence's entry count [B] (clamped into the buffer)."""
    return count.clamp(max=e_max - 1)


def window_valid(positions: torch.Tensor, ring: int) -> torch.Tensor:
    """bool [B, W-1]: the ring slots holding one of the last ``min(p, W-1)`` keys (slot j valid iff j < min(p, W-1))."""
    return torch.arange(ring, device=positions.device) < positions.clamp(max=ring).unsqueeze(-1)


def _write_rows(buf: torch.Tensor, slot: torch.Tensor, value: torch.Tensor, commit: torch.Tensor | None) -> None:
    """buf [B, N, D] in place: row ``slot[b]`` of sequence b becomes value [B, D] where ``commit`` [B] (None: all),
    else keeps its old value (the same index write for every sequence, the mask on the value)."""
    b, d = buf.shape[0], buf.shape[-1]
    idx = slot.view(b, 1, 1).expand(b, 1, d)
    new = value.to(buf.dtype).unsqueeze(1)
    if commit is not None:
        new = torch.where(commit.view(b, 1, 1), new, buf.gather(1, idx))
    buf.scatter_(1, idx, new)


def compressor_step(comp: Compressor, x: torch.Tensor, positions: torch.Tensor, st: BatchedCompressorState,
                    rope: Rope) -> None:
    """One token per sequence, x [B, H] at positions [B], into ``st`` in place (module docstring: buffer slot, masked
    entry and overlap commit)."""
    r, d, b = comp.ratio, comp.head_dim, x.shape[0]
    _write_rows(st.buffer_kv, positions % r, comp.wkv(x), None)
    _write_rows(st.buffer_gate, positions % r, comp.wgate(x), None)
    count = positions // r  # entries before this token: the row its window's entry takes
    closing = (positions + 1) % r == 0  # [B]
    ck, cg = st.buffer_kv, st.buffer_gate + comp.ape.to(st.buffer_gate.dtype)  # [B, r, c*d]
    prev_kv = prev_gate = None
    if comp.overlap:
        none = (count == 0).view(b, 1, 1)  # entry 0 has no previous window: its slots weigh 0
        prev_kv = torch.where(none, torch.zeros_like(st.overlap_kv), st.overlap_kv)
        prev_gate = torch.where(none, torch.full_like(st.overlap_gate, float("-inf")), st.overlap_gate)
    entry = comp.pool(ck, cg, prev_kv, prev_gate, positions + 1 - r, rope)  # [B, d]: every sequence's, closing or not
    _write_rows(st.entries, entry_slot(count, st.e_max), entry, closing & (count < st.e_max))
    if comp.overlap:
        shut = closing.view(b, 1, 1)
        st.overlap_kv.copy_(torch.where(shut, ck[..., :d], st.overlap_kv))
        st.overlap_gate.copy_(torch.where(shut, cg[..., :d], st.overlap_gate))


def attention_step(attn: Attention, x: torch.Tensor, positions: torch.Tensor, rope: Rope,
                   st: BatchedLayerState) -> torch.Tensor:
    """One layer's attention for one token per sequence: x [B, H] (normed block input) at positions [B] -> [B, H];
    ``st`` updated in place (the window ring, the compressors)."""
    b, ring = x.shape[0], attn.window - 1
    cos, sin, q, kv, iq = attn.project(x, positions, rope)  # q [B, nh, d], kv [B, d]
    if st.compressor is not None:
        compressor_step(attn.compressor, x, positions, st.compressor, rope)
    if st.indexer is not None:
        compressor_step(attn.indexer.compressor, x, positions, st.indexer, rope)
    keys = [st.window, kv.unsqueeze(1)]
    allowed = [window_valid(positions, ring), torch.ones(b, 1, dtype=torch.bool, device=x.device)]
    if attn.kind in (CSA, HCA):
        entries = st.compressor.entries  # [B, E_max, d]
        if attn.kind == CSA:  # -inf past each query's visible entries before the top-k, extra picks dropped
            keep = attn.indexer.select(iq[0], iq[1], st.indexer.entries, positions)  # [B, E_max]
        else:
            rows = torch.arange(entries.shape[1], device=x.device)
            keep = rows < visible_entries(positions, attn.ratio).unsqueeze(-1)
        keys.append(entries.to(kv.dtype))
        allowed.append(keep)
    keys_t, allowed_t = torch.cat(keys, dim=1), torch.cat(allowed, dim=1)  # [B, K, d], [B, K]
    logits = torch.einsum("bhd,bkd->hbk", q, keys_t).to(work_dtype(q.dtype)) * attn.head_dim ** -0.5  # [nh, B, K]
    out = torch.einsum("hbk,bkd->bhd", attn.sink_probs(logits, allowed_t).to(keys_t.dtype), keys_t)
    if ring:  # after the read: slot p % (W-1) held position p-W+1, which this query still saw
        _write_rows(st.window, positions % ring, kv, None)
    return attn.project_out(out, cos, sin, rope)


def decode_step(model, token_ids: torch.Tensor, cache: BatchedCache, engram_rows=None,
                dead_mask: torch.Tensor | None = None, ropes: list[Rope] | None = None) -> torch.Tensor:
    """One decode step of a DeepseekV4Model over B sequences: token_ids [B] int64 at ``cache.positions`` -> the
    final-normed hidden [B, H] (``model.compute_logits`` for logits). ``cache`` is updated in place (every layer's
    state, then ``positions`` += 1); on an exception mid-step it is partly updated (unlike the eager path). Engram
    layers read ``engram_rows(layer_id)`` [B, n_cols, head_dim] and ``dead_mask`` [B] as in a StepInputs. ``ropes``:
    ``model.ropes(device)``, built once by a caller that captures this step."""
    b, device = token_ids.shape[0], token_ids.device
    positions = cache.positions
    lt = dict(dtype=torch.long, device=device)
    step = StepInputs(token_ids=token_ids, positions=positions, cu_seqlens=torch.arange(b + 1, **lt),
                      context_lens=positions + 1, block_tables=torch.zeros(b, 0, **lt),
                      slot_mapping=torch.full((b,), -1, **lt), engram_rows=engram_rows, dead_mask=dead_mask,
                      logits_indices=torch.arange(b, **lt))
    ropes = ropes if ropes is not None else model.ropes(device)
    h = model.streams(token_ids)  # [B, hc, H]
    for block, rope, st in zip(model.model.layers, ropes, cache.layers):
        h = block.run(h, step, lambda x, a=block.attn, rope=rope, st=st: attention_step(a, x, positions, rope, st))
    cache.positions.add_(1)
    return model.final_norm(h)
