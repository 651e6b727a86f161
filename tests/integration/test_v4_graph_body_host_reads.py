"""The DeepSeek-V4 decode graphs' body (``V4GraphRunner._forward``: fill from the pages, the Engram gathers, the
batched step with the grouped-GEMM MoE, the write-back, the LM head) runs no op that reads a tensor's value back to the
host: on CUDA any of them would fail the capture or sync every replay. Checked on the CPU in bf16 (where the MoE takes
the grouped path, as on the GPU) by recording every aten op the body dispatches, over an engine run of mixed-length
requests (padding rows, several spans, windows closing for some sequences); the reference MoE (float64: its
per-expert loop reads the expert ids with ``torch.unique``) is caught, so the check can fail."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

from tests.parity.deepseek_v4_fixtures import ENGRAM, Pair, decode_heavy_requests  # noqa: E402

import engram  # noqa: E402
from engram.engine.runners.v4_graphs import V4GraphRunner  # noqa: E402
from tests.engine_runs import engine_with_worker  # noqa: E402

pytestmark = pytest.mark.timeout(600)
# aten ops whose result needs a device value on the host (an .item(), a data-dependent shape)
HOST_READS = ("_local_scalar_dense", "nonzero", "unique", "_unique", "masked_select", "repeat_interleave",
              "bincount", "histc", "equal", "is_nonzero")


class HostReads(TorchDispatchMode):
    """Records every dispatched aten op whose name starts with one of HOST_READS."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name.startswith(HOST_READS):
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return Pair(tmp_path_factory.mktemp("v4hostreads"), ENGRAM)


def _watched_run(pair, tmp_path, monkeypatch, dtype: str) -> list[set[str]]:
    """Each graph body's host-reading ops over an engine run in ``dtype`` (the graphs uncaptured, on the CPU)."""
    llm = engram.LLM(model=str(pair.path), dtype=dtype, device="cpu", cache_dir=str(tmp_path / "cache"),
                     max_num_batched_tokens=128, max_num_seqs=16)
    llm.engine = engine_with_worker(llm.loaded, llm.engine.config, graph_capture=False)
    seen: list[set[str]] = []
    real = V4GraphRunner._forward

    def watched(self, size, span):
        with HostReads() as mode:
            out = real(self, size, span)
        seen.append(mode.ops)
        return out

    monkeypatch.setattr(V4GraphRunner, "_forward", watched)
    prompts, news = decode_heavy_requests(8)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [engram.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in news],
                 use_tqdm=False)
    assert len(seen) >= 10 and len(seen) == llm.engine.stats()["graph_replays"]
    return seen


def test_the_bf16_graph_body_reads_nothing_back(pair, tmp_path, monkeypatch):
    seen = _watched_run(pair, tmp_path, monkeypatch, "bfloat16")
    assert all(not ops for ops in seen), sorted(set().union(*seen))


def test_the_reference_moe_is_caught(pair, tmp_path, monkeypatch):
    seen = _watched_run(pair, tmp_path, monkeypatch, "float64")
    assert all("unique" in ops or "_unique2" in ops for ops in seen), seen[:3]
