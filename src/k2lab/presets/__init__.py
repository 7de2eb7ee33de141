"""The one preset registry: every model k2lab can build by name, text and vision-language, as data.

Each preset is a JSON file in this package. A **text** preset is a ``ModelConfig`` (``k2``, ``k2-mini``,
``k3``, ``kimi-linear-48b-a3b`` ...). A **vision-language** preset (``"kind": "vision-language"``) names its
language model preset and its tower, with the tower's sizes:

| preset     | language model | vision tower                                                         |
|------------|----------------|----------------------------------------------------------------------|
| ``k25``    | ``k2``         | MoonViT-3D (Kimi K2.5: patch 14, 1152 wide, 27 layers, 2×2 merge)    |
| ``k3-vl``  | ``k3``         | MoonViT-V2 as released (K3: patch 14, 1024 wide, 27 layers, 12×128 heads) |
| ``k25-mini`` | ``k2-mini``  | a 2-layer, 128-wide MoonViT-3D (patch 14, 2×2 merge) for CPU runs    |
| ``k3-vl-mini`` | ``k3-mini`` | a 2-layer, 128-wide MoonViT-V2 (RMSNorm, no biases, 2×2 shuffle)   |
| ``k25-nano`` / ``k3-vl-nano`` | ``k2-nano`` / ``k3-nano`` | 1-layer, 32-wide towers (tests)         |

A command that builds text models only (``init``, ``stability`` ...) calls ``load_preset``; given a
vision-language preset it refuses with the reason and names the preset's language model. Reading the registry
needs only ``ModelConfig``; building a vision-language config is ``k2lab.presets.vision_language``.

The media token ids of a VLM come from the tokenizer the model is trained with (``VLMConfig.for_tokenizer``);
without one, K2.5's own ids for a K2-size vocabulary, else a k2lab tokenizer's layout (special tokens first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import ValidationError

from k2lab.config import ConfigError, ModelConfig, format_errors, format_validation_error
from k2lab.recipes import booleans_for_numbers

__all__ = [
    "Preset",
    "available_presets",
    "get_preset",
    "language_model_config",
    "load_preset",
]

Kind = Literal["text", "vision-language"]
TOWERS = ("moonvit-3d", "moonvit-v2")  # built by k2lab.presets.vision_language


@dataclass(frozen=True)
class Preset:
    """One registry entry: a text preset (``data`` is its ``ModelConfig`` fields) or a vision-language one
    (``language_model`` names a text preset; ``tower`` is ``moonvit-3d`` or ``moonvit-v2``; ``vision`` its sizes)."""

    name: str
    kind: Kind
    language_model: str
    data: dict[str, Any] = field(default_factory=dict)
    tower: str | None = None
    vision: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def is_vision_language(self) -> bool:
        return self.kind == "vision-language"


def _entry(name: str, data: dict[str, Any]) -> Preset:
    if data.get("kind") != "vision-language":
        return Preset(name=name, kind="text", language_model=name, data=data)
    if data.get("tower") not in TOWERS:
        raise ConfigError(f"preset {name!r}: tower must be one of {list(TOWERS)}, got {data.get('tower')!r}")
    return Preset(
        name=name,
        kind="vision-language",
        language_model=data["language_model"],
        tower=data["tower"],
        vision=dict(data.get("vision", {})),
        description=data.get("description", ""),
    )


@cache
def _registry() -> dict[str, Preset]:
    folder = resources.files(__name__)
    files = {e.name.removesuffix(".json"): e for e in folder.iterdir() if e.name.endswith(".json")}
    return {name: _entry(name, json.loads(files[name].read_text())) for name in sorted(files)}


def available_presets(kind: Kind | None = None) -> list[str]:
    """Every preset name (sorted), or those of one ``kind``."""
    return [name for name, preset in _registry().items() if kind is None or preset.kind == kind]


def get_preset(name: str) -> Preset:
    """The registry entry of ``name`` (``ConfigError`` listing every preset if unknown)."""
    registry = _registry()
    if name not in registry:
        raise ConfigError(f"unknown preset {name!r}; available presets: {', '.join(available_presets())}")
    return registry[name]


def load_preset(name: str, **overrides: object) -> ModelConfig:
    """The ``ModelConfig`` of text preset ``name`` (``k2``, ``k2-mini`` ...), optionally with fields overridden.

    A vision-language preset is refused with the reason (its language model is named in the message)."""
    preset = get_preset(name)
    if preset.is_vision_language:
        raise ConfigError(
            f"preset {name!r} is a vision-language preset (language model {preset.language_model!r} + a "
            f"{preset.tower} tower); this needs a text preset such as {preset.language_model!r}"
        )
    booleans = booleans_for_numbers(ModelConfig, overrides)  # a recipe's model_overrides: true is not 1
    if booleans:
        raise ConfigError(f"preset {name!r} is invalid: {format_errors(booleans)}")
    try:
        return ModelConfig.model_validate({**preset.data, **overrides})
    except ValidationError as error:
        raise ConfigError(f"preset {name!r} is invalid: {format_validation_error(error)}") from error


def language_model_config(name: str, **overrides: object) -> ModelConfig:
    """The decoder's config of any preset: a text preset itself, a vision-language preset's language model."""
    return load_preset(get_preset(name).language_model, **overrides)
