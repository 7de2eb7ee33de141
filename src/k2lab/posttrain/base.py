"""The iterative post-training loop under RL, MOPD and PARL: state, resume, checkpoint cadence, metrics log.

A trainer subclasses ``IterativeTrainer``, builds its model and optimizer, sets its counter to 0 and calls
``resume()`` at the end of ``__init__``; it supplies

* ``counter``: the name of the attribute counting completed iterations (``"iteration"`` for RL and PARL,
  ``"step"`` for MOPD); the same name keys that count in every checkpoint and in every metrics line;
* ``advance()``: one iteration: do the work, add one to the counter, ``log_metrics`` the metrics line and
  return it;
* ``state_parts()`` / ``load_state_parts(state)``: what a checkpoint holds besides the counter, the RNGs and
  the settings (model, optimizer, pending rollouts, …), and putting it back;
* ``settings()`` (optional): what a resumed run must share with its checkpoint (default: the config).

``run_loop(total, on_metrics)`` advances until the counter reaches ``total`` and writes a checkpoint
(keeping ``config.keep_checkpoints``) whenever the counter is a multiple of ``config.checkpoint_every`` and
after the last iteration. The state is snapshotted at once and written by a ``CheckpointWriter``'s background
thread while the next iteration runs; the loop waits for it before the next save and before it returns
(also when an iteration raises), so on return the last checkpoint is durable. Ctrl-C in the loop says which
checkpoint the run keeps and how to continue (``k2lab.interrupt``) and exits 130. A checkpoint is::

    {counter: n, **state_parts(), "rng": capture_rng_state(), "config": settings()}

``resume()`` loads the latest one (``k2lab.train.persistence.resume_state``): a checkpoint written with other
settings is refused with a ``CheckpointError`` naming each changed field (only the run's length and its
checkpointing may change), metrics lines at or after n are dropped, and the trainer's state, then the RNGs,
then the counter are restored. Tasks and sampling seeds derive from (seed, counter, …) (``derive_seed``),
so a killed run restarted with the same settings logs the uninterrupted run's metrics and ends with its
weights.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from k2lab.errors import K2LabError
from k2lab.fsutil import make_directory
from k2lab.interrupt import RERUN_TO_CONTINUE, last_checkpoint, reports_interrupt
from k2lab.model_dir import save_model
from k2lab.train.persistence import capture_rng_state, restore_rng_state, resume_state
from k2lab.train.run_checkpoints import CheckpointWriter, list_checkpoints
from k2lab.train.run_directory import claim_run_directory

__all__ = ["METRICS", "IterativeTrainer", "LoopConfig", "open_run", "rounded_mean", "save_policy"]

METRICS = "metrics.jsonl"


class LoopConfig(Protocol):
    """What the loop reads of a trainer's pydantic config (``RLConfig``, ``MOPDConfig``, ``ParlConfig``)."""

    checkpoint_every: int
    keep_checkpoints: int | None

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...


def rounded_mean(values: Sequence[float]) -> float | None:
    """The mean to 6 decimals (metrics lines), None for no values."""
    return round(sum(values) / len(values), 6) if values else None


class IterativeTrainer(ABC):
    """State, resume, checkpoint cadence and the metrics log of an iterative post-training run in ``out_dir``
    (see the module docstring for what a subclass supplies)."""

    counter: ClassVar[str] = "iteration"
    metrics_file: ClassVar[str] = METRICS
    resume_hint: ClassVar[str] = RERUN_TO_CONTINUE  # what Ctrl-C says (an outer block may say its own)

    def __init__(self, config: LoopConfig, out_dir: str | Path) -> None:
        self.config = config
        self.out = make_directory(Path(out_dir), "the run directory")
        self.checkpoints = CheckpointWriter()

    # ---- what a subclass supplies
    @abstractmethod
    def advance(self) -> dict[str, Any]:
        """One iteration: the work, the counter + 1, ``log_metrics``; returns the metrics line."""

    @abstractmethod
    def state_parts(self) -> dict[str, Any]:
        """The checkpoint's entries besides the counter, ``rng`` and ``config`` (checkpoint-safe values)."""

    @abstractmethod
    def load_state_parts(self, state: dict[str, Any]) -> None:
        """Restore what ``state_parts`` saved (``state`` is the whole checkpoint)."""

    def settings(self) -> dict[str, Any]:
        """The settings a resumed run must share with the checkpoint (saved as its ``config``)."""
        return self.config.model_dump(mode="json")

    # ---- the loop
    @property
    def completed(self) -> int:
        """Iterations (steps) completed: the value of the ``counter`` attribute."""
        return int(getattr(self, self.counter))

    def run_loop(
        self, total: int, on_metrics: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """``advance()`` until ``total`` iterations are done, checkpointing on the cadence and after the last
        (written in the background, durable when this returns); ``on_metrics`` sees each metrics line once
        its checkpoint has been started. Returns this call's metrics lines."""
        history = []
        kept = last_checkpoint(self.out, self.counter)  # read after the writer has finished its save
        with reports_interrupt(self.out, kept, self.resume_hint), self.checkpoints:
            while self.completed < total:
                metrics = self.advance()
                history.append(metrics)
                if self.completed % self.config.checkpoint_every == 0 or self.completed == total:
                    self.save_checkpoint(wait=False)
                if on_metrics is not None:
                    on_metrics(metrics)
        return history

    # ---- persistence
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything the next iteration depends on: the counter, the subclass's parts, RNGs, settings."""
        return {
            self.counter: self.completed,
            **self.state_parts(),
            "rng": capture_rng_state(),
            "config": self.settings(),
        }

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Write ``checkpoint_state()`` as the checkpoint of the current count; returns its directory.
        ``wait=False`` returns once the state is snapshotted, the write going on in the background."""
        directory = self.checkpoints.save(
            self.out, self.completed, self.checkpoint_state(), self.config.keep_checkpoints
        )
        if wait:
            self.checkpoints.wait()
        return directory

    def resume(self) -> bool:
        """Continue from the latest checkpoint of ``out_dir``, if any (refused when the settings differ);
        returns whether there was one."""
        state = resume_state(self.out, self.metrics_file, self.counter, self.settings())
        if state is None:
            return False
        self.load_state_parts(state)
        restore_rng_state(state["rng"])
        setattr(self, self.counter, int(state[self.counter]))
        return True

    # ---- the metrics log
    def log_metrics(self, metrics: dict[str, Any]) -> None:
        """Append ``metrics`` as one JSON line (sorted keys) to ``out_dir/metrics.jsonl``."""
        with open(self.out / self.metrics_file, "a") as handle:
            handle.write(json.dumps(metrics, sort_keys=True) + "\n")

    def history(self) -> list[dict[str, Any]]:
        """Every metrics line logged in ``out_dir`` so far (resumed runs included)."""
        return metrics_history(self.out / self.metrics_file)


def open_run(
    out: Path, command: str, reads: Sequence[str | Path | None], resume: bool, threads: int | None, seed: int
) -> None:
    """Start a post-training command's run in ``out``: claim it (``claim_run_directory``; ``reads``: the
    directories it loads), refuse its checkpoints when ``resume`` is False, set the torch threads and seed."""
    claim_run_directory(out, command, reads)
    if not resume and list_checkpoints(out):
        raise K2LabError(f"{out} already holds checkpoints: resume it or choose another --out")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)


def save_policy(model: torch.nn.Module, tokenizer: Any, out: Path) -> Path:
    """The trained model with its tokenizer in ``out/model`` (what ``-c`` of the next command takes)."""
    directory = save_model(model, out / "model")
    tokenizer.save(directory / "tokenizer.json")
    return directory


def metrics_history(path: Path) -> list[dict[str, Any]]:
    """Every line of a post-training run's metrics file (``[]`` when there is none yet)."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
