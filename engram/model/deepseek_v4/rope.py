"""DeepSeek-V4's rotary embedding: interleaved pairs (channels 2i, 2i+1 rotate together) on the *trailing*
``rope_dim`` channels of each head, the leading ones untouched. Two frequency sets: ``main`` (sliding-window layers,
plain RoPE) and ``compress`` (layers with a compressor, their compressor and indexer: YaRN-scaled). Frequencies are
computed in float64 once; angles in float32 (float64 for float64 models)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeSpec:
    """One frequency set (transformers' ``rope_parameters["main" | "compress"]``)."""

    theta: float  # base
    dim: int  # rotated channels per head (qk_rope_head_dim), even
    kind: str = "default"  # "default" | "yarn"
    factor: float = 1.0  # YaRN: interpolation factor
    original_max_position_embeddings: int = 0  # YaRN: pre-training context
    beta_fast: float = 32.0  # YaRN ramp bounds
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos and sin (V4 leaves it at 1 for YaRN)
    truncate: bool = True  # YaRN: round the correction range outwards

    def inv_freq(self) -> torch.Tensor:
        """[dim/2] float64 inverse frequencies."""
        pos = self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float64) / self.dim)
        extrapolation = 1.0 / pos
        if self.kind == "default":
            return extrapolation
        interpolation = 1.0 / (self.factor * pos)

        def correction_dim(rotations: float) -> float:
            return (self.dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(self.theta)))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, self.dim - 1)
        if low == high:
            high += 0.001  # the published formula's guard against a zero-width ramp
        ramp = ((torch.arange(self.dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
        return interpolation * (1 - keep) + extrapolation * keep


class Rope:
    """cos / sin tables of one RopeSpec on a device; ``apply`` rotates the trailing ``dim`` channels."""

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu"):
        self.spec, self.dim = spec, spec.dim
        self._inv_freq = spec.inv_freq().to(device)  # [dim/2] float64

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions LongTensor[N] -> cos, sin [N, dim/2] in the rotation dtype (float32, float64 for float64)."""
        work = torch.float64 if dtype == torch.float64 else torch.float32
        angles = positions.to(torch.float64).unsqueeze(-1) * self._inv_freq.to(positions.device)  # [N, dim/2]
        scale = self.spec.attention_factor
        return (angles.cos() * scale).to(work), (angles.sin() * scale).to(work)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [N, ..., D] with cos/sin [N, dim/2] -> x with its last ``dim`` channels rotated (by -angle: ``inverse``).
        The rotation runs in cos's dtype and is cast back to x's."""
        d = self.dim
        nope, rope = x[..., :-d], x[..., -d:]
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
        c, s = cos.view(shape), sin.view(shape)
        if inverse:
            s = -s
        pairs = rope.to(cos.dtype).unflatten(-1, (d // 2, 2))  # [..., dim/2, 2]: (even, odd) channel pairs
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)  # [..., dim]
        return torch.cat((nope, rotated.to(x.dtype)), dim=-1)
