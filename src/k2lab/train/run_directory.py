"""The run directory a training command writes (``train``, ``sft``, ``rl``, ``mopd distill``).

A run writes ``checkpoints/``, ``model/`` (replaced whole), ``metrics.jsonl``, ``summary.json``, its plots and
samples into ``--out``. Before any of that, ``claim_run_directory`` makes sure doing so loses nothing: the
directory must be new, empty or an earlier run (it holds ``RUN_MARKER``, or, for runs from before the marker,
``checkpoints/`` or ``summary.json``), and it must not be or hold a directory the run reads (``-c`` model,
experts, critic): an RL run into its own source run replaced the model it was loading. A claimed directory gets
``RUN_MARKER`` (which command made it, when) at once (a run from before the marker is left unmarked: its
command is unknown, and its checkpoint's kind is checked on resuming, ``check_checkpoint_kind``), so a run
that fails before its first checkpoint can be run again into the same place; an earlier run of another
command (a ``train`` run as the ``--out`` of ``mopd distill``) is refused before anything in it is touched:
the other command cut its metrics to its own checkpoint's counter, or failed on it with a traceback. An
existing directory the run cannot write (a read-only file system, no write permission) is refused before any
work, and so is a path the file system rejects (a name over 255 bytes): one line each. A claimed directory stays locked (``flock``) while its process lives: a second run into it is
refused. Claiming an earlier run removes the hidden temporaries a kill left behind in it mid-way through an
atomic write (``k2lab.fsutil.staged_file``: ``.metrics.jsonl.k3j2x_ab``), and nothing else.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text, holds, make_directory, other_entries

__all__ = ["RUN_MARKER", "claim_run_directory", "is_run_directory", "refuse_foreign"]

RUN_MARKER = "run.json"
LEGACY_MARKERS = ("checkpoints", "summary.json")  # what every run held before RUN_MARKER existed
_HELD: dict[Path, int] = {}  # run directories this process claimed: their locked descriptors
# how each command names itself in RUN_MARKER, as the user types it (``run_mopd``'s mode "sft": its baseline)
_COMMAND_NAMES = {"mopd mopd": "mopd distill", "mopd sft": "mopd report (its SFT baseline)"}
# a staged_file temporary: ".{target name}.{tempfile's 8 random characters}{suffix: '' or the target's .png}"
_TEMPORARY = re.compile(r"^\.(?P<target>.+)\.[a-z0-9_]{8}(?P<suffix>(\.png)?)$")


def claim_run_directory(
    out: str | os.PathLike[str],
    command: str,
    reads: Iterable[str | os.PathLike[str] | None] = (),
    write: bool = True,
    checked: Callable[[], None] = lambda: None,
) -> Path:
    """Check ``out`` (module docstring), make it and write ``RUN_MARKER`` there (``write``: False on the ranks of
    a distributed run other than the first). ``reads``: the directories the run loads from (None entries are
    skipped). Raises ``K2LabError`` naming the problem, before anything is written. ``checked`` runs once the
    checks have passed, before the marker is written: a distributed run's barrier, so that no rank is still
    looking at the directory while the first writes the marker (through a temporary sibling, which a rank
    checking then took for a file of someone else's: the run failed)."""
    if not str(out).strip():
        raise K2LabError("the run directory (--out) is empty; name a directory for the run")
    run_dir = Path(out)
    with _reported(run_dir):
        for source in (Path(s) for s in reads if s is not None and str(s)):
            _refuse_holding(run_dir, source)
        if run_dir.exists():
            refuse_foreign(
                run_dir, "a run writes model/, metrics.jsonl and more there, so choose a new or empty --out"
            )
            _refuse_other_command(run_dir, command)
            _refuse_unwritable(run_dir)
        earlier = run_dir.is_dir() and is_run_directory(run_dir)  # RUN_MARKER, or a run from before it
    make_directory(run_dir, "the run directory")
    checked()
    if write:
        with _reported(run_dir):
            _lock(run_dir)  # before touching anything: another live run may be writing there
            _remove_temporaries(run_dir)
            if not earlier:  # an unmarked earlier run's command is unknown: marking it could misname it
                marker = {"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                atomic_write_text(run_dir / RUN_MARKER, json.dumps(marker) + "\n")
    return run_dir


def _lock(run_dir: Path) -> None:
    """Hold an exclusive ``flock`` on ``run_dir`` until this process ends; another process holding it (a run
    still going there) is a one-line refusal. Two runs into one directory interleaved their metrics lines and
    checkpoints. A directory this process already holds passes (a resumed run in the same process); on a file
    system without locks the run goes on unlocked."""
    held = _HELD.get(run_dir.resolve())
    if held is not None and os.fstat(held).st_ino == os.stat(run_dir).st_ino:
        return
    descriptor = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise K2LabError(
            f"{run_dir} is in use by another k2lab run (a live process holds it); wait for that run to end or "
            "choose another --out"
        ) from None
    except OSError:
        os.close(descriptor)
        return
    if held is not None:  # the directory was replaced since (a study wipes its runs): the old one is gone
        os.close(held)
    _HELD[run_dir.resolve()] = descriptor


def is_run_directory(directory: Path) -> bool:
    """Whether ``directory`` holds an earlier run: ``RUN_MARKER``, or ``LEGACY_MARKERS`` for runs from before it."""
    return any((directory / name).exists() for name in (RUN_MARKER, *LEGACY_MARKERS))


@contextmanager
def _reported(run_dir: Path) -> Iterator[None]:
    """An ``OSError`` while looking at or marking ``run_dir`` (a name too long, say) as a one-line ``K2LabError``."""
    try:
        yield
    except OSError as error:
        raise K2LabError(f"cannot use the run directory {run_dir}: {error.strerror or error}") from error


def _refuse_holding(run_dir: Path, source: Path) -> None:
    if holds(run_dir, source):
        raise K2LabError(
            f"the run directory {run_dir} holds {source}, which this run reads: the run writes model/, "
            "checkpoints/ and its logs there; choose another --out"
        )


def refuse_foreign(run_dir: Path, consequence: str, markers: tuple[str, ...] = ()) -> None:
    """Refuse (one-line ``K2LabError`` ending in ``consequence``) a directory that holds other files and is not
    a run: neither ``is_run_directory`` nor holding one of ``markers`` (a study's own). Not a directory:
    left to the caller."""
    if not run_dir.is_dir():
        return
    shown = other_entries(run_dir)
    if (
        shown is not None
        and not is_run_directory(run_dir)
        and not any((run_dir / m).exists() for m in markers)
    ):
        raise K2LabError(
            f"{run_dir} holds other files ({shown}) and is not a k2lab run directory; {consequence}"
        )


def _refuse_other_command(run_dir: Path, command: str) -> None:
    """Refuse (one line) an earlier run whose ``RUN_MARKER`` names another command than ``command``: each
    command resumes only its own checkpoints and metrics. A marker that cannot be read or names no command
    passes (nothing to compare)."""
    try:
        earlier = json.loads((run_dir / RUN_MARKER).read_text()).get("command")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError, AttributeError):
        return
    if isinstance(earlier, str) and earlier != command:
        raise K2LabError(
            f"{run_dir} is a `k2lab {_COMMAND_NAMES.get(earlier, earlier)}` run; "
            f"`k2lab {_COMMAND_NAMES.get(command, command)}` writes its own: pick a new --out"
        )


def _refuse_unwritable(run_dir: Path) -> None:
    """Refuse an existing directory the run cannot write; a resumed run failed only after building the corpus
    and the model, with an OSError traceback from rewriting its metrics."""
    if not run_dir.is_dir() or os.access(run_dir, os.W_OK | os.X_OK):
        return
    read_only = bool(os.statvfs(run_dir).f_flag & os.ST_RDONLY)
    reason = "it is on a read-only file system" if read_only else "no permission to write there"
    raise K2LabError(f"cannot write to the run directory {run_dir}: {reason}; choose another --out")


def _remove_temporaries(run_dir: Path) -> None:
    """Delete the temporaries of atomic writes killed mid-way (``_TEMPORARY``): only regular files whose name
    is that of a sibling file the run wrote (``.metrics.jsonl.k3j2x_ab`` next to ``metrics.jsonl``, with
    ``.png`` after it for a plot), so no file of anyone else's is touched."""
    for entry in run_dir.iterdir():
        match = _TEMPORARY.match(entry.name)
        if match is None or not entry.is_file() or entry.is_symlink():
            continue
        target = run_dir / match["target"]
        if target.is_file() and match["suffix"] in ("", target.suffix):
            entry.unlink(missing_ok=True)
