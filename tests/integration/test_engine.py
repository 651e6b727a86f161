"""Engine correctness on the tiny model in float64 on CPU: batch composition never changes greedy tokens.

One request alone == the same request among 16 concurrent mixed-length requests == prefill chunks of 1, 7
and 64 tokens == a run that is preempted and resumed; the Engram row ids used at every step equal those
of hashing the whole sequence at once (steps are recorded by a LookupExecutor subclass in the Worker). The paper
variant's conv state is checked across chunks and preemption the same way.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.lookup import LookupExecutor, StagedRows
from engram.engine.step import StepDescription
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import LoadedModel, build_model, load_model
from engram.model.presets import init_random_weights
from engram.store.options import StoreOptions

CPU = torch.device("cpu")
F64 = torch.float64
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", dtype=F64, device=CPU, progress=False)


def tiny_variant(**engram_changes) -> LoadedModel:
    """The tiny decoder (float64, CPU) with its Engram config changed, e.g. the paper variant or DEAD ids."""
    from tests.engine_runs import preset_variant

    return preset_variant("tiny", "tiny-variant", **engram_changes)


@pytest.fixture(scope="module")
def tiny_paper() -> LoadedModel:
    """The tiny decoder with paper-variant Engram layers (ShortConv state per sequence)."""
    return tiny_variant(variant="paper", row_dtype="fp32")


class RecordingExecutor(LookupExecutor):
    """The real lookup executor (a Worker's ``wrap_lookup``), also keeping every step it executed. Without the
    Worker's lookup stream: each step's rows are staged as rows, read back by the tests."""

    def __init__(self, base: LookupExecutor):
        super().__init__(base.tables, base.cfg, base.dtype, base.device)
        self.plans: list[StepDescription] = []
        self.staged: list[StagedRows] = []

    def submit(self, step: StepDescription, *args, **kwargs) -> StagedRows:
        self.plans.append(step)
        staged = super().submit(step, *args, **kwargs)
        self.staged.append(staged)
        return staged


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths, 2..150 tokens of the 4096-id vocab (specials 0-2 avoided)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [2, 150, 9, 33, 1 + 63, 5, 97, 17, 3, 120, 48, 7, 70, 26, 11, 88][:n]
    return [torch.randint(3, 4096, (length,), generator=g).tolist() for length in lengths]


def run(loaded: LoadedModel, reqs: list[list[int]], params=GREEDY, record: bool = False, **cfg):
    from tests.engine_runs import engine_wrapping_lookup

    if record:  # recorded plans hold every row id: no step launched with tokens still on the device
        cfg.setdefault("async_scheduling", False)
    config = EngineConfig(**cfg)
    engine = (engine_wrapping_lookup(loaded, config, RecordingExecutor) if record else
              LLMEngine(loaded, config, loaded.device, loaded.dtype))
    engine.lookup = engine.executor.worker.lookup  # what the tests below read back
    seq_ids = {}
    for i, ids in enumerate(reqs):
        engine.add_request(f"r{i}", ids, params[i] if isinstance(params, list) else params)
        seq_ids[f"r{i}"] = engine._seqs[f"r{i}"].seq_id
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every block came back
    return [out[f"r{i}"] for i in range(len(reqs))], engine, seq_ids


@pytest.fixture(scope="module")
def alone(tiny):
    return [run(tiny, [p], max_num_seqs=1, max_num_batched_tokens=256)[0][0] for p in prompts(16)]


def test_16_concurrent_mixed_lengths_equal_alone(tiny, alone):
    got, engine, _ = run(tiny, prompts(16), max_num_seqs=16, max_num_batched_tokens=64)
    assert got == alone
    assert all(len(t) == GREEDY.max_tokens for t in got)
    assert len(set(map(tuple, got))) > 8  # the requests really differ


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunk_size_does_not_change_tokens(tiny, alone, chunk):
    reqs = prompts(16)[:4]
    got, _, _ = run(tiny, reqs, max_num_seqs=min(chunk, 4), max_num_batched_tokens=chunk)
    assert got == alone[:4]


def test_preempted_and_resumed_equals_alone(tiny, alone):
    # 24 blocks of 8 tokens: enough for one 200-token sequence, far too few for all 16 at once.
    got, engine, _ = run(tiny, prompts(16), max_num_seqs=16, max_num_batched_tokens=64, block_size=8,
                         num_kv_blocks=24, max_model_len=192)
    assert engine.num_preemptions > 0
    assert got == alone


def test_seeded_sampling_is_the_same_alone_batched_and_preempted(tiny):
    reqs = prompts(6, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=10, ignore_eos=True)
              for i in range(6)]
    solo = [run(tiny, [p], [q], max_num_seqs=1)[0][0] for p, q in zip(reqs, params)]
    batched, _, _ = run(tiny, reqs, params, max_num_seqs=6, max_num_batched_tokens=32)
    squeezed, engine, _ = run(tiny, reqs, params, max_num_seqs=6, max_num_batched_tokens=32, block_size=8,
                              num_kv_blocks=20, max_model_len=160)
    assert engine.num_preemptions > 0
    assert batched == solo and squeezed == solo


def full_sequence_rows(engine: LLMEngine, token_ids: list[int]) -> dict[int, torch.Tensor]:
    comp = torch.tensor(engine.ctok.compress(token_ids, engine.ecfg.dead_token_ids)).unsqueeze(0)  # [1, L]
    return {lid: engine.hasher.hash(comp, lid)[0] for lid in engine.ecfg.layer_ids}  # {layer: [L, n_cols]}


def check_plans_against_full_hash(engine: LLMEngine, seq_ids: dict[str, int], prompt_ids: list[list[int]],
                                  outputs: list[list[int]]) -> int:
    """Every (sequence, position) row id of every recorded plan equals the whole-sequence hash; returns
    how many positions were hashed more than once (recomputed after preemption)."""
    full = {seq_ids[f"r{i}"]: full_sequence_rows(engine, p + o) for i, (p, o) in enumerate(zip(prompt_ids, outputs))}
    seen: dict[tuple[int, int], int] = {}
    for plan in engine.lookup.plans:
        cu = plan.cu_seqlens.tolist()
        for s, sid in enumerate(plan.seq_ids):
            pos = plan.positions[cu[s]:cu[s + 1]]
            for lid, row_ids in plan.engram_row_ids.items():
                step_rows = row_ids[cu[s]:cu[s + 1]]  # [n, n_cols]
                assert torch.equal(step_rows, full[sid][lid][pos]), f"seq {sid} layer {lid} positions {pos.tolist()}"
            for p in pos.tolist():
                seen[(sid, p)] = seen.get((sid, p), 0) + 1
    # every token that was ever computed appears: prompt + all outputs except the last sampled one
    for i, (p, o) in enumerate(zip(prompt_ids, outputs)):
        sid = seq_ids[f"r{i}"]
        assert all((sid, q) in seen for q in range(len(p) + len(o) - 1))
    return sum(1 for v in seen.values() if v > 1)


def test_row_ids_at_every_step_equal_hashing_the_full_sequence(tiny):
    reqs = prompts(16)
    got, engine, seq_ids = run(tiny, reqs, record=True, max_num_seqs=16, max_num_batched_tokens=48,
                               block_size=8, num_kv_blocks=24, max_model_len=192)
    assert engine.num_preemptions > 0
    assert check_plans_against_full_hash(engine, seq_ids, reqs, got) > 0  # recomputed positions were checked too


def test_dead_tokens_break_ngrams_across_chunks_and_steps(tiny):
    dead = 777
    ecfg = tiny.engram_config.replace(dead_token_ids=(dead,))
    loaded = dataclasses.replace(tiny, engram_config=ecfg)
    reqs = [p[:10] + [dead] * 3 + p[10:] for p in prompts(6, seed=2)]
    got, engine, seq_ids = run(loaded, reqs, record=True, max_num_seqs=6, max_num_batched_tokens=7)
    assert check_plans_against_full_hash(engine, seq_ids, reqs, got) == 0
    assert any(bool(plan.dead_mask.any()) for plan in engine.lookup.plans)
    solo = [run(loaded, [p], max_num_seqs=1, max_num_batched_tokens=256)[0][0] for p in reqs]
    assert got == solo


def test_paper_variant_conv_state_survives_chunks_and_preemption(tiny_paper):
    reqs = prompts(8, seed=3)
    solo = [run(tiny_paper, [p], max_num_seqs=1, max_num_batched_tokens=256)[0][0] for p in reqs]
    chunked, _, _ = run(tiny_paper, reqs, max_num_seqs=8, max_num_batched_tokens=8)
    squeezed, engine, _ = run(tiny_paper, reqs, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
                              num_kv_blocks=24, max_model_len=192)
    assert engine.num_preemptions > 0
    assert chunked == solo and squeezed == solo


def test_model_without_engram_layers_runs_with_empty_plans(tiny):
    cfg = tiny.model_config.replace(engram=None)
    model = build_model(cfg, F64, CPU)
    init_random_weights(model, 0)
    plain = dataclasses.replace(tiny, model=model, model_config=cfg, engram_config=None, tables={})
    reqs = prompts(5, seed=4)
    solo = [run(plain, [p], max_num_seqs=1)[0][0] for p in reqs]
    got, engine, _ = run(plain, reqs, record=True, max_num_seqs=5, max_num_batched_tokens=16)
    assert got == solo and all(plan.engram_row_ids == {} for plan in engine.lookup.plans)
    assert engine.executor.worker.memory.staging_bytes == 0


@pytest.mark.parametrize("tier,options", [("host", {}), ("disk", {"io": "buffered", "cache_rows": 300})])
def test_same_batches_on_another_tier_give_bitwise_equal_rows_and_tokens(tiny, tier, options):
    other = dataclasses.replace(tiny, tables={}, tier=tier,
                                store_options=StoreOptions().replace(**options))  # the Worker opens them
    reqs = prompts(8, seed=5)
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=32)
    ref, ref_engine, _ = run(tiny, reqs, record=True, **cfg)
    got, engine, _ = run(other, reqs, record=True, **cfg)
    assert got == ref
    assert len(engine.lookup.staged) == len(ref_engine.lookup.staged)
    for a, b, plan in zip(ref_engine.lookup.staged, engine.lookup.staged, engine.lookup.plans):
        for lid in tiny.engram_config.layer_ids:
            ra, rb = a.rows(lid, a.step_id), b.rows(lid, b.step_id)  # [T, n_cols, D] float64
            assert torch.equal(ra.view(torch.uint8), rb.view(torch.uint8))
