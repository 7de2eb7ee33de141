"""Vision-language presets built: the registry entry's language model + its tower as a ``VLMConfig``.

The media token ids come from the tokenizer the model is trained with (``VLMConfig.for_tokenizer``); without
one, K2.5's own ids for a K2-size vocabulary, else a k2lab tokenizer's layout (special tokens first).
"""

from __future__ import annotations

from typing import Any

import torch

from k2lab.config import ConfigError
from k2lab.data.tokenizer import SPECIAL_TOKENS
from k2lab.models.init import constructing_on
from k2lab.params import count_parameters
from k2lab.presets import available_presets, get_preset, load_preset
from k2lab.vision.config import VisionConfig
from k2lab.vision.vlm import VisionLanguageModel, VLMConfig

__all__ = ["load_vlm_preset", "vlm_parameter_counts"]

_TOWERS = {"moonvit-3d": VisionConfig.moonvit_3d, "moonvit-v2": VisionConfig.moonvit_v2}


def load_vlm_preset(
    name: str,
    special_tokens: dict[str, int] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    **text_overrides: Any,
) -> VLMConfig:
    """The ``VLMConfig`` of vision-language preset ``name`` (``ConfigError`` with the reason otherwise)."""
    preset = get_preset(name)
    if not preset.is_vision_language:
        vlm = ", ".join(available_presets("vision-language"))
        raise ConfigError(f"preset {name!r} is a text preset; vision-language presets: {vlm}")
    text = load_preset(preset.language_model, **text_overrides)
    tower = _TOWERS[preset.tower]
    vision = tower(**{**preset.vision, "text_hidden_size": text.hidden_size, **(vision_overrides or {})})
    if special_tokens is None and text.vocab_size <= VLMConfig.model_fields["vision_end_token_id"].default:
        # a small vocabulary is a k2lab tokenizer's: its special tokens take the first ids
        special_tokens = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    if special_tokens is not None:
        return VLMConfig.for_tokenizer(text, vision, special_tokens)
    return VLMConfig(text=text, vision=vision)


def vlm_parameter_counts(config: VLMConfig) -> dict[str, int]:
    """Exact parameter counts of the VLM built on the meta device: language model, tower, projector, total."""
    with constructing_on("meta"):
        model = VisionLanguageModel(config)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    counts = {  # the decoder as ``k2lab params`` counts it (router bias buffers included)
        "language_model": count_parameters(config.text).total,
        "vision_tower": count(model.vision.encoder),
        "projector": count(model.vision.projector),
    }
    counts["total"] = sum(counts.values())
    return counts
