"""The serving roofline: the least time the steps a server actually ran allow, summed over a measured window, and the
same bound for an ideal schedule of the window's tokens.

Per step (an engine ``StepRecord``): max(compute, memory[, link]) seconds where
  compute = projection FLOPs / R(T) + LM-head FLOPs / R_head(sampled) + attention FLOPs / R_peak,
  memory  = (weights once + KV read and written + Engram rows) / copy bandwidth   (roofline.totals_cost),
R(M) the rate of the model's own projection GEMMs [M, K] x [K, N] timed at a grid of M and interpolated in time,
R_head the LM head's, R_peak the best rate any projection reached (attention's FLOPs at it: a bound, not a model).
The ideal schedule (``ideal_schedule``) feeds every prompt token in full ``batch_tokens`` steps and every later output
token in decode steps of ``concurrency`` sequences; it is a reference, not a bound over all schedules (a scheduler
that rides prefill chunks on memory-bound decode steps can beat it)."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch

from engram.bench.roofline import Ceilings, flop_terms, matmul_params_per_token, median_seconds, totals_cost
from engram.engine.step_trace import StepRecord
from engram.model.model_config import ModelConfig

CUDA_POOL_BYTES = 256 << 20  # weight copies cycled per timed shape: past the L2 cache, as a model's layers are
CPU_POOL_BYTES = 16 << 20
MAX_COPIES = 16


# ----------------------------------------------------------------- the model's GEMMs
@dataclass(frozen=True)
class GemmShape:
    """``count`` projections of ``in_features`` -> ``out_features`` each token passes through in one forward."""

    in_features: int
    out_features: int
    count: int


def gemm_shapes(cfg: ModelConfig) -> list[GemmShape]:
    """The projections ``matmul_params_per_token`` counts, grouped by shape (q, o, k and v of KV-owning layers, gate,
    up, down, Engram wkv); Σ count x in x out equals it (checked)."""
    h, qdim, kvdim, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    counts: Counter[tuple[int, int]] = Counter()
    for layer in range(cfg.num_layers):
        counts[(h, qdim)] += 1
        counts[(qdim, h)] += 1
        if cfg.kv_source(layer) == layer:
            counts[(h, kvdim)] += 2
        counts[(h, inter)] += 2
        counts[(inter, h)] += 1
    e = cfg.engram
    if e is not None:
        counts[(e.n_cols * e.head_dim, (e.hc_mult + 1) * h)] += len(e.layer_ids)
    shapes = [GemmShape(k, n, c) for (k, n), c in counts.items()]
    if sum(s.count * s.in_features * s.out_features for s in shapes) != matmul_params_per_token(cfg):
        raise AssertionError(f"gemm_shapes of {cfg.name} disagree with matmul_params_per_token")
    return shapes


@dataclass(frozen=True)
class GemmCurve:
    """Seconds of all the model's projection GEMMs at each M of ``ms`` (``model_s``) and of the LM head at each M of
    ``head_ms``; time is interpolated linearly between grid points and grows in proportion past the last."""

    ms: tuple[int, ...]
    model_s: tuple[float, ...]
    head_ms: tuple[int, ...]
    head_s: tuple[float, ...]
    flops_per_token: int  # 2 x matmul parameters
    head_flops_per_row: int  # 2 x vocab x hidden

    def __post_init__(self) -> None:
        for name, xs, ts in (("ms", self.ms, self.model_s), ("head_ms", self.head_ms, self.head_s)):
            if not xs or len(xs) != len(ts) or list(xs) != sorted(set(xs)) or xs[0] < 1 or min(ts) <= 0:
                raise ValueError(f"GemmCurve.{name}={xs} / times {ts}: need ascending distinct M >= 1, times > 0")

    @staticmethod
    def _time(xs: tuple[int, ...], ts: tuple[float, ...], m: float) -> float:
        if m <= 0:
            return 0.0
        if m > xs[-1]:
            return ts[-1] * m / xs[-1]
        return float(np.interp(m, xs, ts))

    def model_time(self, m: float) -> float:
        return self._time(self.ms, self.model_s, m)

    def head_time(self, m: float) -> float:
        return self._time(self.head_ms, self.head_s, m)

    def rate(self, m: float) -> float:
        """R(M): projection FLOP/s at M tokens."""
        return self.flops_per_token * m / self.model_time(m)

    @property
    def peak_flops(self) -> float:
        """The best FLOP/s any measured M reached (projections or LM head)."""
        return max([self.flops_per_token * m / t for m, t in zip(self.ms, self.model_s)]
                   + [self.head_flops_per_row * m / t for m, t in zip(self.head_ms, self.head_s)])

    def to_dict(self) -> dict:
        return {**asdict(self), "peak_TFLOPs": self.peak_flops / 1e12,
                "rate_TFLOPs": [self.rate(m) / 1e12 for m in self.ms]}


def m_grid(largest: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 x them) up to the first >= ``largest``."""
    out, p = [1], 2
    while out[-1] < largest:
        out += [x for x in (p, p + p // 2) if x > out[-1]]
        p *= 2
    return tuple(x for i, x in enumerate(out) if i == 0 or out[i - 1] < largest)


def measure_gemm_curve(cfg: ModelConfig, ms: tuple[int, ...], head_ms: tuple[int, ...], device: torch.device | str,
                       dtype: torch.dtype, timer: Callable[[Callable[[], object], torch.device], float] | None = None,
                       pool_bytes: int | None = None) -> GemmCurve:
    """Time each of ``gemm_shapes(cfg)`` and the LM head (``x @ W.T`` as the model's linear layers run) at every M;
    each timed call cycles through enough weight copies to fill ``pool_bytes``, so weights come from memory, not
    cache. ``timer(fn, device)`` times one call (default ``roofline.median_seconds``)."""
    timer = timer or median_seconds
    device = torch.device(device)
    pool = pool_bytes or (CUDA_POOL_BYTES if device.type == "cuda" else CPU_POOL_BYTES)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(0)

    def seconds(k: int, n: int, grid: tuple[int, ...]) -> list[float]:
        copies = max(1, min(MAX_COPIES, math.ceil(pool / (k * n * itemsize))))
        weights = [torch.randn(n, k, device=device, dtype=dtype, generator=g) for _ in range(copies)]  # [N, K]
        out = []
        for m in grid:
            x = torch.randn(m, k, device=device, dtype=dtype, generator=g)  # [M, K]
            y = torch.empty(m, n, device=device, dtype=dtype)  # [M, N]

            def run() -> None:
                for w in weights:
                    torch.mm(x, w.t(), out=y)

            out.append(timer(run, device) / copies)
        del weights
        return out

    with torch.inference_mode():
        model_s = np.zeros(len(ms))
        for s in gemm_shapes(cfg):
            model_s += s.count * np.asarray(seconds(s.in_features, s.out_features, ms))
        head_s = seconds(cfg.hidden_size, cfg.padded_vocab_size, head_ms)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return GemmCurve(ms=tuple(ms), model_s=tuple(float(t) for t in model_s), head_ms=tuple(head_ms),
                     head_s=tuple(head_s), flops_per_token=2 * matmul_params_per_token(cfg),
                     head_flops_per_row=2 * cfg.padded_vocab_size * cfg.hidden_size)


# ----------------------------------------------------------------- steps
@dataclass(frozen=True)
class StepBound:
    """One step's roofline terms in seconds; ``bound`` names the largest."""

    compute_s: float
    memory_s: float
    link_s: float
    roofline_s: float
    bound: str  # "compute", "memory" or "link"


def step_bound(cfg: ModelConfig, num_tokens: float, kv_read: float, attended: float, sampled: float,
               curve: GemmCurve, ceilings: Ceilings, itemsize: int, tier: str = "gpu") -> StepBound:
    """The roofline of one step given as totals (module docstring); on the CPU (no link) Engram rows are memory."""
    cost = totals_cost(cfg, num_tokens, kv_read, attended, sampled, itemsize, tier)
    proj, head, attn = flop_terms(cfg, num_tokens, attended, sampled)
    compute = (proj / curve.rate(num_tokens) if num_tokens else 0.0) + curve.head_time(sampled) \
        + attn / curve.peak_flops
    on_link = ceilings.link_GBps is not None
    memory = (cost.memory_bytes + (0 if on_link else cost.link_bytes)) / (ceilings.memory_GBps * 1e9)
    link = cost.link_bytes / (ceilings.link_GBps * 1e9) if on_link else 0.0
    terms = {"compute": compute, "memory": memory, "link": link}
    bound = max(terms, key=terms.get)
    return StepBound(compute, memory, link, terms[bound], bound)


def record_bound(cfg: ModelConfig, r: StepRecord, curve: GemmCurve, ceilings: Ceilings, itemsize: int,
                 tier: str = "gpu") -> StepBound:
    return step_bound(cfg, r.num_tokens, r.kv_read, r.attended, r.sampled, curve, ceilings, itemsize, tier)


def serving_roofline(cfg: ModelConfig, records: list[StepRecord], curve: GemmCurve, ceilings: Ceilings,
                     itemsize: int, tier: str, wall: float, tpot_p50: float | None) -> dict:
    """The window's roofline: Σ over its steps, ``ratio`` = that ÷ ``wall``, the mean step's roofline beside TPOT p50,
    and per step kind the steps, their roofline seconds, measured GPU seconds (CUDA) and compute/memory-bound counts."""
    bounds = [record_bound(cfg, r, curve, ceilings, itemsize, tier) for r in records]
    total = sum(b.roofline_s for b in bounds)
    decode_bearing = [b.roofline_s for r, b in zip(records, bounds) if r.num_decode > 0]
    by_kind = {}
    for kind in ("decode", "mixed", "prefill"):
        pairs = [(r, b) for r, b in zip(records, bounds) if r.kind == kind]
        gpu_s = [r.gpu_s for r, _ in pairs if r.gpu_s is not None]  # CUDA only
        by_kind[kind] = {"steps": len(pairs), "tokens": sum(r.num_tokens for r, _ in pairs),
                         "roofline_s": sum(b.roofline_s for _, b in pairs), "gpu_s": sum(gpu_s) if gpu_s else None,
                         "bound": dict(Counter(b.bound for _, b in pairs))}
    mean = total / len(records) if records else None
    mean_decode = float(np.mean(decode_bearing)) if decode_bearing else None
    gpu = [r.gpu_s for r in records if r.gpu_s is not None]
    return {"steps": len(records), "roofline_s": total, "wall_s": wall, "ratio": total / wall if wall > 0 else None,
            "gpu_busy_s": sum(gpu) if gpu else None, "roofline_over_gpu_busy": total / sum(gpu) if gpu else None,
            "mean_step_roofline_s": mean, "mean_decode_step_roofline_s": mean_decode, "tpot_p50_s": tpot_p50,
            "tpot_p50_over_mean_step": tpot_p50 / mean_decode if tpot_p50 and mean_decode else None,
            "by_kind": by_kind, "bound": dict(Counter(b.bound for b in bounds))}


# ----------------------------------------------------------------- the ideal schedule
def ideal_schedule(cfg: ModelConfig, prompt_lens: list[int], output_lens: list[int], batch_tokens: int,
                   concurrency: int, curve: GemmCurve, ceilings: Ceilings, itemsize: int, tier: str = "gpu") -> dict:
    """The roofline of the window's requests in an ideal schedule: prompt tokens in ceil(P / batch_tokens) steps of
    ``batch_tokens`` (the last the rest), each first token sampled there; the later o - 1 output tokens of each request
    in ceil(D / concurrency) decode steps of ``concurrency`` sequences. A step's KV read, attended pairs and samples are
    its token share of the part's totals (prompt i: p(p + 1)/2 pairs, Σ p KV; decode token j of request i: p + j)."""
    if batch_tokens < 1 or concurrency < 1:
        raise ValueError(f"batch_tokens={batch_tokens}, concurrency={concurrency}: both must be >= 1")
    p = np.asarray(prompt_lens, dtype=np.float64)
    o = np.asarray(output_lens, dtype=np.float64)
    d = np.maximum(o - 1, 0)
    parts = {"prefill": (float(p.sum()), batch_tokens, float((p * (p + 1) / 2).sum()), float(p.sum()), float(p.size)),
             "decode": (float(d.sum()), concurrency, float((d * p + d * (d + 1) / 2).sum()), None, None)}
    out: dict = {"batch_tokens": batch_tokens, "concurrency": concurrency}
    total = 0.0
    for name, (tokens, width, attended, kv_read, sampled) in parts.items():
        steps = math.ceil(tokens / width) if tokens else 0
        seconds = 0.0
        for n, times in ((width, steps - 1), (tokens - width * (steps - 1), 1)) if steps else ():
            share = n / tokens  # every full step is alike: one bound times their count, then the last
            kv = attended * share if kv_read is None else kv_read * share  # a decode token reads p + j entries
            seconds += times * step_bound(cfg, n, kv, attended * share, n if sampled is None else sampled * share,
                                          curve, ceilings, itemsize, tier).roofline_s
        out[f"{name}_steps"], out[f"{name}_s"] = steps, seconds
        total += seconds
    out["roofline_s"] = total
    out["output_tokens_per_s"] = float(o.sum()) / total if total > 0 else None
    return out
