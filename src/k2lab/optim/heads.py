"""Which ``nn.Linear`` of a model is its untied output head, so that it takes AdamW and not Muon.

Muon is for hidden matrices: the output head, like the embedding, takes AdamW (torch.optim.Muon's docs, Keller
Jordan's and Moonlight's recipes). A head tied to the embedding is the embedding's parameter and k2lab names
its untied head ``lm_head``; a user model's untied head is a plain ``nn.Linear(d, V)``, whose weight has the
shape [V, d] of the token embedding it could be tied to. The rule:

    for each ``nn.Embedding`` / ``nn.EmbeddingBag`` of shape [V, d] with V ≠ d, the one ``nn.Linear`` whose
    weight has that shape (and is not the embedding's own) is an output head

Two or more of that shape name no head (a position table [T, d] beside the [4d, d] MLP matrices of a model
with T = 4d, or a vocabulary of 4d): if the model has no head otherwise (none tied, none named ``lm_head``),
a ``UserWarning`` says so. A square table (V = d) names none (every hidden [d, d] matrix has its shape). A
head the rule misses (another shape, a bare ``nn.Parameter`` used with ``F.linear``): name it ``lm_head`` or
put it in a ``kind="adamw"`` group.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def embedding_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weight of every ``nn.Embedding`` / ``nn.EmbeddingBag``, by module name."""
    return {name: m.weight for name, m in model.named_modules() if isinstance(m, EMBEDDINGS)}


def embedding_shaped_linears(model: nn.Module) -> dict[str, list[str]]:
    """For each non-square embedding [V, d] (by name), the ``nn.Linear`` layers whose weight is [V, d] and not
    an embedding's own (a head tied to it is the embedding's already)."""
    tables = embedding_tables(model)
    tied = {id(weight) for weight in tables.values()}
    linears = {
        name: m.weight
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and id(m.weight) not in tied
    }
    return {
        table: [name for name, weight in linears.items() if weight.shape == table_weight.shape]
        for table, table_weight in tables.items()
        if table_weight.shape[0] != table_weight.shape[1]
    }


def has_known_head(model: nn.Module) -> bool:
    """Whether the model has a head routed to AdamW without the shape rule: an ``nn.Linear`` tied to an
    embedding, or k2lab's ``lm_head`` (a vision-language model's ``language_model.lm_head``)."""
    tied = {id(weight) for weight in embedding_tables(model).values()}
    return any(
        isinstance(m, nn.Linear)
        and (id(m.weight) in tied or name.removeprefix("language_model.") == "lm_head")
        for name, m in model.named_modules()
    )


def output_heads(model: nn.Module) -> set[int]:
    """``id`` of each untied output head's weight (module docstring: the one ``nn.Linear`` shaped like a
    non-square embedding). A ``UserWarning`` where some embedding has several candidates and the model has
    no head otherwise (``has_known_head``)."""
    matches = embedding_shaped_linears(model)
    heads = [names[0] for names in matches.values() if len(names) == 1]
    ambiguous = [(table, names) for table, names in matches.items() if len(names) > 1]
    if ambiguous and not heads and not has_known_head(model):
        table, names = ambiguous[0]
        warnings.warn(
            f"{type(model).__name__}: the nn.Linear layers {', '.join(names)} all have the shape of the embedding "
            f"{table}, so none is taken for its output head: if one is an untied head, name it lm_head or put "
            "it in a kind='adamw' group (Muon is for hidden matrices)",
            UserWarning,
            stacklevel=4,
        )
    modules = dict(model.named_modules())
    return {id(modules[name].weight) for name in heads}
