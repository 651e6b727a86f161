"""Roofline of one engine step: the least time its bytes and FLOPs allow at ceilings measured on the machine.
``step_cost`` counts a ``StepShape`` as a lower bound: every weight once (an untied embedding only the step's rows), K/V
read for every layer's KV length and written for the new tokens, T x n_cols Engram rows per layer as stored (over the
host link on tier "host"); FLOPs of the projections, the LM head over sampling rows and causal attention.
``totals_cost`` is the same count for a step given as totals (the engine's step records). ``parameter_counts`` matches
EngramDecoder's allocation exactly (a test compares). ``measure_ceilings`` measures copy
bandwidth, matmul rate and (CUDA) the pinned-host link; ``roofline`` is the largest of the three times, and which."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from engram.model.model_config import ModelConfig

CUDA_COPY_BYTES = 1 << 30  # 1 GiB copied (2 GiB moved) per bandwidth sample
CUDA_MATMUL_N = 8192
CPU_COPY_BYTES = 32 << 20
CPU_MATMUL_N = 512
REPEATS = 7


# ----------------------------------------------------------------- parameters
def parameter_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by group (embedding, lm_head, attention, mlp, norms, hyper_connections, engram), as allocated."""
    h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qdim, kvdim = nh * hd, nkv * hd
    attn = 0
    for layer in range(cfg.num_layers):
        owns_kv = cfg.kv_source(layer) == layer
        attn += h * qdim + qdim * h + (2 * h * kvdim if owns_kv else 0)
        if cfg.attention_bias:
            attn += qdim + (2 * kvdim if owns_kv else 0) + (h if cfg.architecture != "qwen2" else 0)
        if cfg.qk_norm:
            attn += hd + (hd if owns_kv else 0)
    hc = cfg.hc_mult
    return {
        "embedding": cfg.padded_vocab_size * h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.padded_vocab_size * h,
        "attention": attn,
        "mlp": cfg.num_layers * 3 * h * cfg.intermediate_size,
        "norms": (2 * cfg.num_layers + 1) * h,
        "hyper_connections": cfg.num_layers * 2 * (2 * hc + hc * hc) if hc > 1 else 0,
        "engram": len(cfg.engram_layer_ids) * _engram_layer_params(cfg),
    }


def _engram_layer_params(cfg: ModelConfig) -> int:
    e = cfg.engram
    if e is None:
        return 0
    h, hc, d_in = cfg.hidden_size, e.hc_mult, e.n_cols * e.head_dim
    if e.variant == "v41":
        return d_in * (hc + 1) * h + 2 * hc * h  # wkv, q_weight, k_weight
    # value_proj and hc key_projs (weights + biases), hc key norms, hc query norms, ShortConv (conv + hc norms)
    return (hc + 1) * (d_in * h + h) + 2 * hc * h + hc * h * e.kernel_size + hc * h


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights every token is multiplied by: q/k/v/o and gate/up/down of each layer, the Engram projections."""
    h, qdim, kvdim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    total = 0
    for layer in range(cfg.num_layers):
        total += 2 * h * qdim + (2 * h * kvdim if cfg.kv_source(layer) == layer else 0) + 3 * h * cfg.intermediate_size
    e = cfg.engram
    if e is not None:
        total += len(e.layer_ids) * (e.hc_mult + 1) * e.n_cols * e.head_dim * h  # v41 wkv = paper value + keys
    return total


# ----------------------------------------------------------------- one step
@dataclass(frozen=True)
class StepShape:
    """One step: ``new_tokens[s]`` computed, ``context_lens[s]`` KV entries after it, ``sampled`` LM-head rows."""

    new_tokens: tuple[int, ...]
    context_lens: tuple[int, ...]
    sampled: int

    def __post_init__(self) -> None:
        if len(self.new_tokens) != len(self.context_lens):
            raise ValueError(f"StepShape: {len(self.new_tokens)} new_tokens but {len(self.context_lens)} context_lens")
        bad = [(n, c) for n, c in zip(self.new_tokens, self.context_lens) if not 1 <= n <= c]
        if bad:
            raise ValueError(f"StepShape: every sequence needs 1 <= new_tokens <= context_len, got {bad[:3]}")

    @classmethod
    def decode(cls, context_lens) -> "StepShape":
        """Every sequence decodes one token (and samples)."""
        ctx = tuple(int(c) for c in context_lens)
        return cls((1,) * len(ctx), ctx, len(ctx))

    @classmethod
    def prefill(cls, num_seqs: int, length: int) -> "StepShape":
        """``num_seqs`` fresh prompts of ``length`` tokens, each sampling its first token."""
        return cls((length,) * num_seqs, (length,) * num_seqs, num_seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)


@dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs of one step (see the module docstring for what each term counts)."""

    weight_bytes: int
    kv_bytes: int
    engram_bytes: int
    memory_bytes: int  # over device memory: weights + KV (+ Engram rows on tier gpu)
    link_bytes: int  # over the host link: Engram rows on tier host, else 0
    flops: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def step_cost(cfg: ModelConfig, shape: StepShape, itemsize: int, tier: str | None = "gpu") -> StepCost:
    """Bytes and FLOPs of one step in a dtype of ``itemsize`` bytes; ``tier``: where Engram rows come from."""
    attended = sum(n * (c - n) + n * (n + 1) // 2 for n, c in zip(shape.new_tokens, shape.context_lens))
    return totals_cost(cfg, shape.num_tokens, sum(shape.context_lens), attended, shape.sampled, itemsize, tier)


def flop_terms(cfg: ModelConfig, num_tokens: int, attended: int, sampled: int) -> tuple[int, int, int]:
    """(projection FLOPs over ``num_tokens``, LM-head FLOPs over ``sampled`` rows, attention FLOPs over ``attended``
    causal (query, key) pairs: QK^T and PV, 2 FLOPs each per head dimension)."""
    return (2 * matmul_params_per_token(cfg) * num_tokens, 2 * cfg.padded_vocab_size * cfg.hidden_size * sampled,
            4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * attended)


def totals_cost(cfg: ModelConfig, num_tokens: int, kv_read: int, attended: int, sampled: int, itemsize: int,
                tier: str | None = "gpu") -> StepCost:
    """``step_cost`` of a step given as totals (an engine StepRecord): ``kv_read`` = Σ KV entries after the step,
    ``attended`` = Σ causal (query, key) pairs."""
    h, t = cfg.hidden_size, num_tokens
    counts = parameter_counts(cfg)
    read = sum(counts.values())
    if not cfg.tie_word_embeddings:  # an untied embedding: only the step's rows are read
        read += (min(t, cfg.padded_vocab_size) - cfg.padded_vocab_size) * h
    weight_bytes = read * itemsize
    kv_entry = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize  # K and V of one token in one layer
    kv_bytes = kv_entry * (cfg.num_layers * kv_read + len(cfg.kv_layers) * t)
    e = cfg.engram
    engram_bytes = t * e.n_cols * e.row_bytes * len(e.layer_ids) if e is not None else 0
    on_link = e is not None and tier == "host"
    return StepCost(weight_bytes=weight_bytes, kv_bytes=kv_bytes, engram_bytes=engram_bytes,
                    memory_bytes=weight_bytes + kv_bytes + (0 if on_link else engram_bytes),
                    link_bytes=engram_bytes if on_link else 0, flops=sum(flop_terms(cfg, t, attended, sampled)))


# ----------------------------------------------------------------- ceilings
@dataclass(frozen=True)
class Ceilings:
    """What the machine reached in this run (see the module docstring for how each is measured)."""

    device: str  # "cuda" or "cpu"
    dtype: str  # compute dtype of the matmul
    memory_GBps: float  # copy bandwidth, bytes read + written per second / 1e9
    matmul_TFLOPs: float  # n^3 matmul rate in ``dtype``
    link_GBps: float | None  # pinned host -> device copy bandwidth; None on the CPU (one memory)
    copy_bytes: int  # bytes of the copied buffer (twice that moved per copy)
    matmul_n: int

    def to_dict(self) -> dict:
        return asdict(self)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = REPEATS) -> float:
    """Median time of ``fn`` over ``repeats`` runs after one warm-up: CUDA events on CUDA, else the host clock."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ceilings(device: torch.device | str, dtype: torch.dtype, copy_bytes: int | None = None,
                     matmul_n: int | None = None,
                     timer: Callable[[Callable[[], object], torch.device], float] | None = None) -> Ceilings:
    """Measure copy bandwidth, matmul rate and (CUDA) host-link bandwidth on ``device``; ``timer(fn, device)`` times one
    call (default ``median_seconds``)."""
    timer = timer or median_seconds
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    nbytes = copy_bytes or (CUDA_COPY_BYTES if on_cuda else CPU_COPY_BYTES)
    n = matmul_n or (CUDA_MATMUL_N if on_cuda else CPU_MATMUL_N)
    with torch.inference_mode():
        src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        copy_s = timer(lambda: dst.copy_(src), device)
        del src, dst
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
        out = torch.empty(n, n, device=device, dtype=dtype)
        mm_s = timer(lambda: torch.mm(a, b, out=out), device)
        del a, b, out
        link = None
        if on_cuda:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            link_s = timer(lambda: dev.copy_(host, non_blocking=True), device)
            link = nbytes / link_s / 1e9
            del host, dev
    if on_cuda:
        torch.cuda.empty_cache()
    return Ceilings(device=device.type, dtype=str(dtype).removeprefix("torch."), memory_GBps=2 * nbytes / copy_s / 1e9,
                    matmul_TFLOPs=2 * n ** 3 / mm_s / 1e12, link_GBps=link, copy_bytes=nbytes, matmul_n=n)


def roofline(cost: StepCost, ceilings: Ceilings) -> tuple[float, str]:
    """(seconds, "memory" | "link" | "compute"): the largest of the three times (CPU: link bytes are memory bytes)."""
    memory_bytes = cost.memory_bytes + (cost.link_bytes if ceilings.link_GBps is None else 0)
    terms = {"memory": memory_bytes / (ceilings.memory_GBps * 1e9),
             "compute": cost.flops / (ceilings.matmul_TFLOPs * 1e12)}
    if ceilings.link_GBps is not None:
        terms["link"] = cost.link_bytes / (ceilings.link_GBps * 1e9)
    bound = max(terms, key=terms.get)
    return terms[bound], bound
