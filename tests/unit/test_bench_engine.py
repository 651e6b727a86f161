"""`engram bench engine` on the CPU with the tiny preset: every arm runs and every field is written, decode
steps really decode one token per sequence, the roofline arithmetic matches a hand count, the busy-time
union and the HF peer work."""
import json

import pytest
import torch

from engram.bench import engine_bench, engine_steps
from engram.bench.device_time import measure_busy, union_length
from engram.bench.roofline import Ceilings, StepShape, measure_ceilings, parameter_counts, roofline, step_cost
from engram.cli import main
from engram.config import EngramConfig
from engram.model.model_config import ModelConfig

# 2 layers, H 8, 2 heads x 4 (1 KV head), MLP 16, vocab 100: small enough to count by hand.
HAND = ModelConfig(name="hand", architecture="qwen3", vocab_size=100, hidden_size=8, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=4, intermediate_size=16, qk_norm=True, tie_word_embeddings=False)
# one v41 Engram layer: 2 columns of 32-value MXFP8 rows (32 + 1 scale byte = 33 bytes a row)
HAND_ENGRAM = EngramConfig(layer_ids=(1,), max_ngram_size=2, n_heads=2, head_dim=32, vocab_size=101,
                           compressed_vocab_size=50, pad_token_id=2, hidden_size=8, hc_mult=1)
FAST = ["--threads", "1", "--context-len", "12", "--decode-steps", "2", "--warmup-tokens", "2"]


def _tiny_engine(**limits):
    from engram.engine.config import EngineConfig
    from engram.engine.engine import LLMEngine
    from engram.model.loader import random_model
    from engram.model.presets import preset_config

    loaded = random_model(preset_config("tiny"), progress=False)
    cfg = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128, **limits})
    return LLMEngine(loaded, cfg, torch.device("cpu"), torch.float32)


# ----------------------------------------------------------------- roofline arithmetic
def test_parameter_counts_match_the_built_models():
    from engram.model.loader import build_model
    from engram.model.presets import preset_config

    tiny = preset_config("tiny")
    paper = tiny.engram.replace(variant="paper", row_dtype="fp32")
    configs = [tiny, tiny.replace(engram=None), tiny.replace(engram=paper), HAND, HAND.replace(engram=HAND_ENGRAM),
               HAND.replace(kv_source_layer_ids=(0,), architecture="qwen2", attention_bias=True, qk_norm=False),
               HAND.replace(architecture="llama", attention_bias=True, qk_norm=False, tie_word_embeddings=True)]
    for cfg in configs:
        model = build_model(cfg, torch.float32, torch.device("cpu"))
        assert sum(parameter_counts(cfg).values()) == sum(p.numel() for p in model.parameters()), cfg


def test_step_cost_and_roofline_by_hand():
    # parameters: embedding 800, lm_head 800, attention 2 x (q 64 + o 64 + k,v 64 + q/k norms 8) = 400,
    # mlp 2 x 3 x 8 x 16 = 768, norms 5 x 8 = 40: 2808. Matmul weights per token 2 x (128 + 64 + 384) = 1152.
    assert sum(parameter_counts(HAND).values()) == 2808
    decode = StepShape.decode([5, 6, 7])  # KV entries after the step
    c = step_cost(HAND, decode, itemsize=2)
    assert c.weight_bytes == (2808 - 800 + 3 * 8) * 2  # untied embedding: only the 3 rows of the step
    assert c.kv_bytes == (2 * 18 + 2 * 3) * (2 * 1 * 4 * 2)  # reads: 2 layers x 18, writes: 2 layers x 3
    assert c.engram_bytes == 0 and c.link_bytes == 0 and c.memory_bytes == 4064 + 672
    # 2 x 1152 x 3 tokens + LM head 2 x 100 x 8 x 3 + attention 4 x 2 x 4 x 2 layers x (5 + 6 + 7)
    assert c.flops == 6912 + 4800 + 1152
    p = step_cost(HAND, StepShape.prefill(2, 3), itemsize=2)
    assert p.weight_bytes == (2808 - 800 + 6 * 8) * 2 and p.kv_bytes == (2 * 6 + 2 * 6) * 16
    assert p.flops == 2 * 1152 * 6 + 2 * 100 * 8 * 2 + 64 * 2 * (1 + 2 + 3)  # causal: 1 + 2 + 3 keys
    chunk = step_cost(HAND, StepShape((2,), (5,), 1), itemsize=2)  # 2 new tokens after 3 cached: 4 + 5 keys
    assert chunk.flops == 2 * 1152 * 2 + 2 * 100 * 8 + 64 * (4 + 5)

    # tied, plus one Engram layer: wkv 64 x 16 + q/k weights 2 x 8 = 1040 parameters, 1024 of them matmul
    eng = HAND.replace(engram=HAND_ENGRAM, tie_word_embeddings=True)
    assert sum(parameter_counts(eng).values()) == 800 + 400 + 768 + 40 + 1040
    gpu, host = step_cost(eng, decode, 2, "gpu"), step_cost(eng, decode, 2, "host")
    assert gpu.weight_bytes == 3048 * 2 and gpu.engram_bytes == 3 * 2 * 33
    assert (gpu.memory_bytes, gpu.link_bytes) == (6096 + 672 + 198, 0)
    assert (host.memory_bytes, host.link_bytes) == (6096 + 672, 198)
    assert gpu.flops == host.flops == 2 * (1152 + 1024) * 3 + 4800 + 1152

    ceil = Ceilings("cuda", "bfloat16", memory_GBps=1.0, matmul_TFLOPs=1e-3, link_GBps=0.01, copy_bytes=1, matmul_n=1)
    assert roofline(gpu, ceil) == (pytest.approx(19008e-9), "compute")  # 19008 FLOPs at 1 GFLOP/s > 6966 B at 1 GB/s
    assert roofline(host, ceil) == (pytest.approx(198 / 1e7), "link")  # 198 B over a 10 MB/s link
    cpu = Ceilings("cpu", "float32", memory_GBps=1e-6, matmul_TFLOPs=1e-3, link_GBps=None, copy_bytes=1, matmul_n=1)
    assert roofline(host, cpu) == (pytest.approx(6966 / 1e3), "memory")  # the host tier is RAM: rows are memory


def test_measured_ceilings_are_the_work_over_the_time_it_took():
    """A copy of B bytes moves 2B (read + written), an n^3 matmul does 2n^3 FLOPs: each ceiling is that work
    over the time the timer gave for it. The fake timer runs each measured call once, on the real buffers."""
    timed = []

    def timer(fn, device):
        fn()
        timed.append(device.type)
        return {1: 0.5e-3, 2: 2e-3}[len(timed)]  # the copy, then the matmul

    c = measure_ceilings("cpu", torch.float32, copy_bytes=1 << 20, matmul_n=64, timer=timer)
    assert timed == ["cpu", "cpu"]  # no host-link copy without CUDA
    assert c.memory_GBps == pytest.approx(2 * (1 << 20) / 0.5e-3 / 1e9)  # 4.19 GB/s
    assert c.matmul_TFLOPs == pytest.approx(2 * 64 ** 3 / 2e-3 / 1e12)
    assert (c.link_GBps, c.device, c.dtype, c.copy_bytes, c.matmul_n) == (None, "cpu", "float32", 1 << 20, 64)
    real = measure_ceilings("cpu", torch.float32, copy_bytes=1 << 20, matmul_n=64)
    assert real.memory_GBps > 0 and real.matmul_TFLOPs > 0 and real.link_GBps is None


# ----------------------------------------------------------------- busy time
def test_union_length_counts_overlaps_once():
    assert union_length([(5, 6), (0, 2), (1, 3), (6, 6), (2.5, 2.75)]) == 4.0
    assert union_length([]) == 0.0


def test_measure_busy_on_the_cpu_is_within_the_wall_time():
    import time

    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    busy = measure_busy(lambda: [a @ a for _ in range(20)], "cpu")
    assert 0 < busy <= time.perf_counter() - t0
    with pytest.raises(ValueError, match="device_type"):
        measure_busy(lambda: None, "tpu")


def test_measure_profile_groups_work_by_kernel_name():
    from engram.bench.device_time import measure_profile

    a = torch.randn(128, 128)
    prof = measure_profile(lambda: ([a @ a for _ in range(7)], [a + 1 for _ in range(3)]), "cpu")
    by_name = {k.name: k for k in prof.kernels}
    assert by_name["aten::mm"].calls == 7 and by_name["aten::add"].calls == 3
    assert [k.seconds for k in prof.kernels] == sorted((k.seconds for k in prof.kernels), reverse=True)
    assert 0 < prof.busy_s and by_name["aten::mm"].seconds <= sum(k.seconds for k in prof.kernels)


# ----------------------------------------------------------------- driving the engine
def test_prompt_ids_are_deterministic_distinct_and_not_special():
    a, b = engine_steps.prompt_ids(3, 50, 4096, seed=7), engine_steps.prompt_ids(3, 50, 4096, seed=7)
    assert a == b and len(a) == 3 and all(len(p) == 50 for p in a)
    assert a[0] != a[1] and len(set(a[0])) > 10 and min(min(p) for p in a) >= 3 and max(max(p) for p in a) < 4096


def test_decode_steps_decode_one_token_per_sequence():
    engine = _tiny_engine()
    prompts = engine_steps.prompt_ids(3, 10, 4096, seed=1)
    t = engine_steps.measure_decode(engine, prompts, steps=3, warmup_tokens=2, profile_steps=2, busy_device="cpu")
    assert len(t.wall_s) == 3 and min(t.wall_s) > 0 and t.busy_s > 0 and t.graph_steps == 0  # no graphs on the CPU
    # the prompts prefill in one step (30 tokens < 64), so every sequence starts timing with 2 tokens generated
    assert t.context_lens == [[12] * 3, [13] * 3, [14] * 3] and t.busy_context_lens == [[15] * 3, [16] * 3]
    assert not engine.has_unfinished()  # every request aborted at the end

    # a step in which one sequence is still in its prompt is refused
    engine = _tiny_engine(max_num_batched_tokens=16)
    params = engine_steps.SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("short", [5] * 4, params)
    engine.add_request("long", [6] * 40, params)
    assert [o.request_id for o in engine.step()] == ["short"]  # 4 + 12 prompt tokens: only "short" samples
    with pytest.raises(engine_steps.NotADecodeStep, match="1 of 2 sequences"):
        engine_steps._decode_step(engine, ["short", "long"], {"short": 1, "long": 0}, 4)


def test_decode_refuses_a_batch_the_engine_cannot_run_at_once():
    engine = _tiny_engine(max_num_seqs=2, max_num_batched_tokens=64)
    with pytest.raises(engine_steps.NotADecodeStep):
        engine_steps.measure_decode(engine, engine_steps.prompt_ids(3, 8, 4096, 0), steps=2, warmup_tokens=1)
    assert not engine.has_unfinished()


def test_prefill_steps_prefill_every_prompt_in_one_step():
    engine = _tiny_engine()
    t = engine_steps.measure_prefill(engine, 2, 16, 4096, repeats=2, busy_device="cpu")
    assert len(t.wall_s) == 2 and min(t.wall_s) > 0 and t.busy_s > 0
    with pytest.raises(engine_steps.NotAPrefillStep, match="prefilled"):
        engine_steps.measure_prefill(engine, 3, 30, 4096, repeats=1)  # 90 tokens > the 64-token budget
    assert not engine.has_unfinished()


# ----------------------------------------------------------------- the HF peer
def test_hf_peer_decodes_a_tiny_qwen3_shape():
    pytest.importorskip("transformers")
    from engram.bench.hf_peer import build_peer, measure_peer
    from engram.model.presets import preset_config

    tiny = preset_config("tiny")
    model = build_peer(tiny, "cpu", torch.float32)
    plain = tiny.replace(engram=None, hc_mult=1)  # the same decoder shapes, no hyper-connections, no Engram
    assert sum(p.numel() for p in model.parameters()) == sum(parameter_counts(plain).values())
    t = measure_peer(model, engine_steps.prompt_ids(2, 10, 4096, 0), steps=3, warmup_tokens=2, compile_mode=None,
                     busy_device="cpu")
    assert t.ms_per_step > 0 and t.busy_ms_per_step is not None and t.compiled_graphs == 0
    assert t.context_lens == [[12, 12], [13, 13], [14, 14]]  # as the engine's after 2 warm-up tokens

    # ms/step is the long call's time less the short one's over the steps between them: a clock that
    # advances 4 ms per generated token gives exactly 4 ms a step
    now = [0.0]
    real_generate = model.generate

    def generate(input_ids, **kwargs):
        out = real_generate(input_ids, **kwargs)
        now[0] += 4e-3 * (out.shape[1] - input_ids.shape[1])
        return out

    model.generate = generate
    t = measure_peer(model, engine_steps.prompt_ids(2, 10, 4096, 0), steps=3, warmup_tokens=2, compile_mode=None,
                     clock=lambda: now[0])
    assert t.ms_per_step == pytest.approx(4.0) and t.busy_ms_per_step is None


# ----------------------------------------------------------------- the command
POINT_FIELDS = {"model", "arm", "tier", "engram", "phase", "batch", "context", "kv_mean", "steps", "ms_wall", "ms_gpu",
                "ms_host_overhead", "tok_s", "roofline_ms", "ratio", "gpu_ratio", "bound", "weight_bytes", "kv_bytes",
                "engram_bytes", "memory_bytes", "link_bytes", "flops"}


def test_engine_bench_runs_every_arm_and_writes_every_field(tmp_path, capsys):
    pytest.importorskip("transformers")
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    rc = main(["bench", "engine", "--models", "tiny", "--batch-sizes", "1,3", "--prefill-shapes", "1x24,2x8",
               "--prefill-repeats", "1", "--profile-steps", "1", *FAST, "--out", str(out), "--plot", str(png)])
    assert rc == 0 and png.stat().st_size > 0
    doc = json.loads(out.read_text())
    assert doc["name"] == "engine-tiny" and doc["machine"]["torch"] == torch.__version__
    res = doc["result"]
    assert res["ceilings"]["device"] == "cpu" and res["ceilings"]["memory_GBps"] > 0
    assert res["peer"] == {"status": "ran", "reason": None, "compile": "off",
                           "transformers": res["peer"]["transformers"]}
    points = res["points"]
    arms = {(p["arm"], p["tier"], p["engram"]) for p in points}
    assert arms == {("engram/gpu", "gpu", True), ("engram/host", "host", True), ("engram-off", None, False),
                    ("hf-peer", None, False)}
    for p in points:
        assert POINT_FIELDS <= set(p), POINT_FIELDS - set(p)
        assert p["ms_wall"] > 0 and p["roofline_ms"] > 0
        assert p["ratio"] == pytest.approx(p["ms_wall"] / p["roofline_ms"])
        assert p["ms_gpu"] is None and p["ms_host_overhead"] is None  # no GPU on the CPU
        tokens = p["batch"] * (1 if p["phase"] == "decode" else p["context"])
        assert p["tok_s"] == pytest.approx(tokens / p["ms_wall"] * 1e3)
    decode = [p for p in points if p["phase"] == "decode"]
    for p in decode:
        if p["arm"] != "hf-peer":
            assert 0 < p["ms_wall_median"] <= p["ms_wall_max"] and p["ms_wall"] <= p["ms_wall_max"]
    assert sorted((p["arm"], p["batch"]) for p in decode) == sorted(
        (a, b) for a in ("engram/gpu", "engram/host", "engram-off", "hf-peer") for b in (1, 3))
    assert all(p["kv_mean"] == 14.5 and p["steps"] == 2 for p in decode)  # KV 14, 15 after 12 + 2 warm-up tokens
    assert all(p["graph_steps"] == 0 for p in decode if p["arm"] != "hf-peer")  # CUDA graphs are CUDA-only
    assert res["engine_config"]["tiny"]["max_num_seqs"] == 3 and res["engine_config"]["tiny"]["max_model_len"] == 32
    prefill = [p for p in points if p["phase"] == "prefill"]
    assert sorted((p["arm"], p["batch"], p["context"]) for p in prefill) == sorted(
        (a, n, t) for a in ("engram/gpu", "engram/host", "engram-off") for n, t in ((1, 24), (2, 8)))
    # Engram arms read rows (over the link on tier host, which is RAM on the CPU)
    assert all(p["engram_bytes"] > 0 for p in points if p["engram"])
    assert all(p["link_bytes"] == p["engram_bytes"] for p in points if p["tier"] == "host")
    cost = res["engram_cost"]
    assert len(cost) == 2 * (2 + 2)
    for row in cost:
        assert row["ms_engram"] == pytest.approx(row["ms_on"] - row["ms_off"])
    text = capsys.readouterr().out
    assert "roofline_ms" in text and "ms_engram" in text and f"result: {out}" in text


def test_engine_bench_without_peer_or_engram_off(tmp_path, capsys):
    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--models", "tiny", "--tiers", "host", "--batch-sizes", "2", "--prefill-shapes", "",
               "--no-peer", "--no-engram-off", *FAST, "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["result"]
    assert [(p["arm"], p["phase"], p["batch"]) for p in res["points"]] == [("engram/host", "decode", 2)]
    assert res["peer"]["status"] == "skipped" and res["peer"]["reason"] == "--no-peer" and res["engram_cost"] == []
    assert "hf-peer skipped: --no-peer" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--tiers", "disk"], "--tiers"), (["--prefill-shapes", "16by512"], "--prefill-shapes"),
    (["--batch-sizes", "0"], "--batch-sizes"), (["--models", "huge"], "--models"),
    (["--engram-config", '{"nope": 1}'], "--engram-config"), (["--context-len", "4000"], "max_position_embeddings"),
])
def test_engine_bench_refuses_bad_options(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "engine", "--models", "tiny", "--no-peer", "--out", str(tmp_path / "x.json"), *argv])


def test_engram_cost_pairs_each_engram_point_with_engram_off():
    def pt(arm, tier, engram, ms, gpu=None, phase="decode", batch=8):
        return {"model": "m", "arm": arm, "tier": tier, "engram": engram, "phase": phase, "batch": batch,
                "context": 512, "ms_wall": ms, "ms_gpu": gpu}

    rows = engine_bench.engram_cost([pt("engram/gpu", "gpu", True, 12.0, 10.0),
                                     pt("engram-off", None, False, 10.0, 9.0), pt("engram/host", "host", True, 15.0),
                                     pt("hf-peer", None, False, 5.0), pt("engram/gpu", "gpu", True, 3.0, batch=1)])
    assert [(r["tier"], r["ms_engram"], r["rel"], r["ms_gpu_engram"]) for r in rows] == [
        ("gpu", 2.0, pytest.approx(0.2), 1.0), ("host", 5.0, pytest.approx(0.5), None)]


def test_cuda_busy_counts_kernels_copies_and_memsets_only():
    from torch.autograd import DeviceType

    from engram.bench.device_time import busy_intervals_ns

    class Evt:  # the accessors of a kineto event that busy_intervals_ns reads
        def __init__(self, device, activity, start, end, name="k"):
            self._d, self._a, self._s, self._e, self._n = device, activity, start, end, name

        def device_type(self): return self._d
        def activity_type(self): return self._a
        def start_ns(self): return self._s
        def end_ns(self): return self._e
        def name(self): return self._n

    events = [Evt(DeviceType.CUDA, "kernel", 0, 10), Evt(DeviceType.CUDA, "kernel", 5, 12),
              Evt(DeviceType.CUDA, "gpu_memcpy", 20, 25), Evt(DeviceType.CUDA, "gpu_memset", 30, 31),
              Evt(DeviceType.CUDA, "cuda_sync", 0, 100, "Context Sync"),
              Evt(DeviceType.CUDA, "gpu_user_annotation", 0, 90),
              Evt(DeviceType.CPU, "cpu_op", 40, 60), Evt(DeviceType.CPU, "cuda_runtime", 61, 62)]
    assert union_length(busy_intervals_ns(events, "cuda")) == 12 + 5 + 1
    assert busy_intervals_ns(events, "cpu") == [(40, 60)]
    from engram.bench.device_time import cuda_kernels

    Evt.device_resource_id = lambda self: 7 if self._s == 5 else 3  # the stream each event ran on
    assert cuda_kernels(events) == [(0, 10, 3, "k"), (5, 12, 7, "k")]  # kernels only, by start, with streams


def test_a_failing_peer_is_reported_and_the_engine_points_are_kept(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    from engram.bench import hf_peer

    def broken(*args, **kwargs):
        raise RuntimeError("compile exploded")

    monkeypatch.setattr(hf_peer, "measure_peer", broken)
    out = tmp_path / "e.json"
    rc = main(["bench", "engine", "--models", "tiny", "--tiers", "gpu", "--batch-sizes", "1", "--prefill-shapes", "",
               "--no-engram-off", *FAST, "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["result"]
    assert [p["arm"] for p in res["points"]] == ["engram/gpu"] and res["peer"]["status"] == "failed"
    assert res["warnings"] == ["tiny: hf-peer failed, no peer points: RuntimeError: compile exploded"]
    assert "warning: tiny: hf-peer failed" in capsys.readouterr().out
