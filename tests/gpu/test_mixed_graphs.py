"""Mixed-step CUDA graphs (engine/runners/mixed_inputs.py through GraphRunner, skipped without a GPU): steps that
mix prefill chunks (several query tiles each) with decodes replay a token-count bucket's graph (counted, by route);
a whole run with them is bitwise equal to the same runner run eagerly at the padded bucket sizes (``capture=False``:
the same callables on the same static inputs), with async scheduling; greedy tokens equal ``--enforce-eager``'s; the
padding writes only the reserved block. The CPU checks of the layout: tests/unit/test_mixed_inputs.py."""
from __future__ import annotations

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from tests.engine_runs import drain, mixed_graphs_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
LENGTHS = (150, 3, 290, 40, 1, 77, 130, 9)  # chunks of more than one 64-query tile, and one-token prompts


def _engine(loaded, **config):
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, **config)
    return LLMEngine(loaded, cfg, CUDA, loaded.dtype)


def _run(engine):
    for i, n in enumerate(LENGTHS):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, logprobs=3, ignore_eos=True))
    return drain(engine)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def loaded(request):
    return load_model("tiny", dtype=request.param, device=CUDA, progress=False)


def test_mixed_steps_replay_and_equal_the_same_runner_run_eagerly_bitwise(loaded):
    replayed = _engine(loaded)
    want = _run(replayed)
    stats = replayed.stats()
    routes = (stats["steps_by_route"], stats["steps_by_kind"])
    assert stats["mixed_graph_replays"] >= 4 and stats["steps_by_route"].get("mixed-graph", 0) >= 4, routes
    assert stats["steps_by_route"].get("eager", 0) == 0, routes  # every mixed step fitted a bucket
    assert _run(mixed_graphs_eager(_engine(loaded))) == want  # tokens and logprobs, bitwise


def test_greedy_tokens_equal_enforce_eager(loaded):
    got = _run(_engine(loaded))
    want = _run(_engine(loaded, enforce_eager=True))
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}


def test_padding_writes_only_the_reserved_block(loaded):
    engine = _engine(loaded)
    w = engine.executor.worker
    used: set[int] = set()
    launch = w.launch

    def recording(step):
        used.update(b for b in step.block_tables.flatten().tolist() if b >= 0)
        return launch(step)

    w.launch = recording  # the blocks every step's sequences own
    before = {layer: k.clone() for layer, k in w.kv.k.items()}
    _run(engine)
    null = w.memory.num_blocks
    changed = {b for layer, k in w.kv.k.items()
               for b in torch.nonzero((before[layer] != k).flatten(1).any(1)).flatten().tolist()}
    assert null in changed, "no padding token wrote the reserved block"
    assert changed - used == {null}, sorted(changed - used)[:8]
