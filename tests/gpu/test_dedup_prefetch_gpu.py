"""Row-id dedup and prompt prefetch on CUDA (skipped without a GPU), bf16, the same batches: greedy tokens and
logprobs bitwise equal with dedup on and off and with prompt prefetch on and off, on the tiers where they act
(disk, host with a hot-row cache: eager prefill) and where they do not (tier host: the mixed-step graphs), with
async scheduling as each tier chooses it; prefetch really read staged rows where its staging is active."""
from __future__ import annotations

import pytest
import torch

from engram.engine.config import EngineConfig
from engram.engine.engine import LLMEngine
from engram.engine.sampling_params import SamplingParams
from engram.model.loader import load_model
from tests.engine_runs import drain

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def run(loaded, **cfg):
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, **cfg),
                       CUDA, torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    phrase = torch.randint(3, 4000, (9,), generator=g).tolist()
    for i, n in enumerate((600, 40, 300, 3, 500, 90)):
        ids = phrase * (n // 9) if i % 2 == 0 else torch.randint(3, 4000, (n,), generator=g).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2))
    return drain(engine), engine.stats()


@pytest.mark.parametrize("tier,options,active", [("disk", {"io": "buffered"}, True),
                                                 ("host", {"cache_rows": 256}, True), ("host", {}, False)],
                         ids=["disk", "host-cache", "host"])
def test_dedup_and_prefetch_leave_tokens_bitwise(tmp_path, tier, options, active):
    loaded = load_model("tiny", tier=tier, dtype=torch.bfloat16, device=CUDA, cache_dir=tmp_path, progress=False,
                        engram_config=options)
    want, _ = run(loaded, dedup_rows=False)
    got, plain = run(loaded)
    assert got == want
    staged, stats = run(loaded, prompt_prefetch=True)
    assert staged == want
    assert stats["prefetch"]["active"] is active
    if active:
        assert stats["prefetch"]["rows_read"] > 0 and stats["prefetch"]["used_bytes"] == 0
        assert stats["lookup_unique_ids"] < plain["lookup_unique_ids"]
