"""Engine API on the tiny model: stop conditions, ignore_eos, streaming deltas, abort, limits and clear
errors at start, ``engram.LLM.generate`` with text and token ids, and the ``engram generate`` command."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import engram
from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.lookup import LookupExecutor
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import LoadedModel, load_model
from tests.engine_runs import engine_wrapping_lookup

CPU = torch.device("cpu")
PROMPT = "The table store serves rows"


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny", dtype=torch.float32, device=CPU, progress=False)


def engine_for(loaded: LoadedModel, **cfg) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(**cfg), CPU, loaded.dtype)


def drain(engine: LLMEngine) -> dict[str, list]:
    """Run to completion; every RequestOutput of every step, per request."""
    seen: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def complete(loaded, prompt, params, **cfg):
    engine = engine_for(loaded, **cfg)
    engine.add_request("x", prompt, params)
    return drain(engine)["x"][-1].outputs[0]


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy 24 tokens of PROMPT, ignoring EOS."""
    return complete(tiny, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))


def test_streaming_deltas_add_up_and_max_tokens_gives_length(tiny, reference):
    engine = engine_for(tiny)
    engine.add_request("s", PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    outs = drain(engine)["s"]
    assert len(outs) == 24 and [o.finished for o in outs] == [False] * 23 + [True]
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and final.token_ids == reference.token_ids
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text == reference.text
    assert sum((o.outputs[0].delta_token_ids for o in outs), []) == final.token_ids
    assert outs[-1].prompt == PROMPT and outs[-1].prompt_token_ids == tiny.tokenizer.encode(PROMPT).ids
    m = outs[-1].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_eos_stops_unless_ignore_eos(tiny, reference):
    toks = reference.token_ids
    k = next(i for i in range(5, len(toks)) if toks[i] not in toks[:i])  # first occurrence at position k
    as_eos = dataclasses.replace(tiny, eos_token_id=toks[k])
    stopped = complete(as_eos, PROMPT, SamplingParams(temperature=0.0, max_tokens=24))
    assert stopped.token_ids == toks[: k + 1] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = complete(as_eos, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert ignored.token_ids == toks and ignored.finish_reason == "length"
    late = complete(as_eos, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=k + 1))
    assert late.token_ids[:k] == toks[:k] and toks[k] not in late.token_ids[: k + 1]


def test_stop_token_ids(tiny, reference):
    toks = reference.token_ids
    k = next(i for i in range(3, len(toks)) if toks[i] not in toks[:i])
    out = complete(tiny, PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[toks[k]]))
    assert out.token_ids == toks[: k + 1] and out.finish_reason == "stop" and out.stop_reason == toks[k]


def test_stop_string_cuts_text_and_never_streams(tiny, reference):
    text = reference.text
    start = len(text) // 2
    stop = text[start:start + 3]
    assert stop.strip()
    cut = text.index(stop)
    engine = engine_for(tiny)
    engine.add_request("s", PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop, "never-seen"]))
    outs = drain(engine)["s"]
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:cut]
    assert "".join(o.outputs[0].delta_text for o in outs) == text[:cut]
    assert final.token_ids == reference.token_ids[: len(final.token_ids)] and len(final.token_ids) < 24


def test_max_model_len_ends_generation_and_rejects_long_prompts(tiny):
    ids = tiny.tokenizer.encode(PROMPT).ids
    out = complete(tiny, ids, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                   max_model_len=len(ids) + 5)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    engine = engine_for(tiny, max_model_len=len(ids))
    with pytest.raises(ValueError, match=f"prompt of {len(ids)} tokens .* max_model_len={len(ids)}"):
        engine.add_request("long", ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("bad", [5, 99999])
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        engine_for(tiny, max_model_len=10**6)


def test_memory_budget_too_small_fails_at_start(tiny):
    with pytest.raises(ValueError, match=r"KV memory too small: engine.kv_cache_memory=3000000 bytes minus "
                                         r"Engram staging \d+ .*max_model_len=2048 needs 128 blocks"):
        engine_for(tiny, kv_cache_memory=3_000_000)
    with pytest.raises(ValueError, match="num_kv_blocks=3.*needs 4 blocks"):
        engine_for(tiny, num_kv_blocks=3, max_model_len=64)
    fits = engine_for(tiny, kv_cache_memory=16_000_000, max_model_len=512)
    m = fits.executor.worker.memory
    assert (m.num_blocks * m.bytes_per_block + m.staging_bytes <= 16_000_000
            < (m.num_blocks + 1) * m.bytes_per_block + m.staging_bytes)


def test_abort_frees_blocks_and_silences_the_request(tiny):
    engine = engine_for(tiny, max_num_batched_tokens=64)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPT + " " + rid, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    engine.step()
    held = len(engine._seqs["b"].block_table)
    free = engine.stats()["kv_blocks_free"]
    assert engine.abort_request("b") and not engine.abort_request("b") and not engine.abort_request("zzz")
    assert engine.stats()["kv_blocks_free"] == free + held
    rest = drain(engine)
    assert set(rest) == {"a", "c"} and all(len(v[-1].outputs[0].token_ids) == 8 for v in rest.values())
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    engine.add_request("x", PROMPT)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("x", PROMPT)


@pytest.fixture(scope="module")
def llm():
    return engram.LLM(model="tiny", engram_config={"lookup_overlap": False}, max_num_seqs=8)


def test_llm_generate_text_and_token_ids_in_order(llm):
    params = engram.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello there").ids
    outs = llm.generate(["Hello there", "A longer prompt about tables", ids, {"prompt_token_ids": ids}], params,
                        use_tqdm=False)
    assert [o.prompt for o in outs[:2]] == ["Hello there", "A longer prompt about tables"]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    assert outs[0].prompt == "Hello there" and outs[2].prompt is None
    assert all(len(o.outputs[0].token_ids) == 6 and o.finished for o in outs)
    single = llm.generate("Hello there", params, use_tqdm=False)
    assert single[0].outputs[0].text == outs[0].outputs[0].text
    assert llm.dtype == (torch.bfloat16 if torch.cuda.is_available() else torch.float32) and llm.tier == "gpu"
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [params, params], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt of 3000 tokens"):
        llm.generate(["fine", [5] * 3000], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # the good prompt of the failed call was dropped too


def test_llm_options_are_validated():
    with pytest.raises(ValueError, match="unknown engine option"):
        engram.LLM(model="tiny", max_num_seq=4)
    with pytest.raises(ValueError, match="engram_config.lookup_overlap"):
        engram.LLM(model="tiny", engram_config={"lookup_overlap": "yes"})
    with pytest.raises(ValueError, match=r"engram_config has unknown key\(s\) \['wkv_run_ahead'\]"):
        engram.LLM(model="tiny", engram_config={"wkv_run_ahead": True})  # a deleted option: refused by name
    with pytest.raises(ValueError, match="dtype='float8'"):
        engram.LLM(model="tiny", dtype="float8")


def test_cli_generate_prints_completions_and_throughput(tmp_path, capsys):
    from engram.cli import main

    f = tmp_path / "prompts.txt"
    f.write_text("First prompt\n\nSecond prompt\n", encoding="utf-8")
    rc = main(["generate", "tiny", "--prompt", "Hello", "--prompts-file", str(f), "--max-tokens", "5",
               "--ignore-eos", "--json", "--no-progress", "--engram-config", '{"cpu_offload": true}'])
    assert rc == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert [x["prompt"] for x in lines[:-1]] == ["Hello", "First prompt", "Second prompt"]
    assert all(len(x["token_ids"]) == 5 and x["finish_reason"] == "length" for x in lines[:-1])
    summary = lines[-1]["summary"]
    assert summary["tier"] == "host" and summary["requests"] == 3 and summary["generated_tokens"] == 15
    assert summary["output_tokens_per_s"] > 0
    assert main(["generate", "tiny", "--no-progress"]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert main(["generate", "tiny", "--prompt", "x", "--engram-config", "{bad"]) == 2
    assert "--engram-config: not valid JSON" in capsys.readouterr().err


class FailingLookups(LookupExecutor):
    """The real lookup executor (a Worker's ``wrap_lookup``), except for the steps it is told to fail like a
    table read error would: the next step submitted (``fail_next``), every step holding sequence ``fail_seq``."""

    def __init__(self, base: LookupExecutor, fail_next: bool = False):
        super().__init__(base.tables, base.cfg, base.dtype, base.device)
        self.fail_next, self.fail_seq = fail_next, None

    def submit(self, step, *args, **kwargs):
        if self.fail_next:
            self.fail_next = False
            raise OSError("pread failed at offset 4096 of values.bin")
        if self.fail_seq is not None and self.fail_seq in step.seq_ids:
            raise OSError("CRC mismatch in page at offset 8192 of values.bin")
        return super().submit(step, *args, **kwargs)


def test_failed_step_names_its_requests_and_can_be_retried(tiny, reference):
    engine = engine_wrapping_lookup(tiny, EngineConfig(), lambda base: FailingLookups(base, fail_next=True), CPU)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    with pytest.raises(OSError, match="offset 4096") as err:
        engine.step()
    assert err.value.request_ids == ["a"]
    out = drain(engine)["a"][-1].outputs[0]  # nothing was committed by the failed step
    assert out.token_ids == reference.token_ids
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_a_failing_request_does_not_fail_the_others_batched_with_it(tiny):
    from engram.engine.engine import StepError

    engine = engine_wrapping_lookup(tiny, EngineConfig(max_num_batched_tokens=64), FailingLookups, CPU)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for rid in ("a", "b", "c"):
        engine.add_request(rid, PROMPT + " " + rid, params)
    engine.executor.worker.lookup.fail_seq = engine._seqs["b"].seq_id
    with pytest.raises(StepError, match="offset 8192") as err:
        engine.step()  # one batch of three: re-run in halves, only b fails
    assert err.value.request_ids == ["b"] and sorted(o.request_id for o in err.value.outputs) == ["a", "c"]
    assert engine.abort_request("b")
    rest = drain(engine)
    assert all(len(rest[r][-1].outputs[0].token_ids) == 5 for r in ("a", "c"))
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_llm_generate_drops_its_requests_when_a_step_fails(llm):
    params = engram.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ref = llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0].token_ids
    real = llm.engine
    llm.engine = engine_wrapping_lookup(llm.loaded, real.config, FailingLookups, llm.device, llm.dtype)
    failing = llm.engine.executor.worker.lookup
    try:
        failing.fail_next = True
        with pytest.raises(OSError, match="offset 4096"):
            llm.generate(["Hello there"], params, use_tqdm=False)
        assert not llm.engine.has_unfinished()  # nothing left to run inside the next call
        assert llm.engine.stats()["kv_blocks_free"] == llm.engine.stats()["kv_blocks_total"]
        failing.fail_seq = next(iter(llm.engine._seq_ids)) + 1  # the second prompt's sequence
        with pytest.raises(RuntimeError, match="offset 8192"):
            llm.generate(["Hello there", "Another one"], params, use_tqdm=False)
        assert not llm.engine.has_unfinished()
        assert llm.engine.stats()["kv_blocks_free"] == llm.engine.stats()["kv_blocks_total"]
        failing.fail_seq = None
        outs = llm.generate(["Hello there"], params, use_tqdm=False)
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == ref
    finally:
        llm.engine = real


def test_kv_budget_counts_hot_row_cache_and_only_kv_source_layers(tiny):
    budget = dict(kv_cache_memory=24_000_000, max_model_len=256)
    plain = engram.LLM(model="tiny", tier="disk", engram_config={"io": "buffered"}, **budget)
    cached = engram.LLM(model="tiny", tier="disk", engram_config={"io": "buffered", "cache_rows": 20_000}, **budget)
    caches = [t.cache for t in cached.loaded.tables.values()]  # opened by the engine's Worker
    assert all(c is not None and c.capacity > 0 for c in caches)
    plain, cached = plain.engine.executor.worker.memory, cached.engine.executor.worker.memory
    assert cached.cache_bytes == sum(c.nbytes for c in caches) > 0 and plain.cache_bytes == 0
    assert cached.num_blocks == (24_000_000 - cached.staging_bytes - cached.cache_bytes) // cached.bytes_per_block
    assert cached.num_blocks < plain.num_blocks
    from engram.model.loader import build_model
    from engram.model.presets import init_random_weights

    cfg = tiny.model_config.replace(kv_source_layer_ids=(0, 2))  # layers 1 and 3 read 0 and 2
    model = build_model(cfg, torch.float32, CPU)
    init_random_weights(model, 0)
    shared = dataclasses.replace(tiny, model=model, model_config=cfg)
    engine = engine_for(shared, **budget)
    full = engine_for(tiny, **budget)
    engine, full = engine.executor.worker, full.executor.worker
    assert engine.kv.layers == (0, 2) and engine.memory.bytes_per_block * 2 == full.memory.bytes_per_block
    out = complete(shared, PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), **budget)
    assert len(out.token_ids) == 6


def test_unknown_engram_config_key_is_refused_before_loading():
    import engram

    with pytest.raises(ValueError, match=r"unknown key\(s\) \['cache_row'\]"):
        engram.LLM(model="tiny", engram_config={"cache_row": 10})


def test_llm_generate_n_choices_seeded_per_choice(llm):
    params = engram.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate(["Hello there", "Another"], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [0, 1, 2]
    alone = llm.generate(["Hello there"], engram.SamplingParams(temperature=1.0, seed=8, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert out[0].outputs[1].token_ids == alone  # choice j is the request with seed + j
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    with pytest.raises(ValueError, match="SamplingParams.n=2: the engine runs one sequence per request"):
        llm.engine.add_request("x", "Hello", engram.SamplingParams(n=2))
