"""Validation loss: a model's mean next-token cross-entropy over a fixed list of held-out batches.

    L_val = (1/N_b) Σ_b  mean_{t : y_bt ≠ −100} −log p_θ(y_bt | x_b,≤t)

each batch's own token mean (data-parallel: over every rank's rows, ``k2lab.train.token_mean.batch_means``),
then the mean over the ``N_b`` batches. The model runs in eval mode, without gradients and without recording
QK-Clip's max logits (``max_logits_paused``: validation is not the update's forward). Each batch's
``input_ids`` / ``labels`` are int64 ``[B, T]``. ``k2lab train`` (``Trainer.validation_loss``) and
``k2lab visual-rl``'s held-out text loss (``k2lab.vision.text_loss``) both measure it here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k2lab.data.packing import Batch
from k2lab.nn.mla import max_logits_paused
from k2lab.train import distributed
from k2lab.train.token_mean import batch_means

__all__ = ["validation_loss"]


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module, batches: Sequence[Batch], loss_of: Callable[[Batch], torch.Tensor]
) -> float:
    """L_val of ``model`` over ``batches``; ``loss_of(batch)`` is the batch's mean cross-entropy (a scalar)
    from ``model``'s forward. 0.0 for no batches."""
    model.eval()
    with max_logits_paused(model):
        losses = [loss_of(batch) for batch in batches]
    means = batch_means(losses, [batch.labels for batch in batches])
    return distributed.all_reduce_mean(sum(means) / max(len(means), 1))
