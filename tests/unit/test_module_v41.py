"""The v41 Engram gate against an explicit float64 reference; masking; hc_mult 1 and 4; input checks."""
from __future__ import annotations

import math

import pytest
import torch

from engram.config import EngramConfig
from engram.module import Engram


def make_cfg(hc: int, hidden: int = 64, eps: float = 1e-6) -> EngramConfig:
    return EngramConfig(layer_ids=(1, 3), max_ngram_size=3, n_heads=2, head_dim=32, vocab_size=101,
                        compressed_vocab_size=50, pad_token_id=0, hidden_size=hidden, hc_mult=hc,
                        rms_norm_eps=eps, variant="v41", row_dtype="mxfp8")


def make_layer(cfg: EngramConfig, seed: int = 0) -> Engram:
    torch.manual_seed(seed)
    layer = Engram(cfg, 1)
    with torch.no_grad():
        layer.q_weight.uniform_(-2.0, 2.0)
        layer.k_weight.uniform_(-2.0, 2.0)
    return layer


def make_inputs(cfg: EngramConfig, tokens: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, cfg.hc_mult, cfg.hidden_size, generator=g).to(dtype)
    rows = torch.randn(tokens, cfg.n_cols, cfg.head_dim, generator=g).to(dtype)
    return hidden, rows


def reference_v41(layer: Engram, hidden, rows, dead=None, gates_out: list | None = None) -> torch.Tensor:
    """The spec, one token and one branch at a time, in float64 Python scalars where it matters."""
    x = hidden.double()
    e = rows.double().flatten(1)
    w = layer.wkv.weight.detach().double()
    qw, kw = layer.q_weight.detach().double(), layer.k_weight.detach().double()
    t_count, hc, h = x.shape
    eps = layer.cfg.rms_norm_eps
    out = x.clone()
    for t in range(t_count):
        kv = w @ e[t]  # [(hc+1)*H]
        v = kv[hc * h:]
        for i in range(hc):
            k = kv[i * h:(i + 1) * h]
            xi = x[t, i]
            rms_x = 1.0 / math.sqrt(float(xi.square().mean()) + eps)
            rms_k = 1.0 / math.sqrt(float(k.square().mean()) + eps)
            d = float((xi * qw[i] * kw[i] * k).sum()) * rms_x * rms_k / math.sqrt(h)
            z = math.copysign(math.sqrt(max(abs(d), 1e-6)), d) if d != 0 else 0.0
            g = 0.0 if (dead is not None and bool(dead[t])) else 1.0 / (1.0 + math.exp(-z))
            out[t, i] = xi + g * v
            if gates_out is not None:
                gates_out.append(g)
    return out


@pytest.mark.parametrize("hc", [1, 4])
def test_gate_matches_float64_reference(hc):
    cfg = make_cfg(hc)
    layer = make_layer(cfg).double()
    hidden, rows = make_inputs(cfg, 9, torch.float64)
    out = layer(hidden, rows)
    gates: list[float] = []
    ref = reference_v41(layer, hidden, rows, gates_out=gates)
    assert out.dtype == torch.float64 and out.shape == hidden.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    # The inputs exercise the gate over a real range, not just around its midpoint.
    assert min(gates) < 0.3 and max(gates) > 0.7, (min(gates), max(gates))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_gate_low_precision_within_stated_tolerance(dtype, tol):
    """Stated tolerances (abs, outputs of magnitude up to ~4): fp32 1e-5 (measured 1.5e-6); bf16 3e-2
    (measured 1.4e-2: the wkv matmul runs in bf16, the gate in fp32, one bf16 rounding of the output)."""
    cfg = make_cfg(4)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 16, dtype)
    ref = reference_v41(layer, hidden, rows)  # float64 from the same (rounded) inputs and weights
    out = layer.to(dtype)(hidden, rows)
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"{dtype}: max abs error {err:.3g} > {tol}"


def test_params_stay_fp32_while_hidden_is_bf16():
    cfg = make_cfg(2)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 5, torch.bfloat16)
    out = layer(hidden, rows)  # weights cast on the fly
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference_v41(layer, hidden, rows), rtol=0, atol=3e-2)


def test_dead_positions_return_hidden_bitwise_and_leave_others_alone():
    cfg = make_cfg(4)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 8)
    dead = torch.tensor([False, True, False, False, True, True, False, False])
    out = layer(hidden, rows, dead_mask=dead)
    plain = layer(hidden, rows)
    assert torch.equal(out[dead], hidden[dead])  # g = 0: x + 0*v is x exactly
    assert torch.equal(out[~dead], plain[~dead])
    assert not torch.equal(plain[dead], hidden[dead])
    torch.testing.assert_close(out.double(), reference_v41(layer, hidden, rows, dead), rtol=0, atol=1e-5)
    all_dead = layer(hidden, rows, dead_mask=torch.ones(8, dtype=torch.bool))
    assert torch.equal(all_dead, hidden)


def test_zero_logit_gives_half_gate():
    """sign(0) = 0, so a zero query gives g = sigmoid(0) = 1/2 (the clamp never flips the sign)."""
    cfg = make_cfg(2)
    layer = make_layer(cfg).double()
    hidden, rows = make_inputs(cfg, 3, torch.float64)
    hidden[:, 1] = 0.0
    out = layer(hidden, rows)
    v = (rows.flatten(1) @ layer.wkv.weight.detach().T)[:, 2 * cfg.hidden_size:]  # [T, H] shared value
    torch.testing.assert_close(out[:, 1], 0.5 * v, rtol=0, atol=1e-13)


def test_rows_are_cast_to_hidden_dtype():
    cfg = make_cfg(2)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 4)
    rows_bf16 = rows.to(torch.bfloat16)
    assert torch.equal(layer(hidden, rows_bf16), layer(hidden, rows_bf16.float()))
    rows_fp8 = rows.to(torch.float8_e4m3fn)
    assert torch.equal(layer(hidden, rows_fp8), layer(hidden, rows_fp8.float()))


def test_batch_composition_float64_and_empty_input():
    cfg = make_cfg(2)
    layer = make_layer(cfg).double()
    hidden, rows = make_inputs(cfg, 10, torch.float64)
    whole = layer(hidden, rows)
    parts = torch.cat([layer(hidden[:3], rows[:3]), layer(hidden[3:], rows[3:])])
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-13)
    assert layer(hidden[:0], rows[:0]).shape == (0, 2, cfg.hidden_size)


def test_parameter_names_and_shapes():
    cfg = make_cfg(4)
    shapes = {k: tuple(v.shape) for k, v in Engram(cfg, 3).state_dict().items()}
    h, ind = cfg.hidden_size, cfg.n_cols * cfg.head_dim
    assert shapes == {"wkv.weight": (5 * h, ind), "q_weight": (4, h), "k_weight": (4, h)}
    layer = Engram(cfg, 3)
    assert layer.residual_output is False and layer.has_state is False
    assert all(p.dtype == torch.float32 for p in layer.parameters())


def test_bad_inputs_raise_naming_the_layer():
    cfg = make_cfg(2)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 4)
    with pytest.raises(ValueError, match="layer 1: hidden has shape"):
        layer(hidden[:, :1], rows)
    with pytest.raises(ValueError, match="layer 1: rows has shape .* expected \\[T=4, n_cols=4, head_dim=32\\]"):
        layer(hidden, rows[:3])
    with pytest.raises(ValueError, match="dead_mask must be bool"):
        layer(hidden, rows, dead_mask=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="keeps no conv state"):
        layer(hidden, rows, state=object())
    with pytest.raises(ValueError, match="layer 2 is not an Engram layer"):
        Engram(cfg, 2)
    with pytest.raises(ValueError, match="keeps no conv state"):
        layer.new_state(1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_within_stated_tolerance():
    cfg = make_cfg(4)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 16, torch.bfloat16)
    ref = reference_v41(layer, hidden, rows)
    out = layer.to(device="cuda", dtype=torch.bfloat16)(hidden.cuda(), rows.cuda())
    assert out.dtype == torch.bfloat16 and out.is_cuda
    assert (out.double().cpu() - ref).abs().max().item() <= 3e-2
