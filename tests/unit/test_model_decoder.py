"""EngramDecoder against an independent full-sequence reference, and invariances of the paged forward.

The reference below recomputes a whole sequence with its own causal softmax attention (no paging, no
KV cache, explicit KV-sharing bookkeeping) from the model's weights; the paged model must agree in
float64 whatever the chunking or batching. Tables are the real (random, cached) store tables.
"""
from __future__ import annotations

import math

import pytest
import torch

from engram.config import EngramConfig
from engram.model.inputs import StepInputs, make_step_inputs
from engram.model.kv_cache import KVCache
from engram.model.layers.attention import AttentionMetadata
from engram.model.loader import random_model
from engram.model.presets import preset_config
from tests.oracles.reference import engram_fields, greedy_generate, prefill_logits

F64 = torch.float64


def _cfg(hc_mult: int = 2, kv_sources=None, engram: bool = True):
    base = preset_config("tiny")
    eng = EngramConfig.preset("tiny").replace(hc_mult=hc_mult) if engram else None
    return base.replace(hc_mult=hc_mult, kv_source_layer_ids=kv_sources, engram=eng)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("engram-cache")


def _load(cfg, cache_dir, dtype=F64):
    return random_model(cfg, tier="host", dtype=dtype, device="cpu", cache_dir=cache_dir, progress=False)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, hd]
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=F64) / hd)
    ang = pos.to(F64)[:, None] * inv  # [T, hd/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_forward(loaded, ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] of one whole sequence, computed without the paged machinery."""
    m, cfg = loaded.model, loaded.model_config
    t = len(ids)
    pos = torch.arange(t)
    fields = engram_fields(loaded, ids, [], "cpu")
    h = m.model.embed_tokens.weight[torch.tensor(ids)].unsqueeze(1).repeat(1, cfg.hc_mult, 1)  # [T, hc, H]
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    kv_by_layer = {}
    for layer in m.model.layers:
        if layer.engram is not None:
            out = layer.engram(h, fields["engram_rows"](layer.layer_id), dead_mask=fields.get("dead_mask"))
            h = h + out if layer.engram.residual_output else out
        x = layer.attn_hc.collapse(h) if cfg.hc_mult > 1 else h[:, 0]
        a = layer.self_attn
        xn = _rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = (xn @ a.q_proj.weight.T).view(t, cfg.num_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = _rms(q, a.q_norm.weight, cfg.rms_norm_eps)
        q = _rope(q, pos, cfg.rope_theta)
        if a.owns_kv:
            k = (xn @ a.k_proj.weight.T).view(t, cfg.num_kv_heads, cfg.head_dim)
            v = (xn @ a.v_proj.weight.T).view(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                k = _rms(k, a.k_norm.weight, cfg.rms_norm_eps)
            kv_by_layer[layer.layer_id] = (_rope(k, pos, cfg.rope_theta), v)
        k, v = kv_by_layer[cfg.kv_source(layer.layer_id)]
        groups = cfg.num_heads // cfg.num_kv_heads
        outs = []
        for head in range(cfg.num_heads):
            s = q[:, head] @ k[:, head // groups].T / math.sqrt(cfg.head_dim)  # [T, T]
            p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
            outs.append(p @ v[:, head // groups])
        y = torch.cat(outs, dim=-1) @ a.o_proj.weight.T  # [T, H]
        if cfg.hc_mult > 1:
            h = layer.attn_hc.expand(h, y)
            x = layer.mlp_hc.collapse(h)
        else:
            x = x + y
        mlp = layer.mlp
        xn = _rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        gate, up = xn @ mlp.gate_proj.weight.T, xn @ mlp.up_proj.weight.T
        y = (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
        h = layer.mlp_hc.expand(h, y) if cfg.hc_mult > 1 else (x + y).unsqueeze(1)
    final = h.sum(1) if cfg.hc_mult > 1 else h[:, 0]
    return (_rms(final, m.model.norm.weight, cfg.rms_norm_eps) @ m.lm_head.weight.T)[:, : cfg.vocab_size]


def _ids(loaded, text="The quick brown fox jumps over the lazy dog; def main(): return 0"):
    return loaded.tokenizer.encode(text).ids


@pytest.mark.parametrize("hc_mult", [1, 2])
def test_prefill_matches_reference(cache_dir, hc_mult):
    loaded = _load(_cfg(hc_mult), cache_dir)
    ids = _ids(loaded)
    got = prefill_logits(loaded, ids, block_size=4)
    want = reference_forward(loaded, ids)
    assert got.shape == (len(ids), loaded.model_config.vocab_size)
    torch.testing.assert_close(got.double(), want.float().double(), rtol=0, atol=1e-5)


def test_kv_sharing_layers_read_their_source(cache_dir):
    cfg = _cfg(2, kv_sources=(0, 2))
    loaded = _load(cfg, cache_dir)
    layers = loaded.model.model.layers
    assert [l.self_attn.kv_source for l in layers] == [0, 0, 2, 2]
    assert not hasattr(layers[1].self_attn, "k_proj") and hasattr(layers[2].self_attn, "k_proj")
    ids = _ids(loaded)
    torch.testing.assert_close(prefill_logits(loaded, ids).double(), reference_forward(loaded, ids).float().double(),
                               rtol=0, atol=1e-5)
    kv = KVCache.for_model(cfg, 8, 4, F64)
    assert sorted(kv.k) == [0, 2]
    # Poison the source's cache after prefill: the sharer (layer 1) must see it on the next decode step.
    fields = engram_fields(loaded, ids, [], "cpu")
    step = make_step_inputs([ids], [0], [list(range(8))], 4, fields.pop("engram_rows"), **fields)
    loaded.model(step, kv)
    seen = {}
    hook = layers[1].self_attn.register_forward_hook(lambda mod, args, out: seen.setdefault("y", out.clone()))
    nxt = [ids[-1]]

    def decode():
        seen.clear()
        f = engram_fields(loaded, nxt, ids, "cpu")
        s = make_step_inputs([nxt], [len(ids)], [list(range(8))], 4, f.pop("engram_rows"), **f)
        cache = KVCache.for_model(cfg, 8, 4, F64)
        for lid in cache.k:
            cache.k[lid].copy_(kv.k[lid])
            cache.v[lid].copy_(kv.v[lid])
        return cache, s

    cache, s = decode()
    loaded.model(s, cache)
    clean = seen["y"]
    cache, s = decode()
    cache.v[0][0, 0].add_(1.0)  # the first token's V of source layer 0
    loaded.model(s, cache)
    assert not torch.equal(seen["y"], clean)
    hook.remove()


def test_chunked_and_batched_match_whole_prefill(cache_dir):
    """Same logits (float64) for: whole prefill; chunked prefill + decode; two sequences packed together."""
    loaded = _load(_cfg(2), cache_dir)
    model, cfg = loaded.model, loaded.model_config
    a, b = _ids(loaded), _ids(loaded, "import os, sys; print(sys.argv)")
    want_a, want_b = prefill_logits(loaded, a), prefill_logits(loaded, b)

    kv = KVCache.for_model(cfg, 32, 4, F64)
    ta, tb = list(range(0, 16)), list(range(16, 32))
    got_a = []
    # step 1: a's first 5 tokens alone; step 2: a's next 7 + all of b packed; then decode a's rest with b idle
    plan = [([a[:5]], [0], [ta], [a]), ([a[5:12], b], [5, 0], [ta, tb], [a, b])]
    for chunks, past, tables, seqs in plan:
        f = [engram_fields(loaded, c, s[:p], "cpu") for c, p, s in zip(chunks, past, seqs)]
        rows = [x["engram_rows"] for x in f]

        def provider(lid, rows=rows):
            return torch.cat([r(lid) for r in rows])

        cu = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0)
        step = make_step_inputs(chunks, past, tables, 4, provider, logits_indices=torch.arange(int(cu[-1])))
        logits = model.compute_logits(model(step, kv))
        got_a.append(logits[: len(chunks[0])])
        if len(chunks) == 2:
            torch.testing.assert_close(logits[len(chunks[0]):].double(), want_b.double(), rtol=0, atol=1e-5)
    for p in range(12, len(a)):
        f = engram_fields(loaded, [a[p]], a[:p], "cpu")
        step = make_step_inputs([[a[p]]], [p], [ta], 4, f.pop("engram_rows"), **f)
        got_a.append(model.compute_logits(model(step, kv)))
    torch.testing.assert_close(torch.cat(got_a).double(), want_a.double(), rtol=0, atol=1e-5)


def test_hc_identity_equals_plain_residual(cache_dir):
    """hc_mult=2 with identity hyper-connections (one-hot in, I, out=1) is a plain residual: equal streams,
    and the final RMSNorm (eps 0 here) removes the factor 2 of their sum."""
    one = _load(_cfg(1, engram=False), cache_dir)
    two = _load(_cfg(2, engram=False), cache_dir)
    sd = {k: v for k, v in one.model.state_dict().items()}
    missing = two.model.load_state_dict(sd, strict=False)
    assert all("_hc." in k for k in missing.missing_keys) and not missing.unexpected_keys
    for layer in two.model.model.layers:
        for hc in (layer.attn_hc, layer.mlp_hc):
            hc.in_weight.copy_(torch.tensor([1.0, 0.0]))
            hc.res_weight.copy_(torch.eye(2))
            hc.out_weight.fill_(1.0)
    one.model.model.norm.eps = two.model.model.norm.eps = 0.0
    ids = _ids(one)
    torch.testing.assert_close(prefill_logits(two, ids), prefill_logits(one, ids), rtol=0, atol=1e-6)
    two.model.model.layers[0].attn_hc.res_weight[1, 0] = 0.5  # streams now differ: the output must move
    assert not torch.allclose(prefill_logits(two, ids), prefill_logits(one, ids), atol=1e-6)


def test_padding_slots_and_errors(cache_dir):
    loaded = _load(_cfg(2), cache_dir)
    ids = _ids(loaded)[:6]
    f = engram_fields(loaded, ids, [], "cpu")
    with pytest.raises(ValueError, match="positions"):
        StepInputs(
            token_ids=torch.tensor(ids), positions=torch.arange(5), cu_seqlens=torch.tensor([0, 6]),
            context_lens=torch.tensor([6]), block_tables=torch.tensor([[0, 1]]), slot_mapping=torch.arange(6),
            engram_rows=f["engram_rows"])
    step = make_step_inputs([ids], [0], [[0, 1]], 4, None)
    with pytest.raises(ValueError, match="engram_rows"):
        loaded.model(step, KVCache.for_model(loaded.model_config, 2, 4, F64))
    kv = KVCache.for_model(loaded.model_config, 2, 4, F64)
    before = kv.k[0].clone()
    slots = torch.tensor([-1, 3])
    meta = AttentionMetadata.from_step(torch.tensor([0, 2]), torch.tensor([2]), torch.tensor([[0]]), slots)
    kv.write(0, slots, torch.ones(2, 2, 16, dtype=F64), torch.ones(2, 2, 16, dtype=F64), keep=meta.write_keep)
    assert torch.equal(kv.k[0].view(-1, 2, 16)[3], torch.ones(2, 16, dtype=F64))
    assert torch.equal(kv.k[0].view(-1, 2, 16)[:3], before.view(-1, 2, 16)[:3])
    assert kv.bytes_per_block() == 2 * 4 * 4 * 2 * 16 * 8


def _variant_cfg(variant: str):
    cfg = _cfg(2)
    if variant == "paper":  # the demo's fusion (ShortConv with a decode state), float rows
        cfg = cfg.replace(engram=cfg.engram.replace(variant="paper", row_dtype="fp32"))
    return cfg


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_incremental_decode_equals_full_recompute(cache_dir, variant):
    """Prefill + one decode step per token (carrying KV, lookback and, for paper, the conv state) picks the
    same tokens as recomputing every prefix from scratch, and the prefill matches the reference."""
    loaded = _load(_variant_cfg(variant), cache_dir)
    ids = _ids(loaded)
    torch.testing.assert_close(prefill_logits(loaded, ids).double(), reference_forward(loaded, ids).float().double(),
                               rtol=0, atol=1e-5)
    prompt = ids[:6]
    out = greedy_generate(loaded, prompt, 8, stop_at_eos=False)
    full = prefill_logits(loaded, prompt + out[:-1])  # [len(prompt) + 7, vocab]
    assert full[len(prompt) - 1:].argmax(-1).tolist() == out
