"""The Kimi K2.5 (``kimi_k25``) checkpoint format: config and weight names of the vision-language model.

``config.json`` nests the decoder's config (``text_config``, a DeepseekV3 — or Kimi Linear — config read and
written by ``k2lab.hf.mapping``) and the vision tower's (``vision_config``, ``VisionConfig.from_hf``), with the
projector's ``projection_hidden_size`` / ``projection_layer_norm_eps`` and the media token ids on top.

Weights come in three namings (``k2lab.hf.layout``), all read; ``to_hf`` writes the first:

``checkpoint`` — Moonshot's original names, which vLLM and transformers load:
    ``language_model.model.*`` / ``language_model.lm_head.weight`` (the decoder's own on-disk names under
    ``language_model.``), ``vision_tower.patch_embed.{proj,pos_emb}``, ``vision_tower.encoder.blocks.{i}.``
    ``{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}``, ``vision_tower.encoder.final_layernorm``,
    ``mm_projector.{pre_norm, proj.0, proj.2}``. ``wqkv`` [3D, D] fuses q, k, v; within each head of q and k
    its rows are in complex-pair order (row 2j holds our rotate-half row j, row 2j+1 our row j + d/2).
``transformers`` — transformers' in-memory names (``model.language_model.*``, ``lm_head.weight``,
    ``model.vision_tower.layers.{i}.attn.{q,k,v}_proj`` unfused, in rotate-half order ...).
``transformers-saved`` — what transformers 5.24's ``save_pretrained`` writes: the original names except
    ``language_model.model.blocks.{i}`` for layers, ``vision_tower.encoder.patch_embed.proj`` and
    ``model.mm_projector.pre_norm``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from k2lab.hf import mapping
from k2lab.hf.layout import CHECKPOINT, TRANSFORMERS, HFTensor, Slot, WeightGroup
from k2lab.vision.config import VisionConfig
from k2lab.vision.hf_names import to_hf_vision_name
from k2lab.vision.vlm import VLMConfig

MODEL_TYPE = "kimi_k25"
SAVED = "transformers-saved"
TEXT_PREFIX = "language_model."
VISION_PREFIX = "vision."
_TOKEN_FIELDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

# Our vision module -> Moonshot's original name (q/k/v are fused into wqkv separately).
_ORIGINAL_VISION = {
    "encoder.patch_embed": "vision_tower.patch_embed.proj",
    "encoder.blocks.{i}.attn_norm": "vision_tower.encoder.blocks.{i}.norm0",
    "encoder.blocks.{i}.attn.o": "vision_tower.encoder.blocks.{i}.wo",
    "encoder.blocks.{i}.mlp_norm": "vision_tower.encoder.blocks.{i}.norm1",
    "encoder.blocks.{i}.mlp.fc_in": "vision_tower.encoder.blocks.{i}.mlp.fc0",
    "encoder.blocks.{i}.mlp.fc_out": "vision_tower.encoder.blocks.{i}.mlp.fc1",
    "encoder.final_norm": "vision_tower.encoder.final_layernorm",
    "projector.norm": "mm_projector.pre_norm",
    "projector.fc_in": "mm_projector.proj.0",
    "projector.fc_out": "mm_projector.proj.2",
}
_ORIGINAL_POS = "vision_tower.patch_embed.pos_emb.weight"
# transformers 5.24 save_pretrained: original names with these substitutions.
_SAVED_RENAMES = (
    ("language_model.model.layers.", "language_model.model.blocks."),
    ("vision_tower.patch_embed.proj.", "vision_tower.encoder.patch_embed.proj."),
    ("mm_projector.pre_norm.", "model.mm_projector.pre_norm."),
)


# ------------------------------------------------------------------------------------------------- config


def config_from_hf(data: Mapping[str, Any], name: str = "hf") -> VLMConfig:
    """``VLMConfig`` from a ``kimi_k25`` config.json dict (``ValueError`` / ``ValidationError`` if invalid)."""
    text_raw = data.get("text_config")
    vision_raw = data.get("vision_config")
    if not isinstance(text_raw, Mapping) or not isinstance(vision_raw, Mapping):
        raise ValueError("a kimi_k25 config needs text_config and vision_config objects")
    text_raw = dict(text_raw)
    text_raw.setdefault("model_type", "deepseek_v3")
    if "tie_word_embeddings" in data:  # the parent's flag decides the head (Kimi_K25ForConditionalGeneration)
        text_raw["tie_word_embeddings"] = data["tie_word_embeddings"]
    text_raw["num_nextn_predict_layers"] = 0  # MTP layers are skipped for the vision-language model
    text = mapping.config_from_hf(text_raw, name=name)
    vision = VisionConfig.from_hf(
        vision_raw, parent={**data, "text_config": {"hidden_size": text.hidden_size}}
    )
    ids = {key: data[key] for key in _TOKEN_FIELDS if key in data}
    return VLMConfig(text=text, vision=vision, **ids)


def config_to_hf(config: VLMConfig) -> dict[str, Any]:
    """The ``kimi_k25`` config.json dict (``ConfigError`` if the decoder cannot be written)."""
    text = {k: v for k, v in mapping.config_to_hf(config.text).items() if k != "architectures"}
    return {
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": config.vision.to_hf(),
        "projection_hidden_size": config.vision.hidden_size,
        "projection_layer_norm_eps": config.vision.projection_layer_norm_eps,
        "tie_word_embeddings": config.text.tie_word_embeddings,
        **{key: getattr(config, key) for key in _TOKEN_FIELDS},
    }


# ------------------------------------------------------------------------------------------------ weights


def _rename(layout: tuple[HFTensor, ...], rename: Callable[[str], str]) -> tuple[HFTensor, ...]:
    return tuple(HFTensor(rename(t.name), t.shape, t.slots, t.row_order) for t in layout)


def _prefixed(layout: tuple[HFTensor, ...], prefix: str) -> tuple[HFTensor, ...]:
    """The same tensors with ``prefix`` in front of every slot key (our nesting in the VLM)."""
    return tuple(
        HFTensor(
            t.name,
            t.shape,
            tuple(Slot(prefix + s.key, s.expert, s.rows, s.disk_rows) for s in t.slots),
            t.row_order,
        )
        for t in layout
    )


def original_name(decoder_name: str) -> str:
    return TEXT_PREFIX + decoder_name


def transformers_name(decoder_name: str) -> str:
    """``model.layers.…`` -> ``model.language_model.layers.…``; ``lm_head.weight`` stays."""
    if decoder_name.startswith("model."):
        return "model.language_model." + decoder_name.removeprefix("model.")
    return decoder_name


def decoder_name(key: str) -> str:
    """A language-model key in any of the three namings -> the decoder's own name (others unchanged)."""
    for prefix in (
        "language_model.model.blocks.",
        "language_model.model.layers.",
        "model.language_model.layers.",
    ):
        if key.startswith(prefix):
            return "model.layers." + key.removeprefix(prefix)
    if key.startswith("model.language_model."):
        return "model." + key.removeprefix("model.language_model.")
    return key.removeprefix(TEXT_PREFIX)


def saved_name(name: str) -> str:
    """An original name as transformers 5.24's ``save_pretrained`` spells it."""
    for old, new in _SAVED_RENAMES:
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def _text_groups(config: VLMConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    inner = {k.removeprefix(TEXT_PREFIX): v for k, v in state.items() if k.startswith(TEXT_PREFIX)}
    groups = []
    for group in mapping.weight_groups(config.text, inner):
        original = _prefixed(_rename(group.canonical(), original_name), TEXT_PREFIX)
        groups.append(
            WeightGroup(
                {
                    CHECKPOINT: original,
                    TRANSFORMERS: _prefixed(
                        _rename(group.prefer(TRANSFORMERS), transformers_name), TEXT_PREFIX
                    ),
                    SAVED: _rename(original, saved_name),
                }
            )
        )
    return groups


def rope_row_order(heads: int, head_dim: int) -> tuple[int, ...]:
    """Disk row r of a complex-pair-rope projection holds rotate-half row ``order[r]``.

    Within head h: disk row h·d + 2j <- our row h·d + j, disk row h·d + 2j + 1 <- our row h·d + d/2 + j.
    """
    half = head_dim // 2
    return tuple(h * head_dim + (r % 2) * half + r // 2 for h in range(heads) for r in range(head_dim))


def fused_qkv(layer: int, leaf: str, vision: VisionConfig) -> HFTensor:
    """``vision_tower.encoder.blocks.{layer}.wqkv.{leaf}`` [3A, D] / [3A]: q, k, v rows (A = attention width)."""
    d, a = vision.hidden_size, vision.attention_width
    q_order = rope_row_order(vision.num_attention_heads, vision.head_dim)
    order = (*q_order, *(a + r for r in q_order), *range(2 * a, 3 * a))
    shape = (3 * a, d) if leaf == "weight" else (3 * a,)
    slots = tuple(
        Slot(f"{VISION_PREFIX}encoder.blocks.{layer}.attn.{p}.{leaf}", disk_rows=(i * a, (i + 1) * a))
        for i, p in enumerate("qkv")
    )
    return HFTensor(f"vision_tower.encoder.blocks.{layer}.wqkv.{leaf}", shape, slots, order)


def _vision_groups(config: VLMConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    groups = []
    for key, tensor in state.items():
        if not key.startswith(VISION_PREFIX):
            continue
        ours = key.removeprefix(VISION_PREFIX)
        shape = tuple(tensor.shape)
        transformers = HFTensor(to_hf_vision_name(ours), shape, (Slot(key),))
        parts = ours.split(".")
        if ".attn." in ours and parts[-2] in ("q", "k", "v"):
            if parts[-2] != "q":
                continue  # one group per layer and leaf holds q, k and v
            layer, leaf = int(parts[2]), parts[-1]
            unfused = tuple(
                HFTensor(
                    to_hf_vision_name(f"encoder.blocks.{layer}.attn.{p}.{leaf}"),
                    shape,
                    (Slot(f"{VISION_PREFIX}encoder.blocks.{layer}.attn.{p}.{leaf}"),),
                )
                for p in "qkv"
            )
            groups.append(
                WeightGroup({CHECKPOINT: (fused_qkv(layer, leaf, config.vision),), TRANSFORMERS: unfused})
            )
            continue
        original = HFTensor(original_vision_name(ours), shape, (Slot(key),))
        groups.append(
            WeightGroup(
                {
                    CHECKPOINT: (original,),
                    TRANSFORMERS: (transformers,),
                    SAVED: _rename((original,), saved_name),
                }
            )
        )
    return groups


def original_vision_name(ours: str) -> str:
    if ours == "encoder.pos_embed.weight":
        return _ORIGINAL_POS
    module, leaf = ours.rsplit(".", 1)
    parts = module.split(".")
    layer = parts[2] if module.startswith("encoder.blocks.") else None
    pattern = module if layer is None else ".".join([*parts[:2], "{i}", *parts[3:]])
    if pattern not in _ORIGINAL_VISION:
        raise KeyError(f"no kimi_k25 name for vision parameter {ours!r}")
    return _ORIGINAL_VISION[pattern].replace("{i}", layer or "") + "." + leaf


def weight_groups(config: VLMConfig, state: Mapping[str, torch.Tensor]) -> list[WeightGroup]:
    """The VLM's state dict (``language_model.*``, ``vision.*``) as ``kimi_k25`` checkpoint tensors."""
    return _text_groups(config, state) + _vision_groups(config, state)
