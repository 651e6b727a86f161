"""Prefix caching on the CPU in float64 (tiny and small, both Engram variants): outputs with the cache equal those
without it — greedy tokens exactly, every emitted token's logprob and top-5 within 1e-9 — for prompts sharing prefixes
that end inside a block and at a block boundary, prefixes with DEAD tokens just before the boundary, whole prompts
repeated, preemption, async scheduling and chunked prefill; the prompt tokens computed are the expected share; and the
mutations the Engram boundary rule guards against (the lookback padded, the conv state dropped at a cached start) are
caught by the same comparison."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.runners.conv_blocks import ConvBlockStore
from engram.engine.sampling_params import SamplingParams
from engram.engine.sequence import Sequence
from engram.model.loader import LoadedModel, load_model
from tests.engine_runs import drain, preset_variant

CPU, F64 = torch.device("cpu"), torch.float64
TOL = 1e-9
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
DEAD = 777


def build(preset: str, **engram_changes) -> LoadedModel:
    """A preset's decoder (float64, CPU, random weights of seed 0) with its Engram config changed."""
    return preset_variant(preset, f"{preset}-{engram_changes}", **engram_changes)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", dtype=F64, device=CPU, progress=False)


@pytest.fixture(scope="module")
def tiny_paper() -> LoadedModel:
    return build("tiny", variant="paper", row_dtype="fp32", dead_token_ids=(DEAD,))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def shared_prompts(prefix_len: int, suffixes=(5, 9, 17, 3, 30), seed: int = 0) -> list[list[int]]:
    """A shared prefix of ``prefix_len`` tokens, then each request's own tokens; the last one repeats the first."""
    prefix = ids(prefix_len, seed)
    reqs = [prefix + ids(n, seed + 1 + i) for i, n in enumerate(suffixes)]
    return reqs + [list(reqs[0])]


def generate(loaded: LoadedModel, reqs: list[list[int]], waves: int = 2, **cfg):
    """Run ``reqs`` through one engine: the first alone (it fills the cache), the rest together -> (outputs per
    request: (tokens, [(logprob, top-5)]), engine)."""
    engine = LLMEngine(loaded, EngineConfig(**cfg), CPU, F64)
    out = {}
    batches = [reqs[:1], reqs[1:]] if waves == 2 else [reqs]
    for b, batch in enumerate(batches):
        for i, prompt in enumerate(batch):
            engine.add_request(f"w{b}-{i}", prompt, PARAMS)
        out.update(drain(engine))
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every reference was given back
    return [out[k] for k in sorted(out, key=lambda k: (int(k[1]), int(k.split("-")[1])))], engine


def worst_gap(a, b) -> float:
    """Greedy tokens must be equal; -> the largest logprob difference over every emitted token and its top-5."""
    worst = 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        for (lpa, topa), (lpb, topb) in zip(la, lb):
            assert [t for t, _ in topa] == [t for t, _ in topb]
            worst = max(worst, abs(lpa - lpb), *(abs(x - y) for (_, x), (_, y) in zip(topa, topb)))
    return worst


def compare(loaded: LoadedModel, reqs: list[list[int]], **cfg):
    """-> (worst logprob gap between prefix caching on and off, the cached engine's prefix_cache stats)."""
    ref, _ = generate(loaded, reqs, enable_prefix_caching=False, **cfg)
    got, engine = generate(loaded, reqs, **cfg)
    return worst_gap(ref, got), engine.stats()["prefix_cache"]


@pytest.mark.parametrize("prefix_len", [32, 37, 47])  # at a block boundary, inside, one short of the next boundary
def test_v41_outputs_equal_without_the_cache(tiny, prefix_len):
    gap, stats = compare(tiny, shared_prompts(prefix_len), max_num_seqs=4, max_num_batched_tokens=64)
    assert gap <= TOL
    assert stats["hit_blocks"] >= 5 * (prefix_len // 16)  # every later request reused the shared blocks


@pytest.mark.parametrize("prefix_len", [32, 37])
def test_paper_outputs_equal_without_the_cache(tiny_paper, prefix_len):
    gap, stats = compare(tiny_paper, shared_prompts(prefix_len, seed=4), max_num_seqs=4, max_num_batched_tokens=64)
    assert gap <= TOL and stats["hit_blocks"] >= 10


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_dead_tokens_before_the_boundary(tiny, tiny_paper, variant):
    """DEAD tokens at positions 29..30 of a 32-token prefix: the first uncached token's n-grams reach them (sticky)."""
    loaded = tiny_paper if variant == "paper" else dataclasses.replace(
        tiny, engram_config=tiny.engram_config.replace(dead_token_ids=(DEAD,)))
    reqs = shared_prompts(32, seed=7)
    reqs = [r[:29] + [DEAD, DEAD] + r[31:] for r in reqs]
    gap, stats = compare(loaded, reqs, max_num_seqs=4, max_num_batched_tokens=64)
    assert gap <= TOL and stats["hit_blocks"] >= 10


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_cached_blocks_survive_preemption(tiny, tiny_paper, variant):
    loaded = tiny_paper if variant == "paper" else tiny
    reqs = shared_prompts(40, suffixes=(60, 50, 70, 45, 66, 58), seed=11)
    cfg = dict(max_num_seqs=6, max_num_batched_tokens=32, block_size=8, num_kv_blocks=30, max_model_len=160)
    ref, _ = generate(loaded, reqs, enable_prefix_caching=False, **cfg)
    got, engine = generate(loaded, reqs, **cfg)
    assert engine.num_preemptions > 0
    stats = engine.stats()["prefix_cache"]
    assert stats["queries"] > len(reqs)  # preempted sequences asked again, and found blocks
    assert worst_gap(ref, got) <= TOL


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_async_scheduling_and_one_token_chunks(tiny, tiny_paper, variant):
    loaded = tiny_paper if variant == "paper" else tiny
    reqs = shared_prompts(37, seed=13)
    for cfg in (dict(async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=64),
                dict(max_num_seqs=4, max_num_batched_tokens=7)):
        gap, stats = compare(loaded, reqs, **cfg)
        assert gap <= TOL and stats["hit_blocks"] >= 10


def test_small_preset_both_variants():
    for loaded in (build("small"), build("small", variant="paper", row_dtype="fp32")):
        gap, stats = compare(loaded, shared_prompts(40, suffixes=(6, 20), seed=17), max_num_seqs=2,
                             max_num_batched_tokens=64)
        assert gap <= TOL and stats["hit_blocks"] >= 4


def test_prompt_tokens_computed_are_the_expected_share(tiny):
    """16 requests of a 256-token system prompt + 32 own tokens, one output token each: the first computes 288 tokens,
    each later one 288 - 256 = 32, so 768 of the 4608 prompt tokens are computed (1/6)."""
    prefix = ids(256, 21)
    reqs = [prefix + ids(32, 100 + i) for i in range(16)]
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512), CPU, F64)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)
    engine.add_request("first", reqs[0], one)
    drain(engine)
    for i, r in enumerate(reqs[1:]):
        engine.add_request(f"r{i}", r, one)
    drain(engine)
    computed = sum(rec.num_tokens for rec in engine.step_trace())  # every token a step computed
    share = computed / sum(map(len, reqs))
    assert abs(share - 768 / 4608) <= 0.01 * 768 / 4608
    stats = engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == 15 * 256 and stats["queried_tokens"] == 16 * 288
    assert stats["token_hit_rate"] == pytest.approx(1 - share)


def test_reset_forgets_the_cache(tiny):
    reqs = shared_prompts(32)
    engine = LLMEngine(tiny, EngineConfig(max_num_seqs=4), CPU, F64)
    engine.add_request("a", reqs[0], PARAMS)
    drain(engine)
    assert engine.stats()["prefix_cache"]["cached_blocks"] > 0
    assert engine.reset_prefix_cache() > 0
    engine.add_request("b", reqs[1], PARAMS)
    drain(engine)
    stats = engine.stats()["prefix_cache"]
    assert stats["hit_blocks"] == 0 and stats["resets"] == 1 and stats["cached_blocks"] > 0


def test_prefix_caching_off_reports_no_hits(tiny):
    _, engine = generate(tiny, shared_prompts(32), enable_prefix_caching=False)
    stats = engine.stats()["prefix_cache"]
    assert not stats["enabled"] and stats["queries"] == stats["hit_blocks"] == stats["cached_blocks"] == 0


# ----------------------------------------------------------------- the mutations the comparison must catch
def test_padding_the_lookback_at_a_cached_start_is_caught(tiny, monkeypatch):
    """The engine's lookback is a function of the tokens; padding it where a sequence starts after cached blocks
    (what a cache that forgot the lookback would do) changes the first uncached tokens' rows."""
    reqs = shared_prompts(37)
    ref, _ = generate(tiny, reqs, enable_prefix_caching=False, max_num_seqs=4)
    real = Sequence.lookback_before

    def padded(self, position, pad=None):
        if 0 < position == self.num_cached_tokens:
            return list(self._pad)
        return real(self, position, pad)

    monkeypatch.setattr(Sequence, "lookback_before", padded)
    got, _ = generate(tiny, reqs, max_num_seqs=4)
    with pytest.raises(AssertionError):
        assert worst_gap(ref, got) <= TOL


def test_dropping_the_conv_state_at_a_cached_start_is_caught(tiny_paper, monkeypatch):
    """The paper variant's conv inputs are not a function of the tokens; a fresh (zero) state at a cached start is
    what a cache that kept only the K/V would give."""
    reqs = shared_prompts(37, seed=4)
    ref, _ = generate(tiny_paper, reqs, enable_prefix_caching=False, max_num_seqs=4)
    real = ConvBlockStore.history

    def zeros(self, block_table, start):
        return {lid: dataclasses.replace(s, conv=torch.zeros_like(s.conv))
                for lid, s in real(self, block_table, start).items()}

    monkeypatch.setattr(ConvBlockStore, "history", zeros)
    got, _ = generate(tiny_paper, reqs, max_num_seqs=4)
    with pytest.raises(AssertionError):
        assert worst_gap(ref, got) <= TOL


def test_prompt_logprobs_requests_compute_their_whole_prompt(tiny):
    reqs = shared_prompts(32)[:2]
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    outs = []
    for enabled in (False, True):
        engine = LLMEngine(tiny, EngineConfig(enable_prefix_caching=enabled), CPU, F64)
        got = []
        for i, r in enumerate(reqs):
            engine.add_request(f"r{i}", r, scored)
            while engine.has_unfinished():
                got += [o.prompt_logprobs for o in engine.step() if o.finished]
        outs.append(got)
        assert engine.stats()["prefix_cache"]["hit_blocks"] == 0
    for a, b, r in zip(*outs, reqs):
        assert len(a) == len(b) == len(r) and a[0] is None
        assert all(abs(x.logprob - y.logprob) <= TOL for x, y in zip(a[1:], b[1:]))
