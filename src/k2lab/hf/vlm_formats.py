"""The vision-language checkpoint formats ``from_hf`` / ``to_hf`` read and write, chosen in one place.

    kimi_k25                       k2lab.hf.kimi_k25 (K2.5: MoonViT-3D; transformers and vLLM load it)
    kimi_k3 with a vision_config   k2lab.hf.kimi_k3_vision (K3 as released: MoonViT-V2; vLLM loads it)

Reading follows the file (``read_vlm_format``: a kimi_k3 config without ``vision_config`` is a text model,
``k2lab.hf.formats``); writing follows the tower (``write_vlm_format``: a MoonViT-V2-style tower — RMSNorm, no
biases, patchmergerv2 — is written as kimi_k3, any other as kimi_k25, which refuses what it cannot hold).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from k2lab.hf import kimi_k3, kimi_k3_vision, kimi_k25
from k2lab.hf.layout import WeightGroup
from k2lab.vision.vlm import VLMConfig

__all__ = ["KIMI_K3_VLM", "KIMI_K25_VLM", "VLMFormat", "read_vlm_format", "write_vlm_format"]


@dataclass(frozen=True)
class VLMFormat:
    """How one format spells a ``VisionLanguageModel``: config.json <-> ``VLMConfig``, state <-> tensors, and
    where its decoder's own config (``text_config``: MTP count) and names (``decoder_name``) sit."""

    model_type: str
    config_from_hf: Callable[..., VLMConfig]  # (config.json dict, name=...) -> VLMConfig
    config_to_hf: Callable[[VLMConfig], dict[str, Any]]
    weight_groups: Callable[[VLMConfig, Mapping[str, torch.Tensor]], list[WeightGroup]]
    text_config: Callable[[Mapping[str, Any]], Mapping[str, Any]]
    decoder_name: Callable[[str], str]


def _k25_text_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    return raw.get("text_config") or {}


KIMI_K25_VLM = VLMFormat(
    kimi_k25.MODEL_TYPE,
    kimi_k25.config_from_hf,
    kimi_k25.config_to_hf,
    kimi_k25.weight_groups,
    _k25_text_config,
    kimi_k25.decoder_name,
)
KIMI_K3_VLM = VLMFormat(
    kimi_k3_vision.MODEL_TYPE,
    kimi_k3_vision.config_from_hf,
    kimi_k3_vision.config_to_hf,
    kimi_k3_vision.weight_groups,
    kimi_k3.text_config,
    kimi_k3.decoder_name,
)


def read_vlm_format(raw: Mapping[str, Any]) -> VLMFormat | None:
    """The vision-language format of a config.json dict, or None for a text model."""
    if raw.get("model_type") == kimi_k25.MODEL_TYPE:
        return KIMI_K25_VLM
    if raw.get("model_type") == kimi_k3.MODEL_TYPE and raw.get("vision_config") is not None:
        return KIMI_K3_VLM
    return None


def write_vlm_format(config: VLMConfig) -> VLMFormat:
    """kimi_k3 for a MoonViT-V2-style tower, else kimi_k25."""
    return KIMI_K3_VLM if kimi_k3_vision.is_k3_vision(config.vision) else KIMI_K25_VLM
