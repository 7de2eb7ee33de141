"""Run persistence: what a killed run needs to continue exactly where it was, beside its checkpoints.

* ``derive_seed``: task and sampling seeds derived from (run seed, iteration, …), so a resumed run draws the
  same tasks and samples as the uninterrupted one without replaying any generator.
* ``capture_rng_state`` / ``restore_rng_state``: the global RNGs (Python, NumPy, torch CPU and CUDA) as a
  checkpoint-safe value and back.
* ``resume_state``: the latest checkpoint's state of a loop that logs one JSON line per iteration (or step),
  refused when the run was started with other settings (``check_resumed_config``); the metrics lines about
  to be redone are dropped.

The checkpoint files themselves (atomic saves, manifests, verification) are ``k2lab.train.run_checkpoints``.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k2lab.errors import CheckpointError
from k2lab.train.run_checkpoints import load_latest_checkpoint

__all__ = [
    "RESUMABLE_CHANGES",
    "capture_rng_state",
    "check_checkpoint_kind",
    "check_resumed_config",
    "derive_seed",
    "restore_rng_state",
    "resume_state",
]


# ---- derived seeds ----------------------------------------------------------------------------------------
def derive_seed(*parts: object) -> int:
    """A deterministic 31-bit seed from any parts (independent of Python's hash randomisation)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# ---- random number generators ---------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """The state of Python's ``random``, NumPy's global generator, torch CPU and CUDA RNGs.

    The result is checkpoint-safe (plain containers and tensors). Explicit ``torch.Generator`` objects
    (e.g. a data loader's) are not included: save their ``get_state()`` yourself. In a distributed run
    every rank has its own RNG state.
    """
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy_state = np.random.get_state(legacy=False)
    state["numpy"] = {
        "bit_generator": numpy_state["bit_generator"],
        "key": [int(word) for word in numpy_state["state"]["key"]],
        "pos": int(numpy_state["state"]["pos"]),
        "has_gauss": int(numpy_state["has_gauss"]),
        "gauss": float(numpy_state["gauss"]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``capture_rng_state`` captured (parts absent from ``state`` or this machine are skipped)."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        saved = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": saved["bit_generator"],
                "state": {"key": np.asarray(saved["key"], dtype=np.uint32), "pos": saved["pos"]},
                "has_gauss": saved["has_gauss"],
                "gauss": saved["gauss"],
            }
        )
    if "cuda" in state and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state.cpu(), device)


RESUMABLE_CHANGES = frozenset(
    {"iterations", "steps", "checkpoint_every", "keep_checkpoints", "step_timeout_s"}
)


def resume_state(
    run_dir: Path, metrics_file: str, counter: str, config: dict[str, Any] | None = None
) -> dict | None:
    """The latest checkpoint's state for an RL-style loop logging one JSON line per ``counter`` value
    (``"iteration"``, ``"step"``) to ``run_dir / metrics_file``.

    With ``config`` (the run's ``model_dump(mode="json")`` settings, saved under ``state["config"]``) a
    checkpoint written with different settings is refused before anything is touched
    (``check_resumed_config``), and so is one of another kind of run (``check_checkpoint_kind``). Metrics
    lines at or after the checkpoint's counter are dropped (they are about to be redone); with no checkpoint
    the metrics file is removed and None returned. The caller
    restores its own objects from the state (``state[counter]`` is where it continues).
    """
    path = Path(run_dir) / metrics_file
    latest = load_latest_checkpoint(Path(run_dir))
    if latest is None:
        path.unlink(missing_ok=True)
        return None
    state = latest[1]
    check_checkpoint_kind(state, counter, run_dir)
    if config is not None:
        check_resumed_config(state.get("config"), config, run_dir)
    if path.is_file():
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        kept = [x for x in lines if json.loads(x)[counter] < int(state[counter])]
        path.write_text("".join(x + "\n" for x in kept))
    return state


def check_checkpoint_kind(state: dict[str, Any], counter: str, run_dir: Path | str) -> None:
    """Raise ``CheckpointError`` when ``state`` is not a checkpoint of a loop counting ``counter``: it has no
    such count (an RL run counts iterations, MOPD steps), or it is a ``k2lab train``/``sft`` checkpoint
    (``train_config``), whose ``step`` MOPD took for its own and cut the run's metrics at."""
    if counter in state and "train_config" not in state:
        return
    kind = (
        "a `k2lab train`/`sft` run's"
        if "train_config" in state
        else f"not counting {counter}s: another run's"
    )
    raise CheckpointError(
        f"the latest checkpoint in {run_dir} is {kind}, not this command's; choose a new output directory"
    )


def check_resumed_config(
    saved: dict[str, Any] | None,
    current: dict[str, Any],
    run_dir: Path | str,
    may_change: frozenset[str] = RESUMABLE_CHANGES,
) -> None:
    """Raise ``CheckpointError`` when a run is resumed with settings other than those it was started with.

    Only the length of the run and its checkpointing (``may_change``) may differ: continuing with another
    objective, learning rate or seed would splice two different runs into one history. Settings only one
    side has (a field added or removed by a newer k2lab) and ``saved`` None (checkpoints written before
    configs were saved) are accepted, so an upgrade does not strand a run.
    """
    if saved is None:
        return
    shared = (saved.keys() & current.keys()) - may_change
    changed = sorted(k for k in shared if saved[k] != current[k])
    if changed:
        details = "; ".join(f"{k}: {saved[k]!r} then, {current[k]!r} now" for k in changed)
        raise CheckpointError(
            f"{run_dir} was started with other settings ({details}); resume it with the settings it started "
            "with, or choose a new output directory"
        )
