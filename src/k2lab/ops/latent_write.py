"""Writing a decode step's latent rows into the preallocated cache, in place, inside a compiled graph.

An MLA layer appends its T new tokens' c_KV [B, T, C] and k_R [B, T, r] to its slot of the cache storage
``rows`` [L_mla, B, S, C + r] (``k2lab.infer.cache``): rows[slot, :, start : start + T] = [c_KV | k_R].

In eager mode that is two slice assignments. Traced by ``torch.compile``, a slice assignment into a graph
input is functionalised into a scatter that yields a new ``rows``; torch 2.13's inductor did not write it
back in place but recomputed the whole storage (every layer's slot, every batch row, all S slots) at each
layer: O(L_mla² · B · S) copies per step, ~3 ms of a 6 ms k2-mini decode step at batch 4
(docs/generation.md). As the custom op ``k2lab::write_latent_rows``, which declares that it mutates ``rows``,
the graph calls it once per layer and it writes only the T new positions.
"""

from __future__ import annotations

import torch


def write_rows(rows: torch.Tensor, slot: int, start: int, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """rows[slot, :, start : start + T] = [latent | k_rope] for latent [B, T, C], k_rope [B, T, r]."""
    end, width = start + latent.shape[1], latent.shape[-1]
    rows[slot, :, start:end, :width] = latent
    rows[slot, :, start:end, width:] = k_rope


@torch.library.custom_op("k2lab::write_latent_rows", mutates_args=("rows",))
def write_latent_rows(
    rows: torch.Tensor, slot: int, start: int, latent: torch.Tensor, k_rope: torch.Tensor
) -> None:
    """``write_rows`` as an op that compiled graphs call in place (see the module docstring)."""
    write_rows(rows, slot, start, latent, k_rope)


@write_latent_rows.register_fake
def _(rows: torch.Tensor, slot: int, start: int, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    return None
