"""Multi-token-prediction layers in checkpoints (DeepSeek-V3 layout, as vLLM and SGLang read it).

MTP module k (``mtp.{k-1}`` here, ``k2lab.models.mtp``) is checkpoint layer ``L = num_hidden_layers + k - 1``:

    model.layers.{L}.enorm.weight              [D]       ours mtp.{k-1}.enorm.weight
    model.layers.{L}.hnorm.weight              [D]       ours mtp.{k-1}.hnorm.weight
    model.layers.{L}.eh_proj.weight            [D, 2D]   ours mtp.{k-1}.eh_proj.weight ([Emb ; h] columns)
    model.layers.{L}.shared_head.norm.weight   [D]       ours mtp.{k-1}.final_norm.weight
    model.layers.{L}.embed_tokens.weight       [V, D]    a copy of model.embed_tokens (shared)
    model.layers.{L}.shared_head.head.weight   [V, D]    a copy of lm_head (shared)
    model.layers.{L}.{self_attn, mlp, input_layernorm, post_attention_layernorm}.*   ours mtp.{k-1}.block.*
        named exactly as a main layer of the same format (the MTP block is an MLA + MoE/dense layer)

``config.json`` carries ``num_nextn_predict_layers``. ``to_hf`` writes the two shared copies (the released
DeepSeek-V3 checkpoints hold them); loading skips them, since our modules share the main embedding and head
(the DeepSeek-V3 report §2.2; the checkpoints' copies equal the main tensors).

Kimi Linear (``kimi_linear``) and Kimi K3 (``kimi_k3``, under ``language_model.``) use the same keys, the
block's tensors in the Kimi Linear per-layer names (``block_sparse_moe.*`` for the MoE); that is K3's released
layout (vLLM's kimi_k3 MTP loader). K3's MTP block has plain residuals: attention-residual tensors
(``self_attention_res_*``, ``mlp_res_*``) in an MTP layer are skipped on load (``is_skipped``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from k2lab.config import ModelConfig
from k2lab.hf.layout import HFTensor, Slot, WeightGroup, single

MTP_PREFIX = "mtp."
# Our names inside ``mtp.{j}.`` -> theirs inside ``model.layers.{L}.`` (module-own tensors).
MTP_RENAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_norm.weight": "shared_head.norm.weight",
}
# Shared with the main model: written as copies, skipped when loading (ours -> the main tensor).
SHARED_COPIES = {"embed_tokens.weight": "embed.weight", "shared_head.head.weight": "lm_head.weight"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_RESIDUAL_STEMS = ("self_attention_res", "mlp_res")


def main_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the MTP modules' tensors."""
    return {key: value for key, value in state.items() if not key.startswith(MTP_PREFIX)}


def mtp_groups(
    config: ModelConfig,
    state: Mapping[str, torch.Tensor],
    layer_groups: Callable[[Mapping[str, torch.Tensor]], list[WeightGroup]],
) -> list[WeightGroup]:
    """The MTP modules' own tensors as checkpoint layers ``num_hidden_layers + j``.

    ``layer_groups(state)`` is the format's mapping of main-layer tensors (``layers.{i}.…``): each block is
    named through it as layer ``num_hidden_layers + j`` and its slots pointed back at ``mtp.{j}.block.…``."""
    groups: list[WeightGroup] = []
    for j in range(config.num_nextn_predict_layers):
        index, ours = config.num_hidden_layers + j, f"mtp.{j}."
        for leaf, theirs in MTP_RENAMES.items():
            groups.append(
                single(f"model.layers.{index}.{theirs}", ours + leaf, tuple(state[ours + leaf].shape))
            )
        block = {
            f"layers.{index}.{key.removeprefix(ours + 'block.')}": tensor
            for key, tensor in state.items()
            if key.startswith(ours + "block.")
        }
        back = {
            f"layers.{index}.{key.removeprefix(ours + 'block.')}": key
            for key in state
            if key.startswith(ours + "block.")
        }
        groups.extend(_rekeyed(group, back) for group in layer_groups(block))
    return groups


def _rekeyed(group: WeightGroup, keys: Mapping[str, str]) -> WeightGroup:
    """``group`` with every slot's key renamed by ``keys``."""

    def tensor(t: HFTensor) -> HFTensor:
        return replace(t, slots=tuple(replace(s, key=keys[s.key]) for s in t.slots))

    return WeightGroup({label: tuple(tensor(t) for t in layout) for label, layout in group.layouts.items()})


def shared_copies(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> list[HFTensor]:
    """The per-layer copies of the shared embedding and head that the checkpoints carry (written only).

    ``state`` is the state written (``lm_head.weight`` absent when tied: the head copy is the embedding)."""
    copies = []
    for j in range(config.num_nextn_predict_layers):
        index = config.num_hidden_layers + j
        for theirs, ours in SHARED_COPIES.items():
            key = ours if ours in state else "embed.weight"
            copies.append(HFTensor(f"model.layers.{index}.{theirs}", tuple(state[key].shape), (Slot(key),)))
    return copies


def mtp_layer_index(name: str, num_hidden_layers: int) -> int | None:
    """j when ``name`` (a decoder checkpoint name) belongs to checkpoint layer ``num_hidden_layers + j``."""
    match = _LAYER.match(name)
    if match is None or int(match.group(1)) < num_hidden_layers:
        return None
    return int(match.group(1)) - num_hidden_layers


def is_shared_copy(name: str) -> bool:
    """Whether an MTP layer's tensor ``name`` is one of the shared copies (skipped when loading)."""
    return any(name.endswith("." + theirs) for theirs in SHARED_COPIES)


def is_skipped(name: str) -> bool:
    """Whether an MTP layer's tensor ``name`` is skipped when loading: a shared copy, or an attention-residual
    weight (``self_attention_res_*``, ``mlp_res_*``), which K3 checkpoints may carry for their MTP layers
    though the MTP block uses plain residuals (vLLM's kimi_k3 MTP loader skips them too)."""
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
    return is_shared_copy(name) or leaf.startswith(_RESIDUAL_STEMS)


def present_mtp_layers(names: list[str], num_hidden_layers: int, declared: int) -> int:
    """How many of the ``declared`` MTP layers have tensors among ``names`` (decoder names), counting from
    the first: a checkpoint saved by transformers declares its MTP layers but holds none of them."""
    found = {mtp_layer_index(name, num_hidden_layers) for name in names}
    count = 0
    while count < declared and count in found:
        count += 1
    return count
