"""A checkpoint's state file: the reused buffer, the O_DIRECT write and its fallbacks all give the same file."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest
import torch

from k2lab.train import state_file
from k2lab.train.state_file import file_sha256, tensor_bytes, write_state


def make_state(n: int) -> dict:
    generator = torch.Generator().manual_seed(n)
    return {
        "w": torch.randn(n, 37, generator=generator),
        "half": torch.randn(5, generator=generator).to(torch.bfloat16),
        "nested": [{"m": torch.arange(n)}, (1, "two", None)],
        "step": n,
    }


def check_file(path: Path, record: dict, state: dict) -> None:
    """The record names the file's exact size and checksum, and the file loads back to ``state``."""
    assert record == {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["half"], state["half"])
    assert torch.equal(loaded["nested"][0]["m"], state["nested"][0]["m"])
    assert loaded["nested"][1] == state["nested"][1] and loaded["step"] == state["step"]


def direct_refused(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return True
    probe.unlink()
    return not hasattr(os, "O_DIRECT")


def test_tensor_bytes_counts_nested_tensors() -> None:
    assert tensor_bytes(make_state(10)) == 10 * 37 * 4 + 5 * 2 + 10 * 8
    assert tensor_bytes({"a": {1, 2}, "b": "text"}) == 0


def test_reused_buffer_writes_each_state_exactly(tmp_path: Path) -> None:
    """A large save, then a smaller one and a larger one: each file holds that state only (no stale tail)."""
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    for index, n in enumerate((3000, 17, 9000)):
        state = make_state(n)
        path = tmp_path / f"state{index}.pt"
        record = write_state(path, state)
        check_file(path, record, state)
        reference = io.BytesIO()
        torch.save(state, reference)
        assert record["bytes"] == len(reference.getvalue())


def test_buffered_fallback_when_open_refuses_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(state_file.os, "open", refusing_open)
    state = make_state(500)
    check_file(tmp_path / "state.pt", write_state(tmp_path / "state.pt", state), state)


def test_buffered_fallback_when_the_write_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that opens with O_DIRECT but refuses the aligned write: rewritten buffered, complete."""

    def refusing_write(descriptor, data):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(state_file.os, "write", refusing_write)
    state = make_state(500)
    check_file(tmp_path / "state.pt", write_state(tmp_path / "state.pt", state), state)


def test_other_write_errors_are_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if direct_refused(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")

    def full_disk(descriptor, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_file.os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_state(tmp_path / "state.pt", make_state(50))


def test_large_states_stream_to_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_file, "REUSE_LIMIT", 100)
    monkeypatch.setattr(state_file, "_write_direct", None)  # the buffered path must not be reached at all
    state = make_state(400)
    check_file(tmp_path / "state.pt", write_state(tmp_path / "state.pt", state), state)
