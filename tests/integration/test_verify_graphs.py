"""Verify steps through the verify graphs' static inputs on the CPU (engine/runners/verify_inputs.py, verify_graphs.py):
the real VerifyGraphRunner with ``capture=False`` runs what a verify graph holds — S_b x (K + 1) rows, each a decode
query with its position's KV length, padding in the null block, the bucket's static conv states — eagerly, so an
engine running its verify steps that way must give the outputs without speculation: greedy tokens exactly, every
emitted token's logprob within 1e-9 and its top-2, in float64, tiny and small, both Engram variants, greedy drafts of
every length 0..K in one bucket (both proposers, both regimes, both variants on tiny: test_speculative.py's
``test_outputs_with_speculation_equal_those_without[...-verify-graph]``). A
crafted request rejects a draft, then accepts every draft of a later step. Mutations — the rewind counting a
sequence's own drafts instead of the bucket's K (its padding kept), the LM-head rows ignoring the padding; the conv
state not rewound at all: tests/integration/test_speculative.py — must break the equality. The graphs themselves:
tests/gpu/test_speculative_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engram.engine.runners.verify_inputs import VerifyInputs
from engram.engine.sampling_params import SamplingParams
from engram.engine.step import SampleSpec, StepDescription
from engram.model.loader import load_model
from tests.engine_runs import assert_verified_in_buckets, preset_variant, verify_graphs_eager
from tests.integration.test_speculative import (CPU, F64, K, assert_same, engine, max_logprob_diff, prose,  # noqa: F401
                                                requests, run, spec_config)


@pytest.fixture(scope="module")
def models():
    tiny = load_model("tiny", dtype=F64, device=CPU, progress=False)
    return {"v41": tiny, "paper": preset_variant("tiny", "tiny-paper", variant="paper", row_dtype="fp32")}


def verify_engine(loaded, spec, **options):
    return verify_graphs_eager(engine(loaded, spec, **options))


def test_greedy_requests_with_drafts_of_every_length(models, prose):
    """Greedy requests only; the draft model is the target itself, so its drafts are accepted up to its K, while the
    n-gram proposer's spans are short or missing: lengths 0..K in the same buckets."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    reqs = {f"g{i}": (p[:30 + 7 * i], greedy) for i, (p, _) in enumerate(prose * 2)}
    for spec in ({"method": "draft_model", "model": "tiny", "num_speculative_tokens": K},
                 {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 2, "prompt_lookup_min": 1}):
        want = run(engine(models["v41"]), reqs)
        eng = verify_engine(models["v41"], spec)
        assert_same(run(eng, reqs), want)
        assert_verified_in_buckets(eng)


def _crafted():
    """x1..x30 then x1..x6 (K = 3, prompt lookup n = 1..3): the prefill emits x7; step 2 drafts x8 x9 x10, the forced
    continuation accepts x8 and rejects x9 (it emits y); step 3 has no match for y, no drafts: x11; step 4 matches x11
    and drafts x12 x13 x14, all accepted, then the bonus x15."""
    x = list(range(101, 131))
    prompt = x + x[:6]
    y = 900
    forced = [x[6], x[7], y, x[10], x[11], x[12], x[13], x[14]]
    return prompt, forced


@pytest.mark.parametrize("variant", ["v41", "paper"])
def test_a_rejected_draft_then_a_full_accept(models, variant):
    prompt, forced = _crafted()
    params = SamplingParams(temperature=0.0, max_tokens=len(forced), forced_token_ids=forced, ignore_eos=True,
                            logprobs=2)
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    eng = verify_engine(models[variant], spec)
    eng.add_request("c", prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o.outputs[0] for o in eng.step()]
    final = outs[-1]
    assert np.diff([0] + [len(o.token_ids) for o in outs]).tolist() == [1, 2, 1, 4]
    assert [r.route for r in eng.step_trace()] == ["eager", "verify-graph", "eager", "verify-graph"]
    assert eng.stats()["speculative"]["accepted_at"] == [2, 1, 1]  # step 2: draft 1; step 4: drafts 1..3
    want = run(engine(models[variant]), {"c": (prompt, params)})["c"]
    assert_same({"c": (final.token_ids, [(lp.logprob, lp.top) for lp in final.logprobs])}, {"c": want})


def _breaks(models, prose, variant, monkeypatch, mutations: dict) -> None:
    """With ``mutations`` ({VerifyInputs method name: replacement}) the verify runner's outputs differ from those
    without speculation."""
    reqs = requests(models, prose, variant, "ngram", "rejected")
    want = run(engine(models[variant]), reqs)
    for name, fn in mutations.items():
        monkeypatch.setattr(VerifyInputs, name, fn)
    got = run(verify_engine(models[variant], spec_config(models, "ngram", "rejected")), reqs)
    assert max_logprob_diff(got, want) > 1e-6 or any(got[r][0] != want[r][0] for r in want)


def test_keeping_the_padding_in_the_conv_state_breaks_the_paper_variant(models, prose, monkeypatch):
    holder, fill = {}, VerifyInputs.fill

    def remember(self, step, patch):
        holder["drafts"] = list(step.num_drafts)
        return fill(self, step, patch)

    def own_drafts(self, size, accepted):  # the bug: each sequence's own k - accepted, its padding rows kept
        out = torch.zeros(size // self.rows_per_seq, dtype=torch.long)
        out[:accepted.numel()] = torch.tensor(holder["drafts"]) - accepted
        return out

    _breaks(models, prose, "paper", monkeypatch, {"fill": remember, "dropped": own_drafts})


def test_lm_head_rows_ignoring_the_padding_break_the_outputs(models, prose, monkeypatch):
    fill = VerifyInputs.fill

    def every_row(self, step, patch):  # the bug: the bucket's rows in order, padding included
        size = fill(self, step, patch)
        self.logits_rows[:size].copy_(self.arange[:size])
        return size

    _breaks(models, prose, "v41", monkeypatch, {"fill": every_row})


def test_small_preset_both_variants(prose):
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    for loaded in (preset_variant("small", "small-v41"),
                   preset_variant("small", "small-paper", variant="paper", row_dtype="fp32")):
        reqs = {"q": (prose[0][0][:40], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2,
                                                       forced_token_ids=prose[0][0][20:29])),
                "g": (prose[1][0][:24], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2))}
        # the CPU's attention reference pads each verify row's KV to max_model_len: keep it short
        want = run(engine(loaded, max_model_len=256), reqs)
        eng = verify_engine(loaded, spec, max_model_len=256)
        assert_same(run(eng, reqs), want)
        assert eng.stats()["verify_graph"]["replays"] >= 2 and eng.stats()["speculative"]["accepted_tokens"] >= 4


def _verify_step(starts: list[int], drafts: list[int], block_size: int = 4) -> StepDescription:
    """A verify step: sequence s (block table [10s, 10s+1, ...]) feeds its last token and drafts[s] drafts at
    starts[s].. (token ids 1000*s + position)."""
    q = [k + 1 for k in drafts]
    pos = [p for s0, n in zip(starts, q) for p in range(s0, s0 + n)]
    seq = [s for s, n in enumerate(q) for _ in range(n)]
    tables = torch.tensor([[10 * s + b for b in range(8)] for s in range(len(q))])
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size for s, p in zip(seq, pos)]
    spec = SampleSpec(0.0, 1.0, 0, None, 0, (), -1, -1)
    return StepDescription(
        7, list(range(len(q))), list(starts), q, torch.tensor([1000 * s + p for s, p in zip(seq, pos)]),
        torch.tensor(pos), torch.tensor([0, *np.cumsum(q)]), torch.tensor([s0 + n for s0, n in zip(starts, q)]),
        tables, torch.tensor(slots), None, {1: torch.tensor([[s, p] for s, p in zip(seq, pos)])},
        list(range(len(q))), [spec] * sum(q), num_drafts=list(drafts))


def test_the_bucket_layout_pads_and_masks_short_drafts():
    io = VerifyInputs(max_batch=8, num_speculative_tokens=3, max_model_len=32, block_size=4, null_block=99, n_cols=2,
                      row_layers=[1], device=CPU)
    step = _verify_step([9, 5, 12], [3, 1, 0])
    assert io.fits(step) and io.fill(step, None) == 16  # 3 sequences -> the bucket of 4, x (K + 1) rows
    rows = [0, 1, 2, 3, 4, 5, 8]  # s0: 4 rows, s1: its token and one draft, s2: its token
    assert io.last_rows.tolist() == rows
    pad = [r for r in range(16) if r not in rows]
    assert io.token_ids[rows].tolist() == step.token_ids.tolist() and io.token_ids[pad].eq(0).all()
    assert io.lens[rows].tolist() == [10, 11, 12, 13, 6, 7, 13]  # each row's keys: up to its own position
    assert io.lens[pad].eq(1).all() and io.table_rows[pad].eq(0).all()  # padding reads the null row's block
    assert io.slot_mapping[pad].eq(99 * 4).all() and io.slot_mapping[rows].tolist() == step.slot_mapping.tolist()
    assert io.table_rows[rows].tolist() == [1, 1, 1, 1, 2, 2, 3] and io.block_tables[0].eq(99).all()
    assert io.block_tables[1:4].tolist() == step.block_tables.tolist()
    assert io.logits_rows[:7].tolist() == rows  # the verifier's rows first, in packing order
    assert io.row_ids[1][rows].tolist() == step.engram_row_ids[1].tolist() and io.row_ids[1][pad].eq(0).all()
    assert (io.num_rows, io.padded_rows, io.short_seqs) == (7, 9, 2)
    # conv rewind from the window's end: K - accepted, padding sequences none
    assert io.dropped(16, torch.tensor([2, 1, 0])).tolist() == [1, 2, 3, 0]


def test_fits_takes_verify_steps_only():
    io = VerifyInputs(max_batch=2, num_speculative_tokens=2, max_model_len=32, block_size=4, null_block=99, n_cols=2,
                      row_layers=[1], device=CPU)
    assert io.fits(_verify_step([9, 5], [2, 0]))
    assert not io.fits(_verify_step([9, 5], [3, 0]))  # more drafts than K
    assert not io.fits(_verify_step([9, 5, 4], [1, 1, 1]))  # more sequences than the largest bucket
    plain = _verify_step([9, 5], [0, 0])
    plain.num_drafts = []  # a plain decode step: the decode graphs'
    assert not io.fits(plain)
    mixed = _verify_step([9, 0], [1, 3])
    mixed.num_drafts = [1, 0]  # sequence 1 is a prompt chunk of 4 tokens, not a verify sequence
    assert not io.fits(mixed)
    dead = _verify_step([9, 5], [1, 1])
    dead.dead_mask = torch.zeros(dead.num_tokens, dtype=torch.bool)
    assert not io.fits(dead)
