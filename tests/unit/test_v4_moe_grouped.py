"""DeepSeek-V4's routed experts: the grouped-GEMM path (``routed_grouped``, torch._grouped_mm) against the plain loop
(``routed_reference``) and a dense float64 oracle, on CPU in float32 and bf16, over odd expert loads (experts with no
token, one expert taking every assignment, a single token, token counts not a multiple of 8 / 16, a token picking one
expert twice, an empty step, active clamps); a wrong group offset fails parity; which path ``routed_experts`` picks;
the stacked storage behind the checkpoint names; the whole decoder with the grouped path active equal to it with the
reference path.

Tolerances. float32: the paths run the same products in different GEMM shapes (one fused w1|w3 GEMM over all
assignments vs per-expert w1 and w3 linears) and sum a token's picks in a different order, so they agree to float32
rounding, not necessarily bitwise: elementwise atol = rtol = 1e-5 on outputs of O(1) (both also that close to the
float64 oracle). bf16: the intermediates (w1|w3 outputs, the SwiGLU, the per-pick outputs) round to bf16's 8
significant bits, and the reference adds picks into a bf16 buffer one expert at a time where the grouped path sums a
token's picks once; errors then follow the intermediates' size, not the output element's, so the bound is on the
largest difference relative to the largest output: 2^-6 (a few bf16 ulps)."""
from __future__ import annotations

import pytest
import torch

from engram.model.deepseek_v4 import moe
from engram.model.deepseek_v4.checkpoint import load_v4_weights
from engram.model.deepseek_v4.config import V4Config
from engram.model.deepseek_v4.decoder import DeepseekV4Model, pack_sequences
from engram.model.deepseek_v4.moe import (RoutedExperts, group_offsets, grouped_supported, routed_experts,
                                          routed_grouped, routed_reference)
from tests.parity.deepseek_v4_fixtures import SHAPE

F32_TOL, BF16_TOL = 1e-5, 2.0 ** -6  # the module docstring says why


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """got against want (float64 or got's dtype) within got's dtype's stated tolerance."""
    assert got.shape == want.shape
    if got.numel() == 0:
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.to(want.dtype), want, atol=F32_TOL, rtol=F32_TOL)
    else:
        worst, scale = (got.double() - want.double()).abs().max(), want.double().abs().max()
        assert worst <= BF16_TOL * scale, f"{got.dtype}: max difference {worst:.3g} > 2^-6 x max |want| {scale:.3g}"
E, H, I = 8, 64, 32  # 16-byte rows in float32 and bf16


def _experts(dtype=torch.float32, n=E, hidden=H, inner=I, limit=10.0, seed=0) -> RoutedExperts:
    torch.manual_seed(seed)
    ex = RoutedExperts(n, hidden, inner, limit)
    with torch.no_grad():  # weights of ~unit gain so outputs are O(1)
        ex.w13.normal_(0, hidden ** -0.5)
        ex.w2.normal_(0, inner ** -0.5)
    return ex.to(dtype).requires_grad_(False)


def _dense(x, w, ids, ex) -> torch.Tensor:
    """float64 oracle: every expert on every token, then each token's picks weighed and summed."""
    x, w13, w2 = x.double(), ex.w13.double(), ex.w2.double()
    h = torch.einsum("th,eoh->teo", x, w13)  # [T, E, 2I]
    y = torch.einsum("tei,ehi->teh", moe.swiglu(h[..., :ex.inner], h[..., ex.inner:], ex.limit), w2)
    picked = y.gather(1, ids.unsqueeze(-1).expand(-1, -1, y.shape[-1]))  # [T, k, H]
    return (picked * w.double().unsqueeze(-1)).sum(1)


def _load(name: str, g: torch.Generator) -> tuple[int, torch.Tensor]:
    """(tokens, ids [T, k]) of one odd load over E experts."""
    if name == "some_experts_empty":  # only experts 1 and 4 used: 0, 2, 3, 5, 6, 7 get no rows
        return 29, torch.tensor([1, 4])[torch.randint(0, 2, (29, 2), generator=g)]
    if name == "last_expert_takes_all":
        return 37, torch.full((37, 1), E - 1)
    if name == "first_expert_takes_all_twice":  # a hash table of zeros: every token picks expert 0 twice
        return 21, torch.zeros(21, 2, dtype=torch.long)
    if name == "single_token":
        return 1, torch.tensor([[5, 2]])
    if name == "odd_counts":  # T and T·k not multiples of 8 or 16
        return 13, torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(13)])
    if name == "repeated_picks":  # some tokens pick one expert twice, others two different ones
        ids = torch.randint(0, E, (19, 2), generator=g)
        ids[::3, 1] = ids[::3, 0]
        return 19, ids
    if name == "empty_step":
        return 0, torch.zeros(0, 2, dtype=torch.long)
    assert name == "uniform"
    return 64, torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(64)])


LOADS = ["some_experts_empty", "last_expert_takes_all", "first_expert_takes_all_twice", "single_token",
         "odd_counts", "repeated_picks", "empty_step", "uniform"]


def _inputs(name: str, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    t, ids = _load(name, g)
    x = torch.randn(t, H, generator=g).to(dtype)
    w = torch.rand(t, ids.shape[1], generator=g) + 0.1
    return x, w / w.sum(-1, keepdim=True) * 1.5, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limit", [10.0, 0.5])  # 10: V4's, clamps idle here; 0.5: active on most entries
@pytest.mark.parametrize("load", LOADS)
def test_grouped_matches_the_reference_over_odd_loads(load, limit, dtype):
    ex = _experts(dtype, limit=limit)
    x, w, ids = _inputs(load, dtype)
    assert grouped_supported(x, ex)
    got, want = routed_grouped(x, w, ids, ex), routed_reference(x, w, ids, ex)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape == x.shape
    _close(got, want)
    oracle = _dense(x, w, ids, ex)
    for out in (got, want):
        _close(out, oracle)
    if load != "empty_step":
        assert got.abs().max() > 0.1  # the outputs compared are not all near zero


def test_group_offsets_are_inclusive_ends_per_expert():
    ids = torch.tensor([1, 1, 4, 4, 4, 7])
    assert group_offsets(ids, 8).tolist() == [0, 2, 2, 2, 5, 5, 5, 6]
    assert group_offsets(ids, 8).dtype == torch.int32  # what torch._grouped_mm takes
    assert group_offsets(torch.zeros(0, dtype=torch.long), 3).tolist() == [0, 0, 0]


@pytest.mark.parametrize("shift", [1, -1])
def test_a_group_boundary_off_by_one_fails_parity(monkeypatch, shift):
    ex = _experts()
    x, w, ids = _inputs("uniform", torch.float32)
    right = group_offsets

    def wrong(sorted_ids, n):
        offs = right(sorted_ids, n).clone()
        offs[2] += shift  # one assignment computed by the neighbouring expert's weights
        return offs

    monkeypatch.setattr(moe, "group_offsets", wrong)
    got, want = routed_grouped(x, w, ids, ex), routed_reference(x, w, ids, ex)
    with pytest.raises(AssertionError):
        _close(got, want)
    assert (got - want).abs().amax(-1).gt(1e-3).sum() == 1  # exactly the token of the moved row


def test_routed_experts_picks_grouped_where_the_backend_takes_it(monkeypatch):
    calls = []
    monkeypatch.setattr(moe, "routed_grouped", lambda *a: calls.append("grouped") or routed_grouped(*a))
    monkeypatch.setattr(moe, "routed_reference", lambda *a: calls.append("reference") or routed_reference(*a))
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        ex = _experts(dtype)
        x, w, ids = _inputs("odd_counts", dtype)
        calls.clear()
        out = routed_experts(x, w, ids, ex)
        assert calls == (["reference"] if dtype == torch.float64 else ["grouped"]), dtype
        oracle = _dense(x, w, ids, ex)
        if dtype == torch.float64:
            torch.testing.assert_close(out, oracle, atol=1e-12, rtol=1e-12)
        else:
            _close(out, oracle)


def test_rows_torch_grouped_mm_refuses_run_the_reference():
    ex = _experts(inner=6)  # 24-byte rows of w2 in float32
    x, w, ids = _inputs("odd_counts", torch.float32)
    assert not grouped_supported(x, ex)
    with pytest.raises(RuntimeError, match="16 bytes"):
        routed_grouped(x, w, ids, ex)
    _close(routed_experts(x, w, ids, ex), _dense(x, w, ids, ex))
    assert not grouped_supported(x.bfloat16(), _experts(torch.bfloat16, inner=4))  # 8-byte rows in bf16
    assert grouped_supported(x.bfloat16(), _experts(torch.bfloat16, inner=8))
    assert not grouped_supported(x, _experts(torch.bfloat16))  # mixed dtypes


def test_the_stacks_are_the_storage_behind_the_checkpoint_names():
    ex = _experts()
    sd = ex.state_dict()
    assert list(sd)[:4] == ["0.w1.weight", "0.w2.weight", "0.w3.weight", "1.w1.weight"] and len(sd) == 3 * E
    assert [n for n, _ in ex.named_parameters()] == ["w13", "w2"]
    assert sd["3.w1.weight"].shape == (I, H) and sd["3.w2.weight"].shape == (H, I)
    ptr = {ex.w13.untyped_storage().data_ptr(), ex.w2.untyped_storage().data_ptr()}
    assert {t.untyped_storage().data_ptr() for t in sd.values()} == ptr  # views: no second copy
    new = {k: torch.randn_like(v) for k, v in sd.items()}
    ex.load_state_dict(new)
    assert torch.equal(ex.w13[3, :I], new["3.w1.weight"]) and torch.equal(ex.w13[3, I:], new["3.w3.weight"])
    assert torch.equal(ex.w2[5], new["5.w2.weight"])
    half = ex.to(torch.bfloat16)  # a cast keeps the names pointing into the (new) stacks
    assert half.state_dict()["5.w2.weight"].untyped_storage().data_ptr() == half.w2.untyped_storage().data_ptr()
    missing = half.load_state_dict({k: v for k, v in new.items() if k != "2.w3.weight"} | {"9.w1.weight": new[
        "0.w1.weight"]}, strict=False)
    assert missing.missing_keys == ["2.w3.weight"]
    with pytest.raises(RuntimeError, match="Unexpected key.*9.w1.weight"):
        half.load_state_dict(new | {"9.w1.weight": new["0.w1.weight"]})


CFG = V4Config.from_hf_dict(dict(SHAPE, model_type="deepseek_v4"))  # H 64, I 32, 4 experts, k 2, hash layers 0, 1


def _model(dtype) -> DeepseekV4Model:
    torch.manual_seed(0)
    model = DeepseekV4Model(CFG)
    with torch.no_grad():
        for layer in model.model.layers:  # the router weight is made uninitialised (torch.empty) until loaded
            layer.ffn.gate.weight.normal_(0, CFG.hidden_size ** -0.5)
        for layer in model.model.layers[:2]:  # hash layers: a random table, with some tokens picking one expert twice
            layer.ffn.gate.tid2eid.copy_(torch.randint(0, CFG.n_routed_experts, layer.ffn.gate.tid2eid.shape))
    model = model.to(dtype)
    model.keep_fp32()
    return model.eval().requires_grad_(False)


def test_checkpoint_loading_writes_through_the_expert_names(tmp_path):
    from safetensors.torch import save_file

    src, dst = _model(torch.float32), DeepseekV4Model(CFG)
    save_file({k: v.contiguous().clone() for k, v in src.state_dict().items()}, str(tmp_path / "m.safetensors"))
    load_v4_weights(dst, [tmp_path / "m.safetensors"], ())
    assert torch.equal(dst.model.layers[2].ffn.experts.w13, src.model.layers[2].ffn.experts.w13)
    assert torch.equal(dst.model.layers[3].ffn.experts.w2, src.model.layers[3].ffn.experts.w2)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_with_the_grouped_path_equals_it_with_the_reference(monkeypatch, dtype):
    """A packed prefill of two sequences (45 and 19 tokens), then a decode step of one token each, with every layer's
    MoE on the grouped path (checked by counting), against the same with ``grouped_supported`` forced off."""
    model = _model(dtype)
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(3, CFG.vocab_size, (n,), generator=g).tolist() for n in (45, 19)]
    nexts = [[7], [11]]

    def run():
        step = pack_sequences(chunks, [0, 0], logits_indices=torch.arange(64))
        hidden, caches = model(step, [model.empty_cache(), model.empty_cache()])
        decoded, _ = model(pack_sequences(nexts, [45, 19]), caches)
        return hidden, decoded

    calls = []
    monkeypatch.setattr(moe, "routed_grouped", lambda *a: calls.append(1) or routed_grouped(*a))
    grouped = run()
    assert len(calls) == 2 * CFG.num_layers  # every layer, both steps
    monkeypatch.setattr(moe, "grouped_supported", lambda *a: False)
    reference = run()
    assert len(calls) == 2 * CFG.num_layers
    for got, want in zip(grouped, reference):
        assert torch.isfinite(got).all() and got.abs().max() > 0.1
        _close(got, want)
