"""The Kimi K3 (``kimi_k3``) checkpoint format as released, text part: config and weight names.

``config.json`` (what vLLM's ``KimiK3Config`` and mlx-lm's ``kimi_k3.ModelArgs`` read):

    {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
     "tie_word_embeddings": …, "text_config": {"model_type": "kimi_linear", …}}

``text_config`` is a Kimi Linear config (``k2lab.hf.kimi_linear``) with K3's fields (``mla_use_output_gate``,
``attn_res_block_size``, ``routed_expert_hidden_size``, ``latent_moe_use_norm``, ``hidden_act: "situ"``,
``activation_situ_beta`` / ``activation_situ_linear_beta``, ``topk_method``, ``num_nextn_predict_layers``,
``linear_attn_config.{gate_lower_bound, use_full_rank_gate}`` …: ``kimi_linear.k3_fields_from_hf``). Fields a
text_config omits take transformers' KimiLinearConfig defaults except ``K3_TEXT_DEFAULTS`` (mlx-lm's, and here
vLLM's too: no dense prefix, no shared expert, routed scale 1); ``mla_use_nope`` and ``rms_norm_eps``, where
vLLM's defaults differ, follow mlx-lm (True, 1e-5; the released config sets both). A vision-language
checkpoint adds ``vision_config`` (MoonViT-V2), read by ``k2lab.hf.kimi_k3_vision``; this module reads and
writes the text model alone, and a text-only kimi_k3 has no ``vision_config``.

Weights: the Kimi Linear names under ``language_model.`` (``TEXT_PREFIX``):

    language_model.model.embed_tokens.weight, language_model.model.norm.weight, language_model.lm_head.weight
    language_model.model.output_attn_res_{proj [1, D], norm [D]}.weight          ours final_res.{query, key_norm}
    language_model.model.layers.{i}.{input_layernorm, post_attention_layernorm}.weight
        .self_attention_res_{proj, norm}.weight, .mlp_res_{proj, norm}.weight    ours attn_res / mlp_res
        KDA .self_attn.{q,k,v}_proj, {q,k,v}_conv1d [H·K, 1, W], f_a_proj, f_b_proj, b_proj,
            g_proj (full rank) | g_a_proj + g_b_proj, o_norm, o_proj, A_log [H], dt_bias [H·K]
        MLA .self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
            kv_b_proj, g_proj (ours gate_proj), o_proj}
        dense .mlp.{gate,up,down}_proj
        MoE .block_sparse_moe.{gate.weight, gate.e_score_correction_bias, experts.{e}.{w1,w3,w2}.weight,
            routed_expert_down_proj, routed_expert_up_proj, routed_expert_norm (ours latent_down / latent_up /
            latent_norm), shared_experts.{gate,up,down}_proj}
    MTP module j: language_model.model.layers.{num_hidden_layers + j}.{enorm, hnorm, eh_proj,
        shared_head.norm, shared_head.head, embed_tokens} + an MLA + MoE block named as a main layer, without
        attention residuals (``k2lab.hf.mtp``; vLLM's K3 MTP loader; AttnRes weights there are skipped).

Also read: every ``language_model.model.X`` as ``language_model.X`` (``language_model.layers.{i}.…``, which vLLM's
kimi_k3 weight mapper accepts, and ``language_model.{embed_tokens, norm, output_attn_res_{norm,proj}}.weight``,
as facts.md describes the release; the head is ``language_model.lm_head`` in both; we write the long form,
which mlx-lm needs), mlx-lm's
``{stem}.proj_weight`` / ``{stem}.norm_weight`` for the AttnRes tensors, and A_log as [1, 1, H, 1].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from k2lab.config import ConfigError, ModelConfig
from k2lab.hf import kimi_linear, mapping
from k2lab.hf.layout import HFTensor, Layout, WeightGroup
from k2lab.hf.mtp import shared_copies as decoder_shared_copies

MODEL_TYPE = "kimi_k3"
ARCHITECTURE = "KimiK3ForConditionalGeneration"
TEXT_PREFIX = "language_model."
SHORT = "short"  # label suffix of the alternative without ``model.`` (``language_model.layers.{i}`` ...)
# Where mlx-lm's kimi_k3 TextArgs defaults differently from transformers' KimiLinearConfig (vLLM's
# KimiLinearConfig agrees on these three). Where the two engines disagree we follow mlx-lm, our independent
# reference, whose values are also transformers': an absent ``mla_use_nope`` is True (vLLM: False, RoPE MLA,
# which K3 does not have and we refuse) and an absent ``rms_norm_eps`` is 1e-5 (vLLM: 1e-6). The released K3
# config sets both explicitly, so no released checkpoint depends on the choice.
K3_TEXT_DEFAULTS: dict[str, Any] = {
    "first_k_dense_replace": 0,
    "n_shared_experts": 0,
    "routed_scaling_factor": 1.0,
}
_MODEL = "model."  # the decoder names that the short alternative writes without it


# ------------------------------------------------------------------------------------------------- config


def text_config_from_hf(data: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """Our ``ModelConfig`` from a K3 ``text_config`` dict (model_type ``kimi_linear``, or absent).

    Raises ``ConfigError`` naming the field for what cannot be represented (``kimi_linear.config_from_hf``)."""
    data = {"model_type": kimi_linear.MODEL_TYPE, **data}
    if data["model_type"] != kimi_linear.MODEL_TYPE:
        raise ConfigError(
            f"text_config.model_type {data['model_type']!r} is not supported (expected {kimi_linear.MODEL_TYPE!r})"
        )
    config = kimi_linear.config_from_hf(data, name, defaults=K3_TEXT_DEFAULTS)
    tied = data.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise ConfigError(f"tie_word_embeddings: {tied!r} should be true or false")
    return config.replace(tie_word_embeddings=True) if tied else config


def text_config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """K3's ``text_config`` dict for ``config`` (``ConfigError`` listing what K3 cannot express)."""
    data = kimi_linear.config_to_hf(config, k3=True)
    data.pop("torch_dtype", None)  # the parent's, which ``to_hf`` sets
    return data


def text_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's config dict within a kimi_k3 ``config.json`` (the parent's ``tie_word_embeddings`` wins,
    as in the engines' ``KimiK3Config``)."""
    text = data.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"a {MODEL_TYPE} config needs a text_config object, got {text!r}")
    text = dict(text)
    if "tie_word_embeddings" in data:
        text["tie_word_embeddings"] = data["tie_word_embeddings"]
    return text


def config_from_hf(data: Mapping[str, Any], name: str = "hf") -> ModelConfig:
    """The text model's ``ModelConfig`` from a text-only kimi_k3 ``config.json`` dict."""
    if data.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"model_type {data.get('model_type')!r} is not {MODEL_TYPE!r}")
    if data.get("vision_config") is not None:
        raise ConfigError(
            "vision_config: a vision-language kimi_k3 checkpoint; its text model alone is not read here"
        )
    return text_config_from_hf(text_config(data), name)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A text-only kimi_k3 ``config.json`` dict (``ConfigError`` listing what K3 cannot express)."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text_config_to_hf(config),
    }


# ------------------------------------------------------------------------------------------------ weights


def weight_groups(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    prefix: str = TEXT_PREFIX,
    slot_prefix: str = "",
) -> list[WeightGroup]:
    """The decoder's state dict (its own keys, MTP modules included) as kimi_k3 checkpoint tensors.

    Each Kimi Linear name gets ``prefix``; a ``model.…`` name also has the alternative without ``model.``
    (``{prefix}layers.{i}.…``, ``{prefix}embed_tokens.weight``, ``{prefix}norm.weight``,
    ``{prefix}output_attn_res_{norm,proj}.weight``; read, never written), and
    A_log is written [H]. ``slot_prefix`` is put in front of our keys (the decoder nested in a larger model,
    e.g. ``language_model.`` in a vision-language model)."""
    return [_k3_group(group, prefix, slot_prefix) for group in mapping.weight_groups(config, state)]


def shared_copies(
    config: ModelConfig, state: Mapping[str, torch.Tensor], prefix: str = TEXT_PREFIX, slot_prefix: str = ""
) -> list[HFTensor]:
    """The MTP layers' copies of the shared embedding and head (written, skipped when read), under ``prefix``."""
    return [_renamed(tensor, prefix, slot_prefix) for tensor in decoder_shared_copies(config, state)]


def decoder_name(key: str, prefix: str = TEXT_PREFIX) -> str:
    """A checkpoint key -> the decoder's own name (``model.layers.…``, ``lm_head.weight``); others unchanged."""
    if not key.startswith(prefix):
        return key
    name = key.removeprefix(prefix)
    return name if name.startswith((_MODEL, "lm_head.")) else _MODEL + name


def _k3_group(group: WeightGroup, prefix: str, slot_prefix: str) -> WeightGroup:
    layouts: dict[str, Layout] = {
        label: tuple(_renamed(tensor, prefix, slot_prefix) for tensor in layout)
        for label, layout in group.layouts.items()
    }
    for label, layout in group.layouts.items():
        if any(tensor.name.startswith(_MODEL) for tensor in layout):
            layouts[f"{label}/{SHORT}"] = tuple(
                _renamed(tensor, prefix, slot_prefix, short=True) for tensor in layout
            )
    return WeightGroup(layouts)


def _renamed(tensor: HFTensor, prefix: str, slot_prefix: str, short: bool = False) -> HFTensor:
    """``tensor`` named ``prefix + name`` (``short``: without ``model.``, e.g. ``{prefix}layers.{i}.…``,
    ``{prefix}embed_tokens.weight``), its slots under ``slot_prefix``; A_log [H]."""
    name = tensor.name
    if short:
        name = name.removeprefix(_MODEL)
    changes: dict[str, Any] = {"name": prefix + name}
    if slot_prefix:
        changes["slots"] = tuple(replace(slot, key=slot_prefix + slot.key) for slot in tensor.slots)
    if tensor.name.endswith(".A_log") and tensor.also_shapes:  # vLLM's "current 1D" A_log [H]
        changes.update(shape=tensor.also_shapes[0], also_shapes=(tensor.shape,))
    return replace(tensor, **changes)
