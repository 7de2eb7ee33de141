"""Weight layouts: which checkpoint tensors hold which parts of our state dict.

A checkpoint format (``k2lab.hf.mapping`` for DeepseekV3 / Kimi-K2, ``k2lab.hf.kimi_linear``) describes our
state dict as ``WeightGroup``s. A group covers some of our tensors and lists the alternative ways a
checkpoint may store them, by label: ``"checkpoint"`` (the on-disk layout ``to_hf`` writes, always first),
``"transformers"`` (transformers 5's in-memory names, which ``from_pretrained`` also reads from disk) and
format-specific extras. Each layout is a tuple of ``HFTensor``s: a name, its shape on disk, and the ``Slot``s
of our tensors its values fill. Loading picks, per group, the first layout of which any tensor is on disk
(the canonical one when none is, so that "missing" lists the canonical names).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

import torch

CHECKPOINT = "checkpoint"
TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class Slot:
    """A part of one of our tensors: ``state[key][expert][rows[0]:rows[1]]`` (each index optional).

    ``disk_rows`` selects the part of the disk tensor that goes there (a range of its row dimension,
    ``row_dim``: dim 1 of transformers' fused ``gate_up_proj`` [E, 2F, D], dim 0 of a fused ``wqkv``
    [3D, D] and its bias [3D]); the values are reshaped to the slot's shape, so a disk ``A_log``
    [1, 1, H, 1] fills our [H].
    """

    key: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    disk_rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class HFTensor:
    """One checkpoint tensor: its name, its shape there, and the parts of our state it holds.

    ``row_order`` (optional) permutes the row dimension: disk row r holds row ``row_order[r]`` of the
    slots' concatenation (e.g. a fused q/k/v with the q and k rows of each head interleaved for a
    complex-pair rope, where we keep the rotate-half order). ``also_shapes``: other disk shapes read as the
    same tensor (same elements in the same order, reshaped; e.g. K3's A_log [H] or the older [1, 1, H, 1]).
    """

    name: str
    shape: tuple[int, ...]
    slots: tuple[Slot, ...]
    row_order: tuple[int, ...] | None = None
    also_shapes: tuple[tuple[int, ...], ...] = ()

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether a disk tensor of ``shape`` can be read as this tensor."""
        return shape == self.shape or shape in self.also_shapes

    def to_ours(self, disk: torch.Tensor) -> torch.Tensor:
        """The disk tensor with its rows in our (concatenated slots') order."""
        if self.row_order is None:
            return disk
        inverse = torch.argsort(torch.tensor(self.row_order))
        return disk.index_select(row_dim(disk), inverse)


def row_dim(tensor: torch.Tensor) -> int:
    """The dimension fused tensors are split along: the output rows (dim -2), or dim 0 of a vector."""
    return max(tensor.ndim - 2, 0)


Layout = tuple[HFTensor, ...]


@dataclass(frozen=True)
class WeightGroup:
    """Alternative layouts (label -> tensors) of the same part of our state; the first is canonical."""

    layouts: dict[str, Layout]

    def canonical(self) -> Layout:
        return next(iter(self.layouts.values()))

    def choose(self, present: Container[str]) -> Layout:
        """The first layout with a tensor among ``present`` (disk names), else the canonical one."""
        for layout in self.layouts.values():
            if any(tensor.name in present for tensor in layout):
                return layout
        return self.canonical()

    def prefer(self, label: str) -> Layout:
        """The layout called ``label`` if this group has one, else the canonical one."""
        return self.layouts.get(label, self.canonical())


def single(name: str, key: str, shape: tuple[int, ...]) -> WeightGroup:
    """A tensor stored whole under one name (the same in every layout)."""
    return WeightGroup({CHECKPOINT: (HFTensor(name, shape, (Slot(key),)),)})


def renamed(names: Mapping[str, str], key: str, shape: tuple[int, ...]) -> WeightGroup:
    """A tensor stored whole under a name that depends on the layout (label -> name)."""
    return WeightGroup({label: (HFTensor(name, shape, (Slot(key),)),) for label, name in names.items()})


def slot_view(state: Mapping[str, torch.Tensor], slot: Slot) -> torch.Tensor:
    """Our tensor (a view) that ``slot`` designates."""
    tensor = state[slot.key]
    if slot.expert is not None:
        tensor = tensor[slot.expert]
    if slot.rows is not None:
        tensor = tensor[slot.rows[0] : slot.rows[1]]
    return tensor


def gather(state: Mapping[str, torch.Tensor], tensor: HFTensor) -> torch.Tensor:
    """The checkpoint tensor assembled from our state (a view where possible)."""
    pieces = [slot_view(state, slot) for slot in tensor.slots]
    whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=row_dim(pieces[0]))
    if tensor.row_order is not None:
        whole = whole.index_select(row_dim(whole), torch.tensor(tensor.row_order))
    return whole.reshape(tensor.shape)


# ---- names shared by the DeepseekV3 / Kimi-K2 and Kimi Linear checkpoints ---------------------------------

GLOBAL_RENAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Our per-layer names (after ``layers.{i}.``) -> theirs (after ``model.layers.{i}.``).
NORM_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
}
MLA_RENAMES = {
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.q_down.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_up.weight": "self_attn.q_b_proj.weight",
    "attn.kv_down.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_up.weight": "self_attn.kv_b_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
}


def routed_expert_groups(
    state: Mapping[str, torch.Tensor],
    ours: str,
    per_expert: Callable[[int, str], str],
    fused_prefix: str,
) -> tuple[WeightGroup, WeightGroup]:
    """Our fused experts ``{ours}{gate,up,down}_proj`` [E, out, in] as two groups, (gate + up) and down.

    Checkpoint: one tensor per expert and projection, ``per_expert(e, projection)``. transformers 5:
    ``{fused_prefix}gate_up_proj`` [E, 2F, D] (gate rows then up rows) and ``{fused_prefix}down_proj``.
    """
    gate, down = state[ours + "gate_proj"], state[ours + "down_proj"]
    E, F, D = gate.shape
    gate_up = WeightGroup(
        {
            CHECKPOINT: tuple(
                HFTensor(per_expert(e, projection), (F, D), (Slot(ours + projection, expert=e),))
                for projection in ("gate_proj", "up_proj")
                for e in range(E)
            ),
            TRANSFORMERS: (
                HFTensor(
                    fused_prefix + "gate_up_proj",
                    (E, 2 * F, D),
                    (
                        Slot(ours + "gate_proj", disk_rows=(0, F)),
                        Slot(ours + "up_proj", disk_rows=(F, 2 * F)),
                    ),
                ),
            ),
        }
    )
    down_shape = tuple(down.shape)
    down_group = WeightGroup(
        {
            CHECKPOINT: tuple(
                HFTensor(per_expert(e, "down_proj"), down_shape[1:], (Slot(ours + "down_proj", expert=e),))
                for e in range(E)
            ),
            TRANSFORMERS: (HFTensor(fused_prefix + "down_proj", down_shape, (Slot(ours + "down_proj"),)),),
        }
    )
    return gate_up, down_group
