"""Kimi Linear checkpoints (``model_type: kimi_linear``): config and weight names.

Two config.json vocabularies mean the same model and are both read:

* Moonshot's original (``moonshotai/Kimi-Linear-48B-A3B-*``): ``linear_attn_config`` = {``full_attn_layers``,
  ``kda_layers`` (1-based), ``num_heads``, ``head_dim``, ``short_conv_kernel_size``}, ``first_k_dense_replace``,
  ``num_experts``, ``num_experts_per_token``, ``num_shared_experts``, ``num_expert_group``, ``moe_renormalize``,
  ``model_max_length``, ``mla_use_nope``;
* transformers 5's ``KimiLinearConfig``: ``layer_types`` (``full_attention`` | ``linear_attention``),
  ``mlp_layer_types`` (``dense`` | ``sparse``), ``linear_num_heads``, ``linear_head_dim``,
  ``linear_conv_kernel_dim`` and, through its ``attribute_map``, the original MoE names above (which
  ``save_pretrained`` writes). DeepSeek names (``n_routed_experts``, ``num_local_experts`` ...) are accepted too.

Precedence follows transformers: ``linear_attn_config`` sizes over ``linear_*``; ``layer_types`` over
``linear_attn_config``'s lists over transformers' default (MLA at 0-based layers 4, 8, ...);
``mlp_layer_types`` over ``first_k_dense_replace`` (default 1). Absent fields take ``KimiLinearConfig``
defaults (5.24) except token ids, which stay unset. The MLA layers are NoPE (``mla_rope=False``; rope_theta
and rope_scaling are ignored, as transformers does), the KDA layers use the softplus forget gate and the
low-rank output gate. transformers never ties the LM head of this model, so ``tie_word_embeddings`` is read
as false (the head is loaded from the checkpoint) and a tied model is not written.

Weights (per layer ``model.layers.{i}.``), written in the original layout, which transformers' conversion
mapping reads and its ``save_pretrained`` writes back:

    KDA   self_attn.{q,k,v}_proj, {q,k,v}_conv1d [H·K, 1, W] (our conv1d [3·H·K, 1, W] = q | k | v),
          self_attn.{f_a_proj, f_b_proj, dt_bias [H·K], A_log [1, 1, H, 1] (ours [H])},
          self_attn.{b_proj, g_a_proj, g_b_proj, o_norm, o_proj}
    MLA   self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}, kv_a_proj_with_mqa, kv_a_layernorm,
          kv_b_proj, o_proj   (as DeepseekV3)
    MoE   block_sparse_moe.gate.{weight, e_score_correction_bias}, block_sparse_moe.experts.{e}.{w1, w3, w2}
          (gate, up, down), block_sparse_moe.shared_experts.{gate,up,down}_proj
    dense mlp.{gate,up,down}_proj

Also read: transformers' in-memory names (``self_attn.conv1d``, ``self_attn.forget_gate.*``, ``mlp.gate``,
``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.shared_experts``), and ``block_sparse_moe.{gate,up,down}_proj``
for a dense layer, which transformers 5.24's ``save_pretrained`` writes (its ``mlp.`` -> ``block_sparse_moe.``
renaming reversed onto every layer).

MTP modules: written and read in DeepSeek-V3's layout (``k2lab.hf.mtp``: layers ``num_hidden_layers …``,
``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head.*``), the block's MLA and MoE named as above, which is
K3's released layout too; transformers' KimiLinear ignores them.

K3 (``k2lab.hf.kimi_k3``: its ``text_config`` is this format's config): the K3 fields are read here
(``k3_fields_from_hf``; ``config_to_hf(config, k3=True)`` writes them) and K3's tensors have names here:

    KDA full-rank output gate   self_attn.g_proj (ours attn.g_proj)
    gated MLA                   self_attn.g_proj (ours attn.gate_proj)
    LatentMoE                   block_sparse_moe.routed_expert_{down_proj, up_proj, norm} (ours latent_*)
    Block AttnRes               self_attention_res_{proj [1, D], norm}, mlp_res_{proj, norm} per layer,
                                model.output_attn_res_{proj, norm} (ours attn_res / mlp_res / final_res:
                                query [D], key_norm.weight [D]); mlx-lm's ``{stem}.proj_weight`` / ``.norm_weight``
                                read too

A plain Kimi Linear checkpoint (``config_to_hf`` without ``k3``) refuses every K3 feature (``k3_features``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from k2lab.config import ConfigError, ModelConfig
from k2lab.family import k3_features  # kimi_linear.k3_features: the one family test
from k2lab.hf.json_values import is_integer, is_number
from k2lab.hf.layout import (
    CHECKPOINT,
    GLOBAL_RENAMES,
    MLA_RENAMES,
    NORM_RENAMES,
    TRANSFORMERS,
    HFTensor,
    Slot,
    WeightGroup,
    renamed,
    routed_expert_groups,
    single,
)

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
DENSE, SPARSE = "dense", "sparse"

# Our field -> the config.json names that may hold it, in order of preference (conflicting values are an error).
_ALIASES: dict[str, tuple[str, ...]] = {
    "n_routed_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_token", "num_experts_per_tok"),
    "n_shared_experts": ("num_shared_experts", "n_shared_experts"),
    "n_group": ("num_expert_group", "n_group"),
    "norm_topk_prob": ("moe_renormalize", "norm_topk_prob"),
    "max_position_embeddings": ("model_max_length", "max_position_embeddings"),
}
_PLAIN_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "topk_group",
    "routed_scaling_factor",
    "rms_norm_eps",
    "initializer_range",
    "linear_num_heads",
    "linear_head_dim",
    "linear_conv_kernel_dim",
)
# linear_attn_config key -> our field (these win over the flat ``linear_*`` fields, as in transformers).
_LINEAR_ATTN_FIELDS = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}
# transformers' ``KimiLinearConfig`` defaults (5.24) for what a config.json omits.
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.446,
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "linear_num_heads": 32,
    "linear_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}
_DEFAULT_FIRST_K_DENSE = 1  # KimiLinearConfig reads kwargs.get("first_k_dense_replace", 1)
SITU = "situ"
_ACTIVATIONS = {"silu": "swiglu", SITU: "situ_glu"}  # hidden_act -> our mlp_activation
_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


# ---------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------


def config_from_hf(
    data: Mapping[str, Any], name: str = "hf", defaults: Mapping[str, Any] | None = None
) -> ModelConfig:
    """A validated ``ModelConfig`` from a Kimi Linear ``config.json`` dict (either vocabulary), K3's fields
    included (``k3_fields_from_hf``); ``defaults`` replaces some of transformers' defaults for absent fields.

    Raises ``ConfigError`` naming the field for what our decoder cannot represent (an activation other than
    SiLU / SiTU, a softmax router, attention biases, grouped key/value heads, RoPE MLA (``mla_use_nope:
    false``), MoE layers that are not every layer after a dense prefix, layer lists that do not cover every
    layer once, K3 fields of the wrong type), and pydantic's ``ValidationError`` for invalid values.
    """
    if data.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"model_type {data.get('model_type')!r} is not {MODEL_TYPE!r}")
    linear = data.get("linear_attn_config") or {}
    if not isinstance(linear, Mapping):
        raise ConfigError(f"linear_attn_config should be a JSON object, got {linear!r}")
    _check_supported(data)

    fields: dict[str, Any] = {**_DEFAULTS, **(defaults or {})}
    fields.update({key: data[key] for key in _PLAIN_FIELDS if key in data})
    for ours, names in _ALIASES.items():
        given = {key: data[key] for key in names if key in data}
        if len(set(map(repr, given.values()))) > 1:
            raise ConfigError(f"{' / '.join(given)}: conflicting values {list(given.values())}")
        if given:
            fields[ours] = next(iter(given.values()))
    for key, ours in _LINEAR_ATTN_FIELDS.items():
        if linear.get(key) is not None:
            fields[ours] = linear[key]
    if fields["n_routed_experts"] is None:
        raise ConfigError("num_experts: null (a dense-only model) is not supported")
    if data.get("use_grouped_topk") is False and fields["n_group"] != 1:
        raise ConfigError(
            f"use_grouped_topk: false with num_expert_group={fields['n_group']} is not supported "
            "(transformers' KimiLinear always routes group-limited)"
        )

    layers = fields["num_hidden_layers"]
    if not isinstance(layers, int) or layers <= 0:
        raise ConfigError(f"num_hidden_layers: {layers!r} should be a positive integer")
    fields["mla_layers"] = _mla_layers(data, linear, layers)
    fields["first_k_dense_replace"] = _first_k_dense(
        data, layers, fields.get("first_k_dense_replace", _DEFAULT_FIRST_K_DENSE)
    )

    for token_field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token = data.get(token_field)
        fields[token_field] = token[0] if isinstance(token, list) and token else token
    fields.update(
        name=name,
        tie_word_embeddings=False,
        mla_rope=False,
        num_nextn_predict_layers=data.get("num_nextn_predict_layers") or 0,
        **k3_fields_from_hf(data, linear),
    )
    return ModelConfig.model_validate(fields)


def k3_fields_from_hf(data: Mapping[str, Any], linear: Mapping[str, Any]) -> dict[str, Any]:
    """Our K3 settings from the K3 fields of a Kimi Linear text config (``linear``: its
    ``linear_attn_config``), as mlx-lm's ``kimi_k3.TextArgs`` and vLLM's ``KimiLinearConfig`` read them:

        hidden_act "situ" -> mlp_activation situ_glu: h = β1·tanh(g/β1)·σ(g) ⊙ β2·tanh(u/β2) with
            β1 = activation_situ_beta (null: 1.0), β2 = activation_situ_linear_beta;  "silu" -> swiglu
        mla_use_output_gate -> mla_output_gate;  attn_res_block_size -> attnres_block_size
        routed_expert_hidden_size -> moe_latent_size;  latent_moe_use_norm -> moe_latent_norm
        linear_attn_config.gate_lower_bound -> kda_gate "lower_bound" + kda_gate_lower_bound (null: softplus)
        linear_attn_config.use_full_rank_gate -> kda_output_gate "full_rank" (false: "low_rank")

    An absent (or null) field means the feature is off, as in those engines; ``latent_moe_use_norm`` is
    false when absent (their default). Raises ``ConfigError`` naming the field for a value of the wrong type
    or one our model cannot represent (another activation, an uncapped SiTU up branch, a bound >= 0).
    """
    activation = _typed(data, "hidden_act", str, "silu")
    if activation not in _ACTIVATIONS:
        raise ConfigError(f"hidden_act {activation!r} is not supported (only {list(_ACTIVATIONS)})")
    fields: dict[str, Any] = {
        "mlp_activation": _ACTIVATIONS[activation],
        "mla_output_gate": _typed(data, "mla_use_output_gate", bool, False),
        "attnres_block_size": _typed(data, "attn_res_block_size", int, None),
        "moe_latent_size": _typed(data, "routed_expert_hidden_size", int, None),
    }
    if activation == SITU:
        linear_beta = _typed(data, "activation_situ_linear_beta", float, None)
        if linear_beta is None:
            raise ConfigError(
                "activation_situ_linear_beta null (an uncapped SiTU up branch) is not supported: "
                "k2lab's SiTU-GLU caps it at β2·tanh(u/β2)"
            )
        fields.update(situ_beta1=_typed(data, "activation_situ_beta", float, 1.0), situ_beta2=linear_beta)
    # absent: off (the engines' default) for a latent MoE; our default (unused) otherwise
    fields["moe_latent_norm"] = _typed(data, "latent_moe_use_norm", bool, fields["moe_latent_size"] is None)
    bound = _typed(linear, "gate_lower_bound", float, None, where="linear_attn_config.")
    if bound is not None and bound >= 0:
        raise ConfigError(f"linear_attn_config.gate_lower_bound {bound!r} should be negative")
    fields["kda_gate"] = "softplus" if bound is None else "lower_bound"
    if bound is not None:
        fields["kda_gate_lower_bound"] = bound
    full_rank = _typed(linear, "use_full_rank_gate", bool, False, where="linear_attn_config.")
    fields["kda_output_gate"] = "full_rank" if full_rank else "low_rank"
    return fields


def _typed(data: Mapping[str, Any], key: str, kind: type, default: Any, where: str = "") -> Any:
    """``data[key]`` (``default`` when absent or null), checked to be a ``kind`` (float: any number)."""
    value = data.get(key)
    if value is None:
        return default
    ok = is_integer(value) if kind is int else is_number(value) if kind is float else isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{where}{key}: {value!r} should be {_KIND_NAMES[kind]}")
    return float(value) if kind is float else value


def _check_supported(data: Mapping[str, Any]) -> None:
    unsupported = {
        "moe_router_activation_func": (data.get("moe_router_activation_func", "sigmoid"), "sigmoid"),
        "attention_bias": (data.get("attention_bias", False), False),
        "mla_use_nope": (data.get("mla_use_nope", True), True),
        "topk_method": (data.get("topk_method", "noaux_tc"), "noaux_tc"),
    }
    for key, (value, supported) in unsupported.items():
        if value != supported:
            raise ConfigError(f"{key} {value!r} is not supported (Kimi Linear here uses {supported!r})")
    heads = data.get("num_attention_heads", _DEFAULTS["num_attention_heads"])
    kv_heads = data.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ConfigError(
            f"num_key_value_heads {kv_heads} != num_attention_heads {heads} is not supported (MLA)"
        )
    if "mlp_layer_types" not in data and data.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq {data['moe_layer_freq']!r} is not supported (only 1)")


def _mla_layers(data: Mapping[str, Any], linear: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """1-based MLA layer indices from ``layer_types``, else ``linear_attn_config``, else transformers' default."""
    types = data.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ConfigError(f"layer_types: should list {layers} layer types, got {types!r}")
        wrong = sorted({str(kind) for kind in types} - {FULL_ATTENTION, LINEAR_ATTENTION})
        if wrong:
            raise ConfigError(
                f"layer_types: {wrong} not supported (only {FULL_ATTENTION!r}, {LINEAR_ATTENTION!r})"
            )
        return tuple(i + 1 for i, kind in enumerate(types) if kind == FULL_ATTENTION)
    if "full_attn_layers" in linear and "kda_layers" in linear:
        full, kda = linear["full_attn_layers"], linear["kda_layers"]
        if not all(isinstance(v, list) and all(isinstance(i, int) for i in v) for v in (full, kda)):
            raise ConfigError(
                "linear_attn_config: full_attn_layers and kda_layers should be lists of integers"
            )
        if sorted(full + kda) != list(range(1, layers + 1)):
            raise ConfigError(
                f"linear_attn_config: full_attn_layers {full} and kda_layers {kda} should name each of the "
                f"{layers} layers (1-based) exactly once"
            )
        return tuple(sorted(full))
    return tuple(i + 1 for i in range(layers) if i and i % 4 == 0)


def _first_k_dense(data: Mapping[str, Any], layers: int, default: int = _DEFAULT_FIRST_K_DENSE) -> int:
    """The dense-prefix length from ``mlp_layer_types`` (which must be dense* sparse*) or ``first_k_dense_replace``."""
    types = data.get("mlp_layer_types")
    if types is None:
        first = data.get("first_k_dense_replace", default)
        return default if first is None else first
    if not isinstance(types, list) or len(types) != layers:
        raise ConfigError(f"mlp_layer_types: should list {layers} layer types, got {types!r}")
    first = next((i for i, kind in enumerate(types) if kind != DENSE), layers)
    if any(kind != SPARSE for kind in types[first:]):
        raise ConfigError(
            f"mlp_layer_types: {types} is not supported: only dense layers followed by MoE ({SPARSE!r}) layers "
            "(the first_k_dense_replace form) can be represented"
        )
    return first


def config_to_hf(config: ModelConfig, k3: bool = False) -> dict[str, Any]:
    """A Kimi Linear ``config.json`` dict in both vocabularies (original ``linear_attn_config`` and
    transformers' ``layer_types`` ...), loadable by ``KimiLinearForCausalLM`` without remote code.

    ``k3``: K3's text config instead (``kimi_k3``'s ``text_config``): the same fields plus K3's
    (``k3_fields_to_hf``), a tied head allowed; transformers has no such model.

    Raises ``ConfigError`` listing every setting with no equivalent in the format.
    """
    problems = [] if k3 else k3_features(config)
    nope = "K3's" if k3 else "Kimi Linear's"
    if config.mla_rope and "mla" in config.layer_types:
        problems.append(f"mla_rope=True ({nope} MLA is NoPE)")
    if config.rope_scaling is not None:
        problems.append(f"rope_scaling (YaRN changes our MLA softmax scale; {nope} is qk_head_dim^-0.5)")
    if config.tie_word_embeddings and not k3:
        problems.append("tie_word_embeddings=True (transformers' KimiLinear never ties the LM head)")
    if problems:
        written = "kimi_k3" if k3 else MODEL_TYPE
        raise ConfigError(f"cannot write a {written} checkpoint, no equivalent for: " + "; ".join(problems))
    data = _config_dict(config)
    if k3:
        data.update(k3_fields_to_hf(config))
        data["linear_attn_config"].update(k3_linear_attn_fields(config))
    return data


def k3_fields_to_hf(config: ModelConfig) -> dict[str, Any]:
    """K3's text-config fields for ``config`` (the inverse of ``k3_fields_from_hf``), every one written."""
    situ = config.mlp_activation == "situ_glu"
    return {
        "hidden_act": SITU if situ else "silu",
        "activation_situ_beta": config.situ_beta1 if situ else None,
        "activation_situ_linear_beta": config.situ_beta2 if situ else None,
        "mla_use_output_gate": config.mla_output_gate,
        "attn_res_block_size": config.attnres_block_size,
        "routed_expert_hidden_size": config.moe_latent_size,
        "latent_moe_use_norm": config.moe_latent_norm,
        "topk_method": "noaux_tc",
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def k3_linear_attn_fields(config: ModelConfig) -> dict[str, Any]:
    """K3's ``linear_attn_config`` additions: the KDA gate's lower bound (null: softplus) and full-rank gate."""
    return {
        "gate_lower_bound": config.kda_gate_lower_bound if config.kda_gate == "lower_bound" else None,
        "use_full_rank_gate": config.kda_output_gate == "full_rank",
    }


def _config_dict(config: ModelConfig) -> dict[str, Any]:
    types = config.layer_types
    L = config.num_hidden_layers
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hidden_layers": L,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": True,
        "num_experts": config.n_routed_experts,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": config.n_shared_experts,
        "num_expert_group": config.n_group,
        "topk_group": config.topk_group,
        "moe_renormalize": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "moe_layer_freq": 1,
        "first_k_dense_replace": config.first_k_dense_replace,
        "mlp_layer_types": [SPARSE if config.is_moe_layer(i) else DENSE for i in range(L)],
        "layer_types": [FULL_ATTENTION if kind == "mla" else LINEAR_ATTENTION for kind in types],
        "linear_num_heads": config.linear_num_heads,
        "linear_head_dim": config.linear_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, kind in enumerate(types) if kind == "mla"],
            "kda_layers": [i + 1 for i, kind in enumerate(types) if kind == "kda"],
            "num_heads": config.linear_num_heads,
            "head_dim": config.linear_head_dim,
            "short_conv_kernel_size": config.linear_conv_kernel_dim,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "model_max_length": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,  # DeepSeek-style layers (k2lab.hf.mtp)
        "torch_dtype": "float32",
    }


# ---------------------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_WEIGHTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_MOE_RENAMES = {  # ours after ``mlp.`` -> theirs after ``block_sparse_moe.`` / ``mlp.``
    "router.weight": "gate.weight",
    "router.e_score_correction_bias": "gate.e_score_correction_bias",
    "latent_down.weight": "routed_expert_down_proj.weight",  # K3's LatentMoE
    "latent_up.weight": "routed_expert_up_proj.weight",
    "latent_norm.weight": "routed_expert_norm.weight",
}
_KDA_PLAIN = ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "g_proj", "o_norm", "o_proj")
_MLA_RENAMES = {**MLA_RENAMES, "attn.gate_proj.weight": "self_attn.g_proj.weight"}  # K3's gated MLA
# Block AttnRes (K3): our module -> the checkpoint's stem (``{stem}_proj.weight`` [1, D] = our query,
# ``{stem}_norm.weight`` [D] = our key norm); mlx-lm also reads ``{stem}.proj_weight`` / ``{stem}.norm_weight``.
_ATTNRES_STEMS = {"attn_res": "self_attention_res", "mlp_res": "mlp_res", "final_res": "output_attn_res"}
MLX = "mlx"
_SAVE_PRETRAINED = "save_pretrained"  # transformers 5.24's name for a dense MLP written by save_pretrained


def weight_groups(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    """Our state dict as Kimi Linear checkpoint tensors, layer by layer in state order."""
    groups: list[WeightGroup] = []
    for key, tensor in state.items():
        shape = tuple(tensor.shape)
        if key in GLOBAL_RENAMES:
            groups.append(single(GLOBAL_RENAMES[key], key, shape))
            continue
        if key.startswith("final_res."):
            groups.append(_attnres_group(key, "model.", key, shape))
            continue
        match = _LAYER_KEY.match(key)
        if match is None:
            raise KeyError(f"no {MODEL_TYPE} checkpoint name for parameter {key!r}")
        index, rest = int(match.group(1)), match.group(2)
        prefix = f"model.layers.{index}."
        if rest.split(".")[0] in _ATTNRES_STEMS:
            groups.append(_attnres_group(key, prefix, rest, shape))
        elif rest in NORM_RENAMES:
            groups.append(single(prefix + NORM_RENAMES[rest], key, shape))
        elif rest.startswith("attn."):
            groups.extend(_attention_groups(config, state, key, index, rest.removeprefix("attn.")))
        elif rest.startswith("mlp.") and config.is_moe_layer(index):
            groups.extend(_moe_groups(state, key, index, rest.removeprefix("mlp.")))
        elif rest.startswith("mlp."):
            tail = rest.removeprefix("mlp.")
            names = {CHECKPOINT: f"{prefix}mlp.{tail}", _SAVE_PRETRAINED: f"{prefix}block_sparse_moe.{tail}"}
            groups.append(renamed(names, key, shape))
        else:
            raise KeyError(f"no {MODEL_TYPE} checkpoint name for parameter {key!r}")
    return groups


def _attention_groups(
    config: ModelConfig, state: Mapping[str, torch.Tensor], key: str, index: int, name: str
) -> list[WeightGroup]:
    prefix = f"model.layers.{index}.self_attn."
    shape = tuple(state[key].shape)
    if index >= config.num_hidden_layers or config.layer_types[index] == "mla":  # MTP blocks are MLA
        rest = "attn." + name
        if rest not in _MLA_RENAMES:
            raise KeyError(f"no {MODEL_TYPE} checkpoint name for parameter {key!r}")
        return [single(f"model.layers.{index}." + _MLA_RENAMES[rest], key, shape)]
    if name == "conv1d.weight":
        return [_conv_group(key, prefix, shape)]
    if name.startswith("forget_gate."):
        short = name.removeprefix("forget_gate.")
        names = {CHECKPOINT: prefix + short, TRANSFORMERS: f"{prefix}forget_gate.{short}"}
        if short == "A_log":  # ours [H], theirs [1, 1, H, 1] (broadcast over batch, time and channel) or [H]
            return [a_log_group(names, key, shape[0])]
        return [renamed(names, key, shape)]
    if name.removesuffix(".weight") in _KDA_PLAIN:
        return [single(prefix + name, key, shape)]
    raise KeyError(f"no {MODEL_TYPE} checkpoint name for parameter {key!r}")


def _attnres_group(key: str, prefix: str, name: str, shape: tuple[int, ...]) -> WeightGroup:
    """One AttnRes tensor (``name``: ``{attn_res,mlp_res,final_res}.{query,key_norm.weight}``) under ``prefix``.

    The checkpoint's ``{stem}_proj`` is a Linear(D, 1): weight [1, D] = our query [D]."""
    module, leaf = name.split(".", 1)
    stem = prefix + _ATTNRES_STEMS[module]
    if leaf == "query":
        return renamed({CHECKPOINT: f"{stem}_proj.weight", MLX: f"{stem}.proj_weight"}, key, (1, *shape))
    if leaf == "key_norm.weight":
        return renamed({CHECKPOINT: f"{stem}_norm.weight", MLX: f"{stem}.norm_weight"}, key, shape)
    raise KeyError(f"no {MODEL_TYPE} checkpoint name for parameter {key!r}")


def a_log_group(names: Mapping[str, str], key: str, heads: int) -> WeightGroup:
    """A_log (ours [H]) written [1, 1, H, 1] as Kimi Linear and transformers store it; [H] (vLLM's "current
    1D" form, which ``k2lab.hf.kimi_k3`` writes) is read too."""
    return WeightGroup(
        {
            label: (HFTensor(name, (1, 1, heads, 1), (Slot(key),), also_shapes=((heads,),)),)
            for label, name in names.items()
        }
    )


def _conv_group(key: str, prefix: str, shape: tuple[int, ...]) -> WeightGroup:
    """Our conv1d [3·H·K, 1, W] (q | k | v channels) = checkpoint {q,k,v}_conv1d [H·K, 1, W] = transformers' conv1d.

    The per-part tensors are read as [H·K, W] too (vLLM's Kimi Linear / K3 loaders accept that form)."""
    width = shape[0] // 3
    split = tuple(
        HFTensor(
            f"{prefix}{part}_conv1d.weight",
            (width, *shape[1:]),
            (Slot(key, rows=(i * width, (i + 1) * width)),),
            also_shapes=((width, shape[-1]),),
        )
        for i, part in enumerate("qkv")
    )
    return WeightGroup(
        {CHECKPOINT: split, TRANSFORMERS: (HFTensor(prefix + "conv1d.weight", shape, (Slot(key),)),)}
    )


def _moe_groups(state: Mapping[str, torch.Tensor], key: str, index: int, name: str) -> list[WeightGroup]:
    ours = f"layers.{index}.mlp."
    checkpoint, in_memory = f"model.layers.{index}.block_sparse_moe.", f"model.layers.{index}.mlp."
    if name.startswith("experts."):
        projection = name.removeprefix("experts.")
        if projection == "up_proj":
            return []  # in the (gate, up) group
        gate_up, down = routed_expert_groups(
            state,
            ours + "experts.",
            lambda e, p: f"{checkpoint}experts.{e}.{_EXPERT_WEIGHTS[p]}.weight",
            in_memory + "experts.",
        )
        return [gate_up if projection == "gate_proj" else down]
    theirs = _MOE_RENAMES.get(name, name)
    if theirs == name and not name.startswith("shared_experts."):
        raise KeyError(f"no {MODEL_TYPE} checkpoint name for parameter {key!r}")
    names = {CHECKPOINT: checkpoint + theirs, TRANSFORMERS: in_memory + theirs}
    return [renamed(names, key, tuple(state[key].shape))]
