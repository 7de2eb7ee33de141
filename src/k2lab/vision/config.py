"""Validated configuration of the MoonViT vision towers and their projector (Kimi K2.5 and Kimi K3).

Two named variants of one tower (see ``VisionConfig.moonvit_3d`` / ``VisionConfig.moonvit_v2``):

* **MoonViT-3D** (Kimi K2.5, the defaults): LayerNorms and biased projections, q/k/v as wide as the tower,
  bicubic resampling of the position grid; the projector LayerNorms each of the kh·kw patch vectors of a
  merge block before concatenating them (``merge="in_projector"``, vLLM's ``mm_projector_type`` "patchmerger").
* **MoonViT-V2** (Kimi K3, as released in the ``kimi_k3`` checkpoint's ``vision_config``): RMSNorm
  (``norm="rmsnorm"``, eps = fp32 machine epsilon), no bias anywhere (``bias=False``), an attention width
  ``qkv_hidden_size`` = 12 heads × 128 = 1536 apart from the 1024-wide residual stream, bilinear position
  resampling, and the 2×2 pixel shuffle before a projector without a pre-norm whose RMSNorm acts on its
  D_text-wide *output* (``merge="pixel_shuffle"``, "patchmergerv2"). ``k2lab.hf.kimi_k3_vision`` reads and
  writes the released field names.

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

__all__ = ["FP32_EPS", "VisionConfig"]

# fields transformers' kimi_k25 vision_config does not have (K2.5's values are the defaults)
_VARIANT_FIELDS = frozenset({"norm", "bias", "merge", "qkv_hidden_size", "pos_emb_interpolation"})
# torch.nn.RMSNorm(dim) without eps (the released MoonViT-V2's norms) uses the machine epsilon of the
# statistics' dtype, fp32 for fp32 / bf16 / fp16 inputs alike: torch.finfo(torch.float32).eps
FP32_EPS = 2.0**-23


class VisionConfig(BaseModel):
    """MoonViT tower + MLP projector (K2.5's MoonViT-3D by default; ``moonvit_v2()`` for K3's).

    ``layer_norm_eps`` / ``projection_layer_norm_eps`` are the eps of whichever norm ``norm`` selects.
    ``qkv_hidden_size`` (None: ``hidden_size``) is the width of q, k and v, heads × head dim.

    Invariants checked at construction (each error names the field and the reason):
    attention width divisible by ``num_attention_heads``; head dim divisible by 4 (2-D axial rope gives each of
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
    qkv_hidden_size: int | None = Field(default=None, gt=0)
    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_theta: float = Field(default=10000.0, gt=0)
    layer_norm_eps: float = Field(default=1e-5, gt=0)
    # projector (HF: Kimi_K25Config.projection_layer_norm_eps, text_config.hidden_size)
    projection_layer_norm_eps: float = Field(default=1e-5, gt=0)
    text_hidden_size: int = Field(default=7168, gt=0)
    # variant switches (not in HF's config: K2.5 is the only tower transformers has)
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = True
    merge: Literal["in_projector", "pixel_shuffle"] = "in_projector"
    pos_emb_interpolation: Literal["bicubic", "bilinear"] = "bicubic"

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.attention_width % self.num_attention_heads:
            width = "hidden_size" if self.qkv_hidden_size is None else "qkv_hidden_size"
            raise ValueError(
                f"{width}={self.attention_width} must be divisible by num_attention_heads="
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

    # ------------------------------------------------------------------------------------------- presets

    @classmethod
    def moonvit_3d(cls, **overrides: Any) -> VisionConfig:
        """Kimi K2.5's MoonViT-3D: patch 14, D = 1152, 27 layers, 16 heads, F = 4304, 64×64 position grid,
        2×2 merge, LayerNorm, biases, per-patch projector norm (the field defaults)."""
        return cls(**overrides)

    @classmethod
    def moonvit_v2(cls, **overrides: Any) -> VisionConfig:
        """Kimi K3's MoonViT-V2 with the released ``vision_config`` values (vLLM's ``KimiK3VisionConfig``).

        Patch 14, D = 1024, 27 layers, 12 heads of 128 (q/k/v 1536 wide, ``wo`` 1536 -> 1024), F = 4096,
        tanh-GELU MLPs, 64×64 learned position grid resampled bilinearly + sin/cos frame embedding + 2-D axial
        rope (θ = 10⁴), volumes of ≤ 4 frames, RMSNorm with fp32-epsilon eps (``nn.RMSNorm`` without eps),
        no biases, 2×2 pixel shuffle and the "patchmergerv2" projector (post-norm eps 1e-5). The tower
        (patch embedding, positions, 27 blocks, final norm) has 401,214,464 parameters, the report's "401M";
        the projector, whose output is K3's text width ``text_hidden_size``, is counted apart
        (``num_parameters(c, include_projector=False)``).

        Where the report and the release differ: before the release we kept K2.5's D = 1152 / 16 heads with
        F = 4048 and an RMSNorm *before* the projector over the shuffled kh·kw·D token; the release has
        D = 1024 with a wider attention and the projector's RMSNorm on its output.
        """
        fields: dict[str, Any] = {
            "hidden_size": 1024,
            "num_attention_heads": 12,
            "qkv_hidden_size": 1536,
            "intermediate_size": 4096,
            "layer_norm_eps": FP32_EPS,
            "norm": "rmsnorm",
            "bias": False,
            "merge": "pixel_shuffle",
            "pos_emb_interpolation": "bilinear",
        }
        return cls(**{**fields, **overrides})

    @property
    def is_moonvit_3d_family(self) -> bool:
        """True when the architecture is K2.5's (LayerNorm, biases, merge in the projector, q/k/v as wide as
        the tower, bicubic positions): what transformers' ``kimi_k25`` can hold."""
        return (
            self.norm == "layernorm"
            and self.bias
            and self.merge == "in_projector"
            and self.attention_width == self.hidden_size
            and self.pos_emb_interpolation == "bicubic"
        )

    @property
    def attention_width(self) -> int:
        """Width of q, k, v (and of ``wo``'s input): ``qkv_hidden_size``, else ``hidden_size``."""
        return self.hidden_size if self.qkv_hidden_size is None else self.qkv_hidden_size

    @property
    def head_dim(self) -> int:
        return self.attention_width // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        """kh·kw: patches concatenated into one projector token."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, vision: Mapping[str, Any], parent: Mapping[str, Any] | None = None) -> VisionConfig:
        """Build from HF ``vision_config`` (dict) and optionally the parent ``Kimi_K25Config`` dict."""
        fields = {k: vision[k] for k in cls.model_fields if k in vision and k not in _VARIANT_FIELDS}
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
        """The HF ``vision_config`` dict (projector fields go on the parent, see ``from_hf``).

        Raises ``ValueError`` for MoonViT-V2 (or any RMSNorm / bias-free / pixel-shuffle / narrow-or-wide
        attention / bilinear config): transformers' ``kimi_k25`` implements only the K2.5 tower; K3's goes
        to the ``kimi_k3`` format (``k2lab.hf.kimi_k3_vision``).
        """
        if not self.is_moonvit_3d_family:
            raise ValueError(
                f"to_hf: transformers' kimi_k25 has only the K2.5 MoonViT-3D tower (LayerNorm, biases, merge in "
                f"the projector); this config (norm={self.norm!r}, bias={self.bias}, merge={self.merge!r}, "
                f"qkv_hidden_size={self.qkv_hidden_size}, pos_emb_interpolation={self.pos_emb_interpolation!r}) "
                "is MoonViT-V2-like: write it as kimi_k3 (k2lab.hf.kimi_k3_vision)"
            )
        exclude = {"projection_layer_norm_eps", "text_hidden_size", "rope_theta", *_VARIANT_FIELDS}
        data = self.model_dump(exclude=exclude)
        data.pop("layer_norm_eps")
        data["merge_kernel_size"] = list(self.merge_kernel_size)
        data["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        return data
