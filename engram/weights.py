"""Load an ``Engram`` module's weights from a checkpoint state dict (or safetensors files). V4.1 names (prefix
``layers.L.engram.``): ``wkv.weight`` [(hc+1)*H, n_cols*head_dim] in bf16/fp32, or FP8 E4M3 with ``wkv.scale``
[ceil(out/32), ceil(in/32)] block scales, dequantized to float32 at load (exact); ``q_weight``, ``k_weight`` [hc, H].
Table tensors (``embed.*``, ``multi_head_embedding.*``) are skipped and reported: tables live in ``engram.store``."""
from __future__ import annotations

import os
from typing import Iterable, Mapping

import torch

from engram.module import Engram
from engram.quant import scale_factors

WKV_BLOCK = 32
V41_TABLE_KEYS = ("embed.weight", "embed.scale")
PAPER_TABLE_KEYS = ("multi_head_embedding.embedding.weight", "multi_head_embedding.offsets")
_WKV_SCALE_KEYS = ("wkv.scale", "wkv.weight_scale_inv")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def v41_prefix(layer_id: int) -> str:
    """Published key prefix of an Engram layer in a V4.1 checkpoint."""
    return f"layers.{layer_id}.engram."


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int | tuple[int, int] = WKV_BLOCK,
                         dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """weight [O, I] FP8 (E4M3 bytes) with scale [ceil(O/bo), ceil(I/bi)], one per block of ``block`` = bo x bi (an int:
    square) (E8M0 bytes or float multipliers) -> [O, I] ``dtype``."""
    w = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
    if w.dim() != 2 or w.dtype not in _FP8:
        raise ValueError(f"{name}: expected a 2-D FP8 weight, got {weight.dtype} {tuple(weight.shape)}")
    bo, bi = (block, block) if isinstance(block, int) else block
    out_f, in_f = w.shape
    want = (-(-out_f // bo), -(-in_f // bi))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: scale has shape {tuple(scale.shape)}, expected {list(want)} for a "
                         f"[{out_f}, {in_f}] weight in {bo}x{bi} blocks")
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        factors = scale_factors(scale)  # [O/bo, I/bi] fp32, byte 0 -> 0
    else:
        factors = scale.to(torch.float32)
    full = factors.repeat_interleave(bo, 0)[:out_f].repeat_interleave(bi, 1)[:, :in_f]  # [O, I]
    return (w.to(torch.float32) * full).to(dtype)


def _expected_shapes(layer: Engram) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in layer.state_dict().items()}


def _take(sd: Mapping[str, torch.Tensor], prefix: str, table_keys: Iterable[str]) -> tuple[dict, list[str]]:
    """Keys under ``prefix`` with the prefix stripped, minus table tensors (returned as full names)."""
    own, table = {}, []
    for key, value in sd.items():
        if not key.startswith(prefix):
            continue
        short = key[len(prefix):]
        if short in table_keys:
            table.append(key)
        else:
            own[short] = value
    return own, table


def convert_state_dict(layer: Engram, sd: Mapping[str, torch.Tensor], prefix: str = "") -> tuple[dict, list[str]]:
    """Checkpoint tensors under ``prefix`` -> (float32 module state dict, skipped table keys); ValueError naming key,
    layer and shapes on a mismatch, a missing or an unexpected tensor."""
    where = f"Engram layer {layer.layer_id} ({layer.variant}), prefix {prefix!r}"
    table_keys = V41_TABLE_KEYS if layer.variant == "v41" else PAPER_TABLE_KEYS
    own, table = _take(sd, prefix, table_keys)
    if layer.variant == "v41":
        scale_key = next((k for k in _WKV_SCALE_KEYS if k in own), None)
        wkv = own.get("wkv.weight")
        if wkv is not None and (wkv.dtype in _FP8 or wkv.dtype == torch.uint8):
            if scale_key is None:
                raise ValueError(f"{where}: {prefix}wkv.weight is {wkv.dtype} but no {prefix}wkv.scale was found")
            own["wkv.weight"] = dequantize_block_fp8(wkv, own.pop(scale_key), name=f"{prefix}wkv.weight")
        elif scale_key is not None:
            raise ValueError(f"{where}: {prefix}{scale_key} given for a {wkv.dtype if wkv is not None else 'missing'} "
                             f"wkv.weight (block scales only go with FP8)")
    expected = _expected_shapes(layer)
    missing = sorted(set(expected) - set(own))
    unexpected = sorted(set(own) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: missing {[prefix + k for k in missing]}, unexpected "
                         f"{[prefix + k for k in unexpected]}")
    out = {}
    for name, shape in expected.items():
        t = own[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {prefix}{name} has shape {tuple(t.shape)}, expected {list(shape)}")
        if not t.is_floating_point() or t.dtype in _FP8:
            raise ValueError(f"{where}: {prefix}{name} has dtype {t.dtype}; only wkv.weight may be FP8")
        out[name] = t.to(torch.float32)
    return out, table


@torch.no_grad()
def load_engram_weights(layer: Engram, sd: Mapping[str, torch.Tensor], prefix: str = "") -> list[str]:
    """Copy checkpoint weights into ``layer`` (cast to its parameter dtype); returns the table keys skipped."""
    converted, table = convert_state_dict(layer, sd, prefix)
    params = layer.state_dict()
    for name, value in converted.items():
        params[name].copy_(value.to(params[name].dtype))
    return table


def read_safetensors(paths: str | os.PathLike | Iterable[str | os.PathLike], prefix: str,
                     skip: Iterable[str] = V41_TABLE_KEYS + PAPER_TABLE_KEYS) -> dict[str, torch.Tensor]:
    """Tensors under ``prefix`` from safetensors files, never reading the ``skip`` (table) ones."""
    from safetensors import safe_open

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    skip_full = {prefix + k for k in skip}
    out: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(os.fspath(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix) and key not in skip_full:
                    out[key] = f.get_tensor(key)
    return out
