"""Vision-language presets: a text preset (``k2lab.config.load_preset``) plus a vision tower.

| preset     | language model | vision tower                                                         |
|------------|----------------|----------------------------------------------------------------------|
| ``k25``    | ``k2``         | MoonViT-3D (Kimi K2.5: patch 14, 1152 wide, 27 layers, 2×2 merge)    |
| ``k25-mini`` | ``k2-mini``  | a 2-layer, 128-wide MoonViT-3D (patch 14, 2×2 merge) for CPU runs    |
| ``k3-vl-mini`` | ``k3-mini`` | a 2-layer, 128-wide MoonViT-V2 (RMSNorm, no biases, 2×2 shuffle)   |
| ``k25-nano`` / ``k3-vl-nano`` | ``k2-nano`` / ``k3-nano`` | 1-layer, 32-wide towers (tests)         |

The media token ids come from the tokenizer the model is trained with (``VLMConfig.for_tokenizer``);
without one, K2.5's own ids for a K2-size vocabulary, else a k2lab tokenizer's layout (special tokens first).
"""

from __future__ import annotations

from typing import Any

from k2lab.config import load_preset
from k2lab.vision.config import VisionConfig
from k2lab.vision.vlm import VLMConfig

__all__ = ["VLM_PRESETS", "is_vlm_preset", "load_vlm_preset", "vlm_parameter_counts"]

_MINI_TOWER = dict(
    patch_size=14, pos_emb_height=16, pos_emb_width=16, num_attention_heads=4, num_hidden_layers=2,
    hidden_size=128, intermediate_size=256,
)  # fmt: skip

_NANO_TOWER = dict(
    patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=1,
    hidden_size=32, intermediate_size=64,
)  # fmt: skip

VLM_PRESETS: dict[str, tuple[str, Any]] = {
    "k25-nano": ("k2-nano", lambda **kw: VisionConfig(**{**_NANO_TOWER, **kw})),
    "k3-vl-nano": ("k3-nano", lambda **kw: VisionConfig.moonvit_v2(**{**_NANO_TOWER, **kw})),
    "k25": ("k2", VisionConfig.moonvit_3d),
    "k25-mini": ("k2-mini", lambda **kw: VisionConfig(**{**_MINI_TOWER, **kw})),
    "k3-vl-mini": ("k3-mini", lambda **kw: VisionConfig.moonvit_v2(**{**_MINI_TOWER, **kw})),
}


def vlm_parameter_counts(config: VLMConfig) -> dict[str, int]:
    """Exact parameter counts of the VLM built on the meta device: language model, tower, projector, total."""
    import torch

    from k2lab.vision.vlm import VisionLanguageModel

    with torch.device("meta"):
        model = VisionLanguageModel(config)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    from k2lab.params import count_parameters

    counts = {  # the decoder as ``k2lab params`` counts it (router bias buffers included)
        "language_model": count_parameters(config.text).total,
        "vision_tower": count(model.vision.encoder),
        "projector": count(model.vision.projector),
    }
    counts["total"] = sum(counts.values())
    return counts


def is_vlm_preset(name: str) -> bool:
    return name in VLM_PRESETS


def load_vlm_preset(
    name: str,
    special_tokens: dict[str, int] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    **text_overrides: Any,
) -> VLMConfig:
    """The ``VLMConfig`` of preset ``name`` (``ValueError`` naming the presets if unknown)."""
    if name not in VLM_PRESETS:
        raise ValueError(f"unknown vision-language preset {name!r}; expected one of {sorted(VLM_PRESETS)}")
    text_name, tower = VLM_PRESETS[name]
    text = load_preset(text_name, **text_overrides)
    vision = tower(**{"text_hidden_size": text.hidden_size, **(vision_overrides or {})})
    if special_tokens is None and text.vocab_size <= VLMConfig.model_fields["vision_end_token_id"].default:
        # a small vocabulary is a k2lab tokenizer's: its special tokens take the first ids
        from k2lab.data.tokenizer import SPECIAL_TOKENS

        special_tokens = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    if special_tokens is not None:
        return VLMConfig.for_tokenizer(text, vision, special_tokens)
    return VLMConfig(text=text, vision=vision)
