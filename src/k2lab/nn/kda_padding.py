"""Padding in a KDA layer's short convolution: each real token's kernel window holds the previous REAL inputs.

A padded chunk (left padding after cached tokens, right padding, holes) must leave a KDA layer as if its pads
were absent. The recurrence skips a pad by g = 0, β = 0 (then S_t = S_{t−1}, ``nn.kda``); the depthwise
convolution of width W, by running over the real inputs compacted to the front:

    z = [history; x] [B, C, L], L = W − 1 + T,   real = [1 … 1; valid] [B, L]
    n_j = Σ_{i ≤ j} real_i                             (real inputs up to j; the W − 1 history inputs count)
    z'[n_j − 1] = z_j for real j, the pads after them  (a stable partition: a permutation of the L slots)
    y_t = Σ_w W[w] z'[n_t − W + w]                     (n_t = n_{W−1+t}; t real)
    state after t = z'[n_t − W + 1 : n_t]              (the last W − 1 real inputs; unchanged by a pad)

A pad's own output is that of another window of z' (arbitrary: later layers mask or skip pads). The
compaction is a scatter of a permutation and gathers by index: no host sync, no data-dependent shape.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compact_real(
    padded: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """padded = [history; x] [B, C, L] (the W − 1 = L − T history inputs first), valid [B, T] bool ->
    (z' [B, C, L] the real inputs first, in order; slot [B, L] where each input of ``padded`` went;
    n_t [B, T] real inputs up to and including token t)."""
    B, C, L = padded.shape
    real = torch.cat((valid.new_ones(B, L - valid.shape[1]), valid.bool()), dim=1)
    counts = real.long().cumsum(1)  # n_j
    index = torch.arange(L, device=padded.device)
    slot = torch.where(real, counts - 1, counts[:, -1:] + index - counts)  # pads after all reals, in order
    compacted = torch.zeros_like(padded).scatter(2, slot[:, None, :].expand(B, C, L), padded)
    return compacted, slot, counts[:, L - valid.shape[1] :]


def padded_short_conv(
    padded: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The convolution over real inputs only. padded [B, C, W−1+T] (history, then the window's inputs),
    weight [C, 1, W] (W ≥ 2), valid [B, T] bool -> (y [B, T, C], state [B, C, W−1] = the last W−1 real
    inputs)."""
    compacted, slot, counts = compact_real(padded, valid)
    width = weight.shape[-1]
    y = F.conv1d(
        compacted, weight.to(padded.dtype), groups=padded.shape[1]
    )  # [B, C, T]: window ends at i+W−1
    own = slot[:, width - 1 :] - (width - 1)  # [B, T]: token t's output (the inverse of the compaction)
    y = y.gather(2, own[:, None, :].expand_as(y))
    return y.transpose(1, 2), real_history(compacted, counts[:, -1:], width - 1)[:, 0]


def real_history(compacted: torch.Tensor, counts: torch.Tensor, keep: int) -> torch.Tensor:
    """compacted z' [B, C, L], counts n [B, N] -> the last ``keep`` real inputs up to each n,
    z'[n − keep : n] [B, N, C, keep]."""
    B, C, _ = compacted.shape
    windows = compacted.unfold(-1, keep, 1)  # [B, C, L − keep + 1, keep]: window s = z'[s : s + keep]
    start = (counts - keep)[:, None, :, None].expand(B, C, counts.shape[1], keep)
    return windows.gather(2, start).transpose(1, 2)
