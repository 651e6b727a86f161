"""``engram bench engine``: decode and prefill ms/step per model, tier and Engram on/off, beside an HF transformers peer
(hf_peer.py), each point against a roofline measured in the same run (roofline.py). Points are driven and checked by
engine_steps.py; on CUDA ``ms_gpu`` is the device busy time of ``--profile-steps`` more steps."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback

HELP = "Engine decode/prefill ms/step per model, tier, Engram on/off and an HF peer, against a measured roofline."
CUDA_MODELS, CPU_MODELS = "4b-like,8b-like", "tiny"
TIERS = ("gpu", "host")
TABLE_COLUMNS = ["model", "arm", "phase", "batch", "context", "kv_mean", "graph_steps", "ms_wall", "ms_wall_median",
                 "ms_gpu", "ms_host_overhead", "tok_s", "roofline_ms", "ratio", "bound"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None,
                   help=f"presets, comma-separated (default: {CUDA_MODELS} on CUDA, {CPU_MODELS} on the CPU)")
    p.add_argument("--tiers", default="gpu,host", help="tiers of the Engram arms: gpu, host")
    p.add_argument("--batch-sizes", default="1,8,64,256", help="decode batch sizes")
    p.add_argument("--context-len", type=int, default=512, help="prompt tokens per decoding sequence")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--warmup-tokens", type=int, default=3, help="tokens every sequence decodes before timing")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="engine arms launch step N+1 before reading step N (default: the engine's, on for CUDA)")
    p.add_argument("--kernels", type=int, default=0,
                   help="record and print the N largest kernels of each profiled decode point (0: none)")
    p.add_argument("--profile-steps", type=int, default=4,
                   help="decode steps profiled for GPU busy time (CUDA); 0: no profiling, ms_gpu null")
    p.add_argument("--prefill-shapes", default=None,
                   help=f"SEQSxTOKENS prefill steps, comma-separated (default: {DEFAULT_PREFILL_SHAPES}, each cut to "
                        "what the smallest model's positions hold)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed single prefill steps per shape")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="engine token budget per step (raised to the largest prefill shape)")
    p.add_argument("--enforce-eager", action="store_true", help="engine arms without CUDA graphs (vLLM's name)")
    p.add_argument("--no-engram-off", action="store_true", help="skip the arm without Engram layers")
    p.add_argument("--no-peer", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--peer-compile", default="auto", choices=("auto", "off", "reduce-overhead",
                                                              "max-autotune-no-cudagraphs"),
                   help="torch.compile mode of the peer's decoding forward (auto: reduce-overhead on CUDA, "
                        "off on the CPU)")
    p.add_argument("--engram-config", default=None, metavar="JSON",
                   help="runtime options as for serve/generate (table_rows, seed, cache_rows, ...)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="instead of the step points: decode tok/s with and without speculative decoding (vLLM's "
                        "keys) on forced natural windows, interleaved, with the acceptance length (bench/spec_ab.py)")
    p.add_argument("--spec-workload", default="summary", help="forced continuations: natural, quote or summary")
    p.add_argument("--spec-repeats", type=int, default=6, help="recorded ABBA rounds per point (even)")
    p.add_argument("--out", default=None, help="result JSON (default: a fresh file in a temporary directory)")
    p.add_argument("--plot", default=None, metavar="FILE", help="PNG: decode ms/step vs batch size, rooflines")


DEFAULT_PREFILL_SHAPES = "1x2048,16x512"


def default_prefill_shapes(max_position_embeddings: int, block_size: int = 16) -> str:
    """DEFAULT_PREFILL_SHAPES cut to fit ``max_position_embeddings`` in whole KV blocks (noted on stderr)."""
    fit = max(block_size, (max_position_embeddings - 1) // block_size * block_size)
    shapes = ",".join(f"{n}x{min(t, fit)}" for n, t in parse_prefill_shapes(DEFAULT_PREFILL_SHAPES))
    if shapes != DEFAULT_PREFILL_SHAPES:
        print(f"--prefill-shapes: the default {DEFAULT_PREFILL_SHAPES} does not fit max_position_embeddings="
              f"{max_position_embeddings}; measuring {shapes}", file=sys.stderr, flush=True)
    return shapes


def parse_prefill_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"1x2048,16x512" -> ((1, 2048), (16, 512)); "" -> () (no prefill points)."""
    shapes = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        seqs, _, tokens = part.partition("x")
        try:
            shape = (int(seqs), int(tokens))
        except ValueError:
            raise SystemExit(f"--prefill-shapes: {part!r} is not SEQSxTOKENS (e.g. 16x512)") from None
        if min(shape) < 1:
            raise SystemExit(f"--prefill-shapes: {part!r} needs SEQS >= 1 and TOKENS >= 1")
        shapes.append(shape)
    return tuple(shapes)


def settings_from(args: argparse.Namespace, seed: int) -> Settings:
    from engram.bench.engine_steps import Settings, parse_ints

    for option in ("context_len", "decode_steps", "warmup_tokens", "prefill_repeats", "max_num_batched_tokens"):
        if getattr(args, option) < 1:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 1")
    for option in ("profile_steps", "kernels"):
        if getattr(args, option) < 0:
            raise SystemExit(f"--{option.replace('_', '-')}={getattr(args, option)} must be >= 0")
    return Settings(parse_ints(args.batch_sizes, "--batch-sizes"), args.context_len, args.decode_steps,
                    args.warmup_tokens, args.profile_steps, parse_prefill_shapes(args.prefill_shapes),
                    args.prefill_repeats, args.max_num_batched_tokens, seed, args.enforce_eager, args.kernels,
                    args.async_scheduling)


# ----------------------------------------------------------------- points
def make_point(cfg, arm: str, tier: str | None, phase: str, batch: int, context: int, shapes: list,
               ms_wall: float, ms_gpu: float | None, tokens_per_step: int, itemsize: int, ceilings,
               costs: list | None = None) -> dict:
    """One JSON record: timings, throughput and the roofline of the mean cost of ``shapes`` (StepShapes), or of
    ``costs`` (StepCosts) where given: a DeepSeek-V4 decode point's (v4_roofline.py); a V4 point without them has
    None roofline fields (roofline.py counts dense decoders only)."""
    from engram.bench.roofline import StepCost, roofline, step_cost
    from engram.model.deepseek_v4.config import V4Config

    kv = [c for shape in shapes for c in shape.context_lens]
    point = {"model": cfg.name, "arm": arm, "tier": tier, "engram": cfg.engram is not None, "phase": phase,
             "batch": batch, "context": context, "kv_mean": round(statistics.fmean(kv), 1), "steps": len(shapes),
             "ms_wall": ms_wall, "ms_gpu": ms_gpu, "ms_host_overhead": None if ms_gpu is None else ms_wall - ms_gpu,
             "tok_s": tokens_per_step / ms_wall * 1e3}
    if isinstance(cfg, V4Config) and costs is None:
        return {**point, "roofline_ms": None, "ratio": None, "gpu_ratio": None, "bound": None}
    costs = costs if costs is not None else [step_cost(cfg, shape, itemsize, tier) for shape in shapes]
    mean = StepCost(**{f.name: round(statistics.fmean(getattr(c, f.name) for c in costs))
                       for f in dataclasses.fields(StepCost)})
    roof_s, bound = roofline(mean, ceilings)
    roof_ms = roof_s * 1e3
    return {**point, "roofline_ms": roof_ms, "ratio": ms_wall / roof_ms,
            "gpu_ratio": None if ms_gpu is None else ms_gpu / roof_ms, "bound": bound, **mean.to_dict()}


def engine_points(loaded, arm: str, tier: str | None, s: Settings, device, dtype, ceilings,
                  busy_device: str | None) -> list[dict]:
    """Build an engine over ``loaded``, measure every decode and prefill point, close its tables."""
    from engram.bench.engine_steps import engine_config, free_memory, measure_decode, measure_prefill, prompt_ids
    from engram.bench.roofline import StepShape
    from engram.bench.v4_roofline import RoutingProbe, decode_cost, v4_weights
    from engram.engine.engine import LLMEngine
    from engram.engine.heap import freeze_startup_heap, thaw_heap
    from engram.model.deepseek_v4.config import V4Config

    cfg = loaded.model_config
    itemsize = dtype.itemsize
    engine = LLMEngine(loaded, engine_config(s, cfg.max_position_embeddings), device, dtype)
    freeze_startup_heap()  # as engram serve does (engine/heap.py); thawed before the arm's model is dropped
    points = []
    weights = v4_weights(loaded.model) if isinstance(cfg, V4Config) else None  # the roofline's weight split, once
    try:
        for b in s.batch_sizes:
            prompts = prompt_ids(b, s.context_len, cfg.vocab_size, s.seed + b)
            routing = RoutingProbe(engine) if isinstance(cfg, V4Config) else None
            t = measure_decode(engine, prompts, s.decode_steps, s.warmup_tokens, s.profile_steps, busy_device,
                               probe=routing)
            shapes = [StepShape.decode(ctx) for ctx in t.context_lens]
            ms_gpu = None if t.busy_s is None else t.busy_s * 1e3
            costs = None
            if routing is not None:  # positions = KV lengths after the step - 1
                costs = [decode_cost(cfg, weights, [c - 1 for c in ctx], routing.experts, itemsize, tier)
                         for ctx in t.context_lens]
            points.append(make_point(cfg, arm, tier, "decode", b, s.context_len, shapes,
                                     statistics.fmean(t.wall_s) * 1e3, ms_gpu, b, itemsize, ceilings, costs))
            points[-1]["graph_steps"] = t.graph_steps
            if routing is not None:
                points[-1]["routed_experts"] = routing.experts
            walls = sorted(t.wall_s)  # the mean hides whether a few slow steps (GC, a page fault) or all moved
            points[-1]["ms_wall_median"] = statistics.median(walls) * 1e3
            points[-1]["ms_wall_max"] = walls[-1] * 1e3
            if s.kernels and t.kernels:
                n = len(t.busy_context_lens)
                points[-1]["kernels"] = [{"name": k.name, "calls": k.calls / n, "us": k.seconds / n * 1e6}
                                         for k in t.kernels[:s.kernels]]
            _progress(points[-1])
        for n, length in s.prefill_shapes:
            t = measure_prefill(engine, n, length, cfg.vocab_size, s.prefill_repeats, busy_device, s.seed)
            ms_gpu = None if t.busy_s is None else t.busy_s * 1e3
            points.append(make_point(cfg, arm, tier, "prefill", n, length, [StepShape.prefill(n, length)],
                                     statistics.median(t.wall_s) * 1e3, ms_gpu, n * length, itemsize, ceilings))
            _progress(points[-1])
    finally:
        for table in engine.executor.worker.tables.values():
            table.close()
        del engine
        thaw_heap()
        free_memory(device)
    return points


def peer_points(cfg, s: Settings, device, dtype, ceilings, compile_mode: str | None,
                busy_device: str | None) -> tuple[list[dict], int]:
    """The HF peer's decode points (Engram off in the roofline) and the graphs torch.compile produced."""
    import torch

    from engram.bench.engine_steps import free_memory, prompt_ids
    from engram.bench.hf_peer import build_peer, measure_peer
    from engram.bench.roofline import StepShape

    plain = cfg.replace(engram=None)
    model = build_peer(plain, device, dtype, s.seed)
    points, graphs = [], 0
    try:
        for b in s.batch_sizes:
            prompts = prompt_ids(b, s.context_len, cfg.vocab_size, s.seed + b)
            t = measure_peer(model, prompts, s.decode_steps, s.warmup_tokens, compile_mode, busy_device)
            graphs += t.compiled_graphs
            point = make_point(plain, "hf-peer", None, "decode", b, s.context_len,
                               [StepShape.decode(ctx) for ctx in t.context_lens], t.ms_per_step,
                               t.busy_ms_per_step, b, dtype.itemsize, ceilings)
            point.update(compile=compile_mode or "off", compiled_graphs=t.compiled_graphs)
            points.append(point)
            _progress(point)
    finally:
        del model
        if compile_mode is not None:
            torch._dynamo.reset()  # the next model compiles afresh, with its own recompile budget
        free_memory(device)
    return points, graphs


def engram_cost(points: list[dict]) -> list[dict]:
    """Per Engram point: the ms difference from the engram-off point of the same model, phase, batch and context."""
    off = {(p["model"], p["phase"], p["batch"], p["context"]): p for p in points if p["arm"] == "engram-off"}
    rows = []
    for p in points:
        base = off.get((p["model"], p["phase"], p["batch"], p["context"]))
        if not p["engram"] or base is None:
            continue
        gpu = None if p["ms_gpu"] is None or base["ms_gpu"] is None else p["ms_gpu"] - base["ms_gpu"]
        rows.append({"model": p["model"], "tier": p["tier"], "phase": p["phase"], "batch": p["batch"],
                     "context": p["context"], "ms_off": base["ms_wall"], "ms_on": p["ms_wall"],
                     "ms_engram": p["ms_wall"] - base["ms_wall"], "rel": p["ms_wall"] / base["ms_wall"] - 1.0,
                     "ms_gpu_engram": gpu})
    return rows


def plot_points(points: list[dict], path: str) -> None:
    """Decode ms/step against batch size per arm (solid) with each arm's roofline (dashed), one panel per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p["model"] for p in points))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        decode = [p for p in points if p["model"] == model and p["phase"] == "decode"]
        for i, arm in enumerate(dict.fromkeys(p["arm"] for p in decode)):
            pts = sorted((p for p in decode if p["arm"] == arm), key=lambda p: p["batch"])
            xs = [p["batch"] for p in pts]
            ax.plot(xs, [p["ms_wall"] for p in pts], "o-", color=f"C{i}", label=arm)
            if all(p["roofline_ms"] is not None for p in pts):
                ax.plot(xs, [p["roofline_ms"] for p in pts], "--", color=f"C{i}", lw=1, label=f"{arm} roofline")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size (sequences decoding)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{model}: context {decode[0]['context'] if decode else '?'} tokens", fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _progress(p: dict) -> None:
    roof = "no roofline" if p["roofline_ms"] is None else f"roofline {p['roofline_ms']:.3f} ms, {p['ratio']:.2f}x"
    print(f"{p['model']} {p['arm']} {p['phase']} batch {p['batch']} x {p['context']}: {p['ms_wall']:.3f} ms/step "
          f"({roof})", file=sys.stderr, flush=True)


# ----------------------------------------------------------------- the command
def plan(models: list[str], arms: int, s, peer: bool) -> str:
    """What the run will measure, said before it starts (a model's time is known only once it ran: each model
    ends with the time taken and an estimate of what is left)."""
    points = len(s.batch_sizes) + len(s.prefill_shapes)
    steps = s.warmup_tokens + s.decode_steps + s.profile_steps
    return (f"bench engine: {len(models)} model(s) x {arms} arm(s) x {points} point(s) ({len(s.batch_sizes)} decode "
            f"batches of {steps} steps after a {s.context_len}-token prefill, {len(s.prefill_shapes)} prefill shapes x "
            f"{s.prefill_repeats} repeats); each arm loads its model and, on CUDA, captures its graphs"
            + ("; the HF peer compiles first (minutes on CUDA; --no-peer skips it)" if peer else "")
            + ". Fewer --models, --tiers, --batch-sizes or --prefill-shapes shorten it.")


def run(args: argparse.Namespace) -> int:
    import torch

    from engram.bench.engine_steps import engine_config, free_memory, parse_engram_config, runtime_options
    from engram.bench.hf_peer import unavailable_reason
    from engram.bench.report import args_config, format_table, write_result
    from engram.bench.roofline import measure_ceilings
    from engram.model.loader import random_model, resolve_dtype
    from engram.model.presets import MODEL_PRESETS, preset_config

    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads={args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(args.dtype, device)
    models = [m.strip() for m in (args.models or (CUDA_MODELS if device.type == "cuda" else CPU_MODELS)).split(",")
              if m.strip()]
    unknown = [m for m in models if m not in MODEL_PRESETS]
    if unknown or not models:
        raise SystemExit(f"--models: {unknown or models} not among the presets {MODEL_PRESETS}")
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not tiers or any(t not in TIERS for t in tiers):
        raise SystemExit(f"--tiers: {args.tiers!r} must list tiers among {TIERS}")
    opts = runtime_options(parse_engram_config(args.engram_config), "--engram-config")
    configs = {name: preset_config(name, table_rows=opts.table_rows, seed=opts.seed) for name in models}
    if args.speculative_config is not None:
        from engram.bench.spec_ab import run_spec

        return run_spec(args, configs[models[0]], opts, device, dtype)
    if args.prefill_shapes is None:  # the defaults fit every model; shapes asked for are refused if they do not
        args.prefill_shapes = default_prefill_shapes(min(c.max_position_embeddings for c in configs.values()))
    s = settings_from(args, opts.seed)
    compile_mode = {"auto": "reduce-overhead" if device.type == "cuda" else None, "off": None}.get(
        args.peer_compile, args.peer_compile)
    for cfg in configs.values():
        engine_config(s, cfg.max_position_embeddings)  # refuses a context too long before anything loads
    busy_device = "cuda" if device.type == "cuda" and s.profile_steps > 0 else None  # 0: no profiling at all
    peer_reason = "--no-peer" if args.no_peer else unavailable_reason()

    arms = len(dict.fromkeys(opts.tier(t) for t in tiers)) + (not args.no_engram_off) + (peer_reason is None)
    print(plan(models, arms, s, peer_reason is None), file=sys.stderr, flush=True)
    started = time.monotonic()
    ceilings = measure_ceilings(device, dtype)
    print(f"ceilings on {device}: copy {ceilings.memory_GBps:.1f} GB/s, matmul {ceilings.matmul_TFLOPs:.2f} TFLOP/s "
          f"({ceilings.dtype})" + (f", host link {ceilings.link_GBps:.1f} GB/s" if ceilings.link_GBps else ""),
          file=sys.stderr, flush=True)
    points, warnings, peer_failed = [], [], False
    for name, cfg in configs.items():
        base = random_model(cfg, opts.tier(tiers[0]), dtype, device, opts.seed, opts=opts, progress=False)
        for tier in dict.fromkeys(opts.tier(t) for t in tiers):
            loaded = dataclasses.replace(base, tables={}, tier=tier)
            points += engine_points(loaded, f"engram/{tier}", tier, s, device, dtype, ceilings, busy_device)
        del base, loaded
        free_memory(device)
        if not args.no_engram_off:
            plain = random_model(cfg.replace(engram=None), "gpu", dtype, device, opts.seed, opts=opts, progress=False)
            points += engine_points(plain, "engram-off", None, s, device, dtype, ceilings, busy_device)
            del plain
        if peer_reason is None and cfg.architecture == "deepseek_v4":
            warnings.append(f"{name}: no hf-peer points (the HF peer is a dense Qwen3; none for deepseek_v4)")
        elif peer_reason is None:
            try:  # the peer is a comparison: its failure (a transformers or Inductor error) must not lose the rest
                peer, graphs = peer_points(cfg, s, device, dtype, ceilings, compile_mode, busy_device)
            except Exception as e:
                traceback.print_exc()
                warnings.append(f"{name}: hf-peer failed, no peer points: {type(e).__name__}: {e}")
                peer, graphs, peer_failed = [], None, True
            free_memory(device)  # the failure's traceback (and the peer model it held) is gone by now
            points += peer
            if compile_mode is not None and graphs == 0:
                warnings.append(f"{name}: hf-peer asked for torch.compile ({compile_mode}) but no graph was "
                                f"compiled: its numbers are eager")
        done = list(configs).index(name) + 1
        took = time.monotonic() - started
        print(f"bench engine: {done} of {len(configs)} models in {took:.0f} s, about "
              f"{took / done * (len(configs) - done):.0f} s left", file=sys.stderr, flush=True)
    status = "skipped" if peer_reason else "failed" if peer_failed else "ran"
    peer = {"status": status, "reason": peer_reason, "compile": compile_mode or "off",
            "transformers": None if peer_reason else sys.modules["transformers"].__version__}
    cost = engram_cost(points)
    engine_configs = {name: dataclasses.asdict(engine_config(s, cfg.max_position_embeddings))
                      for name, cfg in configs.items()}
    result = {"settings": dataclasses.asdict(s), "engine_config": engine_configs, "ceilings": ceilings.to_dict(),
              "points": points,
              "engram_cost": cost, "peer": peer, "warnings": warnings}
    path = write_result("engine-" + "+".join(models), args_config(args), result, out=args.out)
    print(format_table(points, TABLE_COLUMNS))
    if cost:
        print()
        print(format_table(cost, ["model", "tier", "phase", "batch", "context", "ms_off", "ms_on", "ms_engram", "rel"]))
    if peer_reason:
        print(f"hf-peer skipped: {peer_reason}")
    for w in warnings:
        print(f"warning: {w}")
    for p in points:
        if p.get("kernels"):
            print(f"\n{p['arm']} decode batch {p['batch']}: largest kernels per step "
                  f"(GPU busy {p['ms_gpu']:.3f} ms)")
            print(format_table([{"us": k["us"], "calls": k["calls"], "kernel": k["name"][:100]} for k in p["kernels"]],
                               ["us", "calls", "kernel"]))
    if args.plot:
        plot_points(points, args.plot)
        print(f"plot: {args.plot}")
    print(f"result: {path}")
    return 0
