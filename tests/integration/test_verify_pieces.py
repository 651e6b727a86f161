"""Verify steps over host-read tables through the verify pieces on the CPU (engine/runners/verify_pieces.py over
pieces.py and verify_inputs.py): the real VerifyPiecesRunner with its DecodePieces uncaptured (``capture=False``) runs
what each piece holds, in order, on the verify bucket's static inputs, the rows staged by the lookup executor and
copied to their bucket rows before their layer's piece (``VerifyInputs.place``). In float64, tiny:

* the host tier, the disk tier (real table files, buffered and O_DIRECT reads) and the disk tier over a hot-row cache
  give the outputs without speculation (tokens, every logprob within 1e-9, top-2), both proposers, drafts mostly
  accepted and mostly rejected, every verify step on the route "verify-piecewise", counted in ``verify_graph``;
* the paper variant (its conv states static in the bucket) gives them too;
* on every verify step the rows at the bucket's real rows are bitwise the gpu tier's verify-graph rows of the same
  step, and its padding rows are zero rows;
* mutations — the rows copied in packing order (the decode pieces' copy), the padding rows left as an earlier step
  left them — are caught: the first changes the outputs, the second the rows check.

The captured pieces: tests/gpu/test_speculative_gpu.py."""
from __future__ import annotations

import pytest
import torch

from engram.engine.runners.verify_inputs import VerifyInputs
from engram.model.loader import load_model, save_model
from tests.engine_runs import (assert_verified_in_buckets, preset_variant, verify_graphs_eager,
                               verify_pieces_eager)
from tests.integration.test_speculative import (CPU, F64, K, assert_same, engine, max_logprob_diff, prose,  # noqa: F401
                                                requests, run, spec_config)

ROUTE = "verify-piecewise"
TIERS = {"host": ("host", {}), "disk": ("disk", {"io": "buffered"}), "disk-direct": ("disk", {}),
         "disk-cache": ("disk", {"io": "buffered", "cache_rows": 300})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny preset on the gpu tier (RAM here) and read on the host by each of TIERS; a draft of other weights."""
    out = {"v41": load_model("tiny", dtype=F64, device=CPU, progress=False)}
    for name, (tier, options) in TIERS.items():
        out[name] = load_model("tiny", tier=tier, dtype=F64, device=CPU, engram_config=options or None,
                               progress=False)
    other = load_model("tiny", dtype=F64, device=CPU, engram_config={"seed": 1}, progress=False)
    out["other_draft"] = str(save_model(tmp_path_factory.mktemp("draft") / "tiny-seed1", other))
    return out


def pieces_engine(loaded, spec, **options):
    return verify_pieces_eager(engine(loaded, spec, **options))


class RowLog:
    """Each verify step's static rows, as its runner left them: step id -> (bucket rows of the packed tokens [T],
    {layer: the bucket's rows [size, n_cols, D]})."""

    def __init__(self, eng, route: str):
        w = eng.executor.worker
        self.runner = next(r for r in w.runners if r.name == route)
        self.io = self.runner.pieces.io if route == ROUTE else self.runner.io
        self.rows = self.runner.pieces.rows if route == ROUTE else self.runner.rows
        self.steps: dict[int, tuple] = {}
        launch = self.runner.launch

        def recording(step, patch):
            forward = launch(step, patch)
            size = self.io.bucket(step.num_seqs)
            self.steps[step.step_id] = (torch.as_tensor(self.io.last_rows).clone(),
                                        {lid: t[:size].clone() for lid, t in self.rows.items()})
            return forward

        self.runner.launch = recording


def row_problems(pieces: RowLog, graph: RowLog) -> list[str]:
    """Where the verify pieces' rows are not the gpu tier's on the same step (real rows, bitwise) or not zero rows
    (padding) -> a line each."""
    out = []
    if set(pieces.steps) != set(graph.steps):
        return [f"verify steps differ: {sorted(pieces.steps)} vs {sorted(graph.steps)}"]
    for sid, (at, rows) in pieces.steps.items():
        g_at, g_rows = graph.steps[sid]
        if not torch.equal(at, g_at):
            out.append(f"step {sid}: bucket rows {at.tolist()} vs {g_at.tolist()}")
            continue
        for lid, got in rows.items():
            want = g_rows[lid]
            if not torch.equal(got[at].view(torch.uint8), want[at].view(torch.uint8)):
                out.append(f"step {sid} layer {lid}: real rows differ from the gpu tier's")
            pad = torch.ones(got.shape[0], dtype=torch.bool)
            pad[at] = False
            if got[pad].view(torch.uint8).any():
                out.append(f"step {sid} layer {lid}: padding rows {pad.nonzero().flatten().tolist()} not zero")
    return out


@pytest.mark.parametrize("regime", ["accepted", "rejected"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_host_read_verify_pieces_equal_the_outputs_without_speculation(models, prose, tier, method, regime):
    reqs = requests(models, prose, "v41", method, regime)
    want = run(engine(models["v41"]), reqs)
    eng = pieces_engine(models[tier], spec_config(models, method, regime))
    assert_same(run(eng, reqs), want)
    vg = assert_verified_in_buckets(eng, ROUTE)
    if regime == "rejected":  # spans and drafts of every length meet in a bucket: padding rows copied around
        assert vg["short_seqs"] >= 2 and vg["padded_rows"] >= 4, vg
    s = eng.stats()["speculative"]
    assert (s["acceptance_rate"] >= 0.6) if regime == "accepted" else (s["acceptance_rate"] <= 0.4), s


@pytest.mark.parametrize("tier", ["disk-direct", "disk-cache"])
def test_direct_reads_and_a_hot_row_cache(models, prose, tier):
    reqs = requests(models, prose, "v41", "ngram", "rejected")
    eng = pieces_engine(models[tier], spec_config(models, "ngram", "rejected"))
    assert_same(run(eng, reqs), run(engine(models["v41"]), reqs))
    assert_verified_in_buckets(eng, ROUTE)
    if tier == "disk-cache":
        tables = eng.stats()["tables"]
        assert sum(t["hits"] for t in tables.values()) > 0, tables


def test_the_paper_variant(prose):
    paper = preset_variant("tiny", "tiny-paper", variant="paper", row_dtype="fp32")
    models = {"paper": paper}
    reqs = requests(models, prose, "paper", "ngram", "rejected")
    eng = pieces_engine(paper, spec_config(models, "ngram", "rejected"))
    assert_same(run(eng, reqs), run(engine(paper), reqs))
    assert_verified_in_buckets(eng, ROUTE)


def _rows_against_the_gpu_tier(models, prose, tier):
    """Run the same batch on the gpu tier's verify graphs and ``tier``'s verify pieces -> (their row logs, outputs of
    the pieces, outputs without speculation)."""
    reqs = requests(models, prose, "v41", "ngram", "rejected")
    spec = spec_config(models, "ngram", "rejected")
    graph_eng = verify_graphs_eager(engine(models["v41"], spec))
    pieces_eng = pieces_engine(models[tier], spec)
    graph, pieces = RowLog(graph_eng, "verify-graph"), RowLog(pieces_eng, ROUTE)
    run(graph_eng, reqs)
    got = run(pieces_eng, reqs)
    return pieces, graph, got, run(engine(models["v41"]), reqs)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_rows_are_the_gpu_tiers_bitwise_on_every_verify_step(models, prose, tier):
    pieces, graph, _, _ = _rows_against_the_gpu_tier(models, prose, tier)
    assert len(pieces.steps) >= 3
    assert row_problems(pieces, graph) == []


def test_rows_copied_in_packing_order_break_the_outputs(models, prose, monkeypatch):
    def packed_order(self, static, rows, size):  # the bug: the decode pieces' copy, row t to bucket row t
        static[:rows.shape[0]].copy_(rows)

    monkeypatch.setattr(VerifyInputs, "place", packed_order)
    pieces, graph, got, want = _rows_against_the_gpu_tier(models, prose, "disk")
    assert row_problems(pieces, graph)
    assert max_logprob_diff(got, want) > 1e-6 or any(got[r][0] != want[r][0] for r in want)


def test_padding_left_as_an_earlier_step_left_it_is_caught(models, prose, monkeypatch):
    def no_padding(self, static, rows, size):  # the bug: only the real rows written
        static.index_copy_(0, self.bucket_rows[:rows.shape[0]], rows)

    monkeypatch.setattr(VerifyInputs, "place", no_padding)
    pieces, graph, got, want = _rows_against_the_gpu_tier(models, prose, "disk")
    problems = row_problems(pieces, graph)
    assert problems and all("padding" in p for p in problems), problems
    assert_same(got, want)  # padding never reaches a real row: only the rows check sees it

