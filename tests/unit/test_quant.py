import torch
import pytest

from engram.quant import dequantize_mxfp8, quantize_mxfp8


def _block(*head):
    x = torch.zeros(1, 32)
    x[0, : len(head)] = torch.tensor(head)
    return x


@pytest.mark.parametrize("values,scale_byte,first_value", [
    ((1.0,), 127 - 8, 1.0),            # 1/448 -> e = ceil(-8.8) = -8 ; 1 * 2^8 = 256 stored
    ((448.0,), 127, 448.0),            # exactly the E4M3 max: e = 0
    ((449.0,), 128, 448.0),            # just above: e = 1, 224.5 rounds (RNE) to 224 -> 448
    ((2.0 ** 10,), 127 + 2, 1024.0),  # power of two: 1024/448 -> e = 2 (256 <= 448)
    ((896.0,), 128, 896.0),            # 896 / 448 = 2 exactly -> e = 1, no saturation
    ((0.0,), 127, 0.0),                # all-zero block stores byte 127
    ((2.0 ** -140,), 1, 0.0),          # tiny: byte clamps at 1, value flushes to 0
])
def test_hand_picked_bytes(values, scale_byte, first_value):
    v, s = quantize_mxfp8(_block(*values))
    assert s.dtype == torch.uint8 and v.dtype == torch.float8_e4m3fn
    assert int(s[0, 0]) == scale_byte
    assert dequantize_mxfp8(v, s, torch.float32)[0, 0].item() == first_value


def test_subnormal_e4m3_values_and_rne():
    # block amax 448 -> e = 0, so small values land on E4M3 subnormals (multiples of 2^-9)
    x = _block(448.0, 2.0 ** -9, 3 * 2.0 ** -10, 2.0 ** -11)
    v, s = quantize_mxfp8(x)
    y = dequantize_mxfp8(v, s, torch.float32)[0, :4].tolist()
    assert y == [448.0, 2.0 ** -9, 2 * 2.0 ** -9, 0.0]  # 1.5 ulp -> 2 (even), 0.5 ulp -> 0 (even)


def test_byte_zero_dequantizes_to_exact_zero_and_accepts_e8m0_dtype():
    v = torch.full((1, 32), 1.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[0]], dtype=torch.uint8)
    out = dequantize_mxfp8(v, s, torch.float32)
    assert torch.equal(out.view(torch.uint8), torch.zeros(1, 32).view(torch.uint8))  # +0.0, not 2^-127
    s2 = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert dequantize_mxfp8(v, s2, torch.float32)[0, 0].item() == 8.0


def test_byte_255_is_e8m0_nan():
    v = torch.full((1, 32), 1.0).to(torch.float8_e4m3fn)
    s = torch.tensor([[255]], dtype=torch.uint8)
    assert bool(torch.isnan(dequantize_mxfp8(v, s, torch.float32)).all())
    assert bool(torch.isnan(dequantize_mxfp8(v, s.view(torch.float8_e8m0fnu), torch.bfloat16)).all())


def test_error_bound_for_widely_varying_magnitudes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.exp(
        torch.randn(512, 8, 1, generator=g) * 8).repeat_interleave(32, 1).reshape(512, 256)
    v, s = quantize_mxfp8(x)
    y = dequantize_mxfp8(v, s, torch.float32)
    amax = x.reshape(512, 8, 32).abs().amax(-1, keepdim=True)
    err = (y - x).reshape(512, 8, 32).abs()
    assert bool((err <= amax / 16).all())
    assert bool((y.abs() <= amax.repeat_interleave(32, 1).reshape(512, 256) * (1 + 1 / 16)).all())


def test_input_dtypes_and_output_dtypes_agree():
    x = torch.randn(7, 64, dtype=torch.float64)
    v, s = quantize_mxfp8(x)
    v2, s2 = quantize_mxfp8(x.float())
    assert torch.equal(v.view(torch.uint8), v2.view(torch.uint8)) and torch.equal(s, s2)
    f32 = dequantize_mxfp8(v, s, torch.float32)
    assert torch.equal(dequantize_mxfp8(v, s, torch.bfloat16), f32.to(torch.bfloat16))
    assert torch.equal(dequantize_mxfp8(v.view(torch.uint8), s, torch.float32), f32)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.randn(2, 33))
    with pytest.raises(ValueError, match="scales shape"):
        dequantize_mxfp8(torch.zeros(2, 64).to(torch.float8_e4m3fn), torch.zeros(2, 3, dtype=torch.uint8))
