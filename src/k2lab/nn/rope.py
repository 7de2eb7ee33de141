"""Rotary position embedding with optional YaRN frequency interpolation.

RoPE rotates interleaved pairs ``(x_{2i}, x_{2i+1})`` of the rope part of q and k by ``θ_i · pos``:

    x'_{2i}   = x_{2i} cos(pos θ_i) − x_{2i+1} sin(pos θ_i)
    x'_{2i+1} = x_{2i+1} cos(pos θ_i) + x_{2i} sin(pos θ_i),      θ_i = theta^(−2i/d)

YaRN (Peng et al. 2023) blends interpolated and original frequencies per pair:
``θ'_i = θ_i/s · (1 − e_i) + θ_i · e_i`` with ``e_i = 1 − clamp((i − low)/(high − low), 0, 1)`` and the
correction range ``[low, high]`` from ``d·ln(L/(2π·β)) / (2 ln theta)`` at β_fast and β_slow (floored /
ceiled). ``cos``/``sin`` are multiplied by ``attention_factor = m(s, mscale) / m(s, mscale_all_dim)`` where
``m(s, a) = 0.1·a·ln s + 1``; the rest of the YaRN temperature lives in the softmax scale
(``ModelConfig.softmax_scale``). For K2 (s = 32, β = 1/1, L = 4096, θ = 50000, d = 64) pairs 0–19 keep
their frequency and pairs 20–31 are divided by 32.

The output is written de-interleaved (rotated evens, then rotated odds). q and k get the same
permutation, so every dot product equals the interleaved form; rope keys in the cache stay in this layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from k2lab.config import ModelConfig, YarnScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(dim: int, theta: float, yarn: YarnScaling | None) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies [dim/2] (on the CPU, whatever the default device: constructing on meta
    must not compute them there) and the cos/sin attention factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_freq = 1.0 / theta**exponents
    if yarn is None:
        return inv_freq, 1.0

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    inv_freq = inv_freq / yarn.factor * ramp + inv_freq * keep_original
    if yarn.mscale and yarn.mscale_all_dim:
        attention_factor = _yarn_mscale(yarn.factor, yarn.mscale) / _yarn_mscale(
            yarn.factor, yarn.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(yarn.factor)
    return inv_freq, attention_factor


class RotaryEmbedding(nn.Module):
    """Produces (cos, sin) [B, T, d/2] for positions [B, T]; ``apply_rotary`` rotates [B, T, H, d]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", torch.empty(config.qk_rope_head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the frequencies, e.g. after ``to_empty`` moved the module off the meta device."""
        inv_freq, self.attention_factor = yarn_inverse_frequencies(
            self.config.qk_rope_head_dim, self.config.rope_theta, self.config.rope_scaling
        )
        if self.inv_freq.device.type != "meta":
            self.inv_freq.copy_(inv_freq)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions[..., None].float() * self.inv_freq.to(positions.device)
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, T, H, d] by cos/sin [B, T, d/2]; output de-interleaved, x's dtype."""
    cos = cos.unsqueeze(2).to(x.dtype)
    sin = sin.unsqueeze(2).to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
