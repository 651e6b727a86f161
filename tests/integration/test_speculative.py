"""Speculative decoding through the real engine (tiny model, float64, CPU): outputs with speculation equal those
without — tokens, and every emitted token's logprob within 1e-9 with its top-2 — for the n-gram and the draft-model
proposers, both Engram variants, in batches where drafts are mostly accepted and mostly rejected. Forced continuations
of natural text make the regimes (a draft token is accepted iff it equals the forced token): quoting the prompt (n-gram
drafts accepted), the draft model's own greedy continuation (its drafts accepted), the text's real continuation
(mostly rejected); a greedy request rides along. Mutations that skip the Engram conv-state rewind or the give-back of
rejected positions must break the equality; seeded requests with speculation do not depend on the batch; a prefix
cached by a speculating request serves a later one; DeepSeek-V4 refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine, StepError
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model, save_model
from engram.short_conv import ShortConvState
from tests.engine_runs import assert_verified_in_buckets, drain, preset_variant, verify_graphs_eager

CPU, F64 = torch.device("cpu"), torch.float64
CORPUS = Path(__file__).resolve().parents[2] / "bench" / "corpus" / "natural-v1.jsonl"
K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """v41 (the tiny preset) and the paper variant of the same decoder; a draft checkpoint of other weights."""
    tiny = load_model("tiny", dtype=F64, device=CPU, progress=False)
    other = load_model("tiny", dtype=F64, device=CPU, engram_config={"seed": 1}, progress=False)
    draft_dir = save_model(tmp_path_factory.mktemp("draft") / "tiny-seed1", other)
    return {"v41": tiny, "paper": preset_variant("tiny", "tiny-paper", variant="paper", row_dtype="fp32"),
            "other_draft": str(draft_dir)}


@pytest.fixture(scope="module")
def prose(models):
    """Natural text of the benchmark corpus as token ids: [prompt of 72, its real continuation of 20] x 2."""
    tok = models["v41"].tokenizer
    lines = [json.loads(line) for line in CORPUS.read_text().splitlines()[1:3]]
    ids = [tok.encode(r["prompt"] + r["continuation"]).ids for r in lines]
    return [(x[:72], x[72:92]) for x in ids]


def engine(loaded, spec=None, **options):
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=96, speculative_config=spec)
    return LLMEngine(loaded, EngineConfig(**{**cfg, **options}), CPU, F64)


def run(eng, requests):
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    return drain(eng)


def forced(ids, **kw):
    return SamplingParams(temperature=0.0, max_tokens=len(ids), forced_token_ids=list(ids), ignore_eos=True,
                          logprobs=2, **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)


def assert_same(got, want, tol=1e-9):
    assert set(got) == set(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for i, ((lp, top), (lp2, top2)) in enumerate(zip(logprobs, got[rid][1])):
            assert abs(lp - lp2) <= tol, (rid, i, lp, lp2)
            assert [t for t, _ in top] == [t for t, _ in top2], (rid, i)


def max_logprob_diff(got, want) -> float:
    return max(abs(a[0] - b[0]) for rid in want for a, b in zip(want[rid][1], got[rid][1]))


def requests(models, prose, variant, method, regime):
    """The batch of one case: two forced requests of the regime (and a greedy one where drafts are rejected)."""
    if regime == "accepted" and method == "ngram":  # a summary quoting its prompt: the n-gram drafts are it
        conts = [p[20:40] for p, _ in prose]
    elif regime == "accepted":  # the draft model's own greedy continuation: its drafts are exactly it
        draft = run(engine(load_model("tiny", dtype=F64, device=CPU, progress=False)),
                    {f"d{i}": (p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0))
                     for i, (p, _) in enumerate(prose)})
        conts = [draft[f"d{i}"][0] for i in range(len(prose))]
    else:  # the text's real continuation: mostly not what either proposer guesses
        conts = [c for _, c in prose]
    reqs = {f"f{i}": (p, forced(c)) for i, ((p, _), c) in enumerate(zip(prose, conts))}
    if regime == "rejected":  # the random model's greedy tokens are not what the proposers guess either
        reqs["g"] = (prose[0][0][:40], GREEDY)
    return reqs


def spec_config(models, method, regime):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    model = "tiny" if regime == "accepted" else models["other_draft"]
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K}


@pytest.mark.parametrize("runner", ["eager", "verify-graph"])
@pytest.mark.parametrize("regime", ["accepted", "rejected"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_outputs_with_speculation_equal_those_without(models, prose, variant, method, regime, runner):
    reqs = requests(models, prose, variant, method, regime)
    want = run(engine(models[variant]), reqs)
    eng = engine(models[variant], spec_config(models, method, regime))
    got = run(verify_graphs_eager(eng) if runner == "verify-graph" else eng, reqs)  # VerifyGraphRunner on the CPU
    assert_same(got, want)
    if runner == "verify-graph":
        vg = assert_verified_in_buckets(eng)
        if regime == "rejected":  # n-gram spans and random drafts of every length meet in a bucket
            assert vg["short_seqs"] >= 2 and vg["padded_rows"] >= 4, vg
    s = eng.stats()["speculative"]
    assert s["draft_tokens"] >= 12, s
    if regime == "accepted":
        assert s["acceptance_rate"] >= 0.6 and s["mean_acceptance_length"] >= 2.0, s
    else:
        assert s["acceptance_rate"] <= 0.4, s


@pytest.mark.parametrize("runner", ["eager", "verify-graph"])
def test_skipping_the_conv_state_rewind_breaks_the_paper_variant(models, prose, monkeypatch, runner):
    reqs = requests(models, prose, "paper", "ngram", "rejected")
    want = run(engine(models["paper"]), reqs)
    monkeypatch.setattr(ShortConvState, "rewind", lambda self, dropped: self)  # the state keeps rejected drafts
    eng = engine(models["paper"], spec_config(models, "ngram", "rejected"))
    got = run(verify_graphs_eager(eng) if runner == "verify-graph" else eng, reqs)  # the bucket's static states
    assert max_logprob_diff(got, want) > 1e-6


def test_keeping_rejected_positions_breaks_the_outputs(models, prose, monkeypatch):
    from engram.engine.spec.speculator import Speculator

    reqs = requests(models, prose, "v41", "ngram", "rejected")
    want = run(engine(models["v41"]), reqs)
    commit = Speculator.commit

    def no_give_back(self, seq, start, num_new, num_drafts, accepted):
        seq.num_computed_tokens += num_drafts - accepted  # undo the give-back commit does
        commit(self, seq, start, num_new, num_drafts, accepted)

    monkeypatch.setattr(Speculator, "commit", no_give_back)
    eng = engine(models["v41"], spec_config(models, "ngram", "rejected"))
    try:
        got = run(eng, reqs)
    except StepError as e:  # the next step's chunk runs past the tokens read: the engine refuses it
        assert "unread tokens" in str(e.__cause__) or "invalid" in str(e.__cause__), e
        return
    assert max_logprob_diff(got, want) > 1e-6


def test_seeded_requests_do_not_depend_on_the_batch(models, prose):
    spec = spec_config(models, "draft_model", "accepted")  # drafts: the target's own mode, often accepted
    seeded = SamplingParams(temperature=0.7, top_k=4, seed=1234, max_tokens=24, ignore_eos=True, logprobs=0)
    mine = {"s": (prose[0][0], seeded)}
    solo = engine(models["v41"], spec)
    alone = run(solo, mine)
    drafted = solo.stats()["speculative"]
    assert drafted["draft_tokens"] >= 10 and drafted["accepted_tokens"] >= 3, drafted
    eng = engine(models["v41"], spec)
    crowd = run(eng, {**requests(models, prose, "v41", "ngram", "accepted"), **mine})
    assert crowd["s"][0] == alone["s"][0]
    without = run(engine(models["v41"]), mine)
    assert without["s"][0] != alone["s"][0]  # documented: speculation draws its own randomness


def test_a_prefix_cached_by_a_speculating_request_serves_the_next(models, prose):
    prompt, cont = prose[1]
    spec = spec_config(models, "ngram", "rejected")
    eng = engine(models["v41"], spec)
    run(eng, {"a": (prompt, forced(prompt[30:50]))})
    # b shares a's prompt and its first 16 output tokens: its cached blocks include KV a computed by verify steps
    b = prompt + prompt[30:46]
    got = run(eng, {"b": (b, forced(cont))})
    assert eng.stats()["prefix_cache"]["hit_blocks"] >= 5
    assert_same(got, run(engine(models["v41"], enable_prefix_caching=False), {"b": (b, forced(cont))}))


def test_deepseek_v4_refuses_speculation(tmp_path):
    pytest.importorskip("transformers")
    from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair

    pair = Pair(tmp_path, ENGRAM)
    with pytest.raises(ValueError, match="deepseek_v4 models cannot speculate here: their compressor state"):
        engine(pair.ours, {"method": "ngram", "num_speculative_tokens": 2})


def test_ngram_speculation_across_tensor_parallel_ranks(prose):
    import engram

    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1}
    params = [forced(p[20:40]) for p, _ in prose] + [GREEDY]
    prompts = [p for p, _ in prose] + [prose[0][0][:40]]
    one = engram.LLM("tiny", dtype="float64", device="cpu").generate(prompts, params, use_tqdm=False)
    llm = engram.LLM("tiny", dtype="float64", device="cpu", tensor_parallel_size=2, speculative_config=spec)
    two = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert abs(x.logprob - y.logprob) <= 1e-9
    assert llm.engine.stats()["speculative"]["accepted_tokens"] >= 20
    with pytest.raises(ValueError, match="engine.tensor_parallel_size=2: speculative_config method 'draft_model'"):
        EngineConfig(tensor_parallel_size=2, speculative_config={"method": "draft_model", "model": "tiny",
                                                                 "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tables_read_on_the_host_take_the_verify_rows(models, prose, method):
    # the disk tier reads host ids: n-gram drafts are planned there, a draft model's are copied there from the device
    disk = load_model("tiny", tier="disk", dtype=F64, device=CPU, progress=False)
    for regime in ("accepted", "rejected"):
        reqs = requests(models, prose, "v41", method, regime)
        assert_same(run(engine(disk, spec_config(models, method, regime)), reqs), run(engine(models["v41"]), reqs))


def test_the_plan_covers_every_verify_position(models, prose):
    from engram.engine.lookup import LookupExecutor
    from engram.hashing import NgramHasher
    from tests.engine_runs import engine_wrapping_lookup

    class Recording(LookupExecutor):
        def __init__(self, base):
            super().__init__(base.tables, base.cfg, base.dtype, base.device)
            self.steps = []

        def submit(self, step, *args, **kwargs):
            self.steps.append(step)
            return super().submit(step, *args, **kwargs)

    loaded = models["v41"]
    recorder = []
    eng = engine_wrapping_lookup(loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=96,
                                                      speculative_config=spec_config(models, "ngram", "accepted")),
                                 lambda base: recorder.append(Recording(base)) or recorder[0])
    reqs = requests(models, prose, "v41", "ngram", "accepted")
    got = run(eng, reqs)
    final = [list(prompt) + got[rid][0] for rid, (prompt, _) in reqs.items()]  # seq ids follow arrival order
    hasher = NgramHasher.from_tokenizer(loaded.engram_config, loaded.compressed_tokenizer)
    checked = 0
    for step in recorder[0].steps:
        cu = step.cu_seqlens.tolist()
        for s, k in zip(step.sample_rows, step.num_drafts):
            if not k:
                continue
            start, (a, b) = step.start_positions[s], (cu[s], cu[s + 1])
            full = final[step.seq_ids[s]][:start] + step.token_ids[a:b].tolist()  # read tokens, then the drafts
            ids = torch.tensor([loaded.compressed_tokenizer.compress(full)])
            for lid, rows in step.engram_row_ids.items():
                assert torch.equal(rows[a:b], hasher.hash(ids, lid)[0, start:]), (step.step_id, s, lid)
            checked += k
    assert checked >= 20
    # verify rows shared steps with sequences that did not speculate (a prefill chunk, a decode without a match)
    assert any(step.num_drafts and (0 in step.num_drafts or len(step.sample_rows) < step.num_seqs)
               for step in recorder[0].steps)


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there(models, prose):
    eos = models["v41"].eos_token_id
    prompt = prose[0][0][:30] + [eos] + prose[0][0][30:60]
    quote = prompt[22:40]  # crosses the EOS: the n-gram drafts after it are accepted too, then dropped
    reqs = {"e": (prompt, SamplingParams(temperature=0.0, max_tokens=len(quote), forced_token_ids=quote,
                                         logprobs=1)),
            "s": (prompt, SamplingParams(temperature=0.0, max_tokens=len(quote), forced_token_ids=quote,
                                         ignore_eos=True, stop_token_ids=[quote[12]], logprobs=1))}
    want = run(engine(models["v41"]), reqs)
    eng = engine(models["v41"], spec_config(models, "ngram", "accepted"))
    got = run(eng, reqs)
    assert_same(got, want)
    assert got["e"][0] == quote[:quote.index(eos) + 1] and got["s"][0] == quote[:quote.index(quote[12]) + 1]
    assert eng.stats()["speculative"]["accepted_tokens"] >= 6


def test_drafts_stop_at_max_model_len(models, prose):
    prompt = prose[1][0]
    reqs = {"m": (prompt, forced(prompt[20:40]))}  # 72 + 20 tokens, but max_model_len is 80
    want = run(engine(models["v41"], max_model_len=80), reqs)
    eng = engine(models["v41"], spec_config(models, "ngram", "accepted"), max_model_len=80)
    got = run(eng, reqs)
    assert_same(got, want)
    assert len(got["m"][0]) == 8 and eng.stats()["speculative"]["accepted_tokens"] >= 4


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preemption_under_speculation(models, prose, method):
    reqs = requests(models, prose, "v41", method, "accepted")
    small = dict(max_model_len=128, num_kv_blocks=9)  # two sequences of 6 blocks in 9: preemptions
    want = run(engine(models["v41"], **small), reqs)
    eng = engine(models["v41"], spec_config(models, method, "accepted"), **small)
    got = run(eng, reqs)
    assert_same(got, want)
    assert eng.stats()["preemptions"] >= 1 and eng.stats()["speculative"]["accepted_tokens"] >= 10
