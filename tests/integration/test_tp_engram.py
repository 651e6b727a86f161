"""Engram under tensor parallelism on the CPU over gloo, with real spawned processes: tables sharded by hash column
(parallel/engram_tp.py) give rows bitwise equal to the whole table's on every tier, with N not dividing the columns
(the all-gather padded); each rank holds only its columns' rows; column-parallel WKV (parallel/wkv_column.py) equals
TP1 in float64; sampled ids are rank 0's on every rank; one rank's lookups delayed by 10 ms change nothing."""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engram
from engram.engine.engine import LLMEngine
from engram.engine.config import EngineConfig
from engram.engine.multiproc import MultiprocExecutor, RankSpec, free_port
from engram.model.loader import load_model
from engram.model.presets import preset_config
from engram.parallel import engram_tp
from tests.tp_compare import worst_logprob_gap

PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(dtype="float64", device="cpu", num_kv_blocks=48, max_model_len=256, max_num_seqs=4)


def _params(max_tokens: int = 6, temperature: float = 0.0) -> engram.SamplingParams:
    return engram.SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1():
    return engram.LLM("tiny", **ENGINE)


# ----------------------------------------------------------------- rows, rank by rank
def _rows_rank(rank: int, world: int, port: int, tier: str, in_memory: bool, results) -> None:
    """One rank: open its column shards of tiny's tables, gather hashed ids of every column, compare with the whole
    table's gather byte for byte (a mismatch or error is sent back)."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        opts = {"tables_in_memory": True} if in_memory else None
        whole = load_model("tiny", tier=tier, dtype=torch.float32, device="cpu", engram_config=opts, progress=False)
        sharded = load_model("tiny", tier=tier, dtype=torch.float32, device="cpu", engram_config=opts, progress=False)
        shards = engram_tp.open_column_shards(sharded, rank, world, dist.group.WORLD)
        full = whole.open_tables()
        cfg = whole.engram_config
        hasher = engram.NgramHasher.from_tokenizer(cfg, whole.compressed_tokenizer)
        ids = torch.randint(0, 4096, (1, 37), generator=torch.Generator().manual_seed(7))
        report = {}
        for lid in cfg.layer_ids:
            rows_ids = hasher.hash(whole.compressed_tokenizer(ids), lid).reshape(-1)  # [T * n_cols]
            want = full[lid].gather(rows_ids, dtype=torch.float32)
            got = shards[lid].gather(rows_ids, dtype=torch.float32)
            later = shards[lid].submit(rows_ids, dtype=torch.float32).wait()  # the deferred path
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"layer {lid}: gather differs"
            assert torch.equal(later.view(torch.uint8), want.view(torch.uint8)), f"layer {lid}: submit differs"
            lo, hi = engram_tp.column_rows(cfg, lid, engram_tp.column_split(cfg.n_cols, world)[rank])
            report[lid] = (shards[lid].table.rows, hi - lo, full[lid].rows)
        results.put((rank, "ok", report))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("tier,in_memory,world", [("gpu", False, 3), ("host", False, 3), ("disk", False, 3),
                                                   ("gpu", True, 3), ("disk", False, 2)])
def test_column_shards_give_whole_table_rows(tier, in_memory, world):
    """tiny has 8 columns a layer: over 3 ranks 2 + 3 + 3, the all-gather padded to 3."""
    load_model("tiny", tier="disk" if not in_memory else "gpu", progress=False)  # the whole tables, made once here
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rows_rank, args=(r, world, port, tier, in_memory, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [g[1] for g in got] == ["ok"] * world, got
    cfg = preset_config("tiny").engram
    for lid in cfg.layer_ids:
        owned = [g[2][lid][0] for g in got]
        assert owned == [g[2][lid][1] for g in got], "a rank's table holds exactly its columns' rows"
        assert sum(owned) == sum(cfg.primes(lid)) <= got[0][2][lid][2]


def test_column_split_is_balanced_and_padded():
    assert engram_tp.column_split(8, 3) == [range(0, 2), range(2, 5), range(5, 8)]
    assert [len(c) for c in engram_tp.column_split(24, 16)] == [1, 2] * 8  # every rank owns a column
    with pytest.raises(ValueError, match="n_cols=8 hash columns over tensor_parallel_size=9"):
        engram_tp.column_split(8, 9)
    # one prime base: each rank's rows within 1 % of 1/N (8b-like), 0.01 % at V4.1's 16 M base
    for cfg, spread in ((preset_config("8b-like").engram, 1.01), (engram.EngramConfig.preset("deepseek-v4.1-flash"),
                                                                   1.0001)):
        for world in (2, 4, 8):
            for lid in cfg.layer_ids:
                rows = [engram_tp.column_rows(cfg, lid, c) for c in engram_tp.column_split(cfg.n_cols, world)]
                sizes = [hi - lo for lo, hi in rows]
                assert rows[0][0] == 0 and rows[-1][1] == sum(cfg.primes(lid))
                assert max(sizes) / min(sizes) < spread, (world, sizes)


# ----------------------------------------------------------------- whole engines
@pytest.mark.parametrize("world,tier,wkv", [(2, "gpu", "column"), (4, "gpu", "column"), (2, "disk", "replicated"),
                                            (2, "disk", "column")])
def test_tp_with_sharded_tables_matches_tp1(tp1, world, tier, wkv):
    llm = engram.LLM("tiny", tier=tier, tensor_parallel_size=world, engram_config={"wkv_tp": wkv}, **ENGINE)
    try:
        got = llm.generate(PROMPTS, _params(), use_tqdm=False)
        ranks = llm.engine.executor.rank_bytes
        tables = llm.engine.executor.table_bytes
    finally:
        llm.engine.executor.close()
    assert worst_logprob_gap(tp1.generate(PROMPTS, _params(), use_tqdm=False), got) <= 1e-9
    full_wkv = engram.parallel.tp.parameter_bytes(tp1.loaded.model)["wkv"]
    for b in ranks:  # column-parallel: each rank holds 1/N of every wkv; replicated: all of it
        assert b["wkv"] * (world if wkv == "column" else 1) == full_wkv, (b, full_wkv)
    cfg = tp1.loaded.engram_config
    for lid in cfg.layer_ids:  # the ranks' table bytes add up to the columns' rows: nothing held twice
        assert sum(t[lid] for t in tables) == sum(cfg.primes(lid)) * cfg.row_bytes


def test_sampled_ids_are_rank_zeros_on_every_rank(tp1):
    """Unseeded temperature 1: rank 0 samples, the others take its ids from the in-step broadcast."""
    llm = engram.LLM("tiny", tensor_parallel_size=2, **ENGINE)
    try:
        got = llm.generate(PROMPTS, _params(8, temperature=1.0), use_tqdm=False)
        per_rank = llm.engine.executor.sampled()
    finally:
        llm.engine.executor.close()
    assert len(per_rank) == 2 and per_rank[0] and per_rank[1] == per_rank[0]
    emitted = sorted(t for o in got for t in o.outputs[0].token_ids)
    assert sorted(t for step in per_rank[0] for t in step) == emitted  # every emitted token went through it


@dataclass(frozen=True)
class SlowRank:
    """``RankSpec.before_lookup``: delay rank ``rank``'s every local table read by ``seconds``."""

    rank: int
    seconds: float

    def __call__(self, rank: int, layer_id: int) -> None:
        if rank == self.rank:
            time.sleep(self.seconds)


@pytest.mark.parametrize("tier", ["gpu", "disk"])
def test_one_rank_with_delayed_lookups_gives_the_same_tokens(tp1, tier):
    cfg = EngineConfig(**{k: v for k, v in ENGINE.items() if k not in ("dtype", "device")}, tensor_parallel_size=2)
    loaded = load_model("tiny", tier=tier, dtype=torch.float64, device="cpu", progress=False)
    spec = RankSpec("tiny", tier, torch.float64, engram.model.options.RuntimeOptions(), None, cfg, 256,
                    f"tcp://127.0.0.1:{free_port()}", 1, before_lookup=SlowRank(1, 0.010))
    executor = MultiprocExecutor(spec)
    try:
        engine = LLMEngine(loaded, cfg, torch.device("cpu"), torch.float64, executor=executor)
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, _params())
        start, done = time.monotonic(), {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            assert time.monotonic() - start < 60, "no progress: a collective hangs"
    finally:
        executor.close()
    want = tp1.generate(PROMPTS, _params(), use_tqdm=False)
    assert worst_logprob_gap(want, [done[f"r{i}"] for i in range(len(PROMPTS))]) <= 1e-9


def test_bad_wkv_layouts_are_refused():
    with pytest.raises(ValueError, match="wkv_tp='rows'"):
        engram.model.options.RuntimeOptions.from_dict({"wkv_tp": "rows"})
    from engram.module import Engram
    from engram.parallel.wkv_column import ColumnParallelEngram

    paper = engram.EngramConfig.preset("tiny").replace(variant="paper")
    with pytest.raises(ValueError, match="'paper' variant; column-parallel WKV exists for 'v41' only"):
        ColumnParallelEngram(Engram(paper, 1), 0, 2, None)
    with pytest.raises(ValueError, match="hidden_size=64 does not divide over tensor_parallel_size=3"):
        ColumnParallelEngram(Engram(engram.EngramConfig.preset("tiny"), 1), 0, 3, None)
