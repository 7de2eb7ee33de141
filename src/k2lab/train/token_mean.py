"""Token means over the global batch when data-parallel ranks hold different numbers of scored tokens.

One process's loss on a micro-batch is the mean cross-entropy over its ``N`` scored labels (label ≠ -100).
With ``W`` ranks holding ``n_r`` of them (``Σ_r n_r = N``), backpropagating each rank's own mean ``ℓ_r``
while FSDP2 averages the gradients over ranks gives ``(1/W) Σ_r ∇ℓ_r``, a mean of means: the one-process
gradient ``∇ Σ_r n_r ℓ_r / N`` only when every ``n_r = N / W`` (packed text). SFT rows (prompts and padding
masked) and their PTX mix do not split evenly, so each rank backpropagates its share

    s_r = ℓ_r · W · n_r / N          (0 where n_r = 0; N is one all-reduce of the counts)

whose mean over ranks, ``Σ_r n_r ℓ_r / N``, is the one-process loss, and FSDP2's average of ``∇s_r`` its
gradient. The same shares, averaged over ranks, are the reported losses; each MTP depth (which scores
``labels[:, k:]``) and the depth-1 top-1 rate are weighted by their own counts. Alone every function here
returns its input (the one-process numbers stay bit for bit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k2lab.ops.linear_cross_entropy import IGNORE_INDEX
from k2lab.train import distributed
from k2lab.train.mtp_loss import MTPLoss


def scored_counts(labels: torch.Tensor, depths: int = 0) -> torch.Tensor:
    """labels [B, T] -> [1 + depths] int64: how many of ``labels[:, k:]`` are scored (≠ -100), k = 0..depths
    (the main loss's targets, then MTP depth k's)."""
    valid = labels != IGNORE_INDEX
    return torch.stack([valid[:, k:].sum() for k in range(depths + 1)])


def rank_shares(means: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """This rank's token means [K] and how many tokens each averages [K] -> its shares ``ℓ·W·n/N`` [K]
    (``N``: the count summed over ranks; 0 where ``n`` is 0, NaN where ``N`` is). A collective (one
    all-reduce): every rank calls it in the same order. Alone: ``means`` itself."""
    if not distributed.is_distributed():
        return means
    total = counts.clone()
    dist.all_reduce(total)
    ratio = (counts.double() * distributed.world_size() / total.double()).to(means.dtype)
    return torch.where(counts > 0, means * ratio, ratio)  # a rank without targets adds nothing


def global_token_means(
    loss: torch.Tensor, mtp: MTPLoss | None, labels: torch.Tensor
) -> tuple[torch.Tensor, MTPLoss | None]:
    """A micro-batch's main loss (a scalar) and MTP loss over this rank's labels [B, T] -> the rank's shares
    of both (``rank_shares``; MTP: each depth and depth-1 top-1 by its own count), in one all-reduce.
    Alone: ``loss`` and ``mtp`` as they are."""
    if not distributed.is_distributed():
        return loss, mtp
    if mtp is None:
        return rank_shares(loss[None], scored_counts(labels))[0], None
    counts = scored_counts(labels, len(mtp.depths))
    means = torch.cat([loss[None], mtp.depths.to(loss.dtype), mtp.top1.to(loss.dtype)[None]])
    shares = rank_shares(means, torch.cat([counts, counts[1:2]]))
    depths = shares[1:-1]
    return shares[0], MTPLoss(depths.mean(), shares[-1].detach(), mtp.targets, depths)


def batch_means(losses: list[torch.Tensor], labels: list[torch.Tensor]) -> list[float]:
    """Per-batch mean losses (scalars) of this rank's rows and their labels [B, T] -> the rank's share of
    each as a float (one all-reduce for all of them; alone: ``loss.item()`` of each)."""
    if not distributed.is_distributed() or not losses:
        return [loss.item() for loss in losses]
    counts = torch.stack([scored_counts(rows)[0] for rows in labels])
    return rank_shares(torch.stack(losses), counts).tolist()
