"""Liveness and training through EngramEmbedding: real hashed row ids, one perturbed row changes exactly
the positions that look it up; gradients reach the table (only live rows) and every projection."""
from __future__ import annotations

import pytest
import torch

from engram.config import EngramConfig
from engram.embedding import EngramEmbedding
from engram.hashing import DEAD, NgramHasher
from engram.module import Engram
from engram.quant import dequantize_mxfp8, quantize_mxfp8

LAYER = 1


def make_cfg(variant: str, row_dtype: str = "mxfp8") -> EngramConfig:
    # Small primes (37..47) so rows repeat across positions; 4 columns of 32-dim rows.
    return EngramConfig(layer_ids=(LAYER, 3), max_ngram_size=3, n_heads=2, head_dim=32, vocab_size=37,
                        compressed_vocab_size=12, pad_token_id=0, hidden_size=32, hc_mult=2, rms_norm_eps=1e-6,
                        variant=variant, row_dtype=row_dtype, kernel_size=4)


def setup(variant: str, tokens: int = 40, seed: int = 0):
    cfg = make_cfg(variant, "mxfp8" if variant == "v41" else "fp32")
    torch.manual_seed(seed)
    layer = Engram(cfg, LAYER).double()
    table = EngramEmbedding(cfg, LAYER, dtype=torch.float64)
    ids = torch.randint(1, 6, (tokens,))  # real ids avoid the pad id 0, so all-pad windows only follow DEAD
    ids[[tokens // 5, tokens // 5 + 1, 2 * tokens // 3]] = DEAD  # a DEAD pair and a lone one
    row_ids = NgramHasher(cfg, pad_id=0).hash(ids.unsqueeze(0), LAYER)[0]  # [T, n_cols]
    hidden = torch.randn(tokens, cfg.hc_mult, cfg.hidden_size, dtype=torch.float64)
    return cfg, layer, table, row_ids, ids == DEAD, hidden


def changed_positions(layer, table, row_ids, dead, hidden, row: int) -> set[int]:
    with torch.no_grad():
        base = layer(hidden, table(row_ids), dead_mask=dead)
        table.weight[row] += 0.5
        moved = layer(hidden, table(row_ids), dead_mask=dead)
        table.weight[row] -= 0.5
    diff = (moved != base).flatten(1).any(1)
    return set(torch.nonzero(diff).flatten().tolist())


def test_v41_perturbing_a_row_changes_exactly_its_live_positions():
    cfg, layer, table, row_ids, dead, hidden = setup("v41")
    used = row_ids.unique().tolist()
    assert len(used) < row_ids.numel()  # some rows are shared between positions
    shared = 0
    for row in used:
        users = set(torch.nonzero((row_ids == row).any(1)).flatten().tolist())
        live = {t for t in users if not dead[t]}
        assert changed_positions(layer, table, row_ids, dead, hidden, row) == live, row
        shared += len(live) > 1
    assert shared > 0
    unused = next(r for r in range(table.num_rows) if r not in set(used))
    assert changed_positions(layer, table, row_ids, dead, hidden, unused) == set()


def test_paper_perturbation_reaches_its_positions_and_their_conv_window_only():
    cfg, layer, table, row_ids, dead, hidden = setup("paper")
    dil, k = cfg.max_ngram_size, cfg.kernel_size
    for row in row_ids.unique().tolist()[:25]:
        direct = {t for t in torch.nonzero((row_ids == row).any(1)).flatten().tolist() if not dead[t]}
        window = {t + j * dil for t in direct for j in range(k) if t + j * dil < row_ids.shape[0]}
        got = changed_positions(layer, table, row_ids, dead, hidden, row)
        assert direct <= got <= window, (row, direct, got)


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_gradients_reach_live_rows_and_every_projection(variant):
    cfg, layer, table, row_ids, dead, hidden = setup(variant)
    target = torch.randn_like(hidden)
    out = layer(hidden, table(row_ids), dead_mask=dead)
    (out * target).sum().backward()
    grad_rows = set(torch.nonzero(table.weight.grad.abs().sum(1)).flatten().tolist())
    live_rows = set(row_ids[~dead].unique().tolist())
    dead_only = set(row_ids[dead].unique().tolist()) - live_rows
    assert dead_only, "the DEAD positions should hash to all-pad rows no live position uses"
    assert grad_rows == live_rows  # g = 0 at DEAD positions: their rows get no gradient
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        assert torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_gradcheck_against_finite_differences(variant):
    cfg, layer, table, row_ids, dead, hidden = setup(variant, tokens=6)
    rows = table(row_ids).detach().requires_grad_(True)
    hid = hidden.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, r: layer(h, r, dead_mask=dead), (hid, rows), atol=1e-6, fast_mode=True)


def test_end_to_end_training_fits_a_target():
    cfg, layer, table, row_ids, dead, hidden = setup("v41", tokens=24)
    layer, table = layer.float(), table.float()
    hidden = hidden.float()
    target = hidden + torch.randn_like(hidden)
    opt = torch.optim.Adam(list(layer.parameters()) + list(table.parameters()), lr=3e-2)

    def loss_fn():
        out = layer(hidden, table(row_ids), dead_mask=dead)
        return (out - target)[~dead].square().mean()

    first = loss_fn().item()
    for _ in range(60):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    assert loss_fn().item() < 0.5 * first


def test_embedding_checks_and_export():
    cfg = make_cfg("v41")
    table = EngramEmbedding(cfg, LAYER)
    assert table.weight.shape == (cfg.table_rows(LAYER), cfg.head_dim) == (168, 32)
    ids = torch.tensor([[0, 37, 78, 167]])
    assert table(ids).shape == (1, 4, 32)
    with pytest.raises(ValueError, match="layer 1: row ids span \\[0, 168\\] but the table has 168 rows"):
        table(torch.tensor([[0, 1, 2, 168]]))
    with pytest.raises(ValueError, match="expected \\[..., n_cols=4\\]"):
        table(torch.tensor([[0, 1, 2]]))
    with pytest.raises(ValueError, match="layer 2 is not an Engram layer"):
        EngramEmbedding(cfg, 2)
    values, scales = table.export_rows()
    ref_v, ref_s = quantize_mxfp8(table.weight.detach())
    assert torch.equal(values.view(torch.uint8), ref_v.view(torch.uint8)) and torch.equal(scales, ref_s)
    back = dequantize_mxfp8(values, scales, dtype=torch.float32)
    assert ((back - table.weight).abs() <= table.weight.abs() / 16 + 1e-6).all()  # E4M3: 3 mantissa bits
    bf = EngramEmbedding(make_cfg("v41", "bf16"), LAYER)
    v, s = bf.export_rows()
    assert s is None and v.dtype == torch.bfloat16 and torch.equal(v, bf.weight.detach().to(torch.bfloat16))
