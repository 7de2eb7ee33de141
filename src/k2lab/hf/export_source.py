"""What ``k2lab export`` exports: a run directory, one of its training checkpoints, or a model directory,
resolved to one set of weights and the tokenizer that goes with them.

* A **model directory** (``k2lab.json`` from ``save_model``, or a Hugging Face directory): its weights, and
  its ``tokenizer.json``.
* A **training checkpoint** (``RUN/checkpoints/step_XXXXXXXX`` with ``manifest.json``, verified by size and
  SHA-256): the ``model`` state under its ``model_config``; the tokenizer is the run's
  ``RUN/model/tokenizer.json``, else the ``tokenizer`` file the run was trained with, else the tokenizer of the
  checkpoint an SFT run started from, else (a run that trained its BPE) ``run_tokenizer``'s for the run's
  corpus and model family (K3's XTML tokens for a K3-family model): from the tokenizer cache, or trained
  again (deterministic).
* A **run directory** (``checkpoints/`` and/or ``model/``): with ``choice="latest"`` the final model
  ``model/`` when no checkpoint is newer than it (``summary.json``'s ``steps``; else file times), else the
  newest checkpoint that verifies (each newer one that does not is reported and skipped); with
  ``choice="best"`` the checkpoint (or final model) with the lowest ``val_loss`` logged at its step in
  ``metrics.jsonl``.

An explicit tokenizer file overrides the one found. Every failure is a ``CheckpointError`` naming the path.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import ValidationError

from k2lab.config import ModelConfig, format_validation_error
from k2lab.data.corpus import load_corpus
from k2lab.data.tokenizer import Tokenizer, load_tokenizer
from k2lab.errors import CheckpointError
from k2lab.fsutil import read_json_object, recover_directory
from k2lab.model_dir import MANIFEST as MODEL_MANIFEST
from k2lab.model_dir import check_state_dict, load_model, tied_head_key
from k2lab.models import CausalLM, build_model
from k2lab.models.init import cast_model, materialize
from k2lab.train.config import TrainConfig
from k2lab.train.pretraining import run_tokenizer
from k2lab.train.run_checkpoints import (
    CHECKPOINTS,
    list_checkpoints,
    load_training_checkpoint,
    verify_checkpoint,
)
from k2lab.train.run_checkpoints import MANIFEST as CHECKPOINT_MANIFEST
from k2lab.vision.vlm import VisionLanguageModel, VLMConfig, build_vlm

__all__ = ["Choice", "ExportSource", "find_source", "guarded_directory"]

Choice = Literal["latest", "best"]
Log = Callable[[str], object]
TOKENIZER = "tokenizer.json"
FINAL_MODEL = "model"


@dataclass(frozen=True)
class ExportSource:
    """One set of weights: a model directory (``step`` None unless it is a run's final model) or a training
    checkpoint directory (its tokenizer is found when it is loaded), the tokenizer file (None: not known
    yet or none) and a one-line description."""

    path: Path
    checkpoint: bool
    tokenizer: Path | None
    description: str
    step: int | None = None

    def load(self, log: Log = print) -> tuple[CausalLM | VisionLanguageModel, Tokenizer | None]:
        """The model in fp32 and its tokenizer (from ``self.tokenizer`` when set, else the one found with the
        weights; None when there is none). ``CheckpointError`` for unreadable or mismatched weights."""
        if not self.checkpoint:
            return load_model(self.path), _tokenizer_or_none(self.tokenizer)
        model, train_config = _load_checkpoint(self.path)
        if self.tokenizer is not None:
            return model, load_tokenizer(self.tokenizer)
        return model, checkpoint_tokenizer(self.path, train_config, log)


def find_source(
    path: Path, choice: Choice = "latest", tokenizer: Path | None = None, log: Log = print
) -> ExportSource:
    """The ``ExportSource`` of a run directory, a checkpoint directory or a model directory (see above)."""
    path = Path(path)
    recover_directory(path)  # put back the copy a write killed mid-swap left hidden beside it
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist or is not a directory")
    if (path / CHECKPOINT_MANIFEST).is_file():
        source = _checkpoint_source(path, verify_checkpoint(path), "")
    elif (path / MODEL_MANIFEST).is_file() or (path / "config.json").is_file():
        source = ExportSource(path, False, _file_or_none(path / TOKENIZER), f"model directory {path}")
    elif (path / "checkpoints").is_dir() or (path / FINAL_MODEL / MODEL_MANIFEST).is_file():
        source = _best(path, log) if choice == "best" else _latest(path, log)
    else:
        raise CheckpointError(
            f"{path} is not a run directory (checkpoints/ or model/), a training checkpoint ({CHECKPOINT_MANIFEST})"
            f" or a model directory ({MODEL_MANIFEST} or config.json)"
        )
    if tokenizer is not None:
        if not Path(tokenizer).is_file():
            raise CheckpointError(f"tokenizer file {tokenizer} does not exist")
        source = replace(source, tokenizer=Path(tokenizer))
    return source


def guarded_directory(path: Path) -> tuple[Path, str]:
    """The directory an export of ``path`` must keep out of, and what it is: the run a training checkpoint
    ``RUN/checkpoints/step_*`` belongs to (its ``model/``, other checkpoints, logs), else ``path`` itself."""
    path = Path(path)
    if (path / CHECKPOINT_MANIFEST).is_file() and path.parent.name == CHECKPOINTS:
        return path.parent.parent, "run"
    return path, "source"


def _file_or_none(path: Path) -> Path | None:
    return path if path.is_file() else None


def _final_model(run: Path) -> ExportSource | None:
    """The run's ``model/`` with the step ``summary.json`` gives it (None without a model directory)."""
    model = run / FINAL_MODEL
    if not (model / MODEL_MANIFEST).is_file():
        return None
    summary = run / "summary.json"
    steps = read_json_object(summary).get("steps") if summary.is_file() else None
    step = steps if isinstance(steps, int) else None
    shown = f" (step {step})" if step is not None else ""
    return ExportSource(
        model, False, _file_or_none(model / TOKENIZER), f"run {run}: final model{shown}", step
    )


def _latest(run: Path, log: Log) -> ExportSource:
    final = _final_model(run)
    checkpoints = list_checkpoints(run)
    if final is not None and (not checkpoints or _not_older(final, checkpoints[0][1])):
        return final
    for step, directory in checkpoints:
        if _verifies(directory, log):
            return _checkpoint_source(directory, step, f"run {run}: latest checkpoint ")
    if final is not None:
        return final
    raise CheckpointError(f"run {run} has no checkpoint that verifies and no final model/")


def _verifies(directory: Path, log: Log) -> bool:
    """Whether a checkpoint directory verifies; one that does not is reported in one line."""
    try:
        verify_checkpoint(directory)
    except CheckpointError as error:
        log(f"checkpoint {directory.name} skipped: {error}")
        return False
    return True


def _not_older(final: ExportSource, newest: Path) -> bool:
    """Whether the final model is at least as new as the newest checkpoint directory ``newest``."""
    step = int(newest.name.removeprefix("step_"))
    if final.step is not None:
        return final.step >= step
    return (final.path / MODEL_MANIFEST).stat().st_mtime >= newest.stat().st_mtime


def _best(run: Path, log: Log) -> ExportSource:
    """The checkpoint (or final model) with the lowest validation loss logged at its step."""
    losses = _validation_losses(run)
    final = _final_model(run)
    candidates: list[tuple[float, int, ExportSource | Path]] = []
    if final is not None and final.step in losses:
        candidates.append((losses[final.step], final.step, final))
    candidates += [(losses[step], step, path) for step, path in list_checkpoints(run) if step in losses]
    if not candidates:
        raise CheckpointError(
            f"run {run}: no checkpoint has a val_loss in metrics.jsonl at its step; use --checkpoint latest"
        )
    # lowest loss first; on a tie the final model, then the newest checkpoint
    candidates.sort(key=lambda item: (item[0], isinstance(item[2], Path), -item[1]))
    for loss, step, candidate in candidates:
        if isinstance(candidate, ExportSource):
            return replace(candidate, description=f"{candidate.description}, best val_loss {loss:.4f}")
        if _verifies(candidate, log):
            return _checkpoint_source(candidate, step, f"run {run}: best checkpoint (val_loss {loss:.4f}) ")
    raise CheckpointError(f"run {run}: none of the checkpoints with a validation loss verifies")


def _validation_losses(run: Path) -> dict[int, float]:
    """Step -> the last finite ``val_loss`` logged at that step in ``metrics.jsonl``."""
    metrics = run / "metrics.jsonl"
    losses: dict[int, float] = {}
    if not metrics.is_file():
        return losses
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        value = record.get("val_loss") if isinstance(record, dict) else None
        if isinstance(value, int | float) and math.isfinite(value) and isinstance(record.get("step"), int):
            losses[record["step"]] = float(value)
    return losses


def _checkpoint_source(directory: Path, step: int, prefix: str) -> ExportSource:
    description = f"{prefix}{directory.name} (step {step})" if prefix else f"training checkpoint {directory}"
    return ExportSource(directory, True, None, description, step)


def _tokenizer_or_none(path: Path | None) -> Tokenizer | None:
    return None if path is None else load_tokenizer(path)


def checkpoint_tokenizer(directory: Path, train_config: dict, log: Log = print) -> Tokenizer | None:
    """The tokenizer of a checkpoint's run: ``RUN/model/tokenizer.json``, then the run's ``tokenizer``
    setting, then an SFT run's starting checkpoint's ``tokenizer.json``, then (a pre-training run that
    trained its BPE) the tokenizer ``run_tokenizer`` gives for the run's corpus, vocabulary and model family: the cached
    one, or trained again (deterministic); None when none of these applies."""
    found = _file_or_none(directory.parent.parent / FINAL_MODEL / TOKENIZER)
    named = train_config.get("tokenizer")
    if found is None and isinstance(named, str):
        found = _file_or_none(Path(named).expanduser())
    base = (train_config.get("sft") or {}).get("init_checkpoint")
    if found is None and isinstance(base, str):
        found = _file_or_none(Path(base).expanduser() / TOKENIZER)
    if found is not None or base is not None or named is not None or not train_config:
        return _tokenizer_or_none(found)
    try:
        config = TrainConfig.model_validate(train_config)
    except ValidationError:
        return None  # a run of an older config: the user names the tokenizer
    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes)
    tokenizer = run_tokenizer(config, corpus, log)  # what the run trained: its family's special tokens
    how = "from the cache" if tokenizer.from_cache else "trained again"
    log(f"the run's BPE tokenizer for corpus {corpus.name} ({how})")
    return tokenizer


def _load_checkpoint(directory: Path) -> tuple[CausalLM | VisionLanguageModel, dict]:
    """The ``model`` state of a training checkpoint under its ``model_config`` (fp32), and the run's
    ``train_config`` (``{}`` when the checkpoint has none)."""
    _, state = load_training_checkpoint(directory)
    raw, weights = state.get("model_config"), state.get("model")
    if not isinstance(raw, dict) or not isinstance(weights, dict):
        raise CheckpointError(f"{directory}: the checkpoint holds no model_config and model state")
    vlm = "vision" in raw and "text" in raw
    try:
        config = (VLMConfig if vlm else ModelConfig).model_validate(raw)
    except ValidationError as error:
        raise CheckpointError(
            f"{directory}: invalid model_config: {format_validation_error(error)}"
        ) from error
    model = build_vlm(config, device="meta") if vlm else build_model(config, device="meta")
    tied = tied_head_key(model)
    weights = {key: value for key, value in weights.items() if key != tied}
    check_state_dict(model, weights, str(directory / "state.pt"))
    materialize(model)
    model.load_state_dict(weights, strict=tied is None)
    train_config = state.get("train_config")
    return cast_model(model, torch.float32).eval(), train_config if isinstance(train_config, dict) else {}
