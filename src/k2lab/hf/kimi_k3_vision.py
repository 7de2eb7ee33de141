"""Kimi K3's vision part in the released ``kimi_k3`` layout: MoonViT-V2's ``vision_config`` and weights.

A ``kimi_k3`` config.json nests the text decoder's config (``text_config``, model_type ``kimi_linear``, read and
written by ``k2lab.hf.kimi_k3``) and the tower's (``vision_config``, model_type ``kimi_k3_vision``), with the
image placeholder id ``media_placeholder_token_id`` (163605) on top. vLLM's ``KimiK3ForConditionalGeneration``
builds the tower with its Kimi-K2.5 ``MoonViT3dPretrainedModel`` and ``KimiK25MultiModalProjector`` driven by
these options; that code, not the report, fixes what each field means.

``vision_config`` (released name -> ``VisionConfig``; a field that is absent takes vLLM's
``KimiK3VisionConfig`` default, listed in ``RELEASED_DEFAULTS``):

| released                                      | ours                                           |
|-----------------------------------------------|------------------------------------------------|
| patch_size                                    | patch_size                                     |
| init_pos_emb_height / _width / _time          | pos_emb_height / pos_emb_width / pos_emb_time  |
| vt_num_attention_heads / vt_num_hidden_layers | num_attention_heads / num_hidden_layers        |
| vt_hidden_size (= mm_hidden_size)             | hidden_size                                    |
| vt_intermediate_size                          | intermediate_size                              |
| qkv_hidden_size (12 × 128 = 1536 ≠ 1024)      | qkv_hidden_size                                |
| merge_kernel_size                             | merge_kernel_size                              |
| activation_func                               | hidden_act                                     |
| pos_emb_interpolation_mode                    | pos_emb_interpolation                          |
| projector_ln_eps                              | projection_layer_norm_eps                      |
| text_hidden_size (vLLM: text_config's)        | text_hidden_size                               |

Options we implement only as released (anything else is refused, every offending field named):
``pos_emb_type`` divided_fixed, ``video_attn_type`` spatial_temporal, ``merge_type`` sd2_tpool,
``mm_projector_type`` patchmergerv2, ``projector_hidden_act`` gelu, ``norm_type`` rmsnorm, ``mlp_type`` mlp2,
``attn_bias`` / ``patch_embed_proj_bias`` / ``linear_bias`` false. The tower's RMSNorms are ``nn.RMSNorm(D)``
without eps there (fp32 machine epsilon, ``FP32_EPS``) and the rope base is fixed at 10⁴, so ours must be too.

Weights (ours under ``vision.``; released names as on disk — vLLM's loader maps ``mm_projector.proj.0`` /
``.proj.2`` to its ``linear_1`` / ``linear_2``), D = hidden, A = qkv width, F, k = kh·kw, T = text width:

| ours                                 | released                                         | shape          |
|--------------------------------------|--------------------------------------------------|----------------|
| encoder.patch_embed.weight           | vision_tower.patch_embed.proj.weight             | [D, 3, p, p]   |
| encoder.pos_embed.weight             | vision_tower.patch_embed.pos_emb.weight          | [H, W, D]      |
| encoder.blocks.{i}.attn_norm.weight  | vision_tower.encoder.blocks.{i}.norm0.weight     | [D]            |
| encoder.blocks.{i}.attn.{q,k,v}      | vision_tower.encoder.blocks.{i}.wqkv.weight      | [3A, D]        |
| encoder.blocks.{i}.attn.o.weight     | vision_tower.encoder.blocks.{i}.wo.weight        | [D, A]         |
| encoder.blocks.{i}.mlp_norm.weight   | vision_tower.encoder.blocks.{i}.norm1.weight     | [D]            |
| encoder.blocks.{i}.mlp.fc_in.weight  | vision_tower.encoder.blocks.{i}.mlp.fc0.weight   | [F, D]         |
| encoder.blocks.{i}.mlp.fc_out.weight | vision_tower.encoder.blocks.{i}.mlp.fc1.weight   | [D, F]         |
| encoder.final_norm.weight            | vision_tower.encoder.final_layernorm.weight      | [D]            |
| projector.fc_in.weight               | mm_projector.proj.0.weight                       | [kD, kD]       |
| projector.fc_out.weight              | mm_projector.proj.2.weight                       | [T, kD]        |
| projector.post_norm.weight           | mm_projector.post_norm.weight                    | [T]            |

``wqkv`` holds q, k, v rows in that order; within each head of q and k the rows are in complex-pair order
(vLLM applies the rope non-neox, to pairs (2j, 2j + 1)): disk row 2j is our rotate-half row j, row 2j + 1 our
row j + d/2 (``kimi_k25.rope_row_order``) — the same fusion as K2.5's original checkpoint, A rows per part.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from k2lab.config import ConfigError
from k2lab.hf import kimi_k3
from k2lab.hf.json_values import is_integer, is_number
from k2lab.hf.kimi_k25 import VISION_PREFIX, fused_qkv, original_vision_name
from k2lab.hf.layout import CHECKPOINT, WeightGroup, single
from k2lab.vision.config import FP32_EPS, VisionConfig
from k2lab.vision.vlm import VLMConfig

__all__ = [
    "MODEL_TYPE",
    "RELEASED_DEFAULTS",
    "VISION_MODEL_TYPE",
    "config_from_hf",
    "config_to_hf",
    "is_k3_vision",
    "vision_config_from_hf",
    "vision_config_to_hf",
    "vision_weight_groups",
    "weight_groups",
]

MODEL_TYPE = kimi_k3.MODEL_TYPE
VISION_MODEL_TYPE = "kimi_k3_vision"
PLACEHOLDER = "media_placeholder_token_id"
# our VLMConfig's other media ids, written beside the released placeholder id (extra keys vLLM ignores)
_EXTRA_TOKEN_FIELDS = ("video_token_id", "vision_start_token_id", "vision_end_token_id")

# vLLM's KimiK3VisionConfig defaults: what a vision_config without the field means
RELEASED_DEFAULTS: dict[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "merge_kernel_size": (2, 2),
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2",
    "mm_hidden_size": None,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
    "qkv_hidden_size": 1536,
    "norm_type": "rmsnorm",
    "attn_bias": False,
    "patch_embed_proj_bias": False,
    "mlp_type": "mlp2",
    "linear_bias": False,
    "activation_func": "gelu_pytorch_tanh",
    "pos_emb_interpolation_mode": "bilinear",
}
# released field -> ours, carried over as they are
_RENAMED = {
    "patch_size": "patch_size",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "vt_num_attention_heads": "num_attention_heads",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_hidden_size": "hidden_size",
    "vt_intermediate_size": "intermediate_size",
    "qkv_hidden_size": "qkv_hidden_size",
    "activation_func": "hidden_act",
    "pos_emb_interpolation_mode": "pos_emb_interpolation",
    "projector_ln_eps": "projection_layer_norm_eps",
}
# options implemented only with their released value
_FIXED = {
    key: RELEASED_DEFAULTS[key]
    for key in (
        "pos_emb_type",
        "video_attn_type",
        "merge_type",
        "mm_projector_type",
        "projector_hidden_act",
        "norm_type",
        "mlp_type",
        "attn_bias",
        "patch_embed_proj_bias",
        "linear_bias",
    )
}


def _pair(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) == 2 and all(map(is_integer, value))


# released field -> (what its value must be, the test), for the fields we read as values
_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **{
        key: ("an integer", is_integer)
        for key in _RENAMED
        if key not in ("activation_func", "pos_emb_interpolation_mode", "projector_ln_eps")
    },
    "projector_ln_eps": ("a number", is_number),
    "activation_func": ("a string", lambda value: isinstance(value, str)),
    "pos_emb_interpolation_mode": ("a string", lambda value: isinstance(value, str)),
    "merge_kernel_size": ("two integers", _pair),
    "mm_hidden_size": ("an integer or null", lambda value: value is None or is_integer(value)),
}
_ROPE_THETA = 10000.0  # vLLM's Rope2DPosEmbRepeated(theta_base=10000), not a config field
_POST_NORM = "mm_projector.post_norm.weight"  # patchmergerv2's; the other names are K2.5's original ones

# ------------------------------------------------------------------------------------------------- config


def is_k3_vision(vision: VisionConfig) -> bool:
    """True for a MoonViT-V2-style tower (RMSNorm, no biases, patchmergerv2), which ``kimi_k3`` holds."""
    return vision.norm == "rmsnorm" and not vision.bias and vision.merge == "pixel_shuffle"


def vision_config_from_hf(data: Mapping[str, Any], text_hidden_size: int) -> VisionConfig:
    """``VisionConfig`` from a released ``vision_config`` dict (absent fields: ``RELEASED_DEFAULTS``).

    ``text_hidden_size`` is the text model's width (vLLM overrides the vision_config's with it).
    Raises ``ConfigError`` naming every field of the wrong type (``merge_kernel_size`` must be two integers,
    sizes integers, not strings), then listing every option we do not implement; a pydantic error for bad
    sizes.
    """
    raw = {**RELEASED_DEFAULTS, **data}
    wrong = [
        f"vision_config.{key}: {raw[key]!r} should be {kind}"
        for key, (kind, test) in _TYPES.items()
        if not test(raw[key])
    ]
    if wrong:
        raise ConfigError("; ".join(wrong))
    problems = [
        f"{key}={raw[key]!r} (only {value!r} is implemented)"
        for key, value in _FIXED.items()
        if raw[key] != value
    ]
    if raw.get("model_type", VISION_MODEL_TYPE) != VISION_MODEL_TYPE:
        problems.append(f"model_type={raw['model_type']!r} (expected {VISION_MODEL_TYPE!r})")
    if raw["mm_hidden_size"] not in (None, raw["vt_hidden_size"]):
        problems.append(f"mm_hidden_size={raw['mm_hidden_size']} (the projector reads vt_hidden_size wide)")
    if problems:
        raise ConfigError("vision_config: unsupported MoonViT-V2 options: " + "; ".join(problems))
    fields = {ours: raw[theirs] for theirs, ours in _RENAMED.items()}
    fields["merge_kernel_size"] = tuple(raw["merge_kernel_size"])
    return VisionConfig.moonvit_v2(**fields, text_hidden_size=text_hidden_size)


def vision_config_to_hf(vision: VisionConfig) -> dict[str, Any]:
    """The released ``vision_config`` dict (``ConfigError`` for a tower the released code cannot build)."""
    problems = []
    if not is_k3_vision(vision):
        variant = f"norm={vision.norm!r}, bias={vision.bias}, merge={vision.merge!r}"
        problems.append(f"{variant} (K3 has rmsnorm, no biases, pixel_shuffle)")
    if vision.layer_norm_eps != FP32_EPS:
        problems.append(f"layer_norm_eps={vision.layer_norm_eps} (nn.RMSNorm's default {FP32_EPS} is fixed)")
    if vision.rope_theta != _ROPE_THETA:
        problems.append(f"rope_theta={vision.rope_theta} (the rope base is fixed at {_ROPE_THETA:g})")
    if problems:
        raise ConfigError("kimi_k3 cannot hold this vision tower: " + "; ".join(problems))
    data: dict[str, Any] = {"model_type": VISION_MODEL_TYPE, **RELEASED_DEFAULTS}
    data.update({theirs: getattr(vision, ours) for theirs, ours in _RENAMED.items()})
    data["qkv_hidden_size"] = vision.attention_width
    data["merge_kernel_size"] = list(vision.merge_kernel_size)
    data["mm_hidden_size"] = vision.hidden_size
    data["text_hidden_size"] = vision.text_hidden_size
    return data


def config_from_hf(data: Mapping[str, Any], name: str = "hf") -> VLMConfig:
    """``VLMConfig`` from a ``kimi_k3`` config.json dict with a ``vision_config`` (errors as the parts')."""
    vision_raw = data.get("vision_config")
    if not isinstance(vision_raw, Mapping):
        raise ConfigError("a kimi_k3 vision-language config needs a vision_config object")
    # MTP layers are skipped for the vision-language model (as for kimi_k25)
    text = kimi_k3.text_config_from_hf(kimi_k3.text_config(data), name).replace(num_nextn_predict_layers=0)
    vision = vision_config_from_hf(vision_raw, text.hidden_size)
    ids = {key: data[key] for key in _EXTRA_TOKEN_FIELDS if key in data}
    image = data.get(PLACEHOLDER, VLMConfig.model_fields["image_token_id"].default)
    return VLMConfig(text=text, vision=vision, image_token_id=image, **ids)


def config_to_hf(config: VLMConfig) -> dict[str, Any]:
    """The ``kimi_k3`` config.json dict: ``text_config`` (``k2lab.hf.kimi_k3``), ``vision_config``, ids."""
    vision = vision_config_to_hf(config.vision)  # first: refuses what the format cannot express
    return {
        **kimi_k3.config_to_hf(config.text),
        "vision_config": vision,
        PLACEHOLDER: config.image_token_id,
        **{key: getattr(config, key) for key in _EXTRA_TOKEN_FIELDS},
    }


# ------------------------------------------------------------------------------------------------ weights


def vision_weight_groups(vision: VisionConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    """The ``vision.*`` entries of a VLM state dict as released ``vision_tower.*`` / ``mm_projector.*`` tensors."""
    groups = []
    for key, tensor in state.items():
        if not key.startswith(VISION_PREFIX):
            continue
        ours, shape = key.removeprefix(VISION_PREFIX), tuple(tensor.shape)
        parts = ours.split(".")
        if ours.startswith("encoder.blocks.") and parts[-3] == "attn" and parts[-2] in ("q", "k", "v"):
            if parts[-2] == "q":  # one group per layer holds q, k and v
                groups.append(WeightGroup({CHECKPOINT: (fused_qkv(int(parts[2]), parts[-1], vision),)}))
            continue
        name = _POST_NORM if ours == "projector.post_norm.weight" else original_vision_name(ours)
        groups.append(single(name, key, shape))
    return groups


def weight_groups(config: VLMConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    """The K3 VLM's state dict (``language_model.*``, ``vision.*``) as ``kimi_k3`` checkpoint tensors."""
    prefix = kimi_k3.TEXT_PREFIX  # our language model and the checkpoint's share it
    text = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    groups = kimi_k3.weight_groups(config.text, text, prefix=prefix, slot_prefix=prefix)
    return groups + vision_weight_groups(config.vision, state)
