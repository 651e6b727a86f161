"""Async scheduling on the CPU (the bookkeeping is the same as on CUDA, only nothing overlaps): step N+1 is
launched before step N is read, its decode tokens patched in from N's sampled ids, and the outputs and
the Engram row ids of every (sequence, position) equal synchronous scheduling's.

Batch composition differs between the modes (a stopping sequence computes one dropped token, admission
comes a step later), so the comparisons run in float64, as the determinism policy asks.
"""
from __future__ import annotations

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.lookup import LookupExecutor
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import LoadedModel, load_model
from tests.engine_runs import run_with_failing_decodes
from tests.integration.test_engine import tiny_variant

CPU, F64 = torch.device("cpu"), torch.float64


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", dtype=F64, device=CPU, progress=False)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [2, 150, 9, 33, 64, 5, 97, 17, 3, 120, 48, 7, 70, 26, 11, 88][:n]
    return [torch.randint(3, 4096, (length,), generator=g).tolist() for length in lengths]


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy with EOS allowed, stop strings, min_tokens, varied max_tokens, seeded sampling, forced tokens,
    logprobs and prompt logprobs."""
    out = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            out.append(SamplingParams(temperature=0.0, max_tokens=3 + i))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.0, max_tokens=20, stop=["e", "a"], ignore_eos=True))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=7 + i, max_tokens=15, min_tokens=5))
        elif kind == 3:
            out.append(SamplingParams(temperature=0.0, max_tokens=9, forced_token_ids=[5, 6, 7, 8], ignore_eos=True,
                                      logprobs=2))
        elif kind == 4:
            out.append(SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
        else:
            out.append(SamplingParams(temperature=1.0, seed=3, max_tokens=11, ignore_eos=True, logprobs=0))
    return out


class Recorder:
    """Every launched step's final Engram row ids by (sequence id, position), pending rows included, and
    the order of launches and collects (class-level hooks: the Worker keeps its default lookup executor)."""

    def __init__(self, monkeypatch, engine: LLMEngine):
        self.rows: dict[tuple[int, int], list] = {}
        self.events: list[tuple[str, int]] = []
        self.pending_rows = 0
        real_submit = LookupExecutor.submit
        rec = self

        def submit(self, step, patch=None, project=True):
            ids = {lid: (t if patch is None else patch.patched(t, patch.row_ids[lid])) for lid, t in
                   step.engram_row_ids.items()}
            cu = step.cu_seqlens.tolist()
            for s, sid in enumerate(step.seq_ids):
                for t in range(cu[s], cu[s + 1]):
                    key = (sid, int(step.positions[t]))
                    value = [ids[lid][t].tolist() for lid in sorted(ids)]
                    assert rec.rows.setdefault(key, value) == value, f"row ids of {key} changed on recompute"
            rec.pending_rows += len(step.pending_rows)
            return real_submit(self, step, patch, project)

        monkeypatch.setattr(LookupExecutor, "submit", submit)
        ex = engine.executor
        real_launch, real_collect = ex.launch, ex.collect

        def launch(step):
            self.events.append(("launch", step.step_id))
            return real_launch(step)

        def collect(handle):
            self.events.append(("collect", handle.step.step_id))
            return real_collect(handle)

        monkeypatch.setattr(ex, "launch", launch)
        monkeypatch.setattr(ex, "collect", collect)

    def overlapped(self) -> int:
        """Launches that happened while an earlier step was still uncollected."""
        open_steps, count = set(), 0
        for kind, sid in self.events:
            if kind == "launch":
                count += bool(open_steps)
                open_steps.add(sid)
            else:
                open_steps.discard(sid)
        return count


def run(loaded, reqs, params, monkeypatch, async_scheduling: bool, abort_after: dict | None = None, **cfg):
    engine = LLMEngine(loaded, EngineConfig(async_scheduling=async_scheduling, **cfg), CPU, F64)
    rec = Recorder(monkeypatch, engine)
    seq_ids = {}
    for i, ids in enumerate(reqs):
        engine.add_request(f"r{i}", ids, params[i])
        seq_ids[f"r{i}"] = engine._seqs[f"r{i}"].seq_id
    out, steps = {}, 0
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, c.text, c.finish_reason,
                                     [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs or []],
                                     [None if lp is None else (lp.token_id, lp.logprob, lp.top)
                                      for lp in o.prompt_logprobs or []])
        for rid, at in (abort_after or {}).items():
            if steps == at:
                assert engine.abort_request(rid)
    stats = engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every block came back
    assert all(seq.num_pending == 0 for seq in engine._seqs.values())
    by_position = {(rid, pos): rows for rid, sid in seq_ids.items() for (s, pos), rows in rec.rows.items() if s == sid}
    return out, by_position, rec, engine


@pytest.mark.parametrize("squeeze", [False, True], ids=["roomy", "preempting"])
def test_async_outputs_and_row_ids_equal_sync(tiny, monkeypatch, squeeze):
    reqs, params = prompts(16), mixed_params(16)
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64)
    if squeeze:  # 24 blocks of 8 tokens: sequences are preempted and recomputed
        cfg.update(block_size=8, num_kv_blocks=24, max_model_len=192)
    sync_out, sync_rows, _, sync_engine = run(tiny, reqs, params, monkeypatch, False, **cfg)
    monkeypatch.undo()
    async_out, async_rows, rec, engine = run(tiny, reqs, params, monkeypatch, True, **cfg)
    assert async_out == sync_out
    assert {k: async_rows[k] for k in sync_rows} == sync_rows  # every (request, position) sync computed
    assert set(async_rows) >= set(sync_rows)  # async may compute a dropped token past a stop, never fewer
    assert rec.pending_rows > 50 and rec.overlapped() > 20  # it really ran ahead with tokens on the device
    assert {r[2] for r in sync_out.values()} >= {"stop", "length"}
    if squeeze:
        assert engine.num_preemptions > 0 and sync_engine.num_preemptions > 0


def test_async_with_dead_ids_and_the_paper_variant(monkeypatch):
    reqs, params = prompts(8, seed=3), mixed_params(8)
    for loaded in (tiny_variant(dead_token_ids=tuple(range(3, 4096, 5))),
                   tiny_variant(variant="paper", row_dtype="fp32")):
        sync_out, sync_rows, _, _ = run(loaded, reqs, params, monkeypatch, False, max_num_seqs=8,
                                        max_num_batched_tokens=48)
        monkeypatch.undo()
        async_out, async_rows, rec, _ = run(loaded, reqs, params, monkeypatch, True, max_num_seqs=8,
                                            max_num_batched_tokens=48)
        monkeypatch.undo()
        assert async_out == sync_out and {k: async_rows[k] for k in sync_rows} == sync_rows
        assert rec.pending_rows > 0


def test_abort_while_a_token_is_in_flight(tiny, monkeypatch):
    reqs = prompts(4, seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4
    out, _, _, engine = run(tiny, reqs, params, monkeypatch, True, abort_after={"r1": 6, "r3": 9}, max_num_seqs=4)
    monkeypatch.undo()
    alone, _, _, _ = run(tiny, [reqs[0], reqs[2]], [params[0]] * 2, monkeypatch, False, max_num_seqs=4)
    assert set(out) == {"r0", "r2"} and [out["r0"][0], out["r2"][0]] == [alone["r0"][0], alone["r1"][0]]


def test_one_step_prefill_with_max_tokens_1_finishes_in_one_call(tiny):
    engine = LLMEngine(tiny, EngineConfig(async_scheduling=True), CPU, F64)
    for i, p in enumerate(prompts(3)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
    outs = engine.step()  # the next step holds them (their token in flight is their last): nothing is launched
    assert sorted(o.request_id for o in outs if o.finished) == ["r0", "r1", "r2"]
    assert not engine.has_unfinished() and engine.num_steps == 1


def test_a_failing_request_fails_alone_under_async(tiny, monkeypatch):
    reqs = prompts(4, seed=2)
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 4
    engine = LLMEngine(tiny, EngineConfig(async_scheduling=True, max_num_seqs=4), CPU, F64)
    for i, p in enumerate(reqs):
        engine.add_request(f"r{i}", p, params[i])
    out, failed = run_with_failing_decodes(engine, monkeypatch, "r2", len(reqs[2]))
    assert failed == ["r2"] and set(out) == {"r0", "r1", "r3"}
    sync = LLMEngine(tiny, EngineConfig(async_scheduling=False, max_num_seqs=4), CPU, F64)
    for i in (0, 1, 3):
        sync.add_request(f"r{i}", reqs[i], params[i])
    want = {}
    while sync.has_unfinished():
        want.update({o.request_id: o.outputs[0].token_ids for o in sync.step() if o.finished})
    assert out == want


def test_config_refuses_a_value_that_is_not_a_bool():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


def test_workers_that_cannot_take_tokens_in_flight_run_prefill_ahead_and_decode_after_the_read(tiny, monkeypatch):
    """Tables that need host ids (hot-row caches, the disk tier): a step whose inputs include a token still on
    the device waits for the read; chunked prefill steps still run ahead. Same outputs and row ids."""
    reqs = [p for p in prompts(16, seed=8) if len(p) >= 64][:3]  # long prompts: many chunks of 24 tokens
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * len(reqs)
    cfg = dict(max_num_seqs=1, max_num_batched_tokens=24)  # one at a time: chunks without any decode beside them
    want, want_rows, _, _ = run(tiny, reqs, params, monkeypatch, False, **cfg)
    monkeypatch.undo()
    from engram.engine.executor import UniProcExecutor

    monkeypatch.setattr(UniProcExecutor, "takes_pending_tokens", lambda self: False)
    got, rows, rec, _ = run(tiny, reqs, params, monkeypatch, True, **cfg)
    assert got == want and {k: rows[k] for k in want_rows} == want_rows
    assert rec.pending_rows == 0  # no step carried a token still on the device
    assert rec.overlapped() > 5  # prefill chunks were launched before the step before them was read


@pytest.mark.parametrize("squeeze", [False, True], ids=["roomy", "preempting"])
def test_a_step_that_fails_when_read_is_rerun_and_the_step_after_it_dropped(tiny, monkeypatch, squeeze):
    from engram.engine.worker import Worker

    reqs, params = prompts(8, seed=6), [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 8
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=48)
    if squeeze:
        cfg.update(block_size=8, num_kv_blocks=24, max_model_len=192)
    want, _, _, sync = run(tiny, reqs, params, monkeypatch, False, **cfg)
    assert sync.num_preemptions > 0 or not squeeze
    monkeypatch.undo()
    real, failed_at = Worker.collect, []

    def collect(self, launched):
        if launched.step.step_id in (5, 11, 17) and launched.step.step_id not in failed_at:
            failed_at.append(launched.step.step_id)  # each of these fails once, when read
            raise RuntimeError("planted device error")
        return real(self, launched)

    monkeypatch.setattr(Worker, "collect", collect)
    got, _, rec, engine = run(tiny, reqs, params, monkeypatch, True, **cfg)
    assert failed_at == [5, 11, 17] and got == want
    assert rec.overlapped() > 10 and (engine.num_preemptions > 0 or not squeeze)


@pytest.mark.parametrize("options", [{"io": "buffered"}, {"io": "buffered", "cache_rows": 300}],
                         ids=["disk", "disk-cache"])
def test_host_read_tables_take_tokens_in_flight(tmp_path, monkeypatch, options):
    """The disk tier (with and without a hot-row cache) reads its rows on the host: under async scheduling the
    Worker's launch reads the patched row ids of a step with tokens still in flight on the host
    (LookupExecutor._host_ids) and submits them like any host ids. Same outputs and row ids as synchronous
    scheduling, and decode steps did carry tokens in flight (they were not read first)."""
    import dataclasses

    from engram.store.options import StoreOptions

    base = load_model("tiny", dtype=F64, device=CPU, cache_dir=tmp_path, progress=False)
    disk = dataclasses.replace(base, tables={}, tier="disk", store_options=StoreOptions().replace(**options))
    reqs, params = prompts(6, seed=11), mixed_params(6)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=40)
    want, want_rows, _, _ = run(disk, reqs, params, monkeypatch, False, **cfg)
    monkeypatch.undo()
    real, resolved = LookupExecutor._host_ids, []

    def host_ids(self, step, patch):
        resolved.append(len(step.pending_rows))
        return real(self, step, patch)

    monkeypatch.setattr(LookupExecutor, "_host_ids", host_ids)
    got, rows, rec, engine = run(disk, reqs, params, monkeypatch, True, **cfg)
    assert got == want and {k: rows[k] for k in want_rows} == want_rows  # a stop computes one more, dropped
    assert sum(resolved) == rec.pending_rows > 0  # every token in flight was resolved on the host
    assert rec.pending_rows > 0 and rec.overlapped() > 5
    assert engine.executor.takes_pending_tokens()
