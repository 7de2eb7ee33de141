"""Training metrics: one JSON line per logged step in ``RUN_DIR/metrics.jsonl``, mirrored to TensorBoard.

``metrics.jsonl`` lines look like::

    {"step": 12, "loss": 4.21, "lr": 0.002, "max_logit/layer3": 41.7, "expert_load/layer3": [812.0, 790.0, ...]}

Values are numbers or lists of numbers (per-expert loads); non-finite numbers are written as Python's json
does (``NaN``, ``Infinity``), which ``read_metrics`` reads back. Every line is flushed as it is written, so
a killed run loses at most a partial last line, which readers skip. TensorBoard gets scalars as
``add_scalar`` and lists as ``add_histogram`` under ``RUN_DIR/tensorboard``.

Resuming: ``MetricsLogger(run_dir, resume_step=N)`` drops every line with step > N (rewriting the file
atomically) and tells TensorBoard to hide events after N, so a run killed and resumed from its step-N
checkpoint ends with the same ``metrics.jsonl`` as an uninterrupted one. Pass ``resume_step=0`` when a run
starts from scratch in a directory that may hold metrics of an earlier attempt.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"

MetricValue = float | int | Sequence[float]


class MetricsLogger:
    """Appends metrics to ``RUN_DIR/metrics.jsonl`` and (optionally) TensorBoard; one instance per run (rank 0).

    Usage::

        with MetricsLogger(run_dir, resume_step=start_step) as metrics:
            metrics.log(step, {"loss": 3.2, "lr": 1e-3, "expert_load/layer1": [10.0, 12.0, 9.0]})
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], tensorboard: bool = True, resume_step: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_metrics(self.run_dir, resume_step)
        else:
            _end_partial_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # lazy: only when logging to TensorBoard
            except ImportError as error:
                self._file.close()
                raise K2LabError(
                    f"TensorBoard logging needs the tensorboard package ({error}); install it or pass tensorboard=False"
                ) from error
            self._writer = SummaryWriter(
                str(self.run_dir / TENSORBOARD_DIR),
                purge_step=None if resume_step is None else resume_step + 1,
            )

    def log(self, step: int, values: Mapping[str, Any]) -> dict[str, Any]:
        """Append ``{"step": step, **values}`` as one flushed line (and to TensorBoard); returns the record.

        Values may be Python/NumPy numbers, 0-d or 1-d tensors/arrays, or lists of numbers. Raises
        ``TypeError`` for anything else and ``ValueError`` for a key named ``step``.
        """
        if self._file.closed:
            raise RuntimeError("MetricsLogger is closed")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in values.items():
            if key == "step":
                raise ValueError("'step' is set by MetricsLogger.log, not a metric name")
            record[key] = _plain(key, value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key == "step":
                    continue
                if isinstance(value, list):
                    finite = [v for v in value if math.isfinite(v)]
                    if finite:
                        self._writer.add_histogram(key, torch.tensor(finite, dtype=torch.float64), step)
                else:
                    self._writer.add_scalar(key, value, step)
        return record

    def flush(self) -> None:
        """Flush the JSON file and the TensorBoard event file."""
        self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close both outputs (idempotent)."""
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


def _plain(key: str, value: Any) -> float | int | list[float]:
    """A JSON-ready number or list of floats."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        value = value.item() if value.ndim == 0 else value.flatten().tolist()
    elif hasattr(value, "tolist") and hasattr(value, "dtype"):  # numpy scalar or array
        value = value.tolist()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    if isinstance(value, list | tuple):
        try:
            return [float(item) for item in value]
        except (TypeError, ValueError):
            pass
    raise TypeError(f"metric {key!r}: expected a number or a list of numbers, got {type(value).__name__}")


def _parse_line(line: bytes) -> dict[str, Any] | None:
    """The record of one line, or ``None`` for a blank, partial, undecodable or otherwise unreadable one."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def scan_metrics(run_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """Every record of ``RUN_DIR/metrics.jsonl`` in file order and the number of non-blank lines skipped as
    unreadable (not UTF-8, not JSON, no integer ``step``); ``([], 0)`` if there is no such file."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return [], 0
    records, skipped = [], 0
    with open(path, "rb") as handle:
        for line in handle:
            record = _parse_line(line)
            if record is not None:
                records.append(record)
            elif line.strip():
                skipped += 1
    return records, skipped


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of ``RUN_DIR/metrics.jsonl`` in file order (``[]`` if there is none; bad lines skipped)."""
    return scan_metrics(run_dir)[0]


def truncate_metrics(run_dir: str | os.PathLike[str], step: int) -> int:
    """Atomically drop lines with step > ``step`` (and unreadable lines) from metrics.jsonl; returns lines kept.

    Kept lines are copied byte for byte. The new file replaces the old one by rename, so a kill during the
    rewrite leaves the old file intact.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    with open(path, "rb") as handle:
        kept = [
            line.decode("utf-8").rstrip("\n") + "\n"
            for line in handle
            if (record := _parse_line(line)) is not None and record["step"] <= step
        ]
    atomic_write_text(path, "".join(kept))
    return len(kept)


def _end_partial_line(path: Path) -> None:
    """Terminate a partial last line (from a killed writer) so the next record starts on its own line."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) != b"\n":
            handle.write(b"\n")
