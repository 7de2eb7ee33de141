"""Names at the edge: our module names <-> the public checkpoint names.

The two formats transformers loads: DeepseekV3 / Kimi-K2 (this module) and Kimi Linear
(``k2lab.hf.kimi_linear``). ``config_from_hf`` reads either by ``model_type``; ``hf_model_type`` says which one
a model is written as (Kimi Linear when it has KDA layers or NoPE MLA) and ``config_to_hf`` / ``weight_groups``
dispatch on it. K3's released ``kimi_k3`` (``k2lab.hf.kimi_k3``) nests the Kimi Linear names; which format
``to_hf`` writes is chosen in ``k2lab.hf.formats``.

DeepseekV3 config: ``ModelConfig`` <-> ``config.json`` (legacy ``rope_theta`` + ``rope_scaling`` as real
checkpoints write it; transformers 5 ``rope_parameters`` is read too). Weights: our fused 3-D expert tensors
[E, out, in] <-> one key per expert and projection (``mlp.experts.{e}.{gate,up,down}_proj.weight``) as on disk,
or transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (``k2lab.hf.layout``). MTP modules are
layers ``num_hidden_layers …`` in either format (``k2lab.hf.mtp``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from k2lab.config import ConfigError, ModelConfig
from k2lab.hf import kimi_linear
from k2lab.hf.layout import (
    CHECKPOINT,
    GLOBAL_RENAMES,
    MLA_RENAMES,
    NORM_RENAMES,
    WeightGroup,
    gather,
    routed_expert_groups,
    single,
)
from k2lab.hf.mtp import main_state, mtp_groups

# Architectures whose config.json we read as the K2 decoder.
K2_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_MODEL_TYPES = (*K2_MODEL_TYPES, kimi_linear.MODEL_TYPE)

_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "first_k_dense_replace",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "norm_topk_prob",
    "routed_scaling_factor",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)

# Our names (left) for the per-layer pieces whose HF names differ.
_LAYER_RENAMES = {
    **NORM_RENAMES,
    **MLA_RENAMES,
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.e_score_correction_bias": "mlp.gate.e_score_correction_bias",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


# What a config.json means when it omits a field: transformers' ``DeepseekV3Config`` defaults (5.24). Filling
# them in keeps us loading exactly the model transformers would build (e.g. n_group 8 / topk_group 4, scaling
# 2.5, q_lora_rank 1536 rather than our own defaults). Token ids are left unset rather than defaulted.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)


def hf_model_type(config: ModelConfig) -> str:
    """The checkpoint format a model is written as: ``kimi_linear`` with KDA layers or NoPE MLA, else
    ``deepseek_v3``."""
    return kimi_linear.MODEL_TYPE if config.has_kda or not config.mla_rope else "deepseek_v3"


def config_from_hf(data: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """Build a validated ``ModelConfig`` from a DeepseekV3/Kimi-K2 or Kimi Linear ``config.json`` dict.

    Kimi Linear: see ``k2lab.hf.kimi_linear.config_from_hf``. DeepseekV3 / Kimi-K2: absent fields take
    transformers' ``DeepseekV3Config`` defaults. Raises ``ValueError`` (pydantic's ``ValidationError`` for
    invalid values) for settings the K2 decoder cannot represent: another ``model_type``, a scoring function
    other than sigmoid, an activation other than SiLU, MoE layers that are not every layer after the dense
    prefix, attention biases, or rope scaling other than YaRN.
    """
    model_type = data.get("model_type")
    if model_type == kimi_linear.MODEL_TYPE:
        return kimi_linear.config_from_hf(data, name)
    if model_type not in K2_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not a K2-family decoder (expected one of {SUPPORTED_MODEL_TYPES})"
        )
    unsupported = {
        "scoring_func": (data.get("scoring_func", "sigmoid"), "sigmoid"),
        "hidden_act": (data.get("hidden_act", "silu"), "silu"),
        "moe_layer_freq": (data.get("moe_layer_freq", 1), 1),
        "attention_bias": (data.get("attention_bias", False), False),
    }
    for key, (value, supported) in unsupported.items():
        if value is not None and value != supported:
            raise ValueError(f"{key} {value!r} is not supported (the K2 decoder uses {supported!r})")
    fields = {key: data[key] for key in _CONFIG_FIELDS if key in data and data[key] is not None}
    for key, default in _HF_DEFAULTS.items():
        if key not in data:
            fields[key] = default
    if "q_lora_rank" in data:
        fields["q_lora_rank"] = data["q_lora_rank"]  # null: direct q_proj
    if data.get("rope_interleave", True) is not True:
        raise ValueError(
            f"rope_interleave {data['rope_interleave']!r} is not supported "
            "(k2lab implements DeepSeek's interleaved rotary layout only)"
        )
    rope = dict(_json_object(data, "rope_parameters"))
    scaling = _json_object(data, "rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    theta = data.get("rope_theta")
    if theta is not None and rope.get("rope_theta") is not None and theta != rope["rope_theta"]:
        raise ValueError(
            f"rope_theta {theta!r} contradicts rope_parameters.rope_theta {rope['rope_theta']!r}"
        )
    fields["rope_theta"] = theta if theta is not None else rope.get("rope_theta", 10000.0)
    if scaling:
        kind = scaling.get("type", scaling.get("rope_type"))
        if kind not in ("yarn", "default"):
            raise ValueError(f"rope scaling type {kind!r} is not supported (only yarn)")
        if kind == "yarn":
            if scaling.get("attention_factor") is not None:
                raise ValueError("rope scaling attention_factor is not supported (derived from mscale)")
            if scaling.get("truncate", True) is False:
                raise ValueError("rope scaling truncate=false is not supported")
            fields["rope_scaling"] = {key: scaling[key] for key in _YARN_KEYS if scaling.get(key) is not None}
    for token_field in ("bos_token_id", "eos_token_id"):
        if isinstance(fields.get(token_field), list):
            if not fields[token_field]:
                raise ValueError(f"{token_field} is an empty list (expected a token id or a list of them)")
            fields[token_field] = fields[token_field][0]
    # absent: none (transformers' default is 1, but the released configs all say it; from_hf loads the
    # layers a checkpoint actually holds)
    fields["num_nextn_predict_layers"] = data.get("num_nextn_predict_layers") or 0
    return ModelConfig.model_validate({"name": name, **fields})


def _json_object(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``data[key]`` when it is a JSON object, {} when absent or null; ``ValueError`` for anything else."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} {value!r} should be a JSON object (or null)")
    return value


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that transformers loads without remote code: ``KimiLinearForCausalLM`` for a
    hybrid / NoPE model (``k2lab.hf.kimi_linear.config_to_hf``), else ``DeepseekV3ForCausalLM``.

    Raises ``ConfigError`` listing the settings the format cannot express (K3's gated MLA, SiTU-GLU, LatentMoE,
    Block AttnRes, lower-bounded or full-rank KDA gates), rather than write a checkpoint of another model.
    """
    if hf_model_type(config) == kimi_linear.MODEL_TYPE:
        return kimi_linear.config_to_hf(config)
    problems = kimi_linear.k3_features(config)
    if problems:
        raise ConfigError("cannot write a deepseek_v3 checkpoint, no equivalent for: " + "; ".join(problems))
    data: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **{key: getattr(config, key) for key in _CONFIG_FIELDS},
        "num_key_value_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "rope_interleave": True,
        "attention_bias": False,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "torch_dtype": "float32",
    }
    if config.rope_scaling is not None:
        data["rope_scaling"] = {**config.rope_scaling.model_dump(), "rope_type": "yarn"}
    return data


def weight_groups(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    """Our state dict as checkpoint tensors (``k2lab.hf.layout``) of ``config``'s format, in state order."""
    layer_groups = (
        (lambda part: kimi_linear.weight_groups(config, part))
        if hf_model_type(config) == kimi_linear.MODEL_TYPE
        else deepseek_weight_groups
    )
    return layer_groups(main_state(state)) + mtp_groups(config, state, layer_groups)


def hf_tensors(
    config: ModelConfig, state: Mapping[str, torch.Tensor], layout: str = CHECKPOINT
) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) pairs of our state in ``layout`` (where a group has it, else the canonical
    on-disk one); tensors are views of ours where possible."""
    for group in weight_groups(config, state):
        for tensor in group.prefer(layout):
            yield tensor.name, gather(state, tensor)


def deepseek_weight_groups(state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    """DeepseekV3 / Kimi-K2 names: renames, and routed experts one tensor per expert (or fused)."""
    groups: list[WeightGroup] = []
    for key, tensor in state.items():
        if key in GLOBAL_RENAMES:
            groups.append(single(GLOBAL_RENAMES[key], key, tuple(tensor.shape)))
            continue
        match = _LAYER_KEY.match(key)
        if match is None:
            raise KeyError(f"no checkpoint name for parameter {key!r}")
        layer, rest = match.groups()
        prefix = f"model.layers.{layer}."
        if rest.startswith("mlp.experts."):
            projection = rest.removeprefix("mlp.experts.")
            if projection == "up_proj":
                continue  # in the (gate, up) group
            gate_up, down = routed_expert_groups(
                state,
                f"layers.{layer}.mlp.experts.",
                lambda e, p, prefix=prefix: f"{prefix}mlp.experts.{e}.{p}.weight",
                prefix + "mlp.experts.",
            )
            groups.append(gate_up if projection == "gate_proj" else down)
        else:
            groups.append(single(prefix + _LAYER_RENAMES.get(rest, rest), key, tuple(tensor.shape)))
    return groups


def to_hf_names(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Our state dict -> DeepseekV3 (HF key, tensor) pairs, splitting fused experts into one tensor per expert."""
    for group in deepseek_weight_groups(state):
        for tensor in group.canonical():
            yield tensor.name, gather(state, tensor)


def hf_key_plan(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, int | None]]:
    """For a DeepseekV3-format model's state dict: every HF key it expects -> (our key, expert index or None)."""
    return {
        tensor.name: (tensor.slots[0].key, tensor.slots[0].expert)
        for group in deepseek_weight_groups(state)
        for tensor in group.canonical()
    }
