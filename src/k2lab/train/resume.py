"""What a run directory holds when training starts or resumes, and which settings a resume may change.

- **Results.** A run that finished wrote ``model/`` and then ``summary.json`` (atomically). A directory with
  those results and no checkpoint cannot be resumed, and training it again would replace its model: it is
  refused (``check_no_orphan_results``). A directory whose last checkpoint is the final step but whose results
  are missing (killed while writing them) is finished by ``--resume`` instead of refused (``results_written``).
- **Settings.** A resumed run keeps the recipe it was started with: the learning rate, optimizer, batch, data,
  schedule and seed define its history (a restored optimizer would silently keep the old learning rate, while
  the checkpoint recorded the new one). Only ``RESUMABLE_SETTINGS`` may differ: the run's length, its
  checkpoint and evaluation cadence, its output and the hardware choices (precision, compilation, device),
  which do not change what is trained.
- **Data.** Every checkpoint records the fingerprints of the corpus and the tokenizer (``TrainingData.fingerprints``):
  a corpus edited since (even with every file's length kept) trains another BPE, whose ids mean other text,
  so a resume whose corpus or tokenizer differs is refused (``check_resumed_data``). Checkpoints written
  before they were recorded are resumed unchecked.
"""

from __future__ import annotations

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


def check_resumed_settings(saved: dict[str, Any] | None, current: dict[str, Any], run_dir: Path) -> None:
    """``CheckpointError`` when a run is resumed with settings outside ``RESUMABLE_SETTINGS`` changed
    (``saved`` None: a checkpoint from before configs were saved, accepted)."""
    if saved is not None:
        check_resumed_config(flat_settings(saved), flat_settings(current), run_dir, RESUMABLE_SETTINGS)


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
