"""Validated configuration of the MoonViT-3D vision tower and its projector (Kimi K2.5).

Field names follow transformers' ``Kimi_K25VisionConfig`` (``patch_size``, ``pos_emb_height``,
``pos_emb_width``, ``pos_emb_time``, ``merge_kernel_size`` ...). The projector lives on the parent
``Kimi_K25Config`` there; its two fields we need are kept here under their HF names
(``projection_layer_norm_eps``) or as ``text_hidden_size`` (the parent's ``text_config.hidden_size``).
HF's ``rope_parameters = {"rope_type": "axial", "rope_theta": θ}`` is flattened to ``rope_theta``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["VisionConfig"]


class VisionConfig(BaseModel):
    """MoonViT-3D + MLP projector.

    Invariants checked at construction (each error names the field and the reason):
    ``hidden_size % num_attention_heads == 0``; head dim divisible by 4 (2-D axial rope gives each of
    the h and w axes ``head_dim / 4`` frequencies); ``hidden_size`` even (sin/cos time embedding);
    a square learned position grid (``pos_emb_height == pos_emb_width``, as the reference resamples it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    patch_size: int = Field(default=14, gt=0)
    pos_emb_height: int = Field(default=64, gt=0)
    pos_emb_width: int = Field(default=64, gt=0)
    pos_emb_time: int = Field(default=4, gt=0)
    num_attention_heads: int = Field(default=16, gt=0)
    num_hidden_layers: int = Field(default=27, ge=0)
    hidden_size: int = Field(default=1152, gt=0)
    intermediate_size: int = Field(default=4304, gt=0)
    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_theta: float = Field(default=10000.0, gt=0)
    layer_norm_eps: float = Field(default=1e-5, gt=0)
    # projector (HF: Kimi_K25Config.projection_layer_norm_eps, text_config.hidden_size)
    projection_layer_norm_eps: float = Field(default=1e-5, gt=0)
    text_hidden_size: int = Field(default=7168, gt=0)

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads="
                f"{self.num_attention_heads}"
            )
        if self.head_dim % 4:
            raise ValueError(f"head dim {self.head_dim} must be divisible by 4 for the 2-D axial rope")
        if self.hidden_size % 2:
            raise ValueError(f"hidden_size={self.hidden_size} must be even for the sin/cos time embedding")
        if self.pos_emb_height != self.pos_emb_width:
            raise ValueError(
                f"pos_emb_height={self.pos_emb_height} and pos_emb_width={self.pos_emb_width} must be equal: "
                "the learned position grid is square in the reference"
            )
        if min(self.merge_kernel_size) <= 0:
            raise ValueError(f"merge_kernel_size={self.merge_kernel_size} must be positive")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        """kh·kw: patches concatenated into one projector token."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, vision: Mapping[str, Any], parent: Mapping[str, Any] | None = None) -> VisionConfig:
        """Build from HF ``vision_config`` (dict) and optionally the parent ``Kimi_K25Config`` dict."""
        fields = {k: vision[k] for k in cls.model_fields if k in vision}
        rope = vision.get("rope_parameters") or {}
        if "rope_theta" in rope:
            fields["rope_theta"] = rope["rope_theta"]
        if "merge_kernel_size" in fields:
            fields["merge_kernel_size"] = tuple(fields["merge_kernel_size"])
        if parent is not None:
            if "projection_layer_norm_eps" in parent:
                fields["projection_layer_norm_eps"] = parent["projection_layer_norm_eps"]
            text = parent.get("text_config") or {}
            if "hidden_size" in text:
                fields["text_hidden_size"] = text["hidden_size"]
            proj = parent.get("projection_hidden_size")
            width = fields.get("hidden_size", cls.model_fields["hidden_size"].default)
            if proj is not None and proj != width:
                raise ValueError(f"projection_hidden_size={proj} must equal the vision hidden_size={width}")
        return cls(**fields)

    def to_hf(self) -> dict[str, Any]:
        """The HF ``vision_config`` dict (projector fields go on the parent, see ``from_hf``)."""
        data = self.model_dump(exclude={"projection_layer_norm_eps", "text_hidden_size", "rope_theta"})
        data.pop("layer_norm_eps")
        data["merge_kernel_size"] = list(self.merge_kernel_size)
        data["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return data
