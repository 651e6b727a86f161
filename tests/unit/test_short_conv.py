"""ShortConv and ShortConvState: the demo's whole-sequence conv, chunked / packed decode, state helpers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engram.config import EngramConfig
from engram.short_conv import ShortConv, ShortConvState, causal_conv_packed, history_len


def make_cfg(hc: int = 2, hidden: int = 16, kernel: int = 4, max_ngram: int = 3) -> EngramConfig:
    return EngramConfig(layer_ids=(0,), max_ngram_size=max_ngram, n_heads=2, head_dim=8, vocab_size=101,
                        compressed_vocab_size=50, pad_token_id=0, hidden_size=hidden, hc_mult=hc,
                        rms_norm_eps=1e-5, variant="paper", row_dtype="fp32", kernel_size=kernel)


def make_conv(cfg: EngramConfig, dtype=torch.float64, seed: int = 0) -> ShortConv:
    torch.manual_seed(seed)
    conv = ShortConv(cfg).to(dtype)
    with torch.no_grad():
        for norm in conv.norms:
            norm.weight.uniform_(0.5, 1.5)
    return conv


def reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """The demo's structure, written out: per-branch RMSNorm, zero-padded Conv1d cut to T, SiLU."""
    t, g, h = x.shape
    normed = []
    for i in range(g):
        xi = x[:, i]
        normed.append(xi * torch.rsqrt(xi.square().mean(-1, keepdim=True) + conv.norms[i].eps) * conv.norms[i].weight)
    xc = torch.cat(normed, dim=-1).T.unsqueeze(0)  # [1, C, T]
    pad = (conv.kernel_size - 1) * conv.dilation
    y = F.conv1d(xc, conv.conv.weight, padding=pad, dilation=conv.dilation, groups=xc.shape[1])[..., :t]
    return F.silu(y)[0].T.reshape(t, g, h)


@pytest.mark.parametrize("hc,kernel,max_ngram", [(1, 4, 3), (4, 4, 3), (2, 1, 2), (2, 3, 4)])
def test_whole_sequence_matches_conv1d_reference(hc, kernel, max_ngram):
    cfg = make_cfg(hc=hc, kernel=kernel, max_ngram=max_ngram)
    conv = make_conv(cfg)
    x = torch.randn(23, hc, cfg.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(conv(x), reference(conv, x), rtol=0, atol=1e-12)


def test_state_holds_last_inputs_and_zero_padding():
    cfg = make_cfg()
    conv = make_conv(cfg)
    L = history_len(cfg)
    assert L == (cfg.kernel_size - 1) * cfg.max_ngram_size == 9
    state = ShortConvState.zeros(1, cfg, dtype=torch.float64)
    x = torch.randn(4, cfg.hc_mult, cfg.hidden_size, dtype=torch.float64)  # shorter than L
    conv(x, state)
    normed = torch.cat([conv.norms[i](x[:, i]) for i in range(cfg.hc_mult)], dim=-1)  # [4, C]
    assert torch.equal(state.conv[0, : L - 4], torch.zeros(L - 4, normed.shape[1], dtype=torch.float64))
    torch.testing.assert_close(state.conv[0, L - 4:], normed, rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_and_token_by_token_equal_whole_bitwise(dtype):
    cfg = make_cfg(hc=2)
    conv = make_conv(cfg, dtype=dtype)
    x = torch.randn(31, cfg.hc_mult, cfg.hidden_size, dtype=dtype)
    whole = conv(x)
    for chunks in ([1] * 31, [5, 1, 9, 2, 14], [10, 0, 21]):
        state = ShortConvState.zeros(1, cfg, dtype=dtype)
        outs, start = [], 0
        for n in chunks:
            outs.append(conv(x[start:start + n], state))
            start += n
        got = torch.cat(outs)
        # The taps are summed in a fixed order per token, so packing cannot change a single bit.
        assert torch.equal(got.view(torch.uint8), whole.view(torch.uint8)), chunks


def test_packed_sequences_equal_separate_runs():
    cfg = make_cfg(hc=2)
    conv = make_conv(cfg, dtype=torch.float32)
    lengths = [7, 0, 1, 12, 3]
    seqs = [torch.randn(n, cfg.hc_mult, cfg.hidden_size) for n in lengths]
    prefixes = [torch.randn(n, cfg.hc_mult, cfg.hidden_size) for n in (4, 11, 0, 2, 9)]
    # Give every sequence some history first (each alone), then run the new tokens packed.
    singles = []
    for pre in prefixes:
        s = ShortConvState.zeros(1, cfg)
        conv(pre, s)
        singles.append(s)
    batch = ShortConvState.stack([s.clone() for s in singles], cu_seqlens=[0, 7, 7, 8, 20, 23])
    packed = conv(torch.cat(seqs), batch)
    expect = [conv(x, s) for x, s in zip(seqs, singles)]
    assert torch.equal(packed, torch.cat(expect))
    for got, want in zip(batch.split(), singles):
        assert torch.equal(got.conv, want.conv)
    # A sequence with no new tokens keeps its state untouched.
    assert torch.equal(batch.conv[1], singles[1].conv[0])


def test_causal_conv_packed_direct():
    weight = torch.tensor([[1.0, 10.0, 100.0]])  # C=1, k=3: tap 2 is the current token
    x = torch.arange(1.0, 6.0).unsqueeze(1)  # [5, 1] two sequences: [1, 2] and [3, 4, 5]
    history = torch.tensor([[[-1.0], [-2.0]], [[-3.0], [-4.0]]])  # [S=2, L=2, C=1], dilation 1
    y, new = causal_conv_packed(x, history, torch.tensor([0, 2, 5]), weight, dilation=1)
    # seq 0: in = [-1, -2, 1, 2]; seq 1: in = [-3, -4, 3, 4, 5]
    assert y[:, 0].tolist() == [-1 - 20 + 100, -2 + 10 + 200, -3 - 40 + 300, -4 + 30 + 400, 3 + 40 + 500]
    assert new[:, :, 0].tolist() == [[1.0, 2.0], [4.0, 5.0]]


def test_state_pool_helpers():
    cfg = make_cfg()
    pool = ShortConvState.zeros(5, cfg)
    pool.conv.copy_(torch.randn_like(pool.conv))
    batch = pool.index_select([3, 1], cu_seqlens=[0, 2, 3])
    assert torch.equal(batch.conv, pool.conv[[3, 1]])
    assert batch.cu_seqlens.tolist() == [0, 2, 3]
    batch.conv.add_(1.0)  # a copy: the pool is untouched until scatter_
    assert not torch.equal(batch.conv, pool.conv[[3, 1]])
    pool.scatter_([3, 1], batch)
    assert torch.equal(batch.conv, pool.conv[[3, 1]])
    pool.reset_([1])
    assert not pool.conv[1].any() and pool.conv[3].any()
    parts = pool.split()
    assert len(parts) == 5 and parts[2].conv.data_ptr() == pool.conv[2:3].data_ptr()
    shared = pool.with_cu_seqlens(torch.tensor([0, 1, 1, 1, 1, 1]))
    assert shared.conv is pool.conv


def test_errors_name_the_problem():
    cfg = make_cfg()
    conv = make_conv(cfg, dtype=torch.float32)
    x = torch.randn(6, cfg.hc_mult, cfg.hidden_size)
    with pytest.raises(ValueError, match="expected \\[T, 2, 16\\]"):
        conv(torch.randn(6, 3, cfg.hidden_size))
    with pytest.raises(ValueError, match="no cu_seqlens"):
        conv(x, ShortConvState.zeros(2, cfg))
    with pytest.raises(ValueError, match="end at the 6 packed tokens"):
        conv(x, ShortConvState.zeros(2, cfg).with_cu_seqlens([0, 2, 5]))
    with pytest.raises(ValueError, match="non-decreasing"):
        conv(x, ShortConvState.zeros(2, cfg).with_cu_seqlens([0, 7, 6]))
    with pytest.raises(ValueError, match="expected \\[3\\]"):
        ShortConvState(torch.zeros(2, 9, 32), torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="expected \\[S, 9, 32\\]"):
        conv(x, ShortConvState(torch.zeros(1, 8, 32)))
    with pytest.raises(ValueError, match="different \\[L, C\\] shapes"):
        ShortConvState.stack([ShortConvState(torch.zeros(1, 9, 32)), ShortConvState(torch.zeros(1, 8, 32))])
