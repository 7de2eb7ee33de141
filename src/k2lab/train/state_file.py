"""A checkpoint's state file: serialised into a reused buffer, written with ``O_DIRECT``, hashed from memory.

``torch.save`` straight into a new file spends most of its time in the page cache. On the KVM guests of this
project's machine class, a buffered write of a fresh 195 MB checkpoint (the agentic-mini RL policy with its
MuonClip state) took 0.6–1.8 s, reading it back to hash it 0.2–0.3 s more, while an fsync'd ``O_DIRECT``
write of the same bytes took 0.07–0.11 s. So ``write_state``:

1. serialises the state with ``torch.save`` into an anonymous, page-aligned buffer that the process keeps
   from one save to the next (its pages stay mapped, so the second save onwards copies at memory speed);
2. writes the buffer with ``O_DIRECT`` and fsyncs it, while a thread hashes the same bytes (SHA-256);
   where the file system refuses ``O_DIRECT`` (tmpfs, some network file systems) it writes buffered and
   fsyncs, as before.

Both steps are methods of a ``StateBuffer``, so they can run apart: ``CheckpointWriter``
(``k2lab.train.run_checkpoints``) serialises on the training thread, a snapshot, and writes from a background
thread while training goes on. A state whose tensors exceed ``REUSE_LIMIT`` bytes is streamed into the file
and hashed from it, as before, so a large run never holds a second copy of its state in memory. The bytes
on disk and the manifest's checksum are the same either way: ``torch.load`` reads the file as it reads any
``torch.save`` output.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from k2lab.fsutil import write_synced

REUSE_LIMIT = 1 << 30
"""States holding more tensor bytes than this stream to the file instead of through the reused buffer."""

_ALIGN = 4096  # O_DIRECT needs the buffer address, the length and the file offset aligned to the block size
_CHUNK = 1 << 26  # bytes per write(2) call (Linux writes at most ~2 GiB per call)
_HASH_CHUNK = 1 << 22


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class StateBuffer:
    """A growable, page-aligned anonymous mapping a state is serialised into, then written and hashed from.

    ``serialise(state)`` runs ``torch.save`` into it (it only calls ``write``): the bytes are a snapshot, so
    the state's tensors may change as soon as it returns. ``write_to(path)`` writes those bytes to a new
    file with ``O_DIRECT`` (buffered where refused) and fsyncs it while a thread hashes them. The mapping is
    kept from one save to the next, its pages already faulted in. Not for concurrent use: one owner at a
    time (``write_state`` holds a lock around the module's buffer; a ``CheckpointWriter`` owns its own).
    """

    def __init__(self) -> None:
        self.memory = mmap.mmap(-1, _ALIGN)
        self.size = 0

    def reserve(self, nbytes: int) -> None:
        """Make room for ``nbytes`` in all, keeping the bytes written so far."""
        if nbytes <= len(self.memory):
            return
        grown = mmap.mmap(-1, _round_up(max(nbytes, 2 * len(self.memory))))
        grown[: self.size] = self.memory[: self.size]
        self.memory.close()
        self.memory = grown

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        end = self.size + view.nbytes
        self.reserve(end)
        self.memory[self.size : end] = view
        self.size = end
        return view.nbytes

    def flush(self) -> None:
        pass

    def serialise(self, state: Any) -> None:
        """``torch.save(state)`` into the buffer, replacing what it held."""
        self.size = 0
        self.reserve(tensor_bytes(state) + (1 << 20))
        torch.save(state, self)

    def write_to(self, path: Path) -> dict[str, Any]:
        """The serialised bytes into a new file ``path``, fsynced; returns ``{"bytes": ..., "sha256": ...}``."""
        size = self.size
        with memoryview(self.memory) as memory, ThreadPoolExecutor(1) as pool:
            digest = pool.submit(lambda: hashlib.sha256(memory[:size]).hexdigest())
            if not _write_direct(path, memory, size):
                write_synced(path, memory[:size])
            return {"bytes": size, "sha256": digest.result()}


_buffer: StateBuffer | None = None
_lock = threading.Lock()


def tensor_bytes(value: Any) -> int:
    """Bytes held by the tensors in a nested state (dicts, lists, tuples, sets)."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple, set)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def write_state(path: Path, state: Any) -> dict[str, Any]:
    """``torch.save(state)`` into a new file ``path``, fsynced; returns ``{"bytes": ..., "sha256": ...}``."""
    if tensor_bytes(state) > REUSE_LIMIT:
        return _stream(path, state)
    global _buffer
    with _lock:
        if _buffer is None:
            _buffer = StateBuffer()
        _buffer.serialise(state)
        return _buffer.write_to(path)


def _write_direct(path: Path, memory: memoryview, size: int) -> bool:
    """Write ``memory[:size]`` with ``O_DIRECT`` and fsync; ``False`` where the file system refuses it.

    ``memory`` is page-aligned and at least ``size`` rounded up to a block long; the padding written past
    ``size`` is cut off again with ``ftruncate``.
    """
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o666)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    try:
        padded, offset = _round_up(size), 0
        while offset < padded:
            offset += os.write(descriptor, memory[offset : min(offset + _CHUNK, padded)])
        os.ftruncate(descriptor, size)
        os.fsync(descriptor)
    except OSError as error:
        if error.errno == errno.EINVAL:  # refused at the first write (e.g. a file system with larger blocks)
            return False
        raise
    finally:
        os.close(descriptor)
    return True


def _stream(path: Path, state: Any) -> dict[str, Any]:
    """The large-state path: ``torch.save`` into the file, fsync, then hash the file."""
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
