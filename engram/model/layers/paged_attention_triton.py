"""Paged attention on CUDA in Triton: K/V read in place through the block table, no padded copies.

* **decode** (one new token), split-KV: each (sequence, KV head) walks fixed splits of SPLIT_LEN keys with its
  GQA group of query heads as the M dimension, writing a partial (acc, max, sum) per split that a second
  kernel combines in order; fixed splits make a result independent of batch and launch, and splits past a
  sequence's end are skipped, so a graph sized for max_model_len costs nearly what eager does.
* **prefill** (chunks): flash-attention over packed varlen queries, causal with the chunk's offset.

Head h reads KV head h // (nh // n_kv); float32 uses IEEE fp32 dot products (no TF32). CUDA only; importing needs
triton."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engram.model.layers.fused_triton import pdl_enter
from engram.model.layers.pdl import launch_options


@triton.jit
def _kv_tile_scores(q, K, V, BT, seq, kvh, pos, valid, c, cmask, s_bt, s_kb, s_ks, s_kh,
                    BS: tl.constexpr, IEEE: tl.constexpr):
    """One K/V tile of (``seq``, ``kvh``) read through the block table -> raw scores q @ K^T [M, len(pos)] and the V
    tile; ``valid`` masks missing keys (K = V = 0), ``c`` / ``cmask`` index the head dim."""
    blk = tl.load(BT + seq * s_bt + pos // BS, mask=valid, other=0).to(tl.int64)
    row = blk * s_kb + (pos % BS) * s_ks + kvh * s_kh
    kv_mask = valid[:, None] & cmask[None, :]
    k = tl.load(K + row[:, None] + c[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + row[:, None] + c[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s, v


@triton.jit
def _online_softmax_update(acc, m, l, s, v, IEEE: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Fold masked scores ``s`` [M, N] and their V tile into the running (acc, max m, sum l), float32; EMPTY_ROWS shifts
    a row with no score yet by 0, not -inf (exp(-inf - -inf) is NaN)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    if EMPTY_ROWS:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (nothing enters registers or L1, so later writes are still seen)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _decode_split_kernel(Q, K, V, BT, SEQ, TOK, LENS, O, ML, scale, split_len,
                         s_qt, s_qh, s_kb, s_ks, s_kh, s_bt, s_od, s_oh, s_os, s_md, s_mh,
                         G: tl.constexpr, BLOCK_G: tl.constexpr, HD: tl.constexpr, BLOCK_HD: tl.constexpr,
                         BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                         PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    d = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(SEQ + d)  # step inputs: read before the PDL wait (pdl.py)
    tok = tl.load(TOK + d)
    length = tl.load(LENS + d)
    # Programs past the sequence's splits (a graph's grid is sized for max_model_len) skip even the query load.
    n_splits = tl.cdiv(length, split_len)
    if PREFETCH:  # the first split's K/V lines into L2 while the kernel before still runs (see _prefetch_l2)
        if tl.program_id(2) < n_splits:
            pos = tl.minimum(tl.program_id(2) * split_len + tl.arange(0, SPLIT), length - 1)
            blk = tl.load(BT + seq * s_bt + pos // BS).to(tl.int64)
            row = blk * s_kb + (pos % BS) * s_ks + kvh * s_kh
            line = tl.arange(0, BLOCK_HD // 64) * 64  # 64 16-bit elements to a line
            _prefetch_l2(K + row[:, None] + line[None, :])
            _prefetch_l2(V + row[:, None] + line[None, :])
    pdl_enter(USE_PDL)
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_HD)
    heads = kvh * G + g
    gmask = g < G
    cmask = c < HD
    if tl.program_id(2) < n_splits:
        q = tl.load(Q + tok * s_qt + heads[:, None] * s_qh + c[None, :], mask=gmask[:, None] & cmask[None, :],
                    other=0.0)
        n = tl.arange(0, BLOCK_N)
        # Program p of P computes splits p, p + P, ... of its sequence's own ceil(length / split_len), each alone in
        # key order; splits past the sequence's end are neither computed nor stored (the combine skips them).
        for sp in range(tl.program_id(2), n_splits, tl.num_programs(2)):
            lo = sp * split_len
            hi = tl.minimum(lo + split_len, length)
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_HD], tl.float32)
            for n0 in range(lo, hi, BLOCK_N):
                pos = n0 + n
                valid = pos < hi
                s, v = _kv_tile_scores(q, K, V, BT, seq, kvh, pos, valid, c, cmask, s_bt, s_kb, s_ks, s_kh, BS, IEEE)
                s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_G, BLOCK_N]
                # every tile holds a key (n0 < hi) and padded group rows score 0: no row is empty
                acc, m, l = _online_softmax_update(acc, m, l, s, v, IEEE, False)
            o_ptr = O + d * s_od + heads[:, None] * s_oh + sp * s_os + c[None, :]
            tl.store(o_ptr, acc, mask=gmask[:, None] & cmask[None, :])
            ml_ptr = ML + d * s_md + heads * s_mh + sp * 2
            tl.store(ml_ptr, m, mask=gmask)
            tl.store(ml_ptr + 1, l, mask=gmask)


@triton.jit
def _decode_combine_kernel(O, ML, TOK, LENS, OUT, split_len, s_od, s_oh, s_os, s_md, s_mh, s_ot, s_oh2,
                           HD: tl.constexpr, BLOCK_HD: tl.constexpr, USE_PDL: tl.constexpr):
    d = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.arange(0, BLOCK_HD)
    cmask = c < HD
    splits = tl.cdiv(tl.load(LENS + d), split_len)  # step inputs: read before the PDL wait (pdl.py)
    tok = tl.load(TOK + d)
    pdl_enter(USE_PDL)
    m = float("-inf")
    l = 0.0
    acc = tl.zeros([BLOCK_HD], tl.float32)
    for sp in range(0, splits):  # the sequence's splits, in order, one at a time
        ms = tl.load(ML + d * s_md + h * s_mh + sp * 2)
        ls = tl.load(ML + d * s_md + h * s_mh + sp * 2 + 1)
        o = tl.load(O + d * s_od + h * s_oh + sp * s_os + c, mask=cmask, other=0.0)
        m_new = tl.maximum(m, ms)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        b = tl.exp(ms - m_safe)
        acc = acc * a + o * b
        l = l * a + ls * b
        m = m_new
    # an entry of no keys (a graph's padding) writes nothing
    tl.store(OUT + tok * s_ot + h * s_oh2 + c, (acc / l).to(OUT.dtype.element_ty), mask=cmask & (splits > 0))


@triton.jit
def _prefill_kernel(Q, K, V, BT, OUT, TILE_SEQ, TILE_M0, SEQ, START, QLEN, CTX, scale,
                    s_qt, s_qh, s_kb, s_ks, s_kh, s_bt, s_ot, s_oh,
                    G: tl.constexpr, HD: tl.constexpr, BLOCK_HD: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    p_idx = tl.load(TILE_SEQ + tile)
    m0 = tl.load(TILE_M0 + tile)
    seq = tl.load(SEQ + p_idx)
    start = tl.load(START + p_idx)
    q_len = tl.load(QLEN + p_idx)
    ctx = tl.load(CTX + p_idx)
    kvh = h // G
    i = m0 + tl.arange(0, BLOCK_M)
    imask = i < q_len
    c = tl.arange(0, BLOCK_HD)
    cmask = c < HD
    q = tl.load(Q + (start + i)[:, None] * s_qt + h * s_qh + c[None, :], mask=imask[:, None] & cmask[None, :],
                other=0.0)
    qpos = ctx - q_len + i  # absolute position of each query
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    hi = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # keys past the tile's last query are all masked
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + n
        valid = pos < hi
        s, v = _kv_tile_scores(q, K, V, BT, seq, kvh, pos, valid, c, cmask, s_bt, s_kb, s_ks, s_kh, BS, IEEE)
        keep = valid[None, :] & (pos[None, :] <= qpos[:, None])
        s = tl.where(keep, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
        # rows past q_len see no key at all: their max is shifted by 0, not -inf
        acc, m, l = _online_softmax_update(acc, m, l, s, v, IEEE, True)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(OUT + (start + i)[:, None] * s_ot + h * s_oh + c[None, :], out.to(OUT.dtype.element_ty),
             mask=imask[:, None] & cmask[None, :])


SPLIT_LEN = 128  # keys per decode split: fixed, so results do not depend on the launch shape
DECODE_BLOCK_N = 64  # keys per tile of the decode kernel (divides SPLIT_LEN)
# Split programs a decode launch aims for: parallel programs keep loads in flight; the results do not depend on it.
DECODE_PROGRAMS = 4096
# The decode split kernel asks L2 for its first split's K/V lines before its PDL wait (16-bit caches, head dim 64,
# 128 or 256, at most PREFETCH_MAX_SEQS sequences); the results do not depend on it.
PREFETCH_MAX_SEQS = 4


def _pow2(x: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(x))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seqs: torch.Tensor, tokens: torch.Tensor, lens: torch.Tensor, max_len: int, out: torch.Tensor,
           scale: float, block_n: int = DECODE_BLOCK_N, target_programs: int = DECODE_PROGRAMS,
           num_warps: int = 4, num_stages: int | None = None) -> None:
    """One new token per sequence: out[tokens[d]] = attention of q[tokens[d]] over the first lens[d] keys of seqs[d]; q,
    out [T, nh, hd], caches [NB, BS, n_kv, hd], block_tables [S, W] int64, ``max_len`` >= lens. The result does not
    depend on ``max_len`` or the batch. ``block_n`` (one value for every launch: it orders the sums),
    ``target_programs``, ``num_warps``, ``num_stages``: tuning knobs; the defaults are what the engine runs."""
    if SPLIT_LEN % block_n:
        raise ValueError(f"block_n={block_n} must divide SPLIT_LEN={SPLIT_LEN}")
    d = seqs.numel()
    nh, hd = q.shape[1], q.shape[2]
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    g = nh // n_kv
    num_splits = max(1, -(-max_len // SPLIT_LEN))
    programs = max(1, min(num_splits, target_programs // max(1, d * n_kv)))
    part = torch.empty(d, nh, num_splits, hd, dtype=torch.float32, device=q.device)  # [D, nh, S, hd]
    ml = torch.empty(d, nh, num_splits, 2, dtype=torch.float32, device=q.device)  # [D, nh, S, (max, sum)]
    _decode_split_kernel[(d, n_kv, programs)](
        q, k_cache, v_cache, block_tables, seqs, tokens, lens, part, ml, scale, SPLIT_LEN,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), ml.stride(0), ml.stride(1),
        G=g, BLOCK_G=_pow2(g), HD=hd, BLOCK_HD=_pow2(hd), BS=bs, BLOCK_N=block_n, SPLIT=SPLIT_LEN,
        IEEE=q.dtype == torch.float32, PREFETCH=d <= PREFETCH_MAX_SEQS and q.element_size() == 2
        and hd in (64, 128, 256),
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **launch_options(q.device))
    _decode_combine_kernel[(d, nh)](
        part, ml, tokens, lens, out, SPLIT_LEN, part.stride(0), part.stride(1), part.stride(2), ml.stride(0),
        ml.stride(1), out.stride(0), out.stride(1), HD=hd, BLOCK_HD=_pow2(hd), num_warps=1,
        **launch_options(q.device))


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            tile_seq: torch.Tensor, tile_m0: torch.Tensor, seqs: torch.Tensor, starts: torch.Tensor,
            q_lens: torch.Tensor, ctx_lens: torch.Tensor, block_m: int, out: torch.Tensor, scale: float) -> None:
    """Each prefill sequence's q_len queries attend causally to its first ctx keys; one program per (query tile, head),
    tiles listed in ``tile_seq`` / ``tile_m0``."""
    nh, hd = q.shape[1], q.shape[2]
    n_kv, bs = k_cache.shape[2], k_cache.shape[1]
    fp32 = q.dtype == torch.float32
    _prefill_kernel[(tile_seq.numel(), nh)](
        q, k_cache, v_cache, block_tables, out, tile_seq, tile_m0, seqs, starts, q_lens, ctx_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=nh // n_kv, HD=hd, BLOCK_HD=_pow2(hd), BS=bs, BLOCK_M=block_m, BLOCK_N=32 if fp32 or hd > 128 else 64,
        IEEE=fp32, num_warps=4 if hd <= 64 else 8)
