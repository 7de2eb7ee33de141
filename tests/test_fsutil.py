"""staged_directory and staged_file: a directory or a file is replaced whole or not at all."""

import errno
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import (
    atomic_write_text,
    check_output_file,
    check_replaceable,
    make_directory,
    staged_directory,
    staged_file,
)


def test_staged_directory_replaces_on_success_and_leaves_the_target_on_error(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="crash"), staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no staging left behind
    assert [p.name for p in target.iterdir()] == ["old.txt"]
    with staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert [p.name for p in target.iterdir()] == ["new.txt"]


WRITER = """
import sys, time
from pathlib import Path
from k2lab.fsutil import staged_directory
with staged_directory(Path(sys.argv[1])) as staging:
    (staging / "weights").write_bytes(bytes(1000))
    (staging / sys.argv[2]).touch()
    time.sleep(60)
"""


def writer(target: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """A process in the middle of writing ``target`` through ``staged_directory``, and its staging
    directory (which holds the file ``name``)."""
    process = subprocess.Popen([sys.executable, "-c", WRITER, str(target), name])
    deadline = time.monotonic() + 60
    while not (found := list(target.parent.glob(f".{target.name}.*/{name}"))) and time.monotonic() < deadline:
        time.sleep(0.02)
    return process, found[0].parent


def test_a_write_sweeps_what_killed_writes_left_and_spares_a_live_one(tmp_path: Path) -> None:
    target = tmp_path / "out"
    killed, _ = writer(target, "killed")
    killed.kill()  # SIGKILL mid-write: a full-size staging copy stays
    killed.wait()
    for name in ("..out.abcd1234.efgh5678", ".out.old.zz9_zz9z", ".out.notes", ".out.abcd1234.efgh5678"):
        (tmp_path / name / "out").mkdir(parents=True)  # a nested staging and an old copy are ours
    (tmp_path / ".outx.abcd1234").mkdir()  # another target's
    target.mkdir()
    live, staging = writer(target, "live")  # a concurrent write to the same target
    try:
        with staged_directory(target) as ours:
            (ours / "new.txt").write_text("new")
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([".out.notes", ".out.abcd1234.efgh5678", ".outx.abcd1234", staging.name, "out"])
    finally:
        live.kill()
        live.wait()


def test_a_filesystem_without_flock_still_writes_and_sweeps_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_locks(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr("fcntl.flock", no_locks)
    (tmp_path / ".out.abcd1234").mkdir()  # cannot tell whether a live writer owns it: kept
    with staged_directory(tmp_path / "out") as staging:
        (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.abcd1234", "out"]


def test_a_swap_killed_between_its_renames_is_recovered(tmp_path: Path) -> None:
    target = tmp_path / "out"
    (tmp_path / ".out.old.abcd1234" / "out").mkdir(parents=True)  # replace_directory killed mid-swap
    (tmp_path / ".out.old.abcd1234" / "out" / "k2lab.json").write_text('{"format": "k2lab-model"}')
    check_replaceable(target, "the model")  # sees the old copy, put back
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old.abcd1234", "out"]
    assert [p.name for p in target.iterdir()] == ["k2lab.json"]
    with staged_directory(target) as staging:
        (staging / "new.txt").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_staged_file_renames_on_success_and_keeps_the_old_file_on_error(tmp_path: Path) -> None:
    """The block writes a temporary sibling; success replaces the target (mode 0644), an error leaves the
    target as it was and no temporary behind."""
    target = tmp_path / "out.bin"
    with staged_file(target) as temporary:
        temporary.write_bytes(b"new")
        assert not target.exists()
    assert target.read_bytes() == b"new" and (target.stat().st_mode & 0o777) == 0o644
    with pytest.raises(RuntimeError), staged_file(target) as temporary:
        temporary.write_bytes(b"half")
        raise RuntimeError("failed mid-write")
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]


def test_saved_weights_are_readable_like_their_siblings(tmp_path):
    """A model directory's safetensors file had mode 0600 beside 0644 files (safetensors' writer)."""
    import stat

    from k2lab import build_model, load_preset
    from k2lab.model_dir import save_model

    out = save_model(build_model(load_preset("k2-nano")), tmp_path / "model")
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert set(modes.values()) == {0o644}, modes


def test_check_output_file_refuses_an_input_a_directory_and_a_file_parent(tmp_path: Path) -> None:
    """An output that is one of the inputs (same resolved path) would replace it; a directory or a file in
    the parent's place failed with an OS traceback after all the work. Nothing is created by the check."""
    source = tmp_path / "in.json"
    source.write_text("{}")
    with pytest.raises(K2LabError, match="is also an input"):
        check_output_file(tmp_path / "sub" / ".." / "in.json", "the tools", [None, source])
    with pytest.raises(K2LabError, match="is a directory"):
        check_output_file(tmp_path, "the tools")
    with pytest.raises(K2LabError, match="in.json is not a directory"):
        check_output_file(source / "new" / "out.jsonl", "the tools")
    check_output_file(tmp_path / "new" / "out.jsonl", "the tools", [source])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.json"]


def test_a_fifo_or_socket_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """`factory generate -o /dev/full` replaced the device node with a plain file (the rename of an atomic
    write), as it did a FIFO; every atomic file write and output check now refuses special files."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # AF_UNIX paths are limited to ~108 bytes
        sock_path = Path(short) / "s"
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(sock_path))
            for target, kind in ((fifo, "FIFO"), (sock_path, "socket")):
                with pytest.raises(K2LabError, match=f"is a {kind}, not a regular file"):
                    atomic_write_text(target, "x")
                with pytest.raises(K2LabError, match=f"is a {kind}, not a regular file: .* for the tools"):
                    check_output_file(target, "the tools")
            assert stat.S_ISSOCK(sock_path.lstat().st_mode)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(K2LabError, match="is a FIFO"):
        check_output_file(link, "the tools")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "pipe"]  # no temporaries left


def test_make_directory_says_what_stands_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("keep")
    with pytest.raises(K2LabError, match="the run directory .*file exists and is not a directory"):
        make_directory(tmp_path / "file", "the run directory")
    with pytest.raises(K2LabError, match="cannot make the run directory"):
        make_directory(tmp_path / "file" / "run", "the run directory")
    assert make_directory(tmp_path / "a" / "b", "the run directory").is_dir()
    assert (tmp_path / "file").read_text() == "keep"


def test_a_model_directory_is_known_by_its_marker_contents(tmp_path):
    """A ``config.json`` alone (a web app's) made ``init`` and ``export`` replace a whole project directory."""
    from k2lab.fsutil import check_replaceable, is_model_directory

    (tmp_path / "src").mkdir()
    (tmp_path / "config.json").write_text('{"name": "web app"}')
    assert not is_model_directory(tmp_path)
    with pytest.raises(CheckpointError, match="holds other files"):
        check_replaceable(tmp_path, "the export")
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    assert is_model_directory(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "k2lab.json").write_text('{"format": "something-else"}')
    assert not is_model_directory(tmp_path)
    (tmp_path / "k2lab.json").write_text('{"format": "k2lab-model"}')
    assert is_model_directory(tmp_path)


def test_a_file_is_replaced_only_when_it_is_an_earlier_one_outside_the_source(tmp_path):
    """A GGUF export onto the source's model.safetensors, a notes file or a FIFO replaced each of them."""
    import os

    from k2lab.fsutil import check_replaceable_file

    source = tmp_path / "model"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(CheckpointError, match="lies inside the source"):
        check_replaceable_file(source / "model.safetensors", "a GGUF file", source, b"GGUF")
    (tmp_path / "notes.txt").write_text("notes")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        check_replaceable_file(tmp_path / "notes.txt", "a GGUF file", source, b"GGUF")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(K2LabError, match="is a FIFO, not a regular file"):
        check_replaceable_file(tmp_path / "fifo", "a GGUF file", source, b"GGUF")
    (tmp_path / "old.gguf").write_bytes(b"GGUF\x03\x00")
    check_replaceable_file(tmp_path / "old.gguf", "a GGUF file", source, b"GGUF")  # an earlier one
    check_replaceable_file(tmp_path / "new.gguf", "a GGUF file", source, b"GGUF")  # a new one
    assert (source / "model.safetensors").read_bytes() == b"weights" and (
        tmp_path / "notes.txt"
    ).read_text() == "notes"
