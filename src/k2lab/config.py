"""Validated model configuration (the presets that name configs live in ``k2lab.presets``).

Field names follow the public DeepSeek-V3 / Kimi-K2 ``config.json`` vocabulary (``n_routed_experts``,
``num_experts_per_tok``, ``q_lora_rank`` ...) so a reader can hold our config beside a real checkpoint's.
Everything else in the package reads only this object.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from k2lab.errors import K2LabError

__all__ = [
    "ConfigError",
    "ModelConfig",
    "YarnScaling",
    "format_errors",
    "format_validation_error",
]


class ConfigError(K2LabError, ValueError):
    """A configuration that cannot be built; the message names the field and the reason."""


class YarnScaling(BaseModel):
    """YaRN rope scaling as written in the public configs (``rope_scaling`` with ``type: yarn``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(default=32.0, gt=0)
    beta_slow: float = Field(default=1.0, gt=0)
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


class ModelConfig(BaseModel):
    """One decoder of the Kimi K2 family (MLA attention, DeepSeek-style MoE, optional YaRN).

    Invariants checked at construction (each error names the field):
    ``num_experts_per_tok <= n_routed_experts``, ``n_routed_experts % n_group == 0``,
    ``topk_group <= n_group``, enough experts in the selected groups for top-k, and positive ranks/dims.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0, description="Dense SwiGLU width of the first layers.")
    moe_intermediate_size: int = Field(gt=0, description="Width of one routed (and shared) expert.")
    num_hidden_layers: int = Field(gt=0)
    first_k_dense_replace: int = Field(ge=0, description="Layers [0, k) use the dense MLP.")
    num_attention_heads: int = Field(gt=0)

    # MLA
    q_lora_rank: int | None = Field(default=None, gt=0, description="None: direct q_proj.")
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)

    # MoE
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(ge=0)
    num_experts_per_tok: int = Field(gt=0)
    n_group: int = Field(default=1, gt=0)
    topk_group: int = Field(default=1, gt=0)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    scoring_func: Literal["sigmoid"] = "sigmoid"

    # Position / norm / embeddings
    rope_theta: float = Field(default=10000.0, gt=1, allow_inf_nan=False)  # θ ≤ 1: no rotation
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = Field(default=4096, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = False
    initializer_range: float = Field(default=0.02, gt=0)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # Feed-forward activation (K3: SiTU-GLU in every MLP, β1 = 4, β2 = 25, so |out| <= β1·β2)
    mlp_activation: Literal["swiglu", "situ_glu"] = "swiglu"
    situ_beta1: float = Field(default=4.0, gt=0)
    situ_beta2: float = Field(default=25.0, gt=0)
    # Stable LatentMoE (K3): routed experts work at this width between a down- and an up-projection
    moe_latent_size: int | None = Field(default=None, gt=0, description="None: experts on full width.")
    moe_latent_norm: bool = Field(
        default=True,
        description="RMSNorm on the latent routed sum before W_up (released latent_moe_use_norm).",
    )

    # Hybrid sequence mixing (Kimi Linear, K3): 1-based indices of the MLA layers, every other one is KDA
    mla_layers: tuple[int, ...] | None = Field(default=None, description="None: every layer is MLA.")
    mla_rope: bool = Field(default=True, description="False: NoPE MLA (k_R kept, never rotated).")
    mla_output_gate: bool = Field(default=False, description="Gated MLA: o ⊙ sigmoid(W_g x) before W_O.")
    linear_num_heads: int = Field(default=32, gt=0, description="KDA heads.")
    linear_head_dim: int = Field(default=128, gt=0, description="KDA key/value width per head.")
    linear_conv_kernel_dim: int = Field(default=4, gt=0, description="KDA causal short-conv kernel.")
    kda_gate: Literal["softplus", "lower_bound"] = Field(
        default="softplus", description="Kimi Linear −exp(A)·softplus(·) or K3 g_min·sigmoid(exp(A)·(·))."
    )
    kda_gate_lower_bound: float = Field(default=-5.0, lt=0, description="g_min of the K3 gate.")
    kda_output_gate: Literal["low_rank", "full_rank"] = "low_rank"

    # Block AttnRes (K3): depth-wise attention over block summaries; block size in decoder layers
    attnres_block_size: int | None = Field(default=None, gt=0, description="None: plain residuals.")

    # Multi-token prediction (DeepSeek-V3 §2.2): K modules after the main layers, module k predicts t_{i+k+1}
    num_nextn_predict_layers: int = Field(
        default=0,
        ge=0,
        description="DeepSeek-V3 MTP modules (HF layers num_hidden_layers …); 0: none. Module k predicts "
        "token i+k+1 from the depth k-1 hidden state and Emb(t_{i+k}); they share the embedding and head.",
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> ModelConfig:
        def fail(field: str, reason: str) -> None:
            raise ValueError(f"{field}: {reason}")

        if self.num_experts_per_tok > self.n_routed_experts:
            fail(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}; "
                "a token cannot pick more experts than exist",
            )
        if self.n_routed_experts % self.n_group:
            fail(
                "n_routed_experts",
                f"{self.n_routed_experts} is not divisible by n_group={self.n_group}",
            )
        if self.topk_group > self.n_group:
            fail("topk_group", f"{self.topk_group} > n_group={self.n_group}")
        per_group = self.n_routed_experts // self.n_group
        if self.topk_group * per_group < self.num_experts_per_tok:
            fail(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} experts cannot be chosen from topk_group={self.topk_group} "
                f"groups of {per_group}",
            )
        if self.n_group > 1 and per_group < 2:
            fail(
                "n_group", "group-limited routing scores each group by its top-2 experts; need >= 2 per group"
            )
        if self.first_k_dense_replace > self.num_hidden_layers:
            fail(
                "first_k_dense_replace",
                f"{self.first_k_dense_replace} > num_hidden_layers={self.num_hidden_layers}",
            )
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.mla_layers is not None:
            layers = self.mla_layers
            if any(not 1 <= index <= self.num_hidden_layers for index in layers):
                fail("mla_layers", f"{list(layers)} must be 1-based indices in [1, {self.num_hidden_layers}]")
            if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
                fail("mla_layers", f"{list(layers)} must be strictly increasing")
        if self.moe_latent_size is not None and self.first_k_dense_replace >= self.num_hidden_layers:
            fail("moe_latent_size", "set, but the model has no MoE layer")
        for token_field in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token = getattr(self, token_field)
            if token is not None and not 0 <= token < self.vocab_size:
                fail(token_field, f"{token} is outside the vocabulary [0, {self.vocab_size})")
        return self

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: nope part then rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim^-0.5 · mscale²`` with ``mscale = 0.1·mscale_all_dim·ln(factor) + 1`` under YaRN."""
        scale = self.qk_head_dim**-0.5
        yarn = self.rope_scaling
        if yarn is not None and yarn.mscale_all_dim and yarn.factor > 1:
            mscale = 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0
            scale *= mscale * mscale
        return scale

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Sequence mixer per layer (0-based): ``"mla"`` or ``"kda"``."""
        if self.mla_layers is None:
            return ("mla",) * self.num_hidden_layers
        mla = {index - 1 for index in self.mla_layers}
        return tuple("mla" if i in mla else "kda" for i in range(self.num_hidden_layers))

    @property
    def has_kda(self) -> bool:
        return "kda" in self.layer_types

    @property
    def uses_rope(self) -> bool:
        """Whether any layer rotates positions (MLA with RoPE); a NoPE-only hybrid needs no rotary tables."""
        return self.mla_rope and "mla" in self.layer_types

    def replace(self, **changes: object) -> ModelConfig:
        """A validated copy with some fields changed."""
        return ModelConfig.model_validate({**self.model_dump(), **changes})


def format_validation_error(error: ValidationError, options: Mapping[str, str] | None = None) -> str:
    """One readable line per problem: ``field: reason`` (see ``format_errors``)."""
    return format_errors(error.errors(), options)


def format_errors(errors: Iterable[Mapping[str, Any]], options: Mapping[str, str] | None = None) -> str:
    """Pydantic's error dicts (``loc``, ``msg``, ``type``) as ``field: reason``, joined by "; "; a required
    field that a command-line option sets (``options``: dotted field → ``"--checkpoint/-c"``) is named by
    that option."""
    lines = []
    for item in errors:
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item.get("type") == "missing" and location in (options or {}):
            lines.append(f"{options[location]} is required (recipe key {location})")
        else:
            lines.append(f"{location}: {message}" if location else message)
    return "; ".join(lines)
