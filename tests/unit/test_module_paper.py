"""The paper-variant Engram: float64 reference of the demo's structure, DEAD masking, and decode state
(chunked, one token at a time and packed sequences equal whole runs, in float64)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engram.config import EngramConfig
from engram.module import Engram
from engram.short_conv import ShortConvState

TOL64 = dict(rtol=0, atol=1e-12)


def make_cfg(hc: int, hidden: int = 32, max_ngram: int = 3) -> EngramConfig:
    return EngramConfig(layer_ids=(1, 3), max_ngram_size=max_ngram, n_heads=2, head_dim=16, vocab_size=101,
                        compressed_vocab_size=50, pad_token_id=0, hidden_size=hidden, hc_mult=hc,
                        rms_norm_eps=1e-5, variant="paper", row_dtype="fp32", kernel_size=4)


def make_layer(cfg: EngramConfig, dtype=torch.float64, seed: int = 0) -> Engram:
    torch.manual_seed(seed)
    layer = Engram(cfg, 1)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("conv.weight"):
                p.uniform_(-0.6, 0.6)
    return layer.to(dtype)


def make_inputs(cfg: EngramConfig, tokens: int, dtype=torch.float64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, cfg.hc_mult, cfg.hidden_size, generator=g).to(dtype)
    rows = torch.randn(tokens, cfg.n_cols, cfg.head_dim, generator=g).to(dtype)
    return hidden, rows


def rmsnorm(z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return z * torch.rsqrt(z.square().mean(-1, keepdim=True) + eps) * weight


def reference_paper(layer: Engram, hidden, rows, dead=None) -> torch.Tensor:
    """DeepSeek demo's data flow for one whole sequence, written out in float64."""
    sd = {k: v.detach().double() for k, v in layer.state_dict().items()}
    x, e = hidden.double(), rows.double().flatten(1)
    t_count, hc, h = x.shape
    eps = layer.cfg.rms_norm_eps
    gates = torch.empty(t_count, hc, dtype=torch.float64)
    for i in range(hc):
        key = e @ sd[f"key_projs.{i}.weight"].T + sd[f"key_projs.{i}.bias"]
        d = (rmsnorm(key, sd[f"norm1.{i}.weight"], eps) * rmsnorm(x[:, i], sd[f"norm2.{i}.weight"], eps)).sum(-1)
        d = d / math.sqrt(h)
        gates[:, i] = torch.sigmoid(d.abs().clamp_min(1e-6).sqrt() * d.sign())
    if dead is not None:
        gates[dead] = 0.0
    value = gates.unsqueeze(-1) * (e @ sd["value_proj.weight"].T + sd["value_proj.bias"]).unsqueeze(1)
    normed = torch.cat([rmsnorm(value[:, i], sd[f"short_conv.norms.{i}.weight"], eps) for i in range(hc)], -1)
    k, dil = layer.cfg.kernel_size, layer.cfg.max_ngram_size
    conv = F.conv1d(normed.T.unsqueeze(0), sd["short_conv.conv.weight"], padding=(k - 1) * dil, dilation=dil,
                    groups=hc * h)[..., :t_count]  # [1, C, T]
    return value + F.silu(conv)[0].T.reshape(t_count, hc, h)


@pytest.mark.parametrize("hc", [1, 4])
def test_matches_float64_demo_reference(hc):
    cfg = make_cfg(hc)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 20)
    out = layer(hidden, rows)
    assert layer.residual_output is True and layer.has_state is True
    assert out.shape == hidden.shape and out.dtype == torch.float64
    torch.testing.assert_close(out, reference_paper(layer, hidden, rows), **TOL64)


def test_float32_within_stated_tolerance():
    """fp32 against the float64 reference: abs 1e-5 on outputs of magnitude ~1."""
    cfg = make_cfg(4)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 20)
    ref = reference_paper(layer, hidden, rows)
    out = layer.float()(hidden.float(), rows.float())
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-5)


def test_dead_positions_get_zero_gate():
    cfg = make_cfg(2)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 15)
    dead = torch.zeros(15, dtype=torch.bool)
    dead[[0, 4, 5, 11]] = True
    out = layer(hidden, rows, dead_mask=dead)
    torch.testing.assert_close(out, reference_paper(layer, hidden, rows, dead), **TOL64)
    # With g = 0 the dead positions' own value is 0; what remains there is the conv over earlier tokens.
    solo = layer(hidden[:1], rows[:1], dead_mask=dead[:1])
    assert torch.equal(solo, torch.zeros_like(solo))


@pytest.mark.parametrize("chunks", [[1] * 17, [4, 1, 8, 4], [9, 0, 8], [2, 15]])
def test_chunked_and_token_by_token_equal_whole_float64(chunks):
    cfg = make_cfg(2)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 17)
    whole = layer(hidden, rows)
    state = layer.new_state(1, dtype=torch.float64)
    outs, start = [], 0
    for n in chunks:
        outs.append(layer(hidden[start:start + n], rows[start:start + n], state=state))
        start += n
    torch.testing.assert_close(torch.cat(outs), whole, **TOL64)


def test_packed_sequences_equal_separate_float64():
    cfg = make_cfg(4)
    layer = make_layer(cfg)
    lengths = [6, 1, 0, 13, 10]
    prompts = [make_inputs(cfg, n, seed=10 + i) for i, n in enumerate((3, 12, 5, 0, 1))]
    news = [make_inputs(cfg, n, seed=20 + i) for i, n in enumerate(lengths)]
    # Prefill each sequence alone, then decode the new tokens of all five in one packed call.
    states = []
    for hid, row in prompts:
        s = layer.new_state(1, dtype=torch.float64)
        layer(hid, row, state=s)
        states.append(s)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    batch = ShortConvState.stack([s.clone() for s in states], cu_seqlens=cu)
    packed = layer(torch.cat([h for h, _ in news]), torch.cat([r for _, r in news]), state=batch)
    separate = [layer(h, r, state=s) for (h, r), s in zip(news, states)]
    torch.testing.assert_close(packed, torch.cat(separate), **TOL64)
    for got, want in zip(batch.split(), states):
        torch.testing.assert_close(got.conv, want.conv, **TOL64)
    # And each sequence's prompt + new tokens run whole from scratch gives the same last outputs.
    for (ph, pr), (nh, nr), sep in zip(prompts, news, separate):
        whole = layer(torch.cat([ph, nh]), torch.cat([pr, nr]))
        torch.testing.assert_close(whole[ph.shape[0]:], sep, **TOL64)


def test_parameter_names_follow_the_demo():
    cfg = make_cfg(2)
    names = set(Engram(cfg, 1).state_dict())
    assert names == {"value_proj.weight", "value_proj.bias", "key_projs.0.weight", "key_projs.0.bias",
                     "key_projs.1.weight", "key_projs.1.bias", "norm1.0.weight", "norm1.1.weight",
                     "norm2.0.weight", "norm2.1.weight", "short_conv.conv.weight", "short_conv.norms.0.weight",
                     "short_conv.norms.1.weight"}
    sd = Engram(cfg, 1).state_dict()
    assert sd["short_conv.conv.weight"].shape == (2 * cfg.hidden_size, 1, cfg.kernel_size)
    assert sd["value_proj.weight"].shape == (cfg.hidden_size, cfg.n_cols * cfg.head_dim)


def test_paper_demo_preset_builds():
    cfg = EngramConfig.preset("paper-demo")
    layer = Engram(cfg, 15)
    assert layer.value_proj.in_features == 2 * 512 and layer.short_conv.dilation == 3
    assert layer.new_state(2).conv.shape == (2, 9, 4 * 1024)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_packed_decode_matches_cpu_float64():
    """The CUDA path skips the host-side cu_seqlens checks and sizes repeat_interleave without a sync."""
    cfg = make_cfg(4)
    layer = make_layer(cfg)
    hidden, rows = make_inputs(cfg, 19)
    cu = torch.tensor([0, 5, 5, 6, 19])
    cpu_state = ShortConvState.zeros(4, cfg, dtype=torch.float64).with_cu_seqlens(cu)
    cpu_state.conv.copy_(torch.randn_like(cpu_state.conv))
    gpu_state = ShortConvState(cpu_state.conv.cuda(), cu.cuda())
    want = layer(hidden, rows, state=cpu_state)
    got = layer.cuda()(hidden.cuda(), rows.cuda(), state=gpu_state)
    torch.testing.assert_close(got.cpu(), want, **TOL64)
    torch.testing.assert_close(gpu_state.conv.cpu(), cpu_state.conv, **TOL64)
