"""Small filesystem helpers shared by every checkpoint writer and reader: atomic directory swaps, JSON."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from k2lab.errors import CheckpointError, K2LabError


@contextmanager
def staged_file(target: Path, suffix: str = "") -> Iterator[Path]:
    """A temporary sibling of ``target`` to write into: renamed onto ``target`` (an ordinary 0644 file)
    when the block succeeds, removed when it raises. Readers and crashes never see half a file. A
    ``target`` that is a device, FIFO or socket is refused (``K2LabError``): the rename would replace
    ``/dev/null`` itself with a plain file."""
    check_writable_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(descriptor)
    try:
        yield Path(temporary)
        os.chmod(temporary, 0o644)  # mkstemp makes it private
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def check_writable_path(target: Path, what: str = "a file") -> None:
    """``K2LabError`` when ``target`` exists as something other than a regular file or a symbolic link
    (which a rename replaces as a link): a directory, a device, a FIFO or a socket."""
    try:
        mode = target.lstat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # a new path (a parent in the way is the caller's)
        return
    if stat.S_ISDIR(mode):
        raise K2LabError(f"{target} is a directory: give the path of a file for {what}")
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = next(name for test, name in _SPECIAL if test(mode))
        raise K2LabError(f"{target} is a {kind}, not a regular file: give the path of a file for {what}")


_SPECIAL = (
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISFIFO, "FIFO"),
    (stat.S_ISSOCK, "socket"),
    (lambda mode: True, "special file"),
)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling, fsync, then a rename (``staged_file``)."""
    with staged_file(path) as temporary, open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_synced(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to a new file ``path`` and fsync it (no rename: for files inside a staged directory)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def staging_directory(target: Path) -> Path:
    """A fresh temporary sibling of ``target`` (same filesystem, so the final rename is atomic), unlocked:
    ``sweep_staging`` removes it once its writer is done (``staged_directory`` holds its own locked)."""
    staging, lock = _locked_staging(target)
    os.close(lock)
    return staging


def _locked_staging(target: Path) -> tuple[Path, int]:
    """``staging_directory``, locked (``_locked_directory``): also the descriptor that holds the lock."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging, lock = _locked_directory(f".{target.name}.", target.parent)
    staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    return staging, lock


def replace_directory(staging: Path, target: Path) -> None:
    """Swap ``staging`` in at ``target`` with renames (the old directory is removed afterwards). Between the
    two renames the old copy is ``.NAME.old.xxxxxxxx/NAME``, locked: a process killed there leaves it to
    ``recover_directory``."""
    if not target.exists():
        os.replace(staging, target)
        return
    old, lock = _locked_directory(f".{target.name}.old.", target.parent)
    try:
        os.replace(target, old / target.name)
        try:
            os.replace(staging, target)
        except BaseException:
            os.replace(old / target.name, target)  # put the old one back
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
        os.close(lock)


# tempfile.mkdtemp's names: the prefix, then 8 of these characters.
_RANDOM = "[a-z0-9_]{8}"


def _locked_directory(prefix: str, parent: Path) -> tuple[Path, int]:
    """``mkdtemp(prefix, parent)`` with an exclusive ``flock`` held on the new directory (the descriptor is
    returned): the mark of a live writer, which ``sweep_staging`` and ``recover_directory`` leave alone. A
    sweep that took the directory between its creation and the lock makes a new one; where the filesystem
    has no ``flock`` (some network ones) the directory stays unlocked, and sweeps never remove it."""
    while True:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a sweep holds it and is removing it
            os.close(descriptor)
            continue
        except OSError:  # no flock here
            return path, descriptor
        if _still_at(path, descriptor):
            return path, descriptor
        os.close(descriptor)


def _still_at(path: Path, descriptor: int) -> bool:
    """Whether ``path`` is still the directory open as ``descriptor`` (not swept or renamed meanwhile)."""
    try:
        now, held = os.stat(path, follow_symlinks=False), os.fstat(descriptor)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


@contextmanager
def _abandoned(path: Path) -> Iterator[bool]:
    """Whether ``path`` (a staging or swap directory) belongs to no live writer: its lock could be taken,
    and is held for the block."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held by a live writer (or no flock here: never sure, so kept)
        abandoned = False
    else:
        abandoned = _still_at(path, descriptor)
    try:
        yield abandoned
    finally:
        os.close(descriptor)


def _leftovers(target: Path, depth: int | None = None) -> list[Path]:
    """The directories beside ``target`` named as ``staged_directory`` names its staging and swap
    directories for it: ``.NAME.xxxxxxxx`` and ``.NAME.old.xxxxxxxx``, and those of a staging directory in
    turn (``..NAME.xxxxxxxx.yyyyyyyy``, one leading dot per level); ``depth`` 1: the first level only."""
    pattern = re.compile(rf"(\.+){re.escape(target.name)}((?:\.(?:old\.)?{_RANDOM})+)")
    found = []
    for entry in target.parent.iterdir() if target.parent.is_dir() else ():
        match = pattern.fullmatch(entry.name)
        levels = len(match.group(1)) if match else 0
        segments = len(re.findall(rf"\.(?:old\.)?{_RANDOM}", match.group(2))) if match else -1
        if levels == segments and depth in (None, levels) and entry.is_dir() and not entry.is_symlink():
            found.append(entry)
    return found


def sweep_staging(target: Path) -> None:
    """Remove what writes of ``target`` killed mid-way left beside it (``_leftovers``: full-size staging
    copies, old copies of a swap) and no live process holds (a concurrent write to the same target keeps
    its lock, so its staging directory stays). ``staged_directory`` calls it after each successful write."""
    for entry in _leftovers(target):
        with _abandoned(entry) as abandoned:
            if abandoned:
                shutil.rmtree(entry, ignore_errors=True)


def recover_directory(target: Path) -> Path | None:
    """Put back the old copy of ``target`` that a write killed between the two renames of
    ``replace_directory`` left as ``.NAME.old.xxxxxxxx/NAME`` (``target`` itself missing); returns the
    restored ``target``, None when there was nothing to restore."""
    if os.path.lexists(target):
        return None
    for entry in _leftovers(target, depth=1):
        with _abandoned(entry) as abandoned:
            if abandoned and entry.name.startswith(f".{target.name}.old.") and (entry / target.name).is_dir():
                os.replace(entry / target.name, target)
                return target
    return None


#: Files that mark a directory as a model (HF format: its ``model_type``; k2lab format: its ``format``): one
#: that a new write may replace. A mere ``config.json`` (a web app's, say) is not one.
MODEL_MARKERS = {"config.json": ("model_type", None), "k2lab.json": ("format", "k2lab-model")}


def is_model_directory(directory: Path) -> bool:
    """Whether ``directory`` holds a model: a ``MODEL_MARKERS`` file that is a JSON object with its key (of
    the given value, where one is given)."""
    for name, (key, value) in MODEL_MARKERS.items():
        try:
            data = json.loads((directory / name).read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(data, dict) and isinstance(data.get(key), str) and value in (None, data[key]):
            return True
    return False


def holds(directory: Path, path: Path) -> bool:
    """Whether ``directory`` is ``path`` or one of its ancestors (resolved): writing it whole would take
    ``path`` with it."""
    outer, inner = directory.resolve(), path.resolve()
    return outer == inner or outer in inner.parents


def other_entries(directory: Path) -> str | None:
    """The first entries of a non-empty ``directory`` for a refusal ("a, b, c, d, …"), None when it is
    empty."""
    entries = sorted(entry.name for entry in directory.iterdir())
    return ", ".join(entries[:4]) + (", …" if len(entries) > 4 else "") if entries else None


def check_replaceable(
    target: Path,
    what: str,
    source: Path | None = None,
    earlier: Callable[[Path], bool] | None = None,
    kind: str = "model",
    source_name: str = "source",
) -> None:
    """Refuse (``CheckpointError``) to write ``what`` (a directory of ``kind``) at ``target`` where that would
    lose anything else: ``target`` must be new, empty, or an earlier one (``earlier``; default
    ``is_model_directory``), must not be ``source`` or hold it, and its parent must be a writable directory
    (``check_parent``). ``staged_directory`` replaces the whole
    directory, and an export to a directory of other files, to its own run or to a parent of it deleted them
    all (and a draft trained with ``--out MODEL`` replaced the model)."""
    recover_directory(target)  # a write of it killed mid-swap: the old copy is what is there
    if source is not None and holds(target, source):
        raise CheckpointError(
            f"{target} holds the {source_name} {source}: writing {what} there would replace it; choose another "
            "directory"
        )
    check_parent(target, what)
    if not target.exists():
        return
    if not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory")
    shown = other_entries(target)
    if shown is not None and not (earlier or is_model_directory)(target):
        raise CheckpointError(
            f"{target} holds other files ({shown}) and no earlier {kind}; writing {what} replaces the whole "
            "directory, so choose a new or empty one"
        )


def check_replaceable_file(target: Path, what: str, source: Path, magic: bytes) -> None:
    """Refuse (``CheckpointError``) to write ``what`` (one file, replaced atomically) at ``target`` where that
    would lose anything: ``target`` must not be or lie inside ``source``, and an existing ``target`` must be a
    regular file that starts with ``magic`` (an earlier file of this kind). A GGUF export onto the source's own
    model.safetensors, onto a notes file or onto a FIFO replaced each of them."""
    if holds(source, target):
        raise CheckpointError(
            f"{target} lies inside the source {source}: writing {what} there would change it"
        )
    check_output_file(target, what)
    if not os.path.lexists(target):
        return
    with open(target, "rb") as handle:
        if handle.read(len(magic)) != magic:
            raise CheckpointError(
                f"{target} exists and is not {what}; choose a new path (it is left as it is)"
            )


def check_output_file(target: Path, what: str, inputs: Iterable[Path | None] = ()) -> None:
    """Refuse (one-line ``K2LabError``) to write ``what`` (one file, replaced atomically) at ``target`` before
    any work is done: ``target`` must not be a directory, its nearest existing ancestor must be one, and it
    must not be one of ``inputs`` (same resolved path; None entries are skipped), which the write would
    replace."""
    for source in inputs:
        if source is not None and target.resolve() == source.resolve():
            raise K2LabError(f"{target} is also an input ({source}): writing {what} there would replace it")
    check_writable_path(target.resolve() if target.is_symlink() else target, what)
    check_parent(target, what)


def check_parent(target: Path, what: str) -> None:
    """Refuse (one-line ``K2LabError``) to write ``what`` at ``target`` before any work is done when the
    nearest existing ancestor of ``target`` is not a directory (``-o afile/sub``) or cannot be written (a
    read-only filesystem): the write would fail only at its end, with an OS traceback."""
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise K2LabError(f"cannot write {what} to {target}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise K2LabError(f"cannot write {what} to {target}: {parent} is not writable")


@contextmanager
def reported_write(target: Path, what: str) -> Iterator[None]:
    """An ``OSError`` inside the block (a full disk, a read-only filesystem) as a one-line ``K2LabError``
    naming ``target`` and the OS's reason. The staged writers (``staged_directory``, ``staged_file``) have
    removed their temporary copy by then and left ``target`` as it was."""
    try:
        yield
    except OSError as error:
        raise K2LabError(
            f"cannot write {what} to {target}: {error.strerror or error}; nothing was written "
            "(an earlier one is left as it was)"
        ) from error


def make_directory(path: Path, what: str) -> Path:
    """Create directory ``path`` with its parents (``mkdir -p``) and return it; a one-line ``K2LabError``
    naming ``what`` when a file stands in its place or it cannot be made (no OS traceback)."""
    if path.exists() and not path.is_dir():
        raise K2LabError(f"{what} {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise K2LabError(f"cannot make {what} {path}: {error.strerror or error}") from error
    return path


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """Write a directory atomically: yields a fresh staging sibling of ``target``; when the block ends
    normally the staging directory replaces ``target`` (``replace_directory``) and what killed writes of
    ``target`` left beside it is swept (``sweep_staging``), when it raises (or is interrupted) the staging
    directory is removed and ``target`` is left as it was. A ``target`` that a killed swap left missing is
    first put back (``recover_directory``)."""
    recover_directory(target)
    staging, lock = _locked_staging(target)
    try:
        yield staging
        replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    sweep_staging(target)


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse a JSON object from ``path``; every failure is a one-line ``CheckpointError`` naming the file."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error})") from error
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error})") from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object, not {type(data).__name__}")
    return data


def check_format_version(manifest: dict[str, Any], source: Path, newest: int) -> None:
    """``CheckpointError`` unless ``manifest``'s ``version`` is one this code reads: an integer from 1 to
    ``newest`` (the version it writes)."""
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= newest:
        raise CheckpointError(
            f"{source}: version {version!r} is not supported (this k2lab reads versions 1 … {newest})"
        )


def save_figure_atomically(figure: Any, target: Path, dpi: int = 100) -> Path:
    """Write a matplotlib figure to ``target`` as PNG via a temporary sibling and a rename."""
    with staged_file(target, suffix=".png") as temporary:
        figure.savefig(temporary, format="png", dpi=dpi)
    return target


def save_tensors(tensors: dict[str, Any], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` to ``path``, then mode 0644 like its sibling files (the writer leaves
    the file private to its owner)."""
    from safetensors.torch import save_file  # lazy: torch-free users of this module stay light

    save_file(tensors, str(path), metadata=metadata)
    path.chmod(0o644)
