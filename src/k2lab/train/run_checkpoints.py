"""A run's checkpoints: everything a killed run needs to continue exactly where it was.

(A finished *model* directory, weights + config only, is ``k2lab.model_dir``.)

Layout of ``RUN_DIR/checkpoints``::

    step_00000100/
        state.pt         torch.save of the nested state dict (model, optimizer, schedule, data position, RNG)
        manifest.json    {"format": "k2lab-train", "version": 1, "step": 100,
                          "files": {"state.pt": {"bytes": ..., "sha256": "..."}}, ...}
    step_00000200/
    .step_00000300.k3j2x_/     a save in progress (or one killed mid-write): never read, removed later

A save writes both files into a hidden staging directory next to the target, fsyncs them and the staging
directory, renames it to ``step_XXXXXXXX`` and fsyncs ``checkpoints/``. A ``step_*`` directory therefore
only ever appears complete: a SIGKILL or power loss at any moment leaves either no new checkpoint or a
complete one. ``load_latest_checkpoint`` still verifies sizes and SHA-256 checksums (disks, copies and
people truncate files) and falls back to the newest checkpoint that verifies, reporting each one it skips
in one line.

The state must consist of tensors, dicts, lists, tuples, sets, str, bytes, int, float, complex, bool, None,
``torch.dtype``, ``torch.device`` and ``torch.Size`` (``save_training_checkpoint`` checks this up front and
names the offending key). That is exactly what ``torch.load(weights_only=True)`` accepts, so loading never
unpickles arbitrary objects; model/optimizer ``state_dict()``s, ``k2lab.train.persistence.capture_rng_state()`` and pydantic
``model_dump(mode="json")`` configs all qualify. Store objects as their state dicts, paths as ``str``.

One process writes a run directory (rank 0, or each rank into its own run directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from k2lab.errors import CheckpointError
from k2lab.fsutil import read_json_object, staged_directory, write_synced
from k2lab.train import state_file
from k2lab.train.state_file import StateBuffer, file_sha256, tensor_bytes, write_state

FORMAT = "k2lab-train"
VERSION = 1
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")

_SCALARS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


class CheckpointWarning(UserWarning):
    """A checkpoint that was skipped on load (the message says which and why, in one line)."""


def checkpoint_directory(run_dir: str | os.PathLike[str], step: int) -> Path:
    """``RUN_DIR/checkpoints/step_{step:08d}``."""
    return Path(run_dir) / CHECKPOINTS / f"step_{step:08d}"


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``step_*`` directory, newest first (unverified; staging dirs excluded)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0], reverse=True)


# ---- saving ---------------------------------------------------------------------------------------------
def save_training_checkpoint(
    run_dir: str | os.PathLike[str], step: int, state: dict[str, Any], keep_last: int | None = 3
) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically and prune old ones; returns its directory.

    An existing checkpoint of the same step is replaced. Afterwards only the ``keep_last`` newest complete
    checkpoints up to ``step`` are kept (``None`` keeps all); older ones, incomplete ones (missing manifest or
    wrong file size) and leftover staging directories of killed saves are deleted. Checkpoints newer than ``step`` are left
    alone. Raises ``TypeError`` (naming the key) for values ``torch.load(weights_only=True)`` cannot read, and
    a one-line ``CheckpointError`` (step, directory, the OS reason) where the save fails, e.g. on a full disk.
    """
    _check_request(step, state, keep_last)
    return _commit(Path(run_dir), step, lambda path: write_state(path, state), keep_last)


class CheckpointWriter:
    """``save_training_checkpoint`` with the disk work in a background thread, overlapping training.

    ``save`` checks the state and serialises it into the writer's own buffer (``StateBuffer``: a snapshot,
    so the caller may update its weights as soon as ``save`` returns), then hands writing, hashing, the
    rename and pruning to one background thread. The next ``save`` and ``wait()`` first wait for the
    previous one, and raise its error if it failed; so at most one save is in flight, its checkpoint
    appears complete or not at all (the same staging and rename), and ``wait()`` makes the last one durable.
    As a context manager it waits on leaving the block, also when the block raises.
    A state above ``state_file.REUSE_LIMIT`` bytes is saved synchronously (streamed, never held twice).

    Measured on the AVX2 Zen 3 VM (2 cores), the agentic-mini RL policy with its MuonClip state (195 MB):
    a synchronous save took 0.43 s, 0.11 s of it serialising (docs/agentic-sft-rl.md).
    """

    def __init__(self) -> None:
        self._buffer = StateBuffer()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="k2lab-checkpoint")
        self._pending: Future[Path] | None = None

    def save(
        self, run_dir: str | os.PathLike[str], step: int, state: dict[str, Any], keep_last: int | None = 3
    ) -> Path:
        """Start saving ``state`` as the checkpoint of ``step``; returns the directory it will have."""
        self.wait()
        if tensor_bytes(state) > state_file.REUSE_LIMIT:
            return save_training_checkpoint(run_dir, step, state, keep_last)
        _check_request(step, state, keep_last)
        with _reported(Path(run_dir), step):
            self._buffer.serialise(state)
        self._pending = self._pool.submit(_commit, Path(run_dir), step, self._buffer.write_to, keep_last)
        return checkpoint_directory(run_dir, step)

    def wait(self) -> None:
        """Block until the save in flight, if any, is durable; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        """``wait()``; when the block is already raising, its error stays the one raised (a failed write
        becomes a note on it)."""
        if error is None:
            self.wait()
            return
        try:
            self.wait()
        except Exception as failed:  # noqa: BLE001 - reported on the error already propagating
            error.add_note(f"the checkpoint being written when it was raised failed too: {failed!r}")


def _check_request(step: int, state: dict[str, Any], keep_last: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    _check_plain(state, "state")


def _commit(run_dir: Path, step: int, write: Callable[[Path], dict[str, Any]], keep_last: int | None) -> Path:
    """``write`` the state file into a staging directory with its manifest, rename it into place, prune."""
    target = checkpoint_directory(run_dir, step)
    with _reported(run_dir, step), staged_directory(target) as staging:
        files = {STATE: write(staging / STATE)}
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "files": files,
            "created": time.time(),
            "torch": torch.__version__,
        }
        text = (json.dumps(manifest, indent=2) + "\n").encode()
        write_synced(staging / MANIFEST, text)
        _fsync_directory(staging)
    _fsync_directory(target.parent)
    _prune(run_dir, step, keep_last)
    return target


@contextmanager
def _reported(run_dir: Path, step: int) -> Iterator[None]:
    """An ``OSError`` while saving the checkpoint of ``step`` (a full disk, say) as a one-line
    ``CheckpointError``: the staging directory is gone by then and the earlier checkpoints are untouched."""
    try:
        yield
    except OSError as error:
        raise CheckpointError(
            f"cannot save the checkpoint of step {step} in {run_dir / CHECKPOINTS}: {error.strerror or error}; "
            "nothing of it was kept, the earlier checkpoints are intact"
        ) from error


def _fsync_directory(path: Path) -> None:
    """Make renames and new entries in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _check_plain(value: Any, where: str) -> None:
    """Raise ``TypeError`` at the first value that ``torch.load(weights_only=True)`` would refuse."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(
                f"{where}: tensor subclass {kind.__name__} cannot go into a training checkpoint "
                "(gather it to a plain tensor first, e.g. DTensor.full_tensor())"
            )
        return
    if kind in _SCALARS or kind is torch.Size:
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in _SCALARS:
                raise TypeError(f"{where}: dict key {key!r} of type {type(key).__name__} is not allowed")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where}: {kind.__module__}.{kind.__qualname__} cannot go into a training checkpoint; store tensors, "
        "dicts, lists, tuples, str, numbers, bool or None (e.g. a state_dict() or model_dump(mode='json'))"
    )


def _prune(run_dir: Path, step: int, keep_last: int | None) -> None:
    """Keep the ``keep_last`` newest complete checkpoints up to ``step``; delete older and broken ones.

    Checkpoints newer than ``step`` are not touched. Each doomed directory is first renamed to a hidden
    name, so a kill during the deletion never leaves a half-deleted ``step_*`` directory behind.
    """
    root = run_dir / CHECKPOINTS
    for entry in root.iterdir():  # staging, swap and deletion directories of killed saves
        if entry.name.startswith(".step_") and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    if keep_last is None:
        return
    kept = 0
    for s, path in list_checkpoints(run_dir):
        if s > step:
            continue
        if kept < keep_last and _looks_complete(path):
            kept += 1
            continue
        doomed = root / f".{path.name}.prune"
        try:
            os.replace(path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def _looks_complete(path: Path) -> bool:
    """Manifest readable and every file present with the recorded size (no hashing: used for pruning)."""
    try:
        files = _read_manifest(path)["files"]
        return all((path / name).stat().st_size == entry["bytes"] for name, entry in files.items())
    except (CheckpointError, OSError):
        return False


# ---- loading --------------------------------------------------------------------------------------------
def _read_manifest(path: Path) -> dict[str, Any]:
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path.name}: no {MANIFEST} (incomplete checkpoint)")
    manifest = read_json_object(path / MANIFEST)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{path.name}: {MANIFEST} is format {manifest.get('format')!r} version {manifest.get('version')!r},"
            f" expected {FORMAT!r} version {VERSION}"
        )
    files = manifest.get("files")
    if (
        not isinstance(files, dict)
        or STATE not in files
        or not all(
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), str)
            for entry in files.values()
        )
    ):
        raise CheckpointError(f"{path.name}: {MANIFEST} has no valid file list")
    return manifest


def verify_checkpoint(path: str | os.PathLike[str]) -> int:
    """Check a checkpoint directory's manifest, file sizes and SHA-256s; returns its step.

    Raises ``CheckpointError`` with a one-line reason (naming the directory) on any problem.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    step = manifest.get("step")
    match = _STEP_DIR.match(path.name)
    if not isinstance(step, int) or (match is not None and int(match.group(1)) != step):
        raise CheckpointError(f"{path.name}: {MANIFEST} says step {step!r}")
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{path.name}: {name} is missing")
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path.name}: {name} has {size} bytes, manifest says {entry['bytes']} (truncated?)"
            )
        if file_sha256(file) != entry["sha256"]:
            raise CheckpointError(f"{path.name}: {name} fails its SHA-256 checksum (corrupt)")
    return step


def load_training_checkpoint(
    path: str | os.PathLike[str], map_location: str | torch.device | None = "cpu"
) -> tuple[int, dict[str, Any]]:
    """Verify and load one checkpoint directory: ``(step, state)``; ``CheckpointError`` if it is unusable."""
    path = Path(path)
    step = verify_checkpoint(path)
    try:
        # weights_only=True: tensors and plain containers only, never arbitrary pickled objects.
        state = torch.load(path / STATE, map_location=map_location, weights_only=True)
    except Exception as error:  # a file that verified but does not unpickle: report it like corruption
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path.name}: {STATE} cannot be loaded ({first_line})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path.name}: {STATE} holds a {type(state).__name__}, not a dict")
    return step, state


def load_latest_checkpoint(
    run_dir: str | os.PathLike[str],
    on_skip: Callable[[str], object] | None = None,
    map_location: str | torch.device | None = "cpu",
) -> tuple[int, dict[str, Any]] | None:
    """The newest checkpoint of ``run_dir`` that verifies, as ``(step, state)``; ``None`` if there is none.

    Each newer checkpoint that fails verification (missing/invalid manifest, truncated or corrupt file) is
    reported by calling ``on_skip`` with one line, e.g. ``"checkpoint step_00000200 skipped: step_00000200:
    state.pt fails its SHA-256 checksum (corrupt)"``; without ``on_skip`` the line is a
    ``CheckpointWarning``. Staging directories of killed saves are ignored. If checkpoints exist but none
    verifies, raises ``CheckpointError`` (resuming from scratch over them silently would lose the run).
    """
    report = on_skip if on_skip is not None else _warn
    checkpoints = list_checkpoints(run_dir)
    reasons = []
    for _, path in checkpoints:
        try:
            return load_training_checkpoint(path, map_location=map_location)
        except CheckpointError as error:
            reasons.append(str(error))
            report(f"checkpoint {path.name} skipped: {error}")
    if checkpoints:
        raise CheckpointError(
            f"none of the {len(checkpoints)} checkpoints in {Path(run_dir) / CHECKPOINTS} can be loaded "
            f"(newest: {reasons[0]}); delete the directory to start the run over"
        )
    return None


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)
