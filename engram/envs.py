"""Every environment variable engram reads: debugging and deployment switches, never settings (those are
typed objects passed down). Each is listed in ``VARIABLES`` and documented in docs/config.md.
"""
from __future__ import annotations

import os
from pathlib import Path

VARIABLES = {
    "ENGRAM_CACHE_DIR": "root of engram's caches: preset tables, the compressed-tokenizer maps "
                        "(default ~/.cache/engram)",
    "ENGRAM_KERNELS": "fast path or reference per kernel: 'auto' | 'torch' | 'triton' for every Triton kernel, or "
                      "a comma list of kernel=choice over gather, attention, fused, gate, mhc (auto|torch|triton) and "
                      "reader (auto|c|python); default auto",
    "ENGRAM_PP_LAYER_PARTITION": "layers per pipeline stage, 'a,b,...' (the planner chooses when unset; "
                                 "an explicit partition argument wins)",
    "ENGRAM_COMMIT": "the commit benchmark JSON records, over git's HEAD (a copied tree's .git may be stale)",
}
TRITON_KERNELS = ("gather", "attention", "fused", "gate", "mhc")
KERNELS = TRITON_KERNELS + ("reader",)


def cache_dir() -> Path:
    """The root of engram's caches."""
    return Path(os.environ.get("ENGRAM_CACHE_DIR") or Path.home() / ".cache" / "engram")


def kernel_choice(kernel: str) -> str:
    """The ENGRAM_KERNELS choice for ``kernel`` (one of KERNELS): "auto" unless set. A malformed value raises
    ValueError naming the variable; the choice itself is checked by the kernel's switch."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {list(KERNELS)}")
    spec = os.environ.get("ENGRAM_KERNELS", "").strip()
    if not spec:
        return "auto"
    if "=" not in spec:
        if spec not in ("auto", "torch", "triton"):
            raise ValueError(f"ENGRAM_KERNELS={spec!r}: must be auto, torch, triton or a list kernel=choice")
        return spec if kernel in TRITON_KERNELS else "auto"
    choices = {}
    for part in spec.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in KERNELS or not value:
            raise ValueError(f"ENGRAM_KERNELS={spec!r}: {part!r} is not kernel=choice with kernel in {list(KERNELS)}")
        choices[name] = value
    return choices.get(kernel, "auto")


def pp_layer_partition() -> str | None:
    return os.environ.get("ENGRAM_PP_LAYER_PARTITION")


def commit() -> str | None:
    return os.environ.get("ENGRAM_COMMIT")


# Not engram's variables: torchrun's rendezvous contract (engine/torchrun.py reads it to know a process's rank)
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_environment() -> dict[str, str]:
    """The torchrun rendezvous variables set in this process (TORCHRUN_KEYS; none set outside torchrun)."""
    return {k: os.environ[k] for k in TORCHRUN_KEYS if k in os.environ}


def values_of(keys) -> dict[str, str | None]:
    """This process's values of other libraries' variables ``keys`` (e.g. NCCL's, to report them), None if unset."""
    return {k: os.environ.get(k) for k in keys}
