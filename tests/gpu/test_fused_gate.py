"""The fused v41 Engram gate (fused_triton.engram_gate_v41) against the torch reference (Engram._forward_v41)
on CUDA (skipped without a GPU); and its switch's default on any machine.

Parity: one launch computes both RMS statistics, the gate logit, the gate and x + g*v in float32 and rounds
once, as the reference does, but sums over the hidden size in another order: float32 outputs agree to
1e-5, bf16 / fp16 to one unit in the last place of the output. DEAD tokens get g = 0 (the output is x).
"""
from __future__ import annotations

import pytest
import torch

from engram.config import EngramConfig
from engram.model.layers import fused
from engram.module import Engram


def test_the_fused_gate_is_on_by_default_where_it_can_run():
    import os

    if "ENGRAM_FUSED_GATE" not in os.environ:
        assert fused.GATE_SWITCH.value == "auto"
    x, kv = torch.zeros(2, 1, 8), torch.zeros(2, 16)
    old = fused.GATE_SWITCH.set("auto")
    try:
        assert not fused.engram_gate_fast(x, kv)  # CPU tensors: the reference
        fused.GATE_SWITCH.set("triton")
        with pytest.raises(RuntimeError, match="Engram gate backend 'triton' cannot run"):
            fused.engram_gate_fast(x, kv)
    finally:
        fused.GATE_SWITCH.set(old)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 2 ** -7), torch.float16: (2 ** -10, 2 ** -10)}


def module(hc: int, hidden: int, dtype: torch.dtype) -> Engram:
    cfg = EngramConfig(layer_ids=(1,), max_ngram_size=3, n_heads=4, head_dim=32, vocab_size=(1009, 1511),
                       compressed_vocab_size=2901, pad_token_id=2, hidden_size=hidden, hc_mult=hc)
    m = Engram(cfg, 1).to("cuda", dtype)
    g = torch.Generator(device="cuda").manual_seed(hidden + hc)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda").to(dtype))
    return m


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hc,hidden", [(1, 2560), (2, 64), (4, 1024)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("dead", [False, True])
def test_fused_gate_matches_the_reference(dtype, hc, hidden, tokens, dead):
    m = module(hc, hidden, dtype)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hc, hidden, generator=g, device="cuda").to(dtype)
    kv = torch.randn(tokens, (hc + 1) * hidden, generator=g, device="cuda").to(dtype)
    mask = (torch.arange(tokens, device="cuda") % 3 == 1) if dead else None
    old = fused.GATE_SWITCH.set("torch")
    try:
        ref = m._forward_v41(x, kv, mask)
        fused.GATE_SWITCH.set("triton")
        got = m._forward_v41(x, kv, mask)
    finally:
        fused.GATE_SWITCH.set(old)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol * ref.float().abs().max().item())
    if mask is not None:  # g = 0: the output is x, exactly
        assert torch.equal(got[mask], x[mask])
