"""L2 prefetch of the o projection's weight during attention (model/layers/l2_prefetch.py) on CUDA (skipped
without a GPU): the kernel runs on its side stream beside attention, decode graphs capture it, and tokens
and logprobs are bitwise those without it. The plumbing on the CPU: tests/unit/test_l2_prefetch_plumbing.py."""
from __future__ import annotations

import pytest
import torch

import engram
from engram.bench.device_time import cuda_kernels
from engram.engine.sampling_params import SamplingParams
from engram.model.layers import l2_prefetch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def run(tmp_path, monkeypatch, on: bool, eager: bool):
    monkeypatch.setattr(l2_prefetch, "ENABLED", on)
    llm = engram.LLM("tiny", tier="gpu", dtype=torch.float32, cache_dir=str(tmp_path), enforce_eager=eager,
                     max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [[5 + i, 17, 99, 4 + 3 * i, 8] for i in range(3)]
    outs = [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs, llm


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_prefetching_changes_no_output(tmp_path, monkeypatch, eager):
    off, _ = run(tmp_path, monkeypatch, False, eager)
    on, llm = run(tmp_path, monkeypatch, True, eager)
    assert on == off
    attn = llm.engine.executor.worker.model.model.layers[0].self_attn
    assert isinstance(attn.l2_prefetch, l2_prefetch.WeightPrefetcher)
    if not eager:
        assert llm.engine.stats()["graph_replays"] > 0


def test_the_prefetch_runs_on_its_own_stream_beside_attention():
    from torch.profiler import ProfilerActivity, profile

    w = torch.randn(2560, 4096, device="cuda").to(torch.bfloat16)
    pre = l2_prefetch.WeightPrefetcher(torch.device("cuda"))
    pre.start(w)  # compiles
    pre.finish()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pre.start(w)
        torch.cuda._sleep(200_000)  # what attention would be doing
        pre.finish()
        y = torch.ones(8, device="cuda") * 2
        torch.cuda.synchronize()
    kernels = cuda_kernels(prof.profiler.kineto_results.events())
    fetch = [k for k in kernels if "prefetch_lines" in k[3]]
    spin = [k for k in kernels if "spin" in k[3].lower() or "sleep" in k[3].lower()]
    later = [k for k in kernels if k not in fetch and k not in spin]  # the multiply after finish()
    assert fetch and spin and later
    assert fetch[0][2] != spin[0][2]  # its own stream, beside the main stream's work
    assert all(k[0] >= fetch[-1][1] for k in later)  # what follows finish() waits for the prefetch
    assert y.sum().item() == 16
