"""Kernel dispatch without a GPU: the reference serves every table; "triton" refuses clearly."""
import pytest
import torch

from engram.quant import quantize_mxfp8
from engram.store import kernels
from engram.store.kernels.launch_config import LaunchConfig, parse_config


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_auto_uses_reference_on_cpu(backend):
    backend("auto")
    x = torch.randn(10, 64)
    vals, scales = quantize_mxfp8(x)
    ids = torch.tensor([3, 3, 0, 9])
    assert kernels.fast_path(vals.view(torch.uint8)) is None
    got = kernels.gather_rows(vals.view(torch.uint8), scales, ids, "mxfp8", 64, dtype=torch.float32)
    from engram.quant import dequantize_mxfp8
    want = dequantize_mxfp8(vals, scales, dtype=torch.float32)[ids]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_backend_refuses_without_cuda(backend):
    backend("triton")
    with pytest.raises(RuntimeError, match="triton"):
        kernels.gather_raw(torch.zeros(4, 8, dtype=torch.uint8), torch.tensor([1]))


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="cuda"):
        kernels.set_backend("cuda")


@pytest.mark.parametrize("kw,field", [({"block_r": 24}, "block_r"), ({"num_warps": 3}, "num_warps"),
                                      ({"programs_per_sm": -2}, "programs_per_sm"),
                                      ({"max_programs": -1}, "max_programs"),
                                      ({"tiles_per_program": 0}, "tiles_per_program")])
def test_launch_config_validates(kw, field):
    with pytest.raises(ValueError, match=field):
        LaunchConfig(**kw)


def test_uva_config_caps_only_the_grid():
    from engram.store.kernels import uva

    assert uva.uva_config(0) is uva.UVA_CONFIG
    capped = uva.uva_config(16)
    assert capped.max_programs == 16 and capped.block_r == uva.UVA_CONFIG.block_r
    spread = uva.uva_config(0, 24)
    assert spread.tiles_per_program == 24 and spread.max_programs == 0 and spread.stream == uva.UVA_CONFIG.stream


def test_a_spread_grid_grows_with_the_batch_from_a_floor():
    """The grids measured on the H200 (docs/store.md): a 64-token decode step of a V4.1 layer (1536 rows,
    96 tiles) gets 8 programs, a 256-token one (384 tiles) 16; a batch-1 step's 2 tiles keep one each."""
    from engram.store.kernels.launch_config import SPREAD_MIN_PROGRAMS, spread_programs

    assert spread_programs(96, 24) == 8 == SPREAD_MIN_PROGRAMS
    assert spread_programs(384, 24) == 16
    assert spread_programs(385, 24) == 17  # a partial share still gets its program
    assert spread_programs(2, 24) == 2 and spread_programs(0, 24) == 0
    assert spread_programs(12288, 24) == 512  # a prefill chunk of 8192 tokens
    assert spread_programs(1000, 1) == 1000  # 1: one program per tile


def test_launch_config_parse():
    """A benchmark's gather launch config flag ("block_r,num_warps,programs_per_sm[,0|1]")."""
    assert parse_config("64,8,0") == LaunchConfig(64, 8, 0, False)
    assert parse_config("16,4,-1,1") == LaunchConfig(16, 4, -1, True)
    with pytest.raises(ValueError, match="gather config '64,8' must be"):
        parse_config("64,8")


def test_staged_row_sources_gather_packed_rows_as_one_window():
    from engram.store.kernels import staged
    buf = torch.arange(5 * 272, dtype=torch.int64).remainder(251).to(torch.uint8).view(5, 272)  # packed rows
    values, scales = buf[:, :256], buf[:, 256:264]
    (window,) = staged.row_sources(values, scales)
    assert window.shape == (5, 272) and window.is_contiguous()  # whole rows: one memcpy each
    ids = torch.tensor([4, 0, 4])
    got = torch.index_select(window, 0, ids)
    assert torch.equal(got[:, :264], torch.cat([values[ids], scales[ids]], dim=1))
    short = torch.zeros(5 * 272 - 8, dtype=torch.uint8)  # the last row's padding is not in the storage
    v, s = short.as_strided((5, 256), (272, 1)), short.as_strided((5, 8), (272, 1), 256)
    (window,) = staged.row_sources(v, s)
    assert window.shape == (5, 264) and window.stride() == (272, 1)
    split_v, split_s = buf[:, :256].contiguous(), buf[:, 256:264].contiguous()
    assert len(staged.row_sources(split_v, split_s)) == 2  # separate buffers: two gathers
    assert len(staged.row_sources(buf[:, :256], buf[:, 257:265])) == 2  # not right after the values
    assert len(staged.row_sources(values, None)) == 1


def test_uva_route_choice():
    from engram.store.kernels import uva
    assert uva.route_for(uva.STAGED_MIN_ROWS - 1) == "direct"
    assert uva.route_for(uva.STAGED_MIN_ROWS) == "staged"
    assert uva.route_for(uva.SORTED_MIN_ROWS) == "sorted"
    assert uva.route_for(10, "sorted") == "sorted"
    with pytest.raises(ValueError, match="route='fast'"):
        uva.route_for(10, "fast")
