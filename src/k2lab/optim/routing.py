"""Which update rule one parameter takes: by what it is (its owning module and shape), then by k2lab's names.

    adamw  a parameter of an ``nn.Embedding`` (and so a head tied to it), the weight of an untied output
           head (``k2lab.optim.heads``), a parameter of any convolution (``nn.Conv1d`` kernels
           [out, in/groups, k], ``nn.Conv2d`` [out, in/groups, kh, kw], ...) or of a normalisation layer
           (LayerNorm, GroupNorm, BatchNorm / InstanceNorm, RMSNorm, k2lab's RMSNorm);
           every tensor with ndim < 2 (vectors, scalars) or ndim > 3;
           a 3-D tensor that is not a k2lab expert weight;
           and k2lab's own names: ``embed.`` / ``lm_head.`` (the untied head), ``*norm.weight``,
           ``conv1d.weight`` (KDA's short convolution), the vision ``patch_embed`` / ``pos_embed``
    muon   every other 2-D matrix, and the 3-D [E, out, in] expert weights of ``k2lab.nn.experts.RoutedExperts``
           (orthogonalised per expert)

Muon is for hidden matrices: a user model's untied output head, a plain ``nn.Linear(d, V)``, is found by the
shape it shares with the token embedding (``k2lab.optim.heads``) and takes AdamW like the embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from k2lab.nn.experts import RoutedExperts
from k2lab.nn.norm import RMSNorm
from k2lab.optim.heads import output_heads

ADAMW_MODULES: tuple[type[nn.Module], ...] = (
    nn.Embedding,
    nn.EmbeddingBag,
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    RMSNorm,
)
K2LAB_ADAMW_NAMES = ("norm.weight", "conv1d.weight", "patch_embed.weight", "pos_embed.weight")


def owned_by(model: nn.Module, types: tuple[type[nn.Module], ...]) -> set[int]:
    """``id`` of every parameter held directly by a module of one of ``types`` (a tied one counts once
    for each owner, so an output head tied to an embedding is the embedding's)."""
    return {
        id(p) for module in model.modules() if isinstance(module, types) for p in module.parameters(False)
    }


class ParameterRouter:
    """``is_adamw(name, p)`` for the parameters of one model (module ownership looked up once)."""

    def __init__(self, model: nn.Module) -> None:
        self._adamw_owned = owned_by(model, ADAMW_MODULES) | output_heads(model)
        self._experts = owned_by(model, (RoutedExperts,))

    def is_adamw(self, name: str, parameter: torch.Tensor) -> bool:
        """True where the parameter takes AdamW (module docstring), False where Muon."""
        name = name.removeprefix("language_model.")  # a vision-language model's decoder
        return (
            not 2 <= parameter.ndim <= 3
            or (parameter.ndim == 3 and id(parameter) not in self._experts)
            or id(parameter) in self._adamw_owned
            or name.startswith(("embed.", "lm_head."))
            or name.endswith(K2LAB_ADAMW_NAMES)
        )
