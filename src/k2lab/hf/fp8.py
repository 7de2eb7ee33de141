"""Block-wise FP8 weights, the public DeepSeek-V3 / Kimi-K2 release format: the codec.

A quantised weight [..., out, in] is ``float8_e4m3fn`` with a sibling ``<name>_scale_inv`` (fp32,
[..., ceil(out/b0), ceil(in/b1)], block size (b0, b1) from ``quantization_config.weight_block_size``, 128 x 128
in the releases; the last row / column blocks may be partial)::

    w[..., i, j] = w_fp8[..., i, j] · scale_inv[..., i // b0, j // b1]

Quantising (``quantize_fp8``) takes the block's absolute maximum a and scale_inv = a / 448 (448 = the largest
e4m3 value; 1 for an all-zero block), so every w / scale_inv lies in [-448, 448] and rounds to the nearest
e4m3 value: an error of at most |w| · 2^-4 (3 mantissa bits) or, below e4m3's smallest normal 2^-6,
scale_inv · 2^-10 (half the subnormal spacing 2^-9).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["DEFAULT_FP8_BLOCK", "FP8_MAX", "SCALE_SUFFIX", "dequantize_fp8", "quantize_fp8"]

SCALE_SUFFIX = "_scale_inv"
DEFAULT_FP8_BLOCK = (128, 128)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: Sequence[int] = DEFAULT_FP8_BLOCK
) -> torch.Tensor:
    """Block-wise FP8 dequantisation: ``w[..., i, j] = weight[..., i, j] · scale_inv[..., i // b0, j // b1]``.

    ``weight`` [..., out, in] (float8_e4m3fn or any float dtype), ``scale_inv`` [..., ceil(out/b0),
    ceil(in/b1)]; the last row/column blocks may be partial. Returns fp32.
    """
    rows, cols = weight.shape[-2:]
    b0, b1 = block_size
    scale = scale_inv.float().repeat_interleave(b0, dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(b1, dim=-1)[..., :cols]
    return weight.float() * scale


def quantize_fp8(
    weight: torch.Tensor, block_size: Sequence[int] = DEFAULT_FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (float8_e4m3fn [out, in], fp32 scale_inv [ceil(out/b0), ceil(in/b1)]) with
    scale_inv = block absmax / 448; ``dequantize_fp8`` of the pair is the weight within e4m3 rounding."""
    if weight.ndim != 2:
        raise ValueError(f"block FP8 quantises 2-D weights, got shape {tuple(weight.shape)}")
    dense = weight.detach().to(device="cpu", dtype=torch.float32)
    b0, b1 = block_size
    amax = F.max_pool2d(dense.abs()[None], (b0, b1), (b0, b1), ceil_mode=True)[0]  # partial edge blocks too
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    per_element = dequantize_fp8(torch.ones_like(dense), scale_inv, block_size)  # the reader's block layout
    quantized = (dense / per_element).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale_inv
