"""The resident tiers' serving path never makes the host wait for the GPU.

Each lookup runs under ``torch.cuda.set_sync_debug_mode("error")`` (torch raises on a synchronizing copy,
``.item()``, ``nonzero`` or stream/device synchronize) with the Python-level ``synchronize`` calls that the
debug mode does not see (events, streams, the device) patched to fail, for ids arriving on the CPU and on
the GPU, on the gpu tier and on every route of the host tier; and the hot-row cache's own work (its
bookkeeping lives on the host). Skipped without CUDA (``make device-test``). A cached host-tier lookup as a
whole still waits once per miss batch: its RowStaging buffer waits for the copy that last read it.
"""
import contextlib

import pytest
import torch

from engram.quant import dequantize_mxfp8, quantize_mxfp8
from engram.store import open_table, write_table

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make device-test)")]

ROWS, DIM, N = 4099, 256, 3000
BANDS = {"direct": {}, "staged": {"staged_min_rows": 1024, "sorted_min_rows": 8192},
         "sorted": {"staged_min_rows": 1024, "sorted_min_rows": 1024}}
# (tier, options, where the ids arrive, the host route expected)
CASES = [("gpu", {}, "cpu", None), ("gpu", {}, "cuda", None), ("gpu", {"count_unique": True}, "cuda", None),
         ("host", BANDS["direct"], "cpu", "direct"), ("host", BANDS["direct"], "cuda", "direct"),
         ("host", BANDS["staged"], "cpu", "staged"), ("host", BANDS["staged"], "cuda", "sorted"),
         ("host", BANDS["sorted"], "cpu", "sorted"), ("host", BANDS["sorted"], "cuda", "sorted")]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    v, s = quantize_mxfp8(torch.randn(ROWS, DIM, generator=g))
    d = tmp_path_factory.mktemp("sync") / "t"
    write_table(d, v, s)
    return d, dequantize_mxfp8(v, s, torch.bfloat16)


class SyncRefused(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise SyncRefused("a host synchronisation on the serving path")


@contextlib.contextmanager
def refusing_syncs(monkeypatch):
    """Inside: torch's sync debug mode raises on a synchronizing op, and the Python-level synchronize calls
    it does not see (events, streams, the device) raise SyncRefused; both undone on the way out."""
    for obj, name in ((torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                      (torch.cuda, "synchronize"), (torch.cuda, "current_stream_synchronize")):
        if hasattr(obj, name):
            monkeypatch.setattr(obj, name, _refuse)
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
        monkeypatch.undo()


@pytest.mark.parametrize("tier,options,where,route", CASES,
                         ids=[f"{c[0]}-tier-{'-'.join(f'{k}' for k in c[1]) or 'default'}-{c[2]}-ids" for c in CASES])
def test_gather_never_syncs(table, monkeypatch, tier, options, where, route):
    path, ref = table
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ROWS, (N,), generator=g)
    ids = ids.cuda() if where == "cuda" else ids
    with open_table(path, tier, device="cuda", **options) as t:
        if route is not None:
            assert t.route.kernel == "uva" and t.route.route(N, ids_on_cpu=where == "cpu") == route
        t.gather(ids)  # warm-up: Triton compiles its kernels on the first call
        torch.cuda.synchronize()
        with refusing_syncs(monkeypatch):
            rows = [t.gather(ids) for _ in range(3)]
            rows.append(t.submit(ids).wait())
    want = ref[ids.cpu()]
    for r in rows:
        assert r.is_cuda and torch.equal(r.cpu().view(torch.uint8), want.view(torch.uint8))


def test_sync_detection_works(table, monkeypatch):
    """The harness itself: a lookup that does sync (device ids range-checked on request) is caught."""
    path, _ = table
    ids = torch.randint(0, ROWS, (N,)).cuda()
    with open_table(path, "gpu", device="cuda", check_device_ids=True) as t:
        t.gather(ids)
        old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):
                t.gather(ids)
        finally:
            torch.cuda.set_sync_debug_mode(old)
        ids[5] = ROWS  # and the check it paid for finds a bad id
        with pytest.raises(IndexError, match=f"row id {ROWS} \\(position 5\\)"):
            t.gather(ids)


def test_the_row_cache_decides_hits_and_misses_without_a_device_read_back(monkeypatch):
    """RowCache on CUDA with a backing tier that answers on the device without waiting (as the host tier's
    staging does, apart from its buffer reuse): lookups of fresh ids (hits and misses, inserts and evictions)
    under the sync detector, rows bitwise those of the table."""
    from engram.store.cache import RowCache
    from engram.transfer import to_device

    g = torch.Generator().manual_seed(5)
    table = torch.randint(0, 256, (ROWS, 16), dtype=torch.uint8, generator=g).cuda()
    scales = torch.randint(0, 256, (ROWS, 2), dtype=torch.uint8, generator=g).cuda()

    def backing(ids):  # CPU ids -> rows on the device, no host wait
        dev = to_device(ids, torch.device("cuda"))
        return table.index_select(0, dev), scales.index_select(0, dev)

    cache = RowCache(512, 16, 2, device="cuda", ways=4)
    batches = [torch.unique(torch.randint(0, 2000, (300,), generator=g)) for _ in range(6)]
    cache.fetch(batches[0], backing)  # warm-up
    torch.cuda.synchronize()
    with refusing_syncs(monkeypatch):
        got = [cache.fetch(ids, backing) for ids in batches[1:]]
    assert cache.hits > 0 and cache.misses > 0 and cache.evictions > 0
    for ids, (v, sc) in zip(batches[1:], got):
        assert torch.equal(v.cpu(), table.cpu()[ids]) and torch.equal(sc.cpu(), scales.cpu()[ids])
