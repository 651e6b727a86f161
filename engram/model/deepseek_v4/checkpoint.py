"""DeepSeek-V4 checkpoint tensors -> a DeepseekV4Model. Names are the official checkpoint's, with or without the
``model.`` prefix (``layers.L.attn.wq_a.weight``, ``layers.L.ffn.experts.E.w1.weight``, ``layers.L.ffn.gate.tid2eid``,
``layers.L.hc_attn_base``, ``embed.weight``, ``head.weight``, ``hc_head_fn`` ...); transformers' ``save_pretrained``
writes the same names but for ``model.embed_tokens.weight`` and ``model.hc_head.hc_{fn,base,scale}``, read as aliases.
``mtp.*`` (multi-token prediction) tensors are skipped. FP8 block-scaled weights (``quantization_config``
``quant_method`` fp8, ``weight_block_size`` [bo, bi], scales ``X.scale`` or ``X.weight_scale_inv``, float32 or ue8m0)
are dequantized at load to the model dtype; FP4 experts (``expert_dtype`` fp4) and other methods are refused by name.
Engram tensors (``layers.L.engram.*``) are returned for ``engram.weights``; their tables are converted into the store."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engram.weights import dequantize_block_fp8

_ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(quantization: dict[str, Any] | None) -> tuple[int, int] | None:
    """The FP8 weight block (bo, bi) of a ``quantization_config``, None without one; refuses what is not implemented."""
    if quantization is None:
        return None

    def refuse(key: str, why: str) -> NotImplementedError:
        return NotImplementedError(f"quantization_config.{key}={quantization.get(key)!r}: {why}")

    if quantization.get("quant_method", "fp8") != "fp8":
        raise refuse("quant_method", "only block-scaled 'fp8' checkpoints are loaded")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise refuse("fmt", "only E4M3 weights are loaded")
    if quantization.get("expert_dtype", "fp8") != "fp8":
        raise refuse("expert_dtype", "FP4-packed experts are not implemented; only FP8 (block-scaled) experts")
    if quantization.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise refuse("scale_fmt", "scales must be 'float' (float32) or 'ue8m0' (one exponent byte)")
    bs = quantization.get("weight_block_size", [128, 128])
    if not (isinstance(bs, (list, tuple)) and len(bs) == 2 and all(isinstance(b, int) and b > 0 for b in bs)):
        raise ValueError(f"quantization_config.weight_block_size={bs!r}: must be two ints > 0 (rows, columns)")
    return int(bs[0]), int(bs[1])


def canonical(key: str) -> str | None:
    """Checkpoint key -> this model's state-dict name; None for tensors the model does not hold (``mtp.*``)."""
    k = key[len("model."):] if key.startswith("model.") else key
    if k.startswith("mtp."):
        return None
    k = _ALIASES.get(k, k)
    return k if k == "head.weight" else f"model.{k}"


def _engram_layer(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 4 and parts[1] == "layers" and parts[3] == "engram" else None


@torch.no_grad()
def load_v4_weights(model, files: list[Path], skip_suffixes: tuple[str, ...]) -> dict[int, dict[str, torch.Tensor]]:
    """Copy every backbone tensor of ``files`` into ``model`` (a DeepseekV4Model), dequantizing FP8; returns the Engram
    tensors by layer (``model.layers.L.engram.*`` names, minus ``skip_suffixes``: the tables). ValueError naming a
    missing, unexpected or mis-shaped tensor, or an FP8 weight without its scale."""
    from safetensors import safe_open

    block = block_size(model.config.quantization)
    # parameters, persistent buffers (tid2eid, gate.bias) and the routed experts' per-expert views of their stacks
    # (moe.RoutedExperts): every target shares its model tensor's storage, so copying into it loads the model
    targets = dict(model.state_dict(keep_vars=True))
    engram_layers = model.engram_layers
    engram: dict[int, dict[str, torch.Tensor]] = {lid: {} for lid in engram_layers}
    scales: dict[str, tuple[str, torch.Tensor]] = {}  # weight name -> (key, scale)
    weights: dict[str, tuple[str, str, torch.Tensor]] = {}  # name -> (file, key, tensor)
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = canonical(key)
                if name is None:
                    continue
                lid = _engram_layer(name)
                if lid is not None:
                    if lid not in engram:
                        unexpected.append(key)
                    elif not name.endswith(skip_suffixes):
                        engram[lid][name] = f.get_tensor(key)
                    continue
                suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
                if suffix is not None and name[:-len(suffix)] + ".weight" in targets:
                    scales[name[:-len(suffix)] + ".weight"] = (key, f.get_tensor(key))
                elif name in targets:
                    weights[name] = (file.name, key, f.get_tensor(key))
                else:
                    unexpected.append(key)
    for name, (key, _) in scales.items():
        if name not in weights:
            unexpected.append(key)
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors (not in the deepseek_v4 layout of config.json): "
                         f"{sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
    engram_params = {f"model.layers.{lid}.engram.{p}" for lid, layer in engram_layers.items()
                     for p in layer.state_dict()}
    missing = sorted(n for n in targets if n not in weights and n not in engram_params)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for name, (file, key, t) in weights.items():
        _copy(targets[name], t, scales.get(name), block, file, key)
    return engram


def _copy(target: torch.Tensor, t: torch.Tensor, scale: tuple[str, torch.Tensor] | None,
          block: tuple[int, int] | None, file: str, key: str) -> None:
    if t.dtype in _FP8:
        if scale is None:
            raise ValueError(f"{file}: tensor {key!r} is {t.dtype} but has no block scale ({key[:-len('weight')]}scale)")
        if block is None:
            raise ValueError(f"{file}: tensor {key!r} is {t.dtype} but config.json has no quantization_config")
        t = dequantize_block_fp8(t, scale[1], block, torch.float32, name=key)
    elif scale is not None:
        raise ValueError(f"{file}: {scale[0]!r} is given for {key!r} of dtype {t.dtype} (block scales go with FP8)")
    if tuple(t.shape) != tuple(target.shape):
        raise ValueError(f"{file}: tensor {key!r} has shape {list(t.shape)}, expected {list(target.shape)} "
                         f"(from config.json)")
    if target.is_floating_point() != t.is_floating_point():
        raise ValueError(f"{file}: tensor {key!r} has dtype {t.dtype}, expected {target.dtype}")
    target.copy_(t.to(target.dtype))
