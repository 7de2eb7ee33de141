"""What a run directory holds when training starts or resumes, and which settings a resume may change.

- **Results.** A run that finished wrote ``model/`` and then ``summary.json`` (atomically). A directory with
  those results and no checkpoint cannot be resumed, and training it again would replace its model: it is
  refused (``check_no_orphan_results``). A directory whose last checkpoint is the final step but whose results
  are missing (killed while writing them) is finished by ``--resume`` instead of refused (``results_written``).
- **Settings.** A resumed run keeps the recipe it was started with: the learning rate, optimizer, batch, data,
  schedule and seed define its history (a restored optimizer would silently keep the old learning rate, while
  the checkpoint recorded the new one). Only ``RESUMABLE_SETTINGS`` may differ: the run's length, its
  checkpoint and evaluation cadence, its output and the hardware choices (precision, compilation, device),
  which do not change what is trained. Path settings (``PATH_SETTINGS``) are recorded and compared resolved,
  so ``c3``, ``./c3/`` and its absolute path are the same directory, and ``c3`` typed in another directory
  is not.
- **Data.** Every checkpoint records the fingerprints of the corpus and the tokenizer
  (``TrainingData.fingerprints``): a corpus edited since (even with every file's length kept) trains another
  BPE, whose ids mean other text, so a resume whose corpus or tokenizer differs is refused
  (``check_resumed_data``). Checkpoints written before they were recorded are resumed unchecked.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import is_model_directory
from k2lab.train.persistence import check_resumed_config

SUMMARY_FILE = "summary.json"
DATA_REMEDIES = {
    "corpus": "its files' names, contents or train/validation split differ, and a BPE trained on them gives "
    "other token ids: resume with the files it was started with",
    "tokenizer": "its token ids mean other text: resume with the tokenizer it was started with (the same "
    "`tokenizer` file, or the same corpus and vocab_size)",
}
PATH_SETTINGS = ("data", "tokenizer", "sft.init_checkpoint", "sft.data")
RESUMABLE_SETTINGS = frozenset(
    {
        "steps",
        "save_every",
        "keep_last",
        "eval_every",
        "eval_batches",
        "log_every",
        "sample_prompt",
        "sample_tokens",
        "out",
        "precision",
        "compile",
        "device",
        "optimizer.ns_precision",
        "sft.epochs",  # it only sets steps (load_sft_config)
    }
)


def results_written(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a finished run's results: a model in ``model/`` and a readable summary."""
    try:
        summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and is_model_directory(run_dir / "model")


def check_no_orphan_results(run_dir: Path) -> None:
    """``K2LabError`` when ``run_dir`` holds a finished run's results but no checkpoint to continue from
    (called where there is none): training there would start over and replace its model."""
    if results_written(run_dir):
        raise K2LabError(
            f"{run_dir} holds a finished run ({run_dir / 'model'}, {SUMMARY_FILE}) and no checkpoint to continue "
            "from; training there would start over and replace its model: choose a new --out"
        )


def flat_settings(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optimizer": {"lr": 1}}`` -> ``{"optimizer.lr": 1}`` (nested tables as dotted keys)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flat_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recorded_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``settings`` (a ``TrainConfig`` dump) as checkpoints record them: each of ``PATH_SETTINGS``
    that is set made absolute and resolved against the working directory."""
    settings = copy.deepcopy(settings)
    for dotted in PATH_SETTINGS:
        *tables, key = dotted.split(".")
        table = settings
        for name in tables:
            table = table.get(name) if isinstance(table.get(name), dict) else {}
        if isinstance(table.get(key), str):
            table[key] = str(Path(table[key]).expanduser().resolve())
    return settings


def check_resumed_settings(saved: dict[str, Any] | None, current: dict[str, Any], run_dir: Path) -> None:
    """``CheckpointError`` when a run is resumed with settings outside ``RESUMABLE_SETTINGS`` changed
    (``saved`` None: a checkpoint from before configs were saved, accepted). Paths compare resolved
    (``recorded_settings``; a relative one an older checkpoint recorded resolves against this directory)."""
    if saved is not None:
        then, now = flat_settings(recorded_settings(saved)), flat_settings(recorded_settings(current))
        check_resumed_config(then, now, run_dir, RESUMABLE_SETTINGS)


def check_resumed_data(saved: dict[str, str] | None, current: dict[str, str], run_dir: Path) -> None:
    """``CheckpointError`` naming the first of the corpus and the tokenizer whose fingerprint differs from the
    one the checkpoint recorded (``saved`` None: a checkpoint from before they were recorded, accepted; a
    fingerprint only one side has is not compared)."""
    for key, remedy in DATA_REMEDIES.items():
        then, now = (saved or {}).get(key), current.get(key)
        if then is not None and now is not None and then != now:
            raise CheckpointError(
                f"{run_dir} was trained on another {key} (fingerprint {then[:12]} then, {now[:12]} now): "
                f"{remedy}, or choose a new output directory"
            )
