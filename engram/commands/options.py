"""Options shared by `serve` and `generate`: their arguments, their validation without loading anything
(``check_options``), and the ``engram.LLM`` they describe (``build_llm``).
"""
from __future__ import annotations

import argparse
from typing import Any


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", default="tiny",
                   help="preset (tiny, small, 4b-like, 8b-like, v4-small-like) or checkpoint directory "
                        "(default: tiny)")
    g.add_argument("--tier", choices=("gpu", "host", "disk"), default="gpu",
                   help="where Engram tables live (gpu: device memory, or RAM without CUDA)")
    g.add_argument("--dtype", choices=("float32", "float64", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--engram-config", default=None, metavar="JSON",
                   help='runtime options, e.g. \'{"cpu_offload": true}\' (= tier host), cache_rows, cache_policy, '
                        'io, queue_depth, lookup_overlap')
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (small models on a busy CPU run fastest with 1)")


def add_engine_arguments(p: argparse.ArgumentParser, max_num_seqs: int = 64) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="sequences per step, at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step, at most")
    g.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens per sequence")
    g.add_argument("--block-size", type=int, default=16, help="tokens per paged KV block")
    g.add_argument("--kv-cache-memory", type=byte_count("--kv-cache-memory"), default=None,
                   help="bytes for KV blocks + Engram staging + hot-row cache, e.g. 8589934592 or 8GiB "
                        "(default: sized to the machine)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU the process may fill; the KV cache gets what a profiled step leaves")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: decode steps run eagerly")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch step N+1 before reading step N (default: on for CUDA; with the disk tier or a "
                        "hot-row cache a launch waits for the tokens in flight)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks and Engram state of cached prompt prefixes (default: on)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="Worker processes, one tensor-parallel rank each (gloo on the CPU, one GPU a rank "
                        "over NCCL; docs/parallel.md)")
    g.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages, each --tensor-parallel-size ranks (P x T Worker processes); the planner "
                        "picks the cut unless ENGRAM_PP_LAYER_PARTITION gives one (docs/parallel.md)")
    g.add_argument("--dedup-rows", action=argparse.BooleanOptionalAction, default=True,
                   help="deduplicate each step's Engram row ids on the host; tables gather each distinct row once "
                        "(default: on)")
    g.add_argument("--prompt-prefetch", action=argparse.BooleanOptionalAction, default=False,
                   help="stage prompts' Engram rows ahead of their prefill chunks (default: off; an experiment, "
                        "docs/engine.md)")
    g.add_argument("--prefetch-staging-bytes", type=byte_count("--prefetch-staging-bytes"), default=64 << 20,
                   help="bytes of staged prompt rows per Worker, taken from the KV budget (default: 64MiB)")
    g.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3}\' or \'{"method": "draft_model", "model": "tiny", '
                        '"num_speculative_tokens": 4}\' (docs/engine.md)')
    g.add_argument("--row-trace", default=None, metavar="FILE",
                   help="write every step's distinct Engram row ids per layer and its kind to FILE (a compact binary "
                        "trace that `engram bench serve` replays for the disk tier's bound; docs/benchmarking.md)")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (processes, each --tensor-parallel-size ranks) behind one router, requests "
                        "to the least-loaded; one copy of the host tables per node in /dev/shm (docs/parallel.md)")


def speculative_config(text: str) -> dict[str, Any]:
    """An argparse ``type``: the --speculative-config JSON object (SystemExit naming the option otherwise)."""
    from engram.config import parse_json_object

    try:
        return parse_json_object(text, "--speculative-config")
    except ValueError as e:
        raise SystemExit(str(e)) from None


def byte_count(option: str):
    """An argparse ``type`` for a byte count (engram.config.parse_bytes), SystemExit naming ``option``."""
    from engram.config import parse_bytes

    def parse(text: str) -> int:
        try:
            return parse_bytes(text, option)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    return parse


def parse_engram_config(text: str | None) -> dict[str, Any]:
    """The --engram-config JSON object ({} when not given)."""
    from engram.config import parse_json_object

    return parse_json_object(text, "--engram-config") if text else {}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the command line sets (``add_engine_arguments``)."""
    return dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                async_scheduling=args.async_scheduling, enable_prefix_caching=args.enable_prefix_caching,
                tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                data_parallel_size=args.data_parallel_size, speculative_config=args.speculative_config,
                dedup_rows=args.dedup_rows, prompt_prefetch=args.prompt_prefetch,
                prefetch_staging_bytes=args.prefetch_staging_bytes, row_trace=args.row_trace)


_ENGINE_OPTIONS = {"engine.max_num_seqs=": "--max-num-seqs=", "engine.max_num_batched_tokens=":
                   "--max-num-batched-tokens=", "engine.max_model_len=": "--max-model-len=",
                   "engine.block_size=": "--block-size=", "engine.kv_cache_memory=": "--kv-cache-memory=",
                   "engine.gpu_memory_utilization=": "--gpu-memory-utilization=",
                   "engine.tensor_parallel_size=": "--tensor-parallel-size=",
                   "engine.pipeline_parallel_size=": "--pipeline-parallel-size=",
                   "engine.data_parallel_size=": "--data-parallel-size=",
                   "engine.prefetch_staging_bytes=": "--prefetch-staging-bytes=", "engine.row_trace=": "--row-trace=",
                   "engine.async_scheduling=True":
                   "--async-scheduling", "speculative_config.": "--speculative-config "}


def check_options(args: argparse.Namespace) -> None:
    """ValueError, naming the option and its value, for any value of ``add_model_arguments`` /
    ``add_engine_arguments`` that cannot work, without loading anything (what needs the model, such as a
    --max-model-len beyond its positions, is checked when it loads)."""
    from engram.engine.config import EngineConfig
    from engram.model.options import RuntimeOptions

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} must be >= 1")
    RuntimeOptions.from_dict(parse_engram_config(args.engram_config))
    if args.row_trace is not None:
        from engram.engine.row_trace import check_trace_path

        try:
            check_trace_path(args.row_trace)
        except ValueError as e:
            raise ValueError(f"--row-trace={args.row_trace!r}: {e}") from None
    try:
        EngineConfig.from_options(engine_options(args))
    except ValueError as e:
        text = str(e)
        for field, option in _ENGINE_OPTIONS.items():
            text = text.replace(field, option)
        raise ValueError(text) from None


def run_torchrun_rank(args: argparse.Namespace) -> bool:
    """Under torchrun on a rank other than 0: build this rank's Worker from the command line and run rank 0's steps
    until it stops (engine/torchrun.py) -> True; otherwise (no torchrun, or rank 0) False at once."""
    from engram.engine.torchrun import serve_rank, torchrun_rank

    rank = torchrun_rank()
    if rank is None or rank == 0 or args.tensor_parallel_size == 1:
        return False
    import torch

    from engram.engine.config import EngineConfig
    from engram.engine.tp_rank import make_rank_spec
    from engram.model.loader import resolve_dtype
    from engram.model.options import RuntimeOptions

    options = RuntimeOptions.from_dict(parse_engram_config(args.engram_config))
    spec = make_rank_spec(args.model, options.tier(args.tier), resolve_dtype(args.dtype, torch.device("cpu")),
                          options, None, EngineConfig.from_options(engine_options(args)), "env://", args.threads)
    serve_rank(spec, rank)
    return True


def build_llm(args: argparse.Namespace):
    """An engram.LLM as the command line says (loads the model)."""
    import torch

    from engram.engine.llm import LLM

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    return LLM(args.model, tier=args.tier, dtype=args.dtype, engram_config=parse_engram_config(args.engram_config),
               device=args.device, **engine_options(args))
