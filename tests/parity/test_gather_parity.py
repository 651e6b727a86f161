"""Triton gather (HBM and pinned-host UVA) vs the torch reference, bitwise, over dtypes and odd sizes.

The reference runs on a CUDA copy of the same table, so both sides use the GPU's arithmetic; rows are
compared as bytes (``view(torch.uint8)``), which also tells -0.0 from +0.0 and NaN payloads apart.
Skipped without CUDA (run on the device machine with ``make device-test``).
"""
import pytest
import torch

from engram.store import kernels
from engram.store.kernels import reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make device-test)")]

ROWS = 997  # odd, not a multiple of any tile
ITEM = {"mxfp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
# (row dtype, dim, row stride in bytes, scales packed into the value rows)
TABLES = [
    ("mxfp8", 256, 256, False),  # V4.1 rows, format.py's stride
    ("mxfp8", 256, 264, True),  # 264-B rows: values then scales in one row (8-byte aligned only)
    ("mxfp8", 96, 128, False),  # 3 scale blocks: not a power of two
    ("bf16", 64, 128, False),  # paper-variant rows
    ("bf16", 24, 64, False),
    ("fp16", 40, 80, False),
    ("fp32", 256, 1024, False),
    ("fp32", 7, 32, False),
]
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _float_bits(n: int, dim: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """[n, dim] values of ``dtype`` spread over many binades, with +-0, +-inf, NaN and subnormals mixed in."""
    x = torch.randn(n, dim, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 30, (n, dim), generator=g).double())
    x = x.to(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                             torch.finfo(dtype).tiny / 4, -torch.finfo(dtype).tiny / 8], dtype=dtype)
    pick = torch.randint(0, 40, (n, dim), generator=g)
    return torch.where(pick < len(specials), specials[pick.clamp(max=len(specials) - 1)], x)


def make_table(row_dtype: str, dim: int, stride: int, packed: bool, seed: int = 0):
    """(values uint8 [ROWS, stride], scales uint8 [ROWS, dim/32] | None) on the CPU, every byte used."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (ROWS, stride), generator=g, dtype=torch.uint8)  # padding is random too
    vb = dim * ITEM[row_dtype]
    if row_dtype == "mxfp8":
        if packed:
            return raw, raw[:, vb:vb + dim // 32]  # scales view inside the value rows
        return raw, torch.randint(0, 256, (ROWS, dim // 32), generator=g, dtype=torch.uint8)
    dt = reference.ROW_TORCH_DTYPES[row_dtype]
    raw[:, :vb] = _float_bits(ROWS, dim, dt, g).view(torch.uint8).reshape(ROWS, vb)
    return raw, None


def id_sets(n_rows: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "empty": torch.empty(0, dtype=torch.int64),
        "one": torch.tensor([n_rows - 1]),
        "edges": torch.tensor([0, n_rows - 1, 0, n_rows - 1, n_rows // 2]),
        "random_1000": torch.randint(0, n_rows, (1000,), generator=g),
        "all_same_77": torch.full((77,), 5, dtype=torch.int64),
        # heavy-tailed (Zipf-like, exponent 1.2): a few ids repeat thousands of times
        "zipf_20000": (torch.rand(20000, generator=g, dtype=torch.float64) ** (-1 / 1.2)
                       - 1).long().clamp(max=n_rows - 1),
        "perm_odd": torch.randperm(n_rows, generator=g)[: n_rows - 2],
    }


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    gb, wb = got.contiguous().view(torch.uint8).cpu(), want.contiguous().view(torch.uint8).cpu()
    bad = (gb != wb).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} bytes differ, first at {bad[0].tolist()}"


@pytest.fixture(params=["hbm", "uva"])
def where(request):
    if request.param == "uva":
        from engram.store.pinning import pin_tensor
        return lambda t: pin_tensor(t) if t is not None else None
    return lambda t: t.cuda() if t is not None else None


@pytest.mark.parametrize("row_dtype,dim,stride,packed", TABLES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_gather_rows_bitwise(where, row_dtype, dim, stride, packed, out_dtype):
    values, scales = make_table(row_dtype, dim, stride, packed)
    ref_v, ref_s = values.cuda(), (scales.contiguous().cuda() if scales is not None else None)
    fast_v = where(values)
    fast_s = (fast_v[:, dim:dim + dim // 32] if packed else where(scales)) if scales is not None else None
    assert kernels.fast_path(fast_v) in ("hbm", "uva")
    for name, ids in id_sets(ROWS).items():
        want = reference.gather_rows(ref_v, ref_s, ids.cuda(), row_dtype, dim, dtype=out_dtype)
        got = kernels.gather_rows(fast_v, fast_s, ids.cuda(), row_dtype, dim, dtype=out_dtype)
        assert got.is_cuda
        assert_bitwise(got, want, f"{row_dtype} dim={dim} stride={stride} -> {out_dtype}, ids {name}")


@pytest.mark.parametrize("row_dtype,dim,stride,packed", [TABLES[0], TABLES[3], TABLES[7]])
@pytest.mark.parametrize("id_set", ["random_1000", "zipf_20000"])  # zipf: the host tier's staged route
def test_gather_rows_into_strided_out_writes_every_element(where, row_dtype, dim, stride, packed, id_set):
    values, scales = make_table(row_dtype, dim, stride, packed, seed=3)
    ids = id_sets(ROWS)[id_set]
    want = reference.gather_rows(values.cuda(), scales.cuda() if scales is not None else None, ids.cuda(),
                                 row_dtype, dim, dtype=torch.float32)
    big = torch.full((ids.shape[0], dim + 9), float("nan"), device="cuda")  # poisoned, rows wider than dim
    out = big[:, 3:3 + dim]
    got = kernels.gather_rows(where(values), where(scales), ids, row_dtype, dim, out=out, dtype=torch.float32)
    assert got.data_ptr() == out.data_ptr()
    assert_bitwise(got, want, f"{row_dtype} into strided out, ids {id_set}")
    assert torch.isnan(big[:, :3]).all() and torch.isnan(big[:, 3 + dim:]).all(), "wrote outside out"


@pytest.mark.parametrize("stride", [256, 264, 100, 7])
def test_gather_raw_bitwise(where, stride):
    values, _ = make_table("mxfp8", 32, stride, False, seed=stride)
    for name, ids in id_sets(ROWS).items():
        want = reference.gather_raw(values, ids)
        got = kernels.gather_raw(where(values), ids.cuda())
        assert_bitwise(got, want.cuda(), f"raw stride={stride}, ids {name}")


@pytest.mark.parametrize("layout", ["split", "packed"])
def test_host_routes_agree(layout):
    """direct, sorted and staged (CPU gather + pipelined copies, tiny chunks) give the same bytes; staged
    also with ids on the CPU and into a strided out."""
    from engram.store.kernels import staged, uva
    from engram.store.pinning import pin_tensor
    if layout == "split":
        values, scales = make_table("mxfp8", 256, 256, False, seed=9)
        pv, ps = pin_tensor(values), pin_tensor(scales)
    else:  # the host tier's packed rows: values, then scales, then padding to 272 B
        values, scales = make_table("mxfp8", 256, 272, True, seed=9)
        buf = pin_tensor(values)
        pv, ps = buf[:, :256], buf[:, 256:264]
        assert len(staged.row_sources(pv, ps)) == 1, "packed views should be gathered as one window"
    for name, ids in id_sets(ROWS, seed=4).items():
        ids = ids.cuda()
        want = uva.gather_rows(pv, ps, ids, "mxfp8", 256, route="direct")
        assert_bitwise(uva.gather_rows(pv, ps, ids, "mxfp8", 256, route="sorted"), want, f"sorted, ids {name}")
        assert_bitwise(uva.gather_rows(pv, ps, ids, "mxfp8", 256, route="staged"), want, f"staged, ids {name}")
        got = staged.gather_rows(pv, ps, ids.cpu(), "mxfp8", 256, chunk_rows=7)  # many chunks in flight
        assert got.is_cuda
        assert_bitwise(got, want, f"staged 7-row chunks, cpu ids {name}")
        raw = uva.gather_raw(pv, ids, route="direct")
        for route in ("sorted", "staged"):
            assert_bitwise(uva.gather_raw(pv, ids, route=route), raw, f"raw {route} {name}")
    ids = id_sets(ROWS)["zipf_20000"]
    big = torch.full((ids.shape[0], 256 + 5), float("nan"), device="cuda")
    got = uva.gather_rows(pv, ps, ids, "mxfp8", 256, out=big[:, 2:258], dtype=torch.float32, route="staged")
    assert_bitwise(got, uva.gather_rows(pv, ps, ids.cuda(), "mxfp8", 256, dtype=torch.float32, route="direct"),
                   "staged into a strided out")
    assert torch.isnan(big[:, :2]).all() and torch.isnan(big[:, 258:]).all(), "wrote outside out"


def test_staged_buffer_is_not_overwritten_before_its_copies_ran():
    """Back-to-back staged gathers reuse one pinned buffer: each must see its own rows."""
    from engram.store.kernels import staged
    from engram.store.pinning import pin_tensor
    values, scales = make_table("mxfp8", 256, 256, False, seed=11)
    pv, ps = pin_tensor(values), pin_tensor(scales)
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, ROWS, (5000,), generator=g) for _ in range(6)]
    outs = [staged.gather_rows(pv, ps, b, "mxfp8", 256, chunk_rows=512) for b in batches]
    for b, got in zip(batches, outs):
        want = reference.gather_rows(values.cuda(), scales.cuda(), b.cuda(), "mxfp8", 256)
        assert_bitwise(got, want, "staged batch")
