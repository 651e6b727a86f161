"""The serving roofline (engram/bench/serving_roofline.py) against counts made by hand: one step's compute and
memory terms (a mutation dropping the KV bytes or using the n^3 matmul rate instead of the model's GEMM curve
fails), the window's sums by kind, the ideal schedule's steps, the GEMM shapes adding up to the model's matmul
parameters, and the curve measured with a fake timer on real buffers."""
import pytest
import torch

from engram.bench.roofline import Ceilings, matmul_params_per_token
from engram.bench.serving_roofline import (GemmCurve, gemm_shapes, ideal_schedule, m_grid, measure_gemm_curve,
                                           record_bound, serving_roofline, step_bound)
from engram.engine.step_trace import StepRecord
from engram.model.model_config import ModelConfig

# 2 layers, H 8, 2 heads x 4 (1 KV head), MLP 16, vocab 100, untied: 2808 parameters, 1152 matmul weights a token
HAND = ModelConfig(name="hand", architecture="qwen3", vocab_size=100, hidden_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=4, intermediate_size=16, qk_norm=True, tie_word_embeddings=False)
# projections: 2 x 2304 FLOPs a token in 1, 1.5, 2.5 us at M = 1, 2, 4; LM head 1600 FLOPs a row in 1, 1.6 us
CURVE = GemmCurve(ms=(1, 2, 4), model_s=(1e-6, 1.5e-6, 2.5e-6), head_ms=(1, 2), head_s=(1e-6, 1.6e-6),
                  flops_per_token=2 * 1152, head_flops_per_row=2 * 100 * 8)
SLOW_MEMORY = Ceilings("cuda", "bfloat16", memory_GBps=1e-3, matmul_TFLOPs=1.0, link_GBps=None, copy_bytes=1,
                       matmul_n=1)  # 1 MB/s: every step memory-bound
FAST_MEMORY = Ceilings("cuda", "bfloat16", memory_GBps=10.0, matmul_TFLOPs=1.0, link_GBps=None, copy_bytes=1,
                       matmul_n=1)  # 10 GB/s: compute-bound; the n^3 rate (1 TFLOP/s) must not be used


def _mixed_record(step_id=7):
    # a 2-token prefill chunk after 3 cached tokens (KV 5 after it) and one decode at KV 7; both sample
    return StepRecord.from_shape(step_id, "eager", [2, 1], [5, 7], sampled=2)


def test_one_step_by_hand():
    r = _mixed_record()
    assert (r.num_tokens, r.kv_read, r.attended, r.kind) == (3, 12, 2 * 3 + 3 + 7, "mixed")
    # bytes: weights (2808 - 800 + 3 rows x 8) x 2 = 4064; KV 16 B an entry x (2 layers x 12 read + 2 x 3 written)
    memory = record_bound(HAND, r, CURVE, SLOW_MEMORY, itemsize=2)
    assert memory.memory_s == pytest.approx((4064 + 16 * 30) / 1e6) and memory.bound == "memory"
    # compute: projections 6912 FLOPs at R(3) (time 2 us, halfway from M 2 to 4) + the head's 2 rows in 1.6 us +
    # attention 4 x 2 heads x 4 x 2 layers x 16 pairs = 1024 FLOPs at the peak (2304 x 4 / 2.5 us)
    compute = record_bound(HAND, r, CURVE, FAST_MEMORY, itemsize=2)
    assert CURVE.rate(3) == pytest.approx(6912 / 2e-6)
    assert compute.compute_s == pytest.approx(2e-6 + 1.6e-6 + 1024 / (2304 * 4 / 2.5e-6))
    assert compute.bound == "compute" and compute.roofline_s == compute.compute_s
    assert compute.memory_s == pytest.approx(4544 / 10e9) and compute.link_s == 0.0


def test_curve_interpolates_time_and_extrapolates_in_proportion():
    assert CURVE.model_time(4) == 2.5e-6 and CURVE.model_time(8) == pytest.approx(5e-6)
    assert CURVE.model_time(1.5) == pytest.approx(1.25e-6) and CURVE.head_time(0) == 0.0
    assert CURVE.peak_flops == pytest.approx(2304 * 4 / 2.5e-6)
    with pytest.raises(ValueError, match="GemmCurve.ms"):
        GemmCurve(ms=(2, 1), model_s=(1.0, 1.0), head_ms=(1,), head_s=(1.0,), flops_per_token=1, head_flops_per_row=1)
    assert m_grid(1) == (1,) and m_grid(5) == (1, 2, 3, 4, 6) and m_grid(8) == (1, 2, 3, 4, 6, 8)


def test_window_sums_by_kind():
    decode = StepRecord.from_shape(8, "graph", [1, 1], [9, 4], sampled=2)
    prefill = StepRecord.from_shape(6, "eager", [4], [4], sampled=1)
    records = [prefill, _mixed_record(), decode]
    bounds = [record_bound(HAND, r, CURVE, SLOW_MEMORY, 2) for r in records]
    out = serving_roofline(HAND, records, CURVE, SLOW_MEMORY, 2, "gpu", wall=1.0, tpot_p50=0.01)
    assert out["roofline_s"] == pytest.approx(sum(b.roofline_s for b in bounds)) and out["steps"] == 3
    assert out["ratio"] == pytest.approx(out["roofline_s"])  # over a 1 s wall
    assert {k: v["steps"] for k, v in out["by_kind"].items()} == {"decode": 1, "mixed": 1, "prefill": 1}
    assert out["by_kind"]["decode"]["roofline_s"] == pytest.approx(bounds[2].roofline_s)
    assert out["by_kind"]["decode"]["gpu_s"] is None and out["bound"] == {"memory": 3}
    # TPOT is set against the steps that carry decodes (the mixed and the decode step)
    assert out["mean_decode_step_roofline_s"] == pytest.approx((bounds[1].roofline_s + bounds[2].roofline_s) / 2)
    assert out["tpot_p50_over_mean_step"] == pytest.approx(0.01 / out["mean_decode_step_roofline_s"])
    timed = [StepRecord.from_shape(i, "graph", [1, 1], [9, 4], 2, gpu_s=0.002 * i, idle_s=0.0) for i in (1, 2)]
    cuda = serving_roofline(HAND, timed, CURVE, SLOW_MEMORY, 2, "gpu", wall=1.0, tpot_p50=None)
    assert cuda["by_kind"]["decode"]["gpu_s"] == pytest.approx(0.006) and cuda["gpu_busy_s"] == pytest.approx(0.006)
    assert cuda["roofline_over_gpu_busy"] == pytest.approx(cuda["roofline_s"] / 0.006)
    assert cuda["tpot_p50_over_mean_step"] is None


def test_ideal_schedule_by_hand():
    # prompts 3 and 5 in 2 steps of 4 (each: KV 4, pairs (6 + 15) / 2, one sample); outputs 2 and 4: 1 + 3 decode
    # tokens in 2 steps of 2 (each: KV and pairs (1 x 3 + 1 + 3 x 5 + 6) / 2 = 12.5)
    out = ideal_schedule(HAND, [3, 5], [2, 4], batch_tokens=4, concurrency=2, curve=CURVE, ceilings=SLOW_MEMORY,
                         itemsize=2)
    assert (out["prefill_steps"], out["decode_steps"]) == (2, 2)
    prefill = ((2008 + 4 * 8) * 2 + 16 * (2 * 4 + 2 * 4)) / 1e6
    decode = ((2008 + 2 * 8) * 2 + 16 * (2 * 12.5 + 2 * 2)) / 1e6
    assert out["prefill_s"] == pytest.approx(2 * prefill) and out["decode_s"] == pytest.approx(2 * decode)
    assert out["output_tokens_per_s"] == pytest.approx(6 / (2 * prefill + 2 * decode))
    assert step_bound(HAND, 4, 4, 10.5, 1, CURVE, SLOW_MEMORY, 2).roofline_s == pytest.approx(prefill)
    with pytest.raises(ValueError, match="concurrency=0"):
        ideal_schedule(HAND, [3], [2], 4, 0, CURVE, SLOW_MEMORY, 2)


def test_gemm_shapes_add_up_to_the_matmul_parameters():
    from engram.model.presets import preset_config

    for cfg in (HAND, HAND.replace(kv_source_layer_ids=(0,)), preset_config("tiny"), preset_config("4b-like"),
                preset_config("8b-like")):
        shapes = gemm_shapes(cfg)
        assert sum(s.count * s.in_features * s.out_features for s in shapes) == matmul_params_per_token(cfg)
    by_shape = {(s.in_features, s.out_features): s.count for s in gemm_shapes(preset_config("4b-like"))}
    assert by_shape[(2560, 9728)] == 72 and by_shape[(9728, 2560)] == 36 and by_shape[(6144, 5120)] == 2


def test_measured_curve_is_the_shapes_times_over_the_timer():
    """Every timed call runs each weight copy once: the curve's time is the timer's over the copies, times the
    shape's count, summed over shapes."""
    calls = []

    def timer(fn, device):
        fn()
        calls.append(1)
        return 1e-3

    curve = measure_gemm_curve(HAND, (1, 4), (1,), "cpu", torch.float32, timer=timer, pool_bytes=1)
    shapes = gemm_shapes(HAND)
    assert len(calls) == 2 * len(shapes) + 1
    assert curve.model_s == pytest.approx((sum(s.count for s in shapes) * 1e-3,) * 2)  # one copy each (tiny pool)
    assert curve.head_s == (1e-3,) and curve.flops_per_token == 2 * 1152
    real = measure_gemm_curve(HAND, (1, 8), (1, 2), "cpu", torch.float32)
    assert all(t > 0 for t in real.model_s + real.head_s) and real.rate(8) > 0
