"""Writing a decode step's latent rows into the preallocated cache, in place, inside a compiled graph.

An MLA layer appends its T new tokens' c_KV [B, T, C] and k_R [B, T, r] to its slot of the cache storage
``rows`` [L_mla, B, S, C + r] (``k2lab.infer.cache``): rows[slot, :, start : start + T] = [c_KV | k_R].

In eager mode that is two slice assignments (``write_rows``). Traced by ``torch.compile``, an assignment into
a slice of a graph input is functionalised through its views (select, slice, narrow) into scatters that
yield a new storage, and torch 2.13's inductor recomputed the whole storage (every layer's slot, every batch
row, all S slots) at each layer: O(L_mla² · B · S) copies per step, ~3 ms of a 6 ms k2-mini decode step at
batch 4 (docs/generation.md). ``write_rows_indexed`` writes the same rows as one ``index_put_`` on the base
storage, rows[slot, b, start + t] = [c_KV | k_R][b, t] for b < B, t < T: functionalised, that is an
``index_put`` whose input is dead afterwards, which inductor turns back into an in-place scatter of the
B · T new rows, fused with the kernel that produces them.

It replaces the custom op ``k2lab::write_latent_rows`` that did this before: inductor called it through
the dispatcher and its Python kernel, ≈ 40 µs a call in eager and several times that from the compiled
step's C++ wrapper, six calls a k2-mini step (docs/generation.md).
"""

from __future__ import annotations

import torch


def write_rows(rows: torch.Tensor, slot: int, start: int, latent: torch.Tensor, k_rope: torch.Tensor) -> None:
    """rows[slot, :, start : start + T] = [latent | k_rope] for latent [B, T, C], k_rope [B, T, r]."""
    end, width = start + latent.shape[1], latent.shape[-1]
    rows[slot, :, start:end, :width] = latent
    rows[slot, :, start:end, width:] = k_rope


def write_rows_indexed(
    rows: torch.Tensor, slot: int, start: int, latent: torch.Tensor, k_rope: torch.Tensor
) -> None:
    """``write_rows`` as one ``index_put_`` on ``rows`` itself, the form a compiled graph writes in place
    (see the module docstring): indices slot [1, 1], batch [B, 1], position [1, T]; values [B, T, C + r]."""
    batch, length = latent.shape[:2]
    device = rows.device
    positions = torch.arange(start, start + length, device=device)[None, :]
    rows_of_batch = torch.arange(batch, device=device)[:, None]
    slots = torch.full((1, 1), slot, dtype=torch.long, device=device)
    rows.index_put_((slots, rows_of_batch, positions), torch.cat([latent, k_rope], dim=-1))
