"""Programmatic dependent launch (engram/model/layers/pdl.py) on a Hopper GPU (skipped elsewhere): the kernels
compile with the grid-dependency instructions, their outputs are bitwise those launched without PDL, eager and
replayed from a CUDA graph, and an engine's tokens and logprobs are bitwise unchanged. The reference without
PDL: the device's capability check forced off (``pdl._CAPABLE``). The check on the CPU:
tests/unit/test_pdl_switch.py."""
from __future__ import annotations

import pytest
import torch

import engram
from engram.engine.sampling_params import SamplingParams
from engram.model.layers import pdl

def _use_pdl(monkeypatch, on: bool) -> None:
    """Launches on the current device with PDL (``on``) or without: the no-PDL reference."""
    monkeypatch.setitem(pdl._CAPABLE, torch.cuda.current_device(), on)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                 reason="needs a CUDA GPU of compute capability 9.0 or newer")]


def test_the_kernel_compiles_with_grid_dependency_control():
    from engram.model.layers import fused_triton as ft

    g = torch.randn(4, 300, device="cuda")
    u = torch.randn(4, 300, device="cuda")
    y = torch.empty(4, 300, device="cuda")
    compiled = ft._silu_mul_kernel[(2,)](g, u, y, 1200, 300, g.stride(0), u.stride(0), BLOCK=1024,
                                        num_warps=4, USE_PDL=True, launch_pdl=True)
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    torch.testing.assert_close(y, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-5)


def _chain(x, r, w, q, k, v, wq, wk, cos, sin, kc, vc, slots, tables, lens):
    """A layer's small kernels in their decode order, each reading what the one before wrote; kc, vc
    [blocks, block size, KV heads, hd]."""
    from engram.model.layers import fused_triton as ft
    from engram.model.layers import paged_attention_triton as pat

    s, h = ft.add_rms_norm(x, r, w, 1e-6)
    q = q + h[:, :1, None]  # the queries depend on the norm's output
    qr = ft.norm_rope_qk_store(q, k, v, wq, wk, 1e-6, cos, sin, kc.flatten(0, 1), vc.flatten(0, 1), slots)
    out = torch.empty_like(qr)
    seqs = torch.arange(qr.shape[0], device="cuda")
    pat.decode(qr, kc, vc, tables, seqs, seqs, lens, 256, out, 0.125)
    return s, ft.silu_mul(out.flatten(1), out.flatten(1) * 0.5)


def _inputs(dtype):
    """Three sequences of 200, 37 and 1 keys, block table rows 16 blocks apart, the new key's slots."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t, nh, nk, hd, bs = 3, 8, 2, 64, 16

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    tables = torch.arange(48, device="cuda").view(3, 16)
    lens = torch.tensor([200, 37, 1], device="cuda")
    slots = (tables[:, 0] * bs + lens - 1).to(torch.int64)
    return (rnd(t, 512), rnd(t, 512), rnd(512), rnd(t, nh, hd), rnd(t, nk, hd), rnd(t, nk, hd), rnd(hd),
            rnd(hd), rnd(t, hd), rnd(t, hd), rnd(48, bs, nk, hd), rnd(48, bs, nk, hd), slots, tables, lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_outputs_are_bitwise_those_without_pdl_eager_and_in_a_graph(monkeypatch, dtype):
    outs = {}
    for on in (False, True):
        _use_pdl(monkeypatch, on)
        eager_args = _inputs(dtype)
        eager = _chain(*eager_args)
        args = _inputs(dtype)
        _chain(*_inputs(dtype))  # compile and allocate outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = _chain(*args)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        outs[on] = [t.clone() for t in eager + captured + (eager_args[10], eager_args[11], args[10], args[11])]
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_an_engines_tokens_and_logprobs_do_not_change(tmp_path, monkeypatch, eager):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [[5 + i, 17, 99, 4 + 3 * i, 8] for i in range(3)]
    outs = {}
    for on in (False, True):
        _use_pdl(monkeypatch, on)
        llm = engram.LLM("tiny", tier="gpu", dtype=torch.bfloat16, cache_dir=str(tmp_path), enforce_eager=eager,
                         max_num_seqs=4)
        outs[on] = [(o.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                    for o in llm.generate(prompts, params, use_tqdm=False)]
        if not eager:
            assert llm.engine.stats()["graph_replays"] > 0
    assert outs[True] == outs[False]
