"""Our DeepSeek-V4 (engram/model/deepseek_v4/) against transformers' DeepseekV4ForCausalLM in float64 (through the
float64 twin, tests/oracles/deepseek_v4_f64.py), on a checkpoint written by transformers' save_pretrained and read by
our loader: whole prefill, chunked prefill and decode logits within a relative 1e-12, equal greedy tokens, batched steps
equal to each sequence alone; the same with Engram layers (reference: the twin plus our Engram oracle before each
Engram layer). Prompts of >= 300 tokens reach every layer type's window, compressed entries and top-k selection."""
from __future__ import annotations

import inspect

import pytest
import torch

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair, prompt, rel_err

# the reference is the pinned transformers (pyproject.toml): with 5.17 the chunked-prefill comparison disagrees
transformers = pytest.importorskip("transformers", minversion="5.24")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM", allow_module_level=True)

from tests.oracles import deepseek_v4_f64  # noqa: E402  (needs transformers)

TOL = 1e-12


@pytest.fixture(scope="module", params=["plain", "engram"])
def pair(request, tmp_path_factory):
    return Pair(tmp_path_factory.mktemp(request.param), ENGRAM if request.param == "engram" else None)


def test_twin_only_widens_float32_casts():
    import transformers.models.deepseek_v4.modeling_deepseek_v4 as original

    source = inspect.getsource(original)
    assert "float64" not in source and ".double()" not in source
    twin = deepseek_v4_f64.widen(source, "check")
    assert deepseek_v4_f64.SUBSTITUTIONS["check"] > 10
    assert deepseek_v4_f64.narrow(twin).replace("torch.float32", "torch.float") == \
        source.replace("torch.float32", "torch.float")


def _index_gaps(pair, ids):
    """Every CSA query's gap between its k-th and (k+1)-th visible index score (relative), from the reference."""
    scores = []
    twin = deepseek_v4_f64.module()
    hooks = [m.register_forward_hook(lambda mod, args, out: scores.append((out[0], mod)))
             for m in pair.ref.modules() if isinstance(m, twin.DeepseekV4IndexerScorer)]
    try:
        pair.ref_logits(ids, [])
    finally:
        for h in hooks:
            h.remove()
    cfg = pair.ref.config
    k, r = cfg.index_topk, cfg.compress_rates["compressed_sparse_attention"]
    gaps = []
    for s, _ in scores:  # [T, E]
        for t in range(s.shape[0]):
            visible = s[t, : (t + 1) // r]
            if visible.numel() > k:
                top = visible.topk(k + 1).values
                gaps.append(float((top[k - 1] - top[k]).abs() / top[: k].abs().max()))
    return gaps


def test_prefill_logits_match(pair):
    ids = prompt(320, seed=1)
    gaps = _index_gaps(pair, ids)
    assert len(gaps) > 300 and min(gaps) >= 1e-9, "exact index-score ties make the reference disagree with itself"
    want = pair.ref_logits(ids, [])
    got, caches = pair.our_logits([ids], [[]], [pair.model.empty_cache()])
    assert rel_err(got, want) <= TOL
    layers = caches[0].layers
    assert caches[0].position == 320
    assert layers[0].window.shape[0] == 31 and layers[0].compressor is None
    assert layers[1].compressor.num_entries == 80 and layers[1].indexer.num_entries == 80
    assert layers[2].compressor.num_entries == 20 and layers[2].compressor.buffer_kv.shape[0] == 0
    assert layers[3].compressor.overlap_kv.shape == (4, 32)


def test_chunked_prefill_and_decode_match(pair):
    from transformers import DynamicCache

    ids = prompt(305, seed=2)
    chunks = [ids[:129], ids[129:250], ids[250:]]  # chunk ends inside and at window boundaries
    cache, ref_cache, seq = pair.model.empty_cache(), DynamicCache(config=pair.ref.config), []
    for chunk in chunks:
        want = pair.ref_logits(chunk, seq, ref_cache)
        got, (cache,) = pair.our_logits([chunk], [seq], [cache])
        assert rel_err(got, want) <= TOL
        seq = seq + chunk
    tok = int(got[-1].argmax())
    assert tok == int(want[-1].argmax())
    for _ in range(14):  # greedy decode across CSA and HCA window closes (positions 305..318 -> 319 closes HCA)
        want = pair.ref_logits([tok], seq, ref_cache)
        got, (cache,) = pair.our_logits([[tok]], [seq], [cache])
        assert rel_err(got, want) <= TOL
        seq = seq + [tok]
        tok = int(got[-1].argmax())
        assert tok == int(want[-1].argmax())
    whole = pair.ref_logits(seq, [])  # the same positions in one prefill of the reference
    assert rel_err(got[-1], whole[-1]) <= TOL


def test_batched_step_equals_each_sequence_alone(pair):
    """One packed step of a fresh prefill, a continued chunk and a decode token equals each run alone (ours) and the
    reference run per sequence (it has no batched reference: padding would enter its compressor windows)."""
    a, b, c = prompt(300, seed=3), prompt(260, seed=4), prompt(301, seed=5)
    _, (cb,) = pair.our_logits([b[:200]], [[]], [pair.model.empty_cache()])
    _, (cc,) = pair.our_logits([c[:300]], [[]], [pair.model.empty_cache()])
    chunks, pasts = [a, b[200:], c[300:]], [[], b[:200], c[:300]]
    got, caches = pair.our_logits(chunks, pasts, [pair.model.empty_cache(), cb, cc])
    at = 0
    for chunk, past, cache in zip(chunks, pasts, [pair.model.empty_cache(), cb, cc]):
        alone, (new_alone,) = pair.our_logits([chunk], [past], [cache])
        assert rel_err(got[at:at + len(chunk)], alone) <= TOL  # token-wise GEMMs differ in shape: not bitwise
        want = pair.ref_logits(past + chunk, [])[len(past):]
        assert rel_err(alone, want) <= TOL
        at += len(chunk)
    assert [x.position for x in caches] == [300, 260, 301]


def test_engram_layers_take_part(pair):
    """The Engram case is not vacuous: zero rows (v = 0 on every stream) change the logits."""
    if pair.ours.engram_config is None:
        assert pair.model.engram_layers == {}
        return
    assert sorted(pair.model.engram_layers) == [1, 3]
    ids = prompt(40, seed=6)
    got, _ = pair.our_logits([ids], [[]], [pair.model.empty_cache()])
    from engram.model.deepseek_v4.decoder import pack_sequences

    cfg = pair.ours.engram_config
    step = pack_sequences([ids], [0], engram_rows=lambda lid: torch.zeros(len(ids), cfg.n_cols, cfg.head_dim,
                                                                          dtype=torch.float64))
    step.logits_indices = torch.arange(len(ids))
    with torch.no_grad():
        zero = pair.model.head(pair.model(step, [pair.model.empty_cache()])[0])
    assert rel_err(zero, got) > 1e-3
