"""DeepSeek-V4's routed experts on CUDA (skipped without one): the grouped path (``routed_grouped``,
torch._grouped_mm) against the per-expert reference loop and a float64 oracle in bf16 at V4-Flash's per-expert widths
(hidden 4096, expert width 2048, top-6) over odd loads; captured in a CUDA graph it replays bitwise what it computes
eagerly for new routing (another load each replay, the offsets recomputed inside the graph); and it is faster than
the loop at a decode-sized and a prefill-sized step (both times printed for docs/model.md). Tolerances: tests/unit/test_v4_moe_grouped.py."""
from __future__ import annotations

import pytest
import torch

from engram.model.deepseek_v4.moe import RoutedExperts, grouped_supported, routed_grouped, routed_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E, H, I, K = 16, 4096, 2048, 6  # V4-Flash's hidden, expert width and top-k; fewer experts
BF16_TOL = 2.0 ** -6


def _experts(seed: int = 0) -> RoutedExperts:
    torch.manual_seed(seed)
    ex = RoutedExperts(E, H, I, limit=10.0)
    with torch.no_grad():
        ex.w13.normal_(0, H ** -0.5)
        ex.w2.normal_(0, I ** -0.5)
    return ex.to("cuda", torch.bfloat16).requires_grad_(False)


def _route(t: int, skew: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, K] float32 summing to 1, distinct expert ids [t, K]) on CUDA for one load shape."""
    if skew == "few_experts":  # experts 0..K-1 only: the other groups are empty
        ids = torch.stack([torch.randperm(K, generator=g) for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.rand(t, K, generator=g) + 0.1
    return (w / w.sum(-1, keepdim=True)).cuda(), ids.cuda()


def _oracle(x, w, ids, ex) -> torch.Tensor:
    i = ex.inner
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    xd = x.double()
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            rows = (ids[:, j] == e).nonzero().squeeze(1)
            h = xd[rows] @ ex.w13[e].double().T
            a = torch.nn.functional.silu(h[:, :i].clamp(max=ex.limit)) * h[:, i:].clamp(-ex.limit, ex.limit)
            out[rows] += (a @ ex.w2[e].double().T) * w[rows, j, None].double()
    return out


@pytest.mark.parametrize("t,skew", [(1, "uniform"), (37, "uniform"), (37, "few_experts"), (300, "uniform")])
def test_grouped_bf16_matches_the_reference_and_the_oracle(t, skew):
    ex = _experts()
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).to("cuda", torch.bfloat16)
    w, ids = _route(t, skew, g)
    assert grouped_supported(x, ex)
    got, ref, want = routed_grouped(x, w, ids, ex), routed_reference(x, w, ids, ex), _oracle(x, w, ids, ex)
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= BF16_TOL * scale
    assert (got.double() - ref.double()).abs().max() <= BF16_TOL * scale


def test_grouped_replays_in_a_cuda_graph_bitwise_for_new_routing():
    ex = _experts(1)
    t = 64
    g = torch.Generator().manual_seed(7)
    x = torch.randn(t, H, generator=g).to("cuda", torch.bfloat16)
    w, ids = _route(t, "uniform", g)
    static_x, static_w, static_ids = x.clone(), w.clone(), ids.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
        routed_grouped(static_x, static_w, static_ids, ex)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = routed_grouped(static_x, static_w, static_ids, ex)
    for skew, seed in (("uniform", 1), ("few_experts", 2), ("uniform", 3)):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(t, H, generator=g).to("cuda", torch.bfloat16)
        w, ids = _route(t, skew, g)
        static_x.copy_(x), static_w.copy_(w), static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, routed_grouped(x, w, ids, ex)), skew


def _ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def test_the_grouped_path_is_faster_than_the_loop():
    ex = _experts(2)
    for t in (64, 2048):
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, H, generator=g).to("cuda", torch.bfloat16)
        w, ids = _route(t, "uniform", g)
        grouped = _ms(lambda: routed_grouped(x, w, ids, ex))
        reference = _ms(lambda: routed_reference(x, w, ids, ex))
        print(f"routed experts E={E} H={H} I={I} k={K}, {t} tokens: grouped {grouped:.3f} ms, "
              f"reference {reference:.3f} ms ({reference / grouped:.2f}x)")
        assert grouped < reference, (t, grouped, reference)  # the fast path earns its place at both sizes
