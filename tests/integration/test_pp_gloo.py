"""Pipeline parallelism on the CPU over gloo, with real spawned Worker processes (engine/multiproc.py,
parallel/pp_stage.py, engine/microbatches.py): PP2 and PP2 x TP2 of the tiny model against PP1 in float64 with Engram
layers on both stages (the planner's cut and ENGRAM_PP_LAYER_PARTITION's), a decoder whose layers share KV
(``kv_source_layer_ids``), what each stage allocates, a cut the planner rejects failing before anything loads, and a
killed stage making generate raise in bounded time."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import engram
from engram.engine.multiproc import RankFailed
from engram.model.loader import load_model, random_model, save_model
from engram.model.presets import preset_config
from engram.parallel.pp import PARTITION_ENV, plan_pipeline
from tests.tp_compare import worst_logprob_gap

PROMPTS = ["hello world", "the cat sat on the mat", [5, 17, 17, 300, 2]]
ENGINE = dict(dtype="float64", device="cpu", num_kv_blocks=48, max_model_len=256, max_num_seqs=4)


def _params(max_tokens: int = 6) -> engram.SamplingParams:
    return engram.SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)


def _run(model: str, **options):
    """(outputs of PROMPTS, the engine's most microbatches in flight, each rank's holdings, each stage's counts of
    lookups started early and of relayed sampled-id messages: None without stages) of one LLM."""
    llm = engram.LLM(model, **ENGINE, **options)
    try:
        out = llm.generate(PROMPTS, _params(), use_tqdm=False)
        executor = llm.engine.executor
        stages = executor.stats().get("stages", ())
        early = [{**st["early_lookups"], **st["relay"]} for st in stages] or None
        return out, getattr(llm.engine.pipeline, "max_in_flight", 1), getattr(executor, "holdings", None), early
    finally:
        if hasattr(llm.engine.executor, "close"):
            llm.engine.executor.close()


@pytest.fixture(scope="module")
def pp1():
    return engram.LLM("tiny", **ENGINE)


@pytest.fixture(scope="module")
def want(pp1):
    return pp1.generate(PROMPTS, _params(), use_tqdm=False)


def _assert_every_step_looked_up_once(early: list[dict]) -> None:
    """Each stage took every step's lookups once, started early or at its launch (which of the two depends on timing:
    tests/integration/test_pp_early_lookups.py slows a stage to make the early start certain)."""
    taken = [st["started_early"] + st["submitted_at_launch"] for st in early]
    assert taken[0] == taken[1] >= 1, early


def test_pp2_matches_pp1_with_engram_layers_on_both_stages(pp1, want):
    got, in_flight, holdings, early = _run("tiny", pipeline_parallel_size=2)
    assert worst_logprob_gap(want, got) <= 1e-9
    # two microbatches, and a third launched before the oldest is read (the stages relay its tokens)
    assert in_flight == 3, "the two stages never had a microbatch each"
    _assert_every_step_looked_up_once(early)
    # the last stage relayed every sampling step's ids to the first (straight, not through the engine), and the first
    # took each one (at a step whose tokens were in flight, or at stop)
    assert early[1]["sent"] >= early[0]["received"] >= 1 and early[0]["sent"] == early[1]["received"] == 0, early
    # the planner's cut of tiny (Engram layers 1 and 3 cost 1.5): 2 | 2, one Engram layer a stage
    assert [h["layers"] for h in holdings] == [[0, 1], [2, 3]]
    assert [h["engram_layers"] for h in holdings] == [[1], [3]]
    # every stage allocates only its own layers: KV caches, tables, weights; the embedding on the first stage (and
    # on the last, as the tied LM head), the final norm and LM head on the last
    assert [h["kv_layers"] for h in holdings] == [[0, 1], [2, 3]]
    whole = pp1.engine.stats()["kv_bytes"]
    assert [h["kv_bytes"] for h in holdings] == [whole // 2, whole // 2]
    assert holdings[0]["modules"] == ["embed_tokens"] and holdings[1]["modules"] == ["embed_tokens", "norm", "lm_head"]
    one_layer = pp1.engine.executor.worker.memory.staging_bytes // 2
    assert [h["staging_bytes"] for h in holdings] == [one_layer, one_layer]


def test_each_stage_holds_only_its_parameters(pp1):
    full = {n for n, _ in pp1.loaded.model.named_parameters()}  # tiny's LM head is its embedding (tied)
    for layers in (range(0, 2), range(2, 4)):
        stage = load_model("tiny", dtype="float64", device="cpu", progress=False, layers=layers)
        names = {n for n, _ in stage.model.named_parameters()}
        held = {n for n in full if n.startswith("model.layers.") and int(n.split(".")[2]) in layers}
        held |= {"model.embed_tokens.weight"} | ({"model.norm.weight"} if layers.stop == 4 else set())
        assert names == held, sorted(names ^ held)
        assert list(stage.open_tables()) == [l for l in (1, 3) if l in layers]


def test_pp2_x_tp2_matches_pp1(want):
    got, in_flight, holdings, early = _run("tiny", pipeline_parallel_size=2, tensor_parallel_size=2)
    assert worst_logprob_gap(want, got) <= 1e-9
    assert in_flight == 3
    _assert_every_step_looked_up_once(early)
    assert early[1]["sent"] >= early[0]["received"] >= 1, early  # rank t of the last stage to rank t of the first
    assert [h["layers"] for h in holdings] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # stage-major: rank = 2 * stage + t


def test_partition_from_the_environment(monkeypatch, want):
    monkeypatch.setenv(PARTITION_ENV, "1,3")
    got, _, holdings, _ = _run("tiny", pipeline_parallel_size=2)
    assert worst_logprob_gap(want, got) <= 1e-9
    assert [h["layers"] for h in holdings] == [[0], [1, 2, 3]]
    assert [h["engram_layers"] for h in holdings] == [[], [1, 3]]


def test_pp4_relays_sampled_ids_to_the_first_and_the_engram_stages(monkeypatch, want):
    """A stage a layer: the first (it embeds the tokens) and stage 1 (Engram layer 1) take the relayed ids; stage 2
    (layer 2, no Engram) takes none and gets no tokens in flight; the last (Engram layer 3) sampled them."""
    monkeypatch.setenv(PARTITION_ENV, "1,1,1,1")
    got, in_flight, holdings, relay = _run("tiny", pipeline_parallel_size=4)
    assert worst_logprob_gap(want, got) <= 1e-9
    assert [h["engram_layers"] for h in holdings] == [[], [1], [], [3]]
    assert in_flight == 4  # three microbatches of one sequence, and the oldest's next step
    assert relay[0]["received"] >= 1 and relay[1]["received"] >= 1 and relay[2]["received"] == 0, relay
    assert relay[3]["sent"] >= relay[0]["received"] + relay[1]["received"], relay


# ----------------------------------------------------------------- a decoder whose layers share KV
def _shared_kv_checkpoint(root: Path) -> Path:
    """tiny with kv_source_layer_ids [0, 2] (layer 1 reads layer 0's KV, layer 3 reads layer 2's) as a checkpoint."""
    cfg = preset_config("tiny").replace(kv_source_layer_ids=(0, 2), name="tiny-shared-kv")
    return save_model(root / "tiny-shared-kv", random_model(cfg, progress=False, cache_dir=root / "cache"))


def test_pp2_with_kv_sharing_matches_pp1(tmp_path):
    path = str(_shared_kv_checkpoint(tmp_path))
    cache = str(tmp_path / "cache")
    want_out, _, _, _ = _run(path, cache_dir=cache)
    got, _, holdings, _ = _run(path, cache_dir=cache, pipeline_parallel_size=2)
    assert worst_logprob_gap(want_out, got) <= 1e-9
    assert [h["kv_layers"] for h in holdings] == [[0], [2]]  # the sources only, each on its consumers' stage


def test_a_rejected_cut_fails_before_anything_loads(tmp_path, monkeypatch):
    path = _shared_kv_checkpoint(tmp_path)
    (path / "model.safetensors").write_bytes(b"not weights")  # loading anything would fail differently
    monkeypatch.setenv(PARTITION_ENV, "1,3")  # cuts layer 1 from its KV source, layer 0
    with pytest.raises(NotImplementedError) as planned:
        plan_pipeline(path, 2)
    assert "kv source layer 0 (stage 0) -> layer 1 (stage 1)" in str(planned.value)
    with pytest.raises(NotImplementedError) as refused:
        engram.LLM(str(path), **ENGINE, pipeline_parallel_size=2, cache_dir=str(tmp_path / "cache"))
    assert str(refused.value) == str(planned.value)  # the planner's message, as it is
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(Exception, match="deserializing header"):  # the same start with a legal cut does load
        engram.LLM(str(path), **ENGINE, pipeline_parallel_size=2, cache_dir=str(tmp_path / "cache"))


# ----------------------------------------------------------------- failure
def test_a_killed_stage_makes_generate_raise():
    llm = engram.LLM("tiny", pipeline_parallel_size=2, **ENGINE)
    try:
        llm.generate(PROMPTS[:1], _params(2), use_tqdm=False)
        os.kill(llm.engine.executor.pids[1], signal.SIGKILL)  # the last stage's only rank
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) exited with code -9") as failed:
            llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert time.monotonic() - start < 60
        assert isinstance(failed.value, RankFailed) or isinstance(failed.value.__cause__, RankFailed)
        with pytest.raises(RankFailed):
            llm.engine.executor.stats()
        assert not any(p.is_alive() for p in llm.engine.executor.procs)
    finally:
        llm.engine.executor.close()
