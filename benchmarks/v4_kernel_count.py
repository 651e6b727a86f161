"""Kernels of one batched DeepSeek-V4 decode step (``batched_decode.decode_step``, the body the V4 decode graphs
capture), by part of the layer: on a CUDA graph every kernel costs a few microseconds however little it computes, so
their count bounds the step from below where bandwidth does not.

    python -m benchmarks.v4_kernel_count [--device cpu|cuda] [--batch 1] [--json OUT]

The model is v4-small-like's depth, layer pattern, Sinkhorn rounds and Engram layers at small widths (the count does
not depend on the widths; ``V4_COUNT_SHAPE``), random bf16 weights. On the CPU every aten op that launches a kernel on
CUDA is counted (a ``TorchDispatchMode``; views and allocations excluded): the torch reference, since fast paths run on
CUDA only. On CUDA, the device kernels torch's profiler records (Triton kernels included), fast paths as configured
(``ENGRAM_KERNELS``). Parts: each op is charged to the innermost of the instrumented calls running it."""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engram.bench.report import git_commit
from engram.model.deepseek_v4 import attention, batched_decode, indexer, mhc, moe
from engram.model.deepseek_v4.batched_state import BatchedCache
from engram.model.deepseek_v4.config import CSA, HCA
from engram.model.presets import random_v4_model, v4_preset_config

V4_COUNT_SHAPE = dict(hidden_size=64, num_attention_heads=4, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                      index_n_heads=4, index_head_dim=16, index_topk=8, qk_rope_head_dim=16, n_routed_experts=8,
                      moe_intermediate_size=32, vocab_size=4608, max_position_embeddings=2048, sliding_window=32,
                      compress_rates={CSA: 4, HCA: 16})
# (owner, attribute, part): the calls a step's ops are charged to (innermost wins); a part given as a function names
# itself from the call's arguments
PARTS = [(mhc.HyperConnection, "collapse", "mhc collapse"), (mhc.HyperConnection, "expand", "mhc expand"),
         (mhc, "rms_norm", lambda x, weight, eps: "rms norm" if weight is not None else "rms norm (no weight)"),
         (batched_decode, "compressor_step", "compressor"),
         (indexer.Indexer, "select", "indexer"), (attention.Attention, "project", "attention projections"),
         (attention.Attention, "project_out", "output projections"), (attention.Attention, "sink_probs", "sinks"),
         (moe.MoE, "forward", "moe")]
NOT_KERNELS = {"view", "_unsafe_view", "expand", "as_strided", "slice", "select", "t", "transpose", "permute",
               "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow", "diagonal",
               "unfold", "view_as_real", "view_as_complex", "_reshape_alias", "lift_fresh", "empty", "empty_like",
               "empty_strided", "promote_types", "_local_scalar_dense"}


class _Charged:
    """The part running now (a stack over the instrumented calls) and ops counted per part."""

    def __init__(self):
        self.stack, self.counts, self.calls = ["other"], collections.Counter(), collections.Counter()
        self.counting = False  # calls are counted in the measured step only

    @contextlib.contextmanager
    def instrumented(self):
        saved = []
        for owner, name, part in PARTS:
            real = owner.__dict__[name]
            fn = real.__func__ if isinstance(real, staticmethod) else real

            def wrapped(*a, _fn=fn, _part=part, **k):
                name = _part(*a, **k) if callable(_part) else _part
                self.calls[name] += self.counting
                self.stack.append(name)
                try:
                    return _fn(*a, **k)
                finally:
                    self.stack.pop()
            setattr(owner, name, staticmethod(wrapped) if isinstance(real, staticmethod) else wrapped)
            saved.append((owner, name, real))
        try:
            yield
        finally:
            for owner, name, real in saved:
                setattr(owner, name, real)


class _AtenKernels(TorchDispatchMode):
    def __init__(self, charged: _Charged):
        super().__init__()
        self.charged = charged

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NOT_KERNELS:
            self.charged.counts[self.charged.stack[-1]] += 1
        return func(*args, **(kwargs or {}))


def count(device: str = "cpu", batch: int = 1, position: int = 200) -> dict:
    """One decode step of ``batch`` sequences at ``position`` -> {"kernels": total, "parts": {part: n}, ...}."""
    cfg = v4_preset_config("v4-small-like", table_rows=24 * 60, **V4_COUNT_SHAPE)
    model = random_v4_model(cfg, torch.bfloat16, device, 0)
    cache = BatchedCache.zeros(model, batch, position // 4 + 8, torch.bfloat16, device)
    cache.positions.fill_(position)
    e = cfg.engram
    rows = torch.zeros(batch, e.n_cols, e.head_dim, dtype=torch.bfloat16, device=device)
    args = (model, torch.zeros(batch, dtype=torch.long, device=device), cache)
    kw = dict(engram_rows=lambda lid: rows, dead_mask=torch.zeros(batch, dtype=torch.bool, device=device),
              ropes=model.ropes(device))
    charged = _Charged()
    with torch.no_grad(), charged.instrumented():
        batched_decode.decode_step(*args, **kw)  # warm-up (Triton compiles, lazy buffers)
        charged.counting = True
        if device == "cpu":
            with _AtenKernels(charged):
                batched_decode.decode_step(*args, **kw)
        else:
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                batched_decode.decode_step(*args, **kw)
                torch.cuda.synchronize()
            kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
            charged.counts["all (the profiler does not split by part)"] = len(kernels)
    parts = dict(charged.counts.most_common())
    return {"device": device, "batch": batch, "position": position, "layers": cfg.num_layers,
            "sinkhorn_iters": cfg.hc_sinkhorn_iters, "kernels": sum(parts.values()), "parts": parts,
            "calls": dict(charged.calls.most_common()),
            "counted": "aten ops that launch a kernel (reference path)" if device == "cpu" else "CUDA kernels",
            **git_commit()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", help="write the counts here too")
    args = p.parse_args(argv)
    res = count(args.device, args.batch)
    print(f"{res['kernels']} kernels in one decode step ({res['counted']}), batch {res['batch']}, "
          f"{res['layers']} layers:")
    for part, n in res["parts"].items():
        calls = res["calls"].get(part)
        print(f"  {part:24s} {n:6d}" + (f"  ({calls} calls)" if calls else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
