"""Divergence: an update whose loss or gradient norm is not finite stops the run before it is applied.

Once one step's loss or global gradient norm is NaN or infinite, the update it would apply makes every weight
NaN, and every later step, checkpoint and the final model with it (and a resumed run loads that checkpoint and
fails again). Every training loop (pre-training and SFT, RL, MOPD, PARL, the draft) checks the two numbers
between ``backward()`` and the optimizer's step and raises ``TrainingDiverged``: nothing of that update is
applied or saved, the newest checkpoint is the last good state, and the error says how to go on from it. In
pre-training the loss is reduced across ranks and the norm is the global one, so every rank decides the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch

from k2lab.errors import K2LabError
from k2lab.train.run_checkpoints import CheckpointWriter, list_checkpoints


class TrainingDiverged(K2LabError):
    """A step's loss or gradient norm is NaN or infinite; ``step`` is the step (as logged) not applied."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def check_finite_step(
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    run_dir: Path | None,
    unit: str = "step",
    pending: CheckpointWriter | None = None,
) -> None:
    """Raise ``TrainingDiverged`` for ``unit`` ``step`` (as its metrics line numbers it) unless ``loss`` and
    ``grad_norm`` are finite; the message names the values, the learning rate and the newest checkpoint of
    ``run_dir`` (None: a run without checkpoints), once the save ``pending`` has in flight is durable."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    if pending is not None:
        pending.wait()
    saved = list_checkpoints(run_dir) if run_dir is not None else []
    advice = f"lower the learning rate (now {lr:g})"
    if saved:
        where = f"the newest checkpoint is {saved[0][1]}: {advice} and run again with --resume"
    elif run_dir is not None:
        where = f"no checkpoint was written yet: {advice} and start again"
    else:
        where = f"{advice} and run it again"
    raise TrainingDiverged(
        f"training diverged at {unit} {step}: loss {loss}, gradient norm {grad_norm}; that update was not "
        f"applied and nothing of it is saved; {where}",
        step,
    )


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """The global 2-norm of the parameters' gradients (0 when none has one)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def check_finite_update(
    step: int,
    loss: torch.Tensor,
    parameters: Iterable[torch.nn.Parameter],
    lr: float,
    run_dir: Path | None,
    unit: str = "step",
    pending: CheckpointWriter | None = None,
) -> None:
    """``check_finite_step`` of a loss after its ``backward()``, with the gradients' global norm."""
    norm = gradient_norm(parameters)
    check_finite_step(step, float(loss.detach()), norm, lr, run_dir, unit, pending)
