"""Checkpoints written while training goes on: a snapshot now, ``save_training_checkpoint`` in a thread.

A post-training iteration of the agentic-mini recipe checkpoints ~195 MB (model, MuonClip state, pending
rollouts) and the atomic save (``k2lab.train.run_checkpoints``: write, fsync, checksum, rename, prune) takes
0.5–1 s of a 4–6 s iteration, mostly waiting on the disk. ``BackgroundCheckpoint.start`` copies the state's
tensors (the next iteration updates the live ones in place; ~0.1 s) and hands the copy to a writer thread,
so the save overlaps the next iteration's rollouts. The files, their atomicity and what a resume reads are
those of a foreground save; one save runs at a time, and ``wait()`` returns once the last one is on disk
(raising what it raised).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from k2lab.train.run_checkpoints import check_plain, save_training_checkpoint

__all__ = ["BackgroundCheckpoint", "snapshot"]


def snapshot(state: Any) -> Any:
    """``state`` with every tensor copied (dicts, lists and tuples rebuilt; other values shared)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((key, snapshot(value)) for key, value in state.items())
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(snapshot(value) for value in state)
    return state


class BackgroundCheckpoint:
    """One ``save_training_checkpoint`` at a time in a writer thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(
        self, run_dir: str | os.PathLike[str], step: int, state: dict[str, Any], keep_last: int | None
    ) -> None:
        """Wait for the previous save, snapshot ``state`` and write it as the checkpoint of ``step``. A value
        a checkpoint cannot hold raises ``TypeError`` here, not in the thread."""
        self.wait()
        check_plain(state, "state")
        copy = snapshot(state)
        self._thread = threading.Thread(
            target=self._write, args=(run_dir, step, copy, keep_last), name="k2lab-checkpoint", daemon=True
        )
        self._thread.start()

    def _write(
        self, run_dir: str | os.PathLike[str], step: int, state: dict[str, Any], keep: int | None
    ) -> None:
        try:
            save_training_checkpoint(run_dir, step, state, keep)
        except BaseException as error:  # noqa: BLE001 - re-raised in the training thread by wait()
            self._error = error

    def wait(self) -> None:
        """Block until the running save (if any) is on disk; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
