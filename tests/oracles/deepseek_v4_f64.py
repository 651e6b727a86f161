"""A float64 twin of transformers' DeepSeek-V4 (the parity tests' reference). transformers as shipped computes RoPE,
RMSNorm statistics, the mHC mixes, the compressor softmax and the indexer scores in float32 even for a float64 model;
this module is its modeling file with exactly those casts widened to float64 (``.float()`` -> ``.double()``,
``torch.float32`` / ``torch.float`` -> ``torch.float64``) and YaRN's frequencies computed the same way, executed as a
sibling module. Nothing else changes: ``SUBSTITUTIONS`` counts what was replaced, and a test checks the twin's source
against the original with the substitutions undone."""
from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
import types

import torch

_RULES = [(r"\.float\(\)", ".double()"), (r"torch\.float32\b", "torch.float64"), (r"torch\.float\b(?!\d)", "torch.float64")]
SUBSTITUTIONS: dict[str, int] = {}


def widen(source: str, tag: str) -> str:
    """``source`` with every float32 cast widened; counts the replacements in SUBSTITUTIONS[tag]."""
    total = 0
    for pattern, repl in _RULES:
        source, n = re.subn(pattern, repl, source)
        total += n
    SUBSTITUTIONS[tag] = total
    return source


def narrow(source: str) -> str:
    """The inverse of ``widen`` on text that had no float64 before (the test's check)."""
    return source.replace(".double()", ".float()").replace("torch.float64", "torch.float32")


@functools.lru_cache(maxsize=1)
def module() -> types.ModuleType:
    """The float64 twin of ``transformers.models.deepseek_v4.modeling_deepseek_v4``."""
    original = importlib.import_module("transformers.models.deepseek_v4.modeling_deepseek_v4")
    rope_utils = importlib.import_module("transformers.modeling_rope_utils")
    name = "transformers.models.deepseek_v4.modeling_deepseek_v4_f64"
    twin = types.ModuleType(name)
    twin.__package__ = "transformers.models.deepseek_v4"
    twin.__file__ = original.__file__
    sys.modules[name] = twin
    exec(compile(widen(inspect.getsource(original), "modeling"), original.__file__, "exec"), twin.__dict__)
    yarn_ns = dict(rope_utils.__dict__)
    exec(compile(widen(inspect.getsource(rope_utils._compute_yarn_parameters), "yarn"), rope_utils.__file__, "exec"),
         yarn_ns)
    twin.ROPE_INIT_FUNCTIONS = {**rope_utils.ROPE_INIT_FUNCTIONS, "yarn": yarn_ns["_compute_yarn_parameters"]}
    return twin


def reference_model(config) -> torch.nn.Module:
    """A float64 eager DeepseekV4ForCausalLM of the twin, with what transformers' init zeros randomised: attention sinks,
    ape (``position_bias``), the router bias, the mHC bases and ``tid2eid`` (else every hash-routed token goes to
    expert 0)."""
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = module().DeepseekV4ForCausalLM(config).to(torch.float64).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("sinks", "position_bias", "base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
            elif pname.endswith(("scale", "hc_scale")) or "norm" in pname:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.1)
            elif bname.endswith("tid2eid"):
                n_experts = config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
    return model
