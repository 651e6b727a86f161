"""Engram.project: the part of a layer that needs only its rows, computed ahead (the lookup stream's WKV
run-ahead) and handed to forward in place of the rows, gives bitwise the same output; v41 writes into a
given buffer without allocating; a projection of the wrong token count is refused."""
from __future__ import annotations

import pytest
import torch

from engram.config import EngramConfig
from engram.module import Engram, Projected


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_projected_rows_give_the_same_output(variant):
    cfg = EngramConfig.preset("tiny").replace(variant=variant, row_dtype="fp32")
    torch.manual_seed(0)
    m = Engram(cfg, cfg.layer_ids[0]).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    t = 7
    hidden = torch.randn(t, cfg.hc_mult, cfg.hidden_size, dtype=torch.float64)
    rows = torch.randn(t, cfg.n_cols, cfg.head_dim, dtype=torch.float32)
    dead = torch.tensor([False, True, False, False, False, True, False])
    m.requires_grad_(False)  # as the engine runs it (out= buffers take no autograd)
    want = m(hidden, rows, dead)  # the paper variant without a state: one fresh sequence
    proj = m.project(rows, torch.float64)
    assert isinstance(proj, Projected) and proj.num_tokens == t
    got = m(hidden, proj, dead)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if variant == "v41":
        out = torch.full((t, (cfg.hc_mult + 1) * cfg.hidden_size), 9.0, dtype=torch.float64)
        assert m.project(rows, torch.float64, out=out).tensors[0].data_ptr() == out.data_ptr()
        assert torch.equal(out, proj.tensors[0])
    with pytest.raises(ValueError, match="projected rows of 6 tokens"):
        m(hidden, Projected(6, proj.tensors), dead)
