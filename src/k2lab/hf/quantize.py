"""``to_hf(..., quantize=...)``: which quantised format a checkpoint can be written in, and its tensors.

* ``"mxfp4"``: the routed experts (``…experts.{e}.{w1,w2,w3}`` in the kimi_k3 / kimi_linear layouts,
  ``…experts.{e}.{gate,up,down}_proj`` in deepseek_v3's) become compressed-tensors MXFP4 pairs
  ``weight_packed`` + ``weight_scale`` (``k2lab.hf.mxfp4``), as Kimi K3 is released; everything else is
  written as without quantisation. ``quantization_config`` goes where the release keeps it: in
  ``text_config`` for a checkpoint with one (kimi_k3, kimi_k25), else at the top level. Every expert's
  input width must be a multiple of 32.
* ``"fp8"``: block FP8 for a ``deepseek_v3`` checkpoint (DeepSeek-V3 / Kimi-K2 release format,
  ``k2lab.hf.fp8_export``).

Refused with a ``ConfigError`` saying why: an unknown format, MXFP4 for a model without routed experts,
FP8 for a checkpoint that is not written as ``deepseek_v3`` (Kimi Linear, Kimi K3, Kimi K2.5).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import torch

from k2lab.config import ConfigError
from k2lab.hf.fp8_export import fp8_quantization_config, fp8_tensors
from k2lab.hf.mxfp4 import GROUP_SIZE, PACKED_SUFFIX, SCALE_SUFFIX, quantization_config, quantize_mxfp4

__all__ = ["QUANTIZE_FORMATS", "Quantize", "quantize_checkpoint"]

Quantize = Literal["mxfp4", "fp8"]
QUANTIZE_FORMATS: tuple[str, ...] = ("mxfp4", "fp8")
FP8_MODEL_TYPES = ("deepseek_v3",)
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")

Tensors = list[tuple[str, torch.Tensor]]


def quantize_checkpoint(
    method: str, hf_config: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]
) -> Tensors:
    """The checkpoint tensors of ``hf_config`` (its ``config.json``, given its ``quantization_config`` here)
    quantised with ``method``; raises ``ConfigError`` before anything is quantised when the model cannot
    take it."""
    model_type = hf_config.get("model_type")
    if method == "mxfp4":
        return _mxfp4(hf_config, tensors)
    if method == "fp8":
        if model_type not in FP8_MODEL_TYPES:
            raise ConfigError(
                f"--quantize fp8 writes the block-FP8 DeepSeek-V3 / Kimi-K2 release format; this model is "
                f"written as {model_type!r}, which has no FP8 release format (Kimi K3 ships MXFP4 routed "
                "experts: --quantize mxfp4)"
            )
        hf_config["quantization_config"] = fp8_quantization_config()
        return list(fp8_tensors(tensors))
    raise ConfigError(f"quantize {method!r} is not a format k2lab writes (one of {list(QUANTIZE_FORMATS)})")


def _mxfp4(hf_config: dict[str, Any], tensors: Sequence[tuple[str, torch.Tensor]]) -> Tensors:
    experts = [(name, tensor) for name, tensor in tensors if _ROUTED_EXPERT.search(name)]
    if not experts:
        raise ConfigError(
            f"--quantize mxfp4 quantises the routed experts, and this {hf_config.get('model_type')} model "
            "has none (a dense model); export it unquantised"
        )
    ragged = [f"{name} {tuple(t.shape)}" for name, t in experts if t.ndim != 2 or t.shape[-1] % GROUP_SIZE]
    if ragged:
        raise ConfigError(
            f"--quantize mxfp4 needs every routed expert's input width to be a multiple of {GROUP_SIZE}: "
            + ", ".join(ragged[:5])
            + (f" and {len(ragged) - 5} more" if len(ragged) > 5 else "")
        )
    text = hf_config.get("text_config")
    (text if isinstance(text, dict) else hf_config)["quantization_config"] = quantization_config()
    result: Tensors = []
    for name, tensor in tensors:
        if _ROUTED_EXPERT.search(name):
            packed, scale = quantize_mxfp4(tensor)
            module = name.removesuffix("weight")
            result += [(module + PACKED_SUFFIX, packed), (module + SCALE_SUFFIX, scale)]
        else:
            result.append((name, tensor))
    return result
