"""Parameter names: our ``MoonViT3D`` state dict <-> transformers' Kimi-K2.5 vision tower + projector.

transformers' ``Kimi_K25ForConditionalGeneration`` holds them under ``model.vision_tower.`` and
``model.mm_projector.`` (``prefix="model."``, the default); a bare ``Kimi_K25Model`` uses ``prefix=""``.
Every tensor keeps its shape and layout (no transposes, no q/k permutation: our rope uses the same
rotate-half layout as transformers). The original Moonshot checkpoint on the Hub (fused ``wqkv``,
interleaved-rope q/k rows, ``encoder.blocks``) is a further step transformers performs on load; see its
``conversion_mapping`` entry ``kimi_k25``.

| ours                                   | transformers (after ``prefix``)                        | shape          |
|----------------------------------------|--------------------------------------------------------|----------------|
| encoder.patch_embed.{weight,bias}      | vision_tower.patch_embed.proj.{weight,bias}            | [D, 3, p, p]   |
| encoder.pos_embed.weight               | vision_tower.patch_embed.pos_emb.position_embeddings   | [H, W, D]      |
| encoder.blocks.{i}.attn_norm.*         | vision_tower.layers.{i}.norm1.*                        | [D]            |
| encoder.blocks.{i}.attn.{q,k,v}.*      | vision_tower.layers.{i}.attn.{q,k,v}_proj.*            | [D, D], [D]    |
| encoder.blocks.{i}.attn.o.*            | vision_tower.layers.{i}.attn.proj.*                    | [D, D], [D]    |
| encoder.blocks.{i}.mlp_norm.*          | vision_tower.layers.{i}.norm2.*                        | [D]            |
| encoder.blocks.{i}.mlp.fc_in.*         | vision_tower.layers.{i}.mlp.fc1.*                      | [F, D], [F]    |
| encoder.blocks.{i}.mlp.fc_out.*        | vision_tower.layers.{i}.mlp.fc2.*                      | [D, F], [D]    |
| encoder.final_norm.*                   | vision_tower.final_layernorm.*                         | [D]            |
| projector.norm.*                       | mm_projector.pre_norm.*                                | [D]            |
| projector.fc_in.*                      | mm_projector.in_proj.*                                 | [kD, kD], [kD] |
| projector.fc_out.*                     | mm_projector.out_proj.*                                | [D_text, kD]   |
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = [
    "VISION_NAME_TABLE",
    "from_hf_vision_name",
    "from_hf_vision_names",
    "to_hf_vision_name",
    "to_hf_vision_names",
]

# (ours, transformers) with ``{i}`` a layer index; the leaf (weight / bias) is carried over unchanged.
VISION_NAME_TABLE: tuple[tuple[str, str], ...] = (
    ("encoder.patch_embed", "vision_tower.patch_embed.proj"),
    ("encoder.blocks.{i}.attn_norm", "vision_tower.layers.{i}.norm1"),
    ("encoder.blocks.{i}.attn.q", "vision_tower.layers.{i}.attn.q_proj"),
    ("encoder.blocks.{i}.attn.k", "vision_tower.layers.{i}.attn.k_proj"),
    ("encoder.blocks.{i}.attn.v", "vision_tower.layers.{i}.attn.v_proj"),
    ("encoder.blocks.{i}.attn.o", "vision_tower.layers.{i}.attn.proj"),
    ("encoder.blocks.{i}.mlp_norm", "vision_tower.layers.{i}.norm2"),
    ("encoder.blocks.{i}.mlp.fc_in", "vision_tower.layers.{i}.mlp.fc1"),
    ("encoder.blocks.{i}.mlp.fc_out", "vision_tower.layers.{i}.mlp.fc2"),
    ("encoder.final_norm", "vision_tower.final_layernorm"),
    ("projector.norm", "mm_projector.pre_norm"),
    ("projector.fc_in", "mm_projector.in_proj"),
    ("projector.fc_out", "mm_projector.out_proj"),
)
# whole-name entries (no weight/bias leaf)
_EXACT: tuple[tuple[str, str], ...] = (
    ("encoder.pos_embed.weight", "vision_tower.patch_embed.pos_emb.position_embeddings"),
)


def _compile(module: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(module).replace(r"\{i\}", r"(?P<i>\d+)") + r"\.(?P<leaf>weight|bias)$")


_TO_HF = [(_compile(ours), theirs) for ours, theirs in VISION_NAME_TABLE]
_FROM_HF = [(_compile(theirs), ours) for ours, theirs in VISION_NAME_TABLE]


def _translate(name: str, rules: list[tuple[re.Pattern[str], str]], exact: dict[str, str]) -> str:
    if name in exact:
        return exact[name]
    for pattern, target in rules:
        if m := pattern.match(name):
            return target.replace("{i}", m.groupdict().get("i") or "") + "." + m.group("leaf")
    raise KeyError(f"no vision name mapping for {name!r}")


def to_hf_vision_name(name: str, prefix: str = "model.") -> str:
    """Our parameter name -> transformers' (``KeyError`` if it is not a MoonViT3D parameter)."""
    return prefix + _translate(name, _TO_HF, dict(_EXACT))


def from_hf_vision_name(name: str, prefix: str = "model.") -> str:
    """transformers' name (with ``prefix``) -> ours (``KeyError`` if it is not a vision/projector name)."""
    if not name.startswith(prefix):
        raise KeyError(f"{name!r} does not start with {prefix!r}")
    return _translate(name[len(prefix) :], _FROM_HF, {theirs: ours for ours, theirs in _EXACT})


def is_hf_vision_name(name: str, prefix: str = "model.") -> bool:
    """True for names under ``{prefix}vision_tower.`` or ``{prefix}mm_projector.``."""
    return name.startswith((prefix + "vision_tower.", prefix + "mm_projector."))


def to_hf_vision_names(state: Mapping[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Rename every entry of a ``MoonViT3D`` state dict to transformers' names (tensors shared, not copied)."""
    return {to_hf_vision_name(k, prefix): v for k, v in state.items()}


def from_hf_vision_names(
    state: Mapping[str, torch.Tensor], prefix: str = "model."
) -> dict[str, torch.Tensor]:
    """The vision tower + projector entries of a transformers state dict, under our names (others skipped)."""
    return {from_hf_vision_name(k, prefix): v for k, v in state.items() if is_hf_vision_name(k, prefix)}
