"""The decoder checkpoint formats ``from_hf`` / ``to_hf`` read and write, chosen in one place.

A ``DecoderFormat`` says how one format spells a decoder (a ``CausalLM``): its config.json <-> ``ModelConfig``,
our state dict <-> its tensors (``k2lab.hf.layout`` groups, MTP layers included), the MTP layers' written-only
copies of the shared embedding and head, and where the decoder's own config and names sit in the file (a
kimi_k3 config nests them in ``text_config`` and ``language_model.``).

    deepseek_v3 / kimi_k2 / kimi_linear   k2lab.hf.mapping (DeepseekV3, Kimi Linear: transformers loads them)
    kimi_k3                               k2lab.hf.kimi_k3 (K3 as released; vLLM and mlx-lm load it)

Reading follows the file's ``model_type`` (``read_format``); writing follows the model (``write_format``):
kimi_k3 for a model with K3-only features (``kimi_linear.k3_features``: gated MLA, SiTU-GLU, LatentMoE, Block
AttnRes, lower-bounded or full-rank KDA gates), else DeepseekV3 or Kimi Linear as ``mapping.hf_model_type``
says. Vision-language formats (``kimi_k25``) are handled beside these in ``k2lab.hf.io``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from k2lab.config import ModelConfig
from k2lab.hf import kimi_k3, kimi_linear, mapping
from k2lab.hf.layout import HFTensor, WeightGroup
from k2lab.hf.mtp import shared_copies

State = Mapping[str, torch.Tensor]


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class DecoderFormat:
    """How one checkpoint format names a decoder (see the module docstring)."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[..., ModelConfig]  # (config.json dict, name=...) -> ModelConfig
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    weight_groups: Callable[[ModelConfig, State], list[WeightGroup]]
    shared_copies: Callable[[ModelConfig, State], list[HFTensor]]
    text_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] = _same  # the decoder's own config dict
    decoder_name: Callable[[str], str] = _same  # a checkpoint key -> the decoder's own name


HF_DECODER = DecoderFormat(
    mapping.SUPPORTED_MODEL_TYPES,
    mapping.config_from_hf,
    mapping.config_to_hf,
    mapping.weight_groups,
    shared_copies,
)
KIMI_K3 = DecoderFormat(
    (kimi_k3.MODEL_TYPE,),
    kimi_k3.config_from_hf,
    kimi_k3.config_to_hf,
    kimi_k3.weight_groups,
    kimi_k3.shared_copies,
    kimi_k3.text_config,
    kimi_k3.decoder_name,
)
FORMATS = (HF_DECODER, KIMI_K3)
MODEL_TYPES = tuple(model_type for fmt in FORMATS for model_type in fmt.model_types)


def read_format(model_type: str) -> DecoderFormat:
    """The format of a config.json's ``model_type`` (``KeyError`` when none reads it)."""
    for fmt in FORMATS:
        if model_type in fmt.model_types:
            return fmt
    raise KeyError(f"model_type {model_type!r} is not a decoder format (expected one of {list(MODEL_TYPES)})")


def write_format(config: ModelConfig) -> DecoderFormat:
    """The format a decoder is written in: kimi_k3 when it has K3-only features, else DeepseekV3 / Kimi Linear."""
    return KIMI_K3 if kimi_linear.k3_features(config) else HF_DECODER


def checkpoint_model_type(config: ModelConfig) -> str:
    """The ``model_type`` ``to_hf`` writes for ``config``: ``kimi_k3``, ``kimi_linear`` or ``deepseek_v3``."""
    return kimi_k3.MODEL_TYPE if write_format(config) is KIMI_K3 else mapping.hf_model_type(config)
