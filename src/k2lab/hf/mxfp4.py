"""MXFP4 weights as compressed-tensors' ``mxfp4-pack-quantized`` format stores them (Kimi K3's routed experts).

A weight ``w`` [out, in] is stored as two uint8 tensors beside each other, ``<module>.weight_packed`` and
``<module>.weight_scale``; the input dimension is cut into groups of G = 32 (``in % 32 == 0``)::

    weight_packed [out, in / 2]   two 4-bit E2M1 codes per byte: element j of a row is in byte j // 2, in the
                                  low nibble (bits 0-3) for even j and the high nibble (bits 4-7) for odd j;
                                  a code is s·8 + m with sign bit s (bit 3) and magnitude index m (bits 0-2)
                                  of E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6)
    weight_scale  [out, in / 32]  E8M0: a biased power-of-two exponent, one per group of 32 inputs

    w[i, j] = (-1)^s · E2M1[m] · 2^(weight_scale[i, j // 32] − 127)      (code (s, m) of element i, j)

Quantisation is compressed-tensors' own (the observer rule of ``calculate_qparams`` → ``generate_mx_scales``,
then ``MXFP4PackedCompressor.compress``): per group, a = max |w|; the scale exponent is
e = floor(log2(round_to_power_2(a))) − 2 (2 = floor(log2 6)), where ``round_to_power_2`` rounds a up to the
next power of two when its mantissa is at least 1.75; every w / 2^e is clamped to ±6 and rounded to the
nearest E2M1 value (ties to even). So |w| / 2^e < 7 in every group, and an element's error is at most
2^e times half the E2M1 spacing at |w| / 2^e: 0.25 up to 2, 0.5 up to 4, 1 above (clamping (6, 7) to 6
stays within 1). A value that already is E2M1 × 2^k comes back exactly.

``quantization_config`` is the dict the released Kimi K3 carries (in its ``text_config``): one
``config_groups.group_0`` targeting ``Linear`` modules with 4-bit float weights in groups of 32 and uint8
scales, no activation quantisation stored, and the release's ``ignore`` list (attention, shared experts,
dense MLPs, head, vision tower, projector). Readers (vLLM, mlx-lm, compressed-tensors' dequantiser) go by
the ``weight_packed`` tensors present; everything not packed is stored unquantised.

compressed-tensors is imported when first used: importing it costs seconds (measured 3-6 s on this CPU),
which every ``import k2lab.hf`` would otherwise pay.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from k2lab.errors import CheckpointError

__all__ = [
    "FORMAT",
    "GROUP_SIZE",
    "QUANT_METHOD",
    "declared_mxfp4",
    "dequantize_mxfp4",
    "packed_shapes",
    "quantization_config",
    "quantize_mxfp4",
]

QUANT_METHOD = "compressed-tensors"
FORMAT = "mxfp4-pack-quantized"
GROUP_SIZE = 32
E8M0_BIAS = 127
PACKED_SUFFIX = "weight_packed"
SCALE_SUFFIX = "weight_scale"

_WEIGHTS = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": GROUP_SIZE,
    "num_bits": 4,
    "observer": "minmax",
    "observer_kwargs": {},
    "scale_dtype": "torch.uint8",
    "strategy": "group",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}
# moonshotai/Kimi-K3 config.json text_config.quantization_config, as the engines' tests and fixtures quote it.
_RELEASED_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "format": FORMAT,
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": _WEIGHTS,
        }
    },
    "format": FORMAT,
    "global_compression_ratio": None,
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:.*vision_tower.*",
        "re:.*mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": QUANT_METHOD,
    "quantization_status": "compressed",
}


def quantization_config() -> dict[str, Any]:
    """The ``quantization_config`` of an MXFP4 checkpoint: the released Kimi K3's (a fresh copy)."""
    return copy.deepcopy(_RELEASED_CONFIG)


def _scheme() -> Any:
    """compressed-tensors' MXFP4 weight scheme (``MXFP4A16``: 4-bit float, group 32, uint8 scales)."""
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    return preset_name_to_scheme("MXFP4A16", ["Linear"])


def _compressor() -> Any:
    from compressed_tensors.compressors import BaseCompressor

    return BaseCompressor.get_value_from_registry(FORMAT)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(weight_packed, weight_scale) shapes of a weight [..., out, in]: [..., out, in/2], [..., out, in/32]."""
    *lead, rows, cols = shape
    return (*lead, rows, cols // 2), (*lead, rows, cols // GROUP_SIZE)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] (in a multiple of 32) -> (weight_packed uint8 [out, in/2], weight_scale uint8
    [out, in/32]), quantised in fp32 by compressed-tensors (scale rule and rounding in the module docstring)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    if weight.ndim != 2 or weight.shape[1] % GROUP_SIZE:
        raise ValueError(
            f"MXFP4 needs a 2-D weight with a multiple of {GROUP_SIZE} inputs, got {tuple(weight.shape)}"
        )
    scheme = _scheme()
    dense = weight.detach().to(device="cpu", dtype=torch.float32)
    groups = dense.view(dense.shape[0], -1, GROUP_SIZE)
    scale, _ = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), scheme.weights)
    compressed = _compressor().compress({"weight": dense, "weight_scale": scale}, scheme)
    return positive_zeros(compressed[PACKED_SUFFIX]), compressed[SCALE_SUFFIX]


def positive_zeros(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` with every E2M1 −0 (code 8: a small negative weight rounded to zero) written as +0 (code 0):
    the same value, one spelling, so that quantising a checkpoint's dequantised weights again gives the same
    bytes (an export of an MXFP4 export was not byte-identical: −0 dequantises to 0.0, which packs as +0)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.where(low == 8, 0, low) | (torch.where(high == 8, 0, high) << 4)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w = E2M1(code) · 2^(scale − 127)`` as fp32 [..., out, in] from ``packed`` uint8 [..., out, in/2] and
    ``scale`` uint8 [..., out, in/32]; the codes are unpacked by compressed-tensors (``unpack_fp4_from_uint8``).
    Exact: every E2M1 value times a power of two is an fp32 number."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    *lead, rows, half = packed.shape
    values = unpack_fp4_from_uint8(packed.reshape(-1, half), packed.numel() // half, 2 * half, torch.float32)
    values = values.reshape(*lead, rows, -1, GROUP_SIZE)
    exponent = scale.to(torch.int32) - E8M0_BIAS
    return torch.ldexp(values, exponent.unsqueeze(-1)).reshape(*lead, rows, 2 * half)


def declared_mxfp4(raw: Mapping[str, Any], root: str | os.PathLike[str]) -> bool:
    """Whether ``config.json`` (``raw``) declares compressed-tensors MXFP4 weights, at the top level or in
    its ``text_config`` (where Kimi K3 keeps it). ``CheckpointError`` for another compressed-tensors format
    or MXFP4 settings other than 4-bit float weights in groups of 32."""
    quant, where = raw.get("quantization_config"), "quantization_config"
    text = raw.get("text_config")
    if not quant and isinstance(text, Mapping) and text.get("quantization_config"):
        quant, where = text["quantization_config"], "text_config.quantization_config"
    if not isinstance(quant, Mapping) or quant.get("quant_method") != QUANT_METHOD:
        return False
    where = f"{Path(root) / 'config.json'}: {where}"
    fmt = quant.get("format")
    if fmt != FORMAT:
        raise CheckpointError(
            f"{where}: quant_method {QUANT_METHOD!r} is not supported with format {fmt!r} (only {FORMAT!r})"
        )
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise CheckpointError(f"{where}: no config_groups")
    wrong = [
        f"{name}.weights.{key} = {_weight_setting(group, key)!r} (expected {want!r})"
        for name, group in groups.items()
        for key, want in (("num_bits", 4), ("type", "float"), ("group_size", GROUP_SIZE))
        if _weight_setting(group, key) != want
    ]
    if wrong:
        raise CheckpointError(f"{where}: not MXFP4: " + "; ".join(wrong))
    return True


def _weight_setting(group: Any, key: str) -> Any:
    """``group["weights"][key]`` of one ``config_groups`` entry; None where the entry or its weights are not
    JSON objects (or lack the key)."""
    weights = group.get("weights") if isinstance(group, Mapping) else None
    return weights.get(key) if isinstance(weights, Mapping) else None
