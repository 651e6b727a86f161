"""The HF transformers peer: ``Qwen3ForCausalLM`` with the ModelConfig's decoder shapes (no Engram or hyper-connections:
a shape peer for ``hc_mult > 1``), run through ``generate`` with a static cache and, unless ``compile_mode`` is None,
torch.compile. ms/step is the difference of two generate calls of one cache size (``w + steps`` and ``w`` tokens) over
``steps``, so prefill, allocation and capture cancel."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from engram.model.model_config import ModelConfig

COMPILE_MODES = ("reduce-overhead", "max-autotune-no-cudagraphs")


def unavailable_reason() -> str | None:
    """None when transformers (with Qwen3) imports, else why the peer cannot run."""
    try:
        from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: F401
    except ImportError as e:
        return f"transformers with Qwen3 is not importable ({e})"
    return None


def qwen3_config(cfg: ModelConfig):
    """A ``transformers.Qwen3Config`` of ``cfg``'s decoder shapes, without special token ids."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=cfg.padded_vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
                       rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                       attention_bias=cfg.attention_bias, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_peer(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0):
    """Qwen3ForCausalLM with ``cfg``'s shapes on ``device`` in ``dtype``, HF's random init seeded by ``seed``."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(qwen3_config(cfg))
    model = model.to(dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0  # never emitted as padding: no sequence finishes early
    return model


@dataclass
class PeerTimes:
    ms_per_step: float  # wall: (long call - short call) / steps
    busy_ms_per_step: float | None  # device busy, differenced the same way (None: not profiled)
    context_lens: list[list[int]]  # [steps][batch]: KV length after each differenced decode forward
    compiled_graphs: int  # graphs torch.compile produced during this measurement (0: nothing compiled)


def measure_peer(model, prompts: list[list[int]], steps: int, warmup_tokens: int = 3,
                 compile_mode: str | None = "reduce-overhead", busy_device: str | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> PeerTimes:
    """Greedy decode ms/step of ``model`` for these prompts (one batch, equal lengths); ``clock``: the host clock."""
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation import CompileConfig

    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={compile_mode!r}: must be None or one of {COMPILE_MODES}")
    if steps < 1 or warmup_tokens < 1:
        raise ValueError(f"steps={steps} and warmup_tokens={warmup_tokens} must be >= 1")
    device = model.device
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)  # [B, L]
    batch, length = input_ids.shape
    short = max(warmup_tokens, 2)  # tokens of the short call: >= 1 decode forward, so CUDA-graph capture is in both
    long = short + steps

    class StopAt(StoppingCriteria):
        def __init__(self, total: int):
            self.total = total

        def __call__(self, ids, scores, **kwargs):
            return torch.full((ids.shape[0],), ids.shape[1] >= self.total, dtype=torch.bool, device=ids.device)

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=long, do_sample=False,
                  cache_implementation="static")
    if compile_mode is None:
        kwargs["disable_compile"] = True
    else:
        kwargs["compile_config"] = CompileConfig(mode=compile_mode, dynamic=None)

    def generate(new_tokens: int) -> None:
        stop = StoppingCriteriaList([StopAt(length + new_tokens)])
        out = model.generate(input_ids, stopping_criteria=stop, **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if tuple(out.shape) != (batch, length + new_tokens):
            raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}, "
                               f"expected {(batch, length + new_tokens)}")

    def wall(new_tokens: int) -> float:
        t0 = clock()
        generate(new_tokens)
        return clock() - t0

    graphs0 = _compiled_graphs()
    generate(long)  # warm-up: compilation, CUDA-graph capture, allocator
    ms = (wall(long) - wall(short)) / steps * 1e3
    busy = None
    if busy_device:
        from engram.bench.device_time import measure_busy

        busy = (measure_busy(lambda: generate(long), busy_device)
                - measure_busy(lambda: generate(short), busy_device)) / steps * 1e3
    lens = [[length + j] * batch for j in range(short, long)]
    return PeerTimes(ms, busy, lens, _compiled_graphs() - graphs0)


def _compiled_graphs() -> int:
    """Graphs torch.compile has produced in this process so far (dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
