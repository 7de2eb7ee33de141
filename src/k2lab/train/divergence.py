"""Divergence: a training step whose loss or gradient norm is not finite stops the run before its update.

Once one step's loss or global gradient norm is NaN or infinite, the update it would apply makes every weight
NaN, and every later step, checkpoint and the final model with it. ``train_loop`` checks the two numbers each
step already computes (the loss is reduced across ranks and the norm is the global one, so every rank decides
the same) and raises ``TrainingDiverged`` *before* the optimizer step: nothing of that step is applied or
saved, the newest checkpoint is the last good state, and the error says how to go on from it.
"""

from __future__ import annotations

import math
from pathlib import Path

from k2lab.errors import K2LabError
from k2lab.train.run_checkpoints import list_checkpoints


class TrainingDiverged(K2LabError):
    """A step's loss or gradient norm is NaN or infinite; ``step`` is the step that was not applied."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def check_finite_step(step: int, loss: float, grad_norm: float, lr: float, run_dir: Path) -> None:
    """Raise ``TrainingDiverged`` for step ``step`` (1-based, not yet applied) unless ``loss`` and
    ``grad_norm`` are finite; the message names the values, the learning rate and the newest checkpoint."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    saved = list_checkpoints(run_dir)
    where = (
        f"the newest checkpoint is step {saved[0][0]} ({saved[0][1]}): lower --lr (now {lr:g}) or lengthen "
        "the warm-up and run again with --resume"
        if saved
        else f"no checkpoint was written yet: lower --lr (now {lr:g}) or lengthen the warm-up and start again"
    )
    raise TrainingDiverged(
        f"training diverged at step {step}: loss {loss}, gradient norm {grad_norm}; that step was not "
        f"applied and nothing after step {step - 1} is saved; {where}",
        step,
    )
