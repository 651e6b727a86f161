"""Speculative decoding on CUDA (skipped without a GPU): verify steps replay the verify graphs (S_b x (K + 1) rows,
decode-style; counted by route and in ``stats()["verify_graph"]``) — one graph a bucket with the gathers inside
("verify-graph", runners/verify_graphs.py) on tiers gpu and host, pieces cut at the Engram layers with the host-read
rows copied in ("verify-piecewise", runners/verify_pieces.py) on the disk tier and over hot-row caches — n-gram and
draft-model proposers, both Engram variants, in bf16 and float32; a run with them is bitwise equal — tokens and
logprobs — to the same runners run eagerly on the same static inputs (``capture=False``); the host-read pieces'
rows on every verify step are bitwise the gpu tier's (its one-graph replays; padding: zero rows), their outputs within
float rounding of its (prefill runs eager there), and forced natural continuations come out as forced with their logprobs within float rounding of a run without
speculation (the verify rows' attention is the decode kernel's, the non-speculative decode steps' too). The CPU
checks: tests/integration/test_verify_graphs.py, tests/integration/test_verify_pieces.py,
tests/integration/test_speculative.py, tests/unit/test_mixed_inputs.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from engram.store.options import StoreOptions
from tests.engine_runs import drain, eager_verify_steps, mixed_graphs_eager, preset_variant, verify_graphs_eager, verify_pieces_eager
from tests.integration.test_verify_pieces import RowLog, row_problems

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
         "draft": {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}}
# tables read on the host (as tests/gpu/test_piecewise_graphs.py): their verify steps replay the verify pieces
HOST_READ = {"disk": ("disk", {"io": "buffered"}), "disk-cache": ("disk", {"io": "buffered", "cache_rows": 300}),
             "host-cache": ("host", {"cache_rows": 300})}


def _prompts():
    base = [(11 * j) % 400 + 3 for j in range(60)]
    return [base[i:] + base[:i] for i in range(0, 48, 6)]  # 8 prompts whose second half repeats their first


def _engine(loaded, spec=None, **config):
    return LLMEngine(loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, speculative_config=spec,
                                          **config), CUDA, loaded.dtype)


def _run(engine):
    for i, p in enumerate(_prompts()):
        quote = p[10:34]  # a continuation quoting the prompt: n-gram drafts are accepted
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=len(quote), logprobs=2,
                                                      forced_token_ids=quote, ignore_eos=True))
    return drain(engine)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def loaded(request):
    return load_model("tiny", dtype=request.param, device=CUDA, progress=False)


@pytest.fixture(scope="module")
def paper():
    return preset_variant("tiny", "tiny-paper", device=CUDA, dtype=torch.bfloat16, variant="paper", row_dtype="fp32")


def _eager_graphs(engine):
    """The same engine with its verify and mixed-step runners run on their static inputs without capture."""
    return verify_graphs_eager(mixed_graphs_eager(engine))


def _check_replayed(engine, method, route="verify-graph"):
    stats = engine.stats()
    # the forced continuation quotes the prompt: n-gram drafts find it, the random-weight draft model does not
    # (its greedy tokens are not the quote), so only the n-gram run must be mostly accepted
    assert stats["speculative"]["spec_steps"] >= 8, stats
    assert method != "ngram" or stats["speculative"]["acceptance_rate"] > 0.5, stats
    vg = stats["verify_graph"]
    # verify steps that still carry prefill chunks run as mixed steps: only the replayed steps' rows are counted
    replayed = [r for r in engine.step_trace() if r.route == route]
    assert vg["replays"] >= 4 and vg["rows"] == sum(r.sampled for r in replayed), (vg, len(replayed))
    assert vg["rows"] > sum(r.num_seqs for r in replayed), vg  # drafts were verified inside the graphs
    # the pieces share the decode pieces' pool, whose free blocks may already hold them
    assert route != "verify-graph" or vg["pool_bytes"] > 0, vg
    routes = stats["steps_by_route"]
    assert routes.get(route, 0) == vg["replays"], (routes, vg)
    if route == "verify-graph":  # every step on a graph
        assert routes.get("eager", 0) == 0, routes
    else:  # over host-read tables prefill and mixed steps run eager, but no verify step does
        assert not eager_verify_steps(engine), routes


@pytest.mark.parametrize("tier", ["gpu", "host"])
@pytest.mark.parametrize("method", list(SPECS))
def test_verify_steps_replay_verify_graphs_bitwise(loaded, tier, method):
    model = dataclasses.replace(loaded, tables={}, tier=tier)
    replayed = _engine(model, SPECS[method])
    want = _run(replayed)
    _check_replayed(replayed, method)
    assert _run(_eager_graphs(_engine(model, SPECS[method]))) == want  # tokens and logprobs, bitwise


@pytest.mark.parametrize("tier", list(HOST_READ))
@pytest.mark.parametrize("method", list(SPECS))
def test_host_read_verify_pieces_bitwise(loaded, tier, method):
    """The verify pieces over host-read tables equal their uncaptured pieces and the gpu tier's one-graph replays."""
    kind, options = HOST_READ[tier]
    model = dataclasses.replace(loaded, tables={}, tier=kind, store_options=StoreOptions().replace(**options))
    replayed = _engine(model, SPECS[method])
    assert replayed.executor.worker.runners[0].name == "verify-piecewise"
    pieces = RowLog(replayed, "verify-piecewise")
    want = _run(replayed)
    _check_replayed(replayed, method, route="verify-piecewise")
    assert _run(verify_pieces_eager(_engine(model, SPECS[method]))) == want  # tokens and logprobs, bitwise
    gpu = _engine(dataclasses.replace(loaded, tables={}, tier="gpu"), SPECS[method])
    graph = RowLog(gpu, "verify-graph")
    _assert_close(_run(gpu), want, loaded.dtype)
    _check_replayed(gpu, method)
    # forced tokens: the same verify steps on both tiers, whose rows are bitwise the gpu tier's (padding: zero rows)
    assert row_problems(pieces, graph) == []


def test_paper_variant_verify_pieces_bitwise(paper):
    """The paper variant's verify steps over a disk tier: pieces with the conv inside, bitwise the gpu tier's."""
    disk = dataclasses.replace(paper, tables={}, tier="disk", store_options=StoreOptions().replace(io="buffered"))
    replayed = _engine(disk, SPECS["ngram"])
    want = _run(replayed)
    _check_replayed(replayed, "ngram", route="verify-piecewise")
    assert _run(verify_pieces_eager(_engine(disk, SPECS["ngram"]))) == want
    _assert_close(_run(_engine(paper, SPECS["ngram"])), want, paper.dtype)


def test_paper_variant_verify_graphs_bitwise(paper):
    # the paper variant's decode and mixed steps run eager; its verify steps replay graphs with the conv inside
    replayed = _engine(paper, SPECS["ngram"])
    want = _run(replayed)
    stats = replayed.stats()
    assert stats["verify_graph"]["replays"] >= 4 and stats["speculative"]["acceptance_rate"] > 0.5, stats
    assert stats["mixed_graph_replays"] == 0 and stats["graph_replays"] == 0, stats
    assert _run(verify_graphs_eager(_engine(paper, SPECS["ngram"]))) == want  # tokens and logprobs, bitwise


def _assert_close(got, want, dtype):
    """Tokens equal, logprobs within float rounding: graph buckets (and eager prefill) differ in shape."""
    tol = 0.05 if dtype == torch.bfloat16 else 1e-3
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a[0] - b[0]) for a, b in zip(logprobs, got[rid][1])) <= tol, rid


def test_forced_outputs_and_logprobs_match_a_run_without_speculation(loaded):
    _assert_close(_run(_engine(loaded, SPECS["ngram"])), _run(_engine(loaded)), loaded.dtype)
