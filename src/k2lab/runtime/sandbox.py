"""Run untrusted Python in a contained child process (K2's code sandboxes, K3's pausable sandboxes).

``run_python(source, limits, workdir)`` runs a program and returns a JSON-able :class:`SandboxResult`.
The containment, outermost first (each part is measured at run time and reported in ``isolation``):

* ``unshare --net --mount --pid --ipc --uts --fork --kill-child --mount-proc`` (util-linux) gives the run
  its own network namespace (only an isolated loopback, brought up), mount namespace, PID namespace,
  IPC and UTS namespaces. Unprivileged callers add ``--user --map-root-user``.
* Inside, a small init process (this module run as a script, PID 1 of the namespace) mounts an empty tmpfs
  over the directories where host services keep their Unix sockets (``HIDDEN_DIRS``: /tmp, /var/tmp, /run,
  /dev/shm; connect() on a socket ignores read-only mounts, and the network namespace only covers abstract
  sockets), binding back the workdir, the program and the interpreter where they lie inside one; makes the
  whole mount tree read-only (``mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY)``), bind-mounts the working
  directory back read-write (nosuid, nodev), then forks the program with resource limits (RLIMIT_CPU,
  RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE=0), an emptied capability bounding
  set, ``no_new_privs`` and - when we are root - a dedicated unprivileged uid/gid drawn per run, so
  RLIMIT_NPROC counts only this sandbox's processes and system paths are not writable even without the
  read-only mounts.
* The program is ``python -I -S -B`` (isolated mode, no site-packages, the standard library importable)
  with a clean environment (PATH, HOME/TMPDIR = working directory, LANG) and its own session.
* When the program's main process exits, or the caller asks (timeout, output limit) or disappears, the
  init process kills every process of the namespace (``kill(-1, SIGKILL)`` from PID 1) and reaps them, so
  nothing survives the run; CPU seconds are those of all reaped processes.
* The caller enforces the wall-clock timeout and caps the captured stdout/stderr (killing the run when
  either is exceeded).

Where namespaces are unavailable the program still runs (own session, limits, dedicated uid when root,
process tree killed at the end) and ``isolation`` says what is not contained and why.

``snapshot(workdir)`` / ``restore(snapshot, workdir)`` tar a working directory so a rollout can pause and
resume later in a fresh sandbox; restore replaces nothing unless the whole snapshot extracts.

This module imports only the standard library: it is also executed as the sandbox's init process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import json
import math
import os
import resource
import secrets
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import tokenize
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

UNSHARE = "/usr/bin/unshare"
NAMESPACE_FLAGS = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
SANDBOX_UID_RANGE = (200_000, 260_000)  # dedicated per-run uids (root only); never real accounts
STOP_GRACE_S = 2.0  # time the init process gets to kill and reap before we SIGKILL the whole group
INIT_FLAG = "--sandbox-init"
SETID_BITS = stat.S_ISUID | stat.S_ISGID
# Where host services put their Unix sockets: each gets an empty tmpfs inside the sandbox's mount namespace
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm")


class SandboxInputError(ValueError):
    """A program or working directory ``run_python`` cannot use (unreadable file, not Python source text, a
    working directory that is a file); raised before anything runs."""


@dataclass
class SandboxLimits:
    """Resource limits of one sandboxed run.

    ``cpu_s`` defaults to the timeout rounded up; ``max_output_bytes`` caps stdout and stderr each
    (the run is killed when either is exceeded); ``max_processes`` is RLIMIT_NPROC for the run's uid.

    Most are rlimits, so they hold per process, not per run (there is no cgroup): ``memory_mb`` is each
    process's address space (RLIMIT_AS), so a run may use up to ``max_processes × memory_mb`` (32 GiB with
    the defaults); ``cpu_s`` is each process's CPU time (the wall-clock ``timeout_s`` bounds the run);
    ``max_file_bytes`` is the size of each file (RLIMIT_FSIZE), not of the working directory, whose total
    only the filesystem and the timeout bound; ``max_open_files`` is per process. Without a dedicated uid
    (not root) RLIMIT_NPROC counts all of the caller's processes, so it still bounds the run's.
    """

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 512
    max_processes: int = 64
    max_output_bytes: int = 1_000_000
    max_file_bytes: int = 64 * 2**20
    max_open_files: int = 256

    def cpu_seconds(self) -> int:
        """The RLIMIT_CPU soft limit in whole seconds (at least 1)."""
        return max(1, math.ceil(self.cpu_s if self.cpu_s is not None else self.timeout_s))


@dataclass
class SandboxResult:
    """What a sandboxed run did. ``exit_code`` is negative (-N) when the program died of signal N.

    ``killed_reason`` is None for a normal exit, else "timeout", "cpu", "memory", "output_limit",
    "file_size" or "signal N (NAME)". ``isolation`` reports what was actually contained.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    wall_seconds: float
    cpu_seconds: float | None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    isolation: dict[str, Any] = field(default_factory=dict)
    workdir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the result."""
        return asdict(self)


# ----------------------------------------------------------------------------------------------------
# The caller's side
# ----------------------------------------------------------------------------------------------------


def run_python(
    source: str | Path,
    limits: SandboxLimits | None = None,
    workdir: str | Path | None = None,
    stdin: str | bytes | None = None,
) -> SandboxResult:
    """Run Python ``source`` (code as ``str``, or a file as ``Path``) in a sandbox and return its result.

    ``workdir`` is the only writable directory (created if missing); by default a fresh temporary
    directory that is removed afterwards. When we are root its tree belongs to the run's uid during the run
    (files with a setuid/setgid bit excepted: the program may read, not rewrite them) and is given back
    after: each path to its recorded owner, what the program made to the directory's owner (no setuid or
    setgid bits). ``stdin`` is fed to the program's standard input. A file that
    cannot be read or is not Python source text, or a ``workdir`` that cannot be a directory, raises
    ``SandboxInputError`` before anything runs.
    """
    limits = limits or SandboxLimits()
    code = _program_bytes(source)
    own_workdir = workdir is None
    work = _working_directory(tempfile.mkdtemp(prefix="k2lab-sandbox-") if own_workdir else workdir)
    program_dir = Path(tempfile.mkdtemp(prefix="k2lab-sandbox-prog-"))
    try:
        program = program_dir / "main.py"
        program.write_bytes(code)
        program_dir.chmod(0o755)
        program.chmod(0o644)
        result = _run_program(program, work, limits, stdin)
    finally:
        shutil.rmtree(program_dir, ignore_errors=True)
        if own_workdir:
            shutil.rmtree(work, ignore_errors=True)
    result.workdir = None if own_workdir else str(work)
    return result


def _program_bytes(source: str | Path) -> bytes:
    """The program to run: a file's bytes verbatim once they decode as Python source (UTF-8, or the encoding
    its PEP 263 declaration names), code given as ``str`` in UTF-8."""
    if not isinstance(source, Path):
        return source.encode("utf-8")
    try:
        data = source.read_bytes()
    except OSError as error:
        raise SandboxInputError(f"cannot read the program {source}: {error.strerror or error}") from error
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError) as error:
        reason = error.msg if isinstance(error, SyntaxError) else str(error)
        raise SandboxInputError(
            f"the program {source} is not Python source text ({reason}): save it as UTF-8 or declare its "
            "encoding (PEP 263)"
        ) from error
    return data


def _working_directory(workdir: str | Path) -> Path:
    """``workdir`` resolved and created (with its parents); ``SandboxInputError`` when it cannot be."""
    work = Path(workdir).resolve()
    if work.exists() and not work.is_dir():
        raise SandboxInputError(f"the working directory {workdir} exists and is not a directory")
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SandboxInputError(
            f"cannot make the working directory {workdir}: {error.strerror or error}"
        ) from error
    return work


def _run_program(
    program: Path, work: Path, limits: SandboxLimits, stdin: str | bytes | None
) -> SandboxResult:
    """Start the init process (inside namespaces when possible), pump its pipes, build the result."""
    flags, ns_reason = namespace_support()
    python = sandbox_python()
    uid = _sandbox_uid() if python is not None else None
    record = {path: os.lstat(path) for path in _tree(work)} if uid is not None else None
    config = _init_config(program, work, limits, uid, namespaces=flags is not None, ns_reason=ns_reason)
    config["python"] = python or sys.executable
    if python is None:
        config["notes"].append(
            "uid: no interpreter reachable by an unprivileged uid; the program runs as root"
        )
    try:
        if record is not None:
            _hand_over(record, uid)
        pump = _Pump(limits, stdin.encode() if isinstance(stdin, str) else stdin)
        config.update(status_fd=pump.status_w, ctrl_fd=pump.ctrl_r)
        pump.start([*([UNSHARE, *flags] if flags else []), *_init_command(config)])
        pump.run()
    finally:
        if record is not None:
            _hand_back(work, record)
    return _build_result(pump, limits)


def _init_config(
    program: Path, work: Path, limits: SandboxLimits, uid: int | None, namespaces: bool, ns_reason: str | None
) -> dict[str, Any]:
    """The JSON configuration handed to the init process."""
    return {
        "program": str(program),
        "workdir": str(work),
        "uid": uid,
        "namespaces": namespaces,
        "ns_reason": ns_reason,
        "notes": [],
        "host_netns": os.readlink("/proc/self/ns/net"),
        "host_mntns": os.readlink("/proc/self/ns/mnt"),
        "rlimits": {
            "RLIMIT_CPU": [limits.cpu_seconds(), limits.cpu_seconds() + 1],
            "RLIMIT_AS": [limits.memory_mb * 2**20] * 2,
            "RLIMIT_NPROC": [limits.max_processes] * 2,
            "RLIMIT_FSIZE": [limits.max_file_bytes] * 2,
            "RLIMIT_NOFILE": [limits.max_open_files] * 2,
            "RLIMIT_CORE": [0, 0],
        },
        "env": {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(work),
            "TMPDIR": str(work),
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
        },
    }


def _init_command(config: dict[str, Any]) -> list[str]:
    """The init process: this file run by our interpreter in isolated mode."""
    return [sys.executable, "-I", "-S", "-B", str(Path(__file__).resolve()), INIT_FLAG, json.dumps(config)]


@lru_cache(maxsize=1)
def namespace_support() -> tuple[tuple[str, ...] | None, str | None]:
    """The ``unshare`` flags that work here (None when none do) and, if none do, why."""
    if not os.path.exists(UNSHARE):
        return None, f"{UNSHARE} not found"
    candidates = [NAMESPACE_FLAGS] if os.geteuid() == 0 else []
    candidates.append(["--user", "--map-root-user", *NAMESPACE_FLAGS])
    reason = None
    for flags in candidates:
        probe = subprocess.run([UNSHARE, *flags, "true"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return tuple(flags), None
        reason = f"`unshare {' '.join(flags)}` failed: {probe.stderr.strip() or probe.returncode}"
    return None, reason


@lru_cache(maxsize=1)
def sandbox_python() -> str | None:
    """An interpreter an unprivileged uid can run: ours if world-accessible, else the system's python3.

    (A venv's interpreter often lives under a 0700 home such as /root.) None when there is none.
    """
    if os.geteuid() != 0:
        return sys.executable
    candidates = [sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"]
    candidates += ["/usr/bin/python3", "/usr/local/bin/python3"]
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if os.path.isfile(real) and _world_reachable(real) and _world_reachable(_stdlib_of(real)):
            return real
    return None


def _stdlib_of(python: str) -> str:
    """The standard library directory of an interpreter (``PREFIX/lib/pythonX.Y``)."""
    probe = [python, "-I", "-S", "-c", "import os, sysconfig; print(sysconfig.get_paths()['stdlib'])"]
    try:
        return subprocess.run(probe, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "/nonexistent"


def _world_reachable(path: str) -> bool:
    """Whether "other" may read ``path`` and search every directory above it."""
    mode = os.stat(path).st_mode if os.path.exists(path) else 0
    if not mode & 0o004:
        return False
    parent = os.path.dirname(path)
    while parent not in ("/", ""):
        if not os.stat(parent).st_mode & 0o001:
            return False
        parent = os.path.dirname(parent)
    return True


def _sandbox_uid() -> int | None:
    """A fresh unprivileged uid for this run when we are root and it is mapped, else None."""
    if os.geteuid() != 0:
        return None
    uid = SANDBOX_UID_RANGE[0] + secrets.randbelow(SANDBOX_UID_RANGE[1] - SANDBOX_UID_RANGE[0])
    with open("/proc/self/uid_map") as handle:
        for line in handle:
            inner, _, count = (int(x) for x in line.split())
            if inner <= uid < inner + count:
                return uid
    return None


def _tree(root: Path) -> list[str]:
    """``root`` and every path under it, never following symlinks (the sandbox may have planted some)."""
    paths = [str(root)]
    for base, dirs, files in os.walk(root, followlinks=False):
        paths += [os.path.join(base, name) for name in dirs + files]
    return paths


def _hand_over(record: dict[str, os.stat_result], uid: int) -> None:
    """``lchown`` the recorded paths (``lstat`` of each, taken before) to the sandbox ``uid``: all but files
    with a setuid or setgid bit, which stay their owner's (a chown would clear the bit, and the program must
    not rewrite a file that gets a privilege bit back afterwards)."""
    for path, info in record.items():
        if info.st_mode & SETID_BITS and not stat.S_ISDIR(info.st_mode):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.lchown(path, uid, uid)


def _hand_back(root: Path, record: dict[str, os.stat_result]) -> None:
    """Give the tree back after a run. A path still holding its recorded inode gets its recorded owner; one
    the program made (or replaced) gets the working directory's owner. Modes stay as the program left them,
    without setuid/setgid bits on files the program owned (only a file never handed over keeps them)."""
    owner = record[str(root)]
    for path in _tree(root):
        with contextlib.suppress(FileNotFoundError):
            _give_back(path, os.lstat(path), record.get(path), owner)


def _give_back(path: str, now: os.stat_result, before: os.stat_result | None, owner: os.stat_result) -> None:
    """Chown (and re-mode: chown clears setuid/setgid) one path for :func:`_hand_back`."""
    same = before is not None and (before.st_dev, before.st_ino) == (now.st_dev, now.st_ino)
    uid, gid = (before.st_uid, before.st_gid) if same else (owner.st_uid, owner.st_gid)
    never_handed_over = same and (now.st_uid, now.st_gid) == (uid, gid)
    mode = stat.S_IMODE(now.st_mode)
    if not (never_handed_over or stat.S_ISDIR(now.st_mode)):
        mode &= ~SETID_BITS
    os.lchown(path, uid, gid)
    if not stat.S_ISLNK(now.st_mode):
        os.chmod(path, mode)


class _Pump:
    """Runs the init process and pumps stdin/stdout/stderr/status with the timeout and output caps."""

    def __init__(self, limits: SandboxLimits, stdin: bytes | None) -> None:
        self.limits = limits
        self.stdin = stdin or b""
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = {"stdout": False, "stderr": False}
        self.status = bytearray()
        self.reason: str | None = None
        self.stop_at: float | None = None
        self.status_r, self.status_w = os.pipe()  # init process -> us: its JSON report
        self.status_open = True
        self.ctrl_r, self.ctrl_w = os.pipe()  # us -> init process: a byte (or EOF) means kill everything

    def start(self, command: list[str]) -> None:
        """Spawn the command in its own session, handing it the status and control pipes."""
        status_w, ctrl_r = self.status_w, self.ctrl_r
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, ctrl_r),
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                cwd="/",
            )
        except OSError:
            for fd in (self.status_r, self.ctrl_w):
                os.close(fd)
            raise
        finally:
            os.close(status_w)
            os.close(ctrl_r)

    def run(self) -> None:
        """Pump until every pipe is closed; then wait for the process group to be gone."""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, "stdout")
        sel.register(self.proc.stderr, selectors.EVENT_READ, "stderr")
        sel.register(self.status_r, selectors.EVENT_READ, "status")
        if self.stdin:
            os.set_blocking(self.proc.stdin.fileno(), False)
            sel.register(self.proc.stdin, selectors.EVENT_WRITE, "stdin")
        else:
            self.proc.stdin.close()
        try:
            self._loop(sel)
        finally:
            sel.close()
            self._finish()

    def _loop(self, sel: selectors.BaseSelector) -> None:
        deadline = self.started + self.limits.timeout_s
        while sel.get_map():
            now = time.monotonic()
            if self.stop_at is None and now >= deadline:
                self._stop("timeout")
            if self.stop_at is not None and now >= self.stop_at + STOP_GRACE_S:
                self._kill_group()
                break
            limit = deadline if self.stop_at is None else self.stop_at + STOP_GRACE_S
            for key, _ in sel.select(max(0.0, min(limit - now, 0.25))):
                self._handle(sel, key)

    def _handle(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        if key.data == "stdin":
            self._write_stdin(sel, key)
            return
        try:
            data = os.read(key.fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            sel.unregister(key.fileobj)
            if key.data == "status":
                os.close(self.status_r)
                self.status_open = False
            return
        if key.data == "status":
            self.status += data
            return
        buffer = self.out[key.data]
        room = max(0, self.limits.max_output_bytes - len(buffer))
        buffer += data[:room]
        if len(data) > room:  # more than the cap: keep the first max_output_bytes and stop the run
            self.truncated[key.data] = True
            self._stop("output_limit")

    def _write_stdin(self, sel: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        try:
            written = os.write(key.fd, self.stdin[:65536])
            self.stdin = self.stdin[written:]
        except BlockingIOError:
            return
        except OSError:
            self.stdin = b""
        if not self.stdin:
            sel.unregister(key.fileobj)
            self.proc.stdin.close()

    def _stop(self, reason: str) -> None:
        """Ask the init process to kill everything (it reports CPU time); we SIGKILL after a grace."""
        if self.stop_at is not None:
            return
        self.reason, self.stop_at = reason, time.monotonic()
        try:
            os.write(self.ctrl_w, b"k")
        except OSError:
            self._kill_group()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def _finish(self) -> None:
        try:
            self.proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill_group()
            self.proc.wait()
        # (no killpg after the wait: the pid may be reused; the namespace died with its init process)
        os.close(self.ctrl_w)
        if self.status_open:
            os.close(self.status_r)
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream and not stream.closed:
                stream.close()
        self.wall = time.monotonic() - self.started


def _build_result(pump: _Pump, limits: SandboxLimits) -> SandboxResult:
    """Turn the pump's bytes and the init process's status into a :class:`SandboxResult`."""
    try:
        status = json.loads(pump.status.decode())
    except ValueError:
        status = {"error": f"no status from the init process (exit {pump.proc.returncode})"}
    stdout = pump.out["stdout"].decode("utf-8", "replace")
    stderr = pump.out["stderr"].decode("utf-8", "replace")
    if status.get("error"):
        stderr += f"\n[sandbox] {status['error']}"
    sig = status.get("signal")
    exit_code = -sig if sig else status.get("exit_code")
    reason = pump.reason or _classify(sig, exit_code, stderr, status.get("cpu_seconds"), limits)
    return SandboxResult(
        exit_code=exit_code,
        stdout=stdout,
        stderr=stderr,
        timed_out=reason == "timeout",
        killed_reason=reason,
        wall_seconds=round(pump.wall, 3),
        cpu_seconds=status.get("cpu_seconds"),
        stdout_truncated=pump.truncated["stdout"],
        stderr_truncated=pump.truncated["stderr"],
        isolation=status.get("isolation", {"error": status.get("error")}),
    )


def _classify(
    sig: int | None, exit_code: int | None, stderr: str, cpu: float | None, limits: SandboxLimits
) -> str | None:
    """Why the program ended abnormally (None for a normal exit or an ordinary error)."""
    if sig:
        if sig == signal.SIGXCPU or (
            sig == signal.SIGKILL and cpu is not None and cpu >= limits.cpu_seconds()
        ):
            return "cpu"
        if sig == signal.SIGXFSZ:
            return "file_size"
        return f"signal {sig} ({signal.Signals(sig).name})"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    if exit_code and last.startswith("MemoryError"):
        return "memory"
    if exit_code and "[Errno 27] File too large" in last:
        return "file_size"
    return None


# ----------------------------------------------------------------------------------------------------
# Workdir snapshots (pausable sandboxes)
# ----------------------------------------------------------------------------------------------------


def snapshot(workdir: str | Path, dest: str | Path | None = None) -> bytes | Path:
    """Tar (gzip) the contents of ``workdir``; bytes, or the written ``dest`` path when given.

    Symlinks (wherever they point) and FIFOs are stored as such, sockets skipped; a device file raises
    ``ValueError``, because :func:`restore` would refuse it - every snapshot made restores.
    """
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for child in sorted(Path(workdir).iterdir()):
            tar.add(child, arcname=child.name, recursive=True, filter=_no_devices)
    if dest is None:
        return buffer.getvalue()
    Path(dest).write_bytes(buffer.getvalue())
    return Path(dest)


def _no_devices(member: tarfile.TarInfo) -> tarfile.TarInfo:
    """``tar.add``'s filter for :func:`snapshot`: a character or block device raises ``ValueError``."""
    if member.isdev() and not member.isfifo():
        raise ValueError(f"cannot snapshot {member.name}: a device file, which restore refuses")
    return member


def restore(snap: bytes | str | Path, workdir: str | Path) -> Path:
    """Replace the contents of ``workdir`` with a :func:`snapshot` (bytes or a path to one).

    The snapshot's content came from untrusted code: it is extracted with tarfile's ``data`` filter (no
    absolute or escaping paths, no device files) into a staging directory inside ``workdir``, with symlinks
    and FIFOs made last, so no file is ever written through a link, whatever it points to (the program could
    have made the same links itself). Only once all of it is extracted is the old content replaced; a
    snapshot that cannot be restored raises and leaves ``workdir`` as it was.
    """
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = snap if isinstance(snap, bytes) else Path(snap).read_bytes()
    staging = Path(tempfile.mkdtemp(prefix=".k2lab-restore-", dir=work)).resolve()
    try:
        _extract(data, staging)
        for child in work.iterdir():
            if child.name == staging.name:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
        for child in staging.iterdir():
            child.rename(work / child.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return work


def _extract(data: bytes, dest: Path) -> None:
    """Extract a snapshot into the empty directory ``dest``: regular members through the ``data`` filter,
    then the symlinks and FIFOs (their names checked by the same filter)."""
    later: list[tarfile.TarInfo] = []

    def data_or_later(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
        if not (member.issym() or member.isfifo()):
            return tarfile.data_filter(member, path)
        tarfile.data_filter(tarfile.TarInfo(member.name), path)  # its name, as a plain file's
        later.append(member)
        return None

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter=data_or_later)
    for member in later:
        _make_link_or_fifo(member, dest)


def _make_link_or_fifo(member: tarfile.TarInfo, dest: Path) -> None:
    """Create a symlink or FIFO member under ``dest`` (resolved), refusing a path through a symlink."""
    target = os.path.normpath(os.path.join(dest, member.name))
    parent = os.path.dirname(target)
    if os.path.realpath(parent) != parent or os.path.lexists(target):
        raise tarfile.OutsideDestinationError(member, target)
    os.makedirs(parent, exist_ok=True)
    if member.issym():
        os.symlink(member.linkname, target)
    else:
        os.mkfifo(target, 0o600 | (member.mode & 0o755))


# ----------------------------------------------------------------------------------------------------
# The init process (runs inside the namespaces as their PID 1; standard library only)
# ----------------------------------------------------------------------------------------------------

_LIBC = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]  # fmt: skip


def _mount_setattr(path: str, recursive: bool, attr_set: int = 0, attr_clr: int = 0) -> None:
    """mount_setattr(2) (syscall 442 on every architecture); MOUNT_ATTR_RDONLY=1, NOSUID=2, NODEV=4."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    flags = 0x8000 if recursive else 0  # AT_RECURSIVE
    ret = _libc().syscall(
        ctypes.c_long(442), ctypes.c_int(-100), ctypes.c_char_p(path.encode()), ctypes.c_uint(flags),
        ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
    )  # fmt: skip
    _check(ret, f"mount_setattr {path}")


def _bind(source: str, target: str | None = None) -> None:
    """Bind-mount ``source`` onto ``target`` (MS_BIND | MS_REC), by default onto itself so it gets its own
    mount flags."""
    target = target or source
    _check(_libc().mount(source.encode(), target.encode(), None, ctypes.c_ulong(4096 | 16384), None), "bind")


def _contain_filesystem(config: dict[str, Any], notes: list[str]) -> list[str] | None:
    """Hide the host's socket directories, then everything read-only except the workdir (in our own mount
    namespace); the directories hidden, None when the mount tree could not be made read-only."""
    workdir = config["workdir"]
    try:
        hidden = _hide_socket_dirs(_paths_to_keep(config), notes)
        _mount_setattr("/", recursive=True, attr_set=1)
        _bind(workdir)
        _mount_setattr(workdir, recursive=True, attr_set=2 | 4, attr_clr=1)
        return hidden
    except OSError as error:
        notes.append(f"filesystem: could not make the mount tree read-only ({error})")
        return None


def _paths_to_keep(config: dict[str, Any]) -> list[str]:
    """What the program needs to see: its workdir, its program's directory and its interpreter's prefix
    (``PREFIX/bin/python``, a venv's or the real one)."""
    python = config["python"]
    venv = os.path.dirname(os.path.realpath(os.path.dirname(python)))
    real = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    directories = [config["workdir"], os.path.realpath(os.path.dirname(config["program"])), venv, real]
    return list(dict.fromkeys(directories))


def _hide_socket_dirs(keep: list[str], notes: list[str]) -> list[str]:
    """Mount an empty tmpfs over each of ``HIDDEN_DIRS`` (where host services put their Unix sockets, which a
    read-only mount does not stop anyone from connecting to), binding the ``keep`` paths inside one back.
    A directory that is, or lies inside, a ``keep`` path stays as it is. The directories hidden."""
    hidden = []
    for directory in dict.fromkeys(os.path.realpath(d) for d in HIDDEN_DIRS):
        if not os.path.isdir(directory):
            continue
        if any(_within(directory, path) for path in keep):
            notes.append(f"filesystem: {directory} left visible (it holds the workdir or the interpreter)")
            continue
        try:
            _empty_over(directory, [path for path in keep if _within(path, directory)])
            hidden.append(directory)
        except OSError as error:
            notes.append(f"filesystem: {directory} not hidden, host Unix sockets in it reachable ({error})")
    return hidden


def _empty_over(directory: str, inside: list[str]) -> None:
    """Mount an empty tmpfs (nosuid, nodev) over ``directory`` and bind the paths ``inside`` it back (through
    handles opened before they were covered)."""
    handles = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in inside]
    try:
        flags = ctypes.c_ulong(2 | 4)  # MS_NOSUID | MS_NODEV
        _check(
            _libc().mount(b"tmpfs", directory.encode(), b"tmpfs", flags, b"mode=755"), f"tmpfs {directory}"
        )
        for path, handle in zip(inside, handles, strict=True):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _bind(f"/proc/self/fd/{handle}", path)
    finally:
        for handle in handles:
            os.close(handle)


def _within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies under it (both absolute, normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _loopback_up() -> None:
    """Bring up ``lo`` of the new network namespace (isolated; nothing else is reachable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, 0x8913, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(sock, 0x8914, struct.pack("16sH22x", b"lo", flags | 1))


def _isolate(config: dict[str, Any]) -> dict[str, Any]:
    """Set up what can be set up before forking the program; the isolation report."""
    notes: list[str] = list(config["notes"])
    if not config["namespaces"]:
        notes.append(f"no namespaces: {config['ns_reason']}")
    network = os.readlink("/proc/self/ns/net") != config["host_netns"]
    if network:
        try:
            _loopback_up()
        except OSError as error:
            notes.append(f"network: loopback left down ({error})")
    else:
        notes.append("network: NOT isolated (the program shares the host network)")
    own_mounts = os.readlink("/proc/self/ns/mnt") != config["host_mntns"]
    hidden = _contain_filesystem(config, notes) if own_mounts else None
    filesystem = hidden is not None
    if not filesystem:
        notes.append(
            "filesystem: paths outside the workdir are writable, and host Unix sockets reachable, where the "
            "program's uid may write"
        )
    pid_ns = os.getpid() == 1
    if not pid_ns:
        notes.append("pid: no PID namespace (the program sees host processes; killed by session and uid)")
    uid = config["uid"]
    if uid is None:
        notes.append("uid: no dedicated uid (not root): RLIMIT_NPROC counts all of the caller's processes")
    return {
        "network": network,
        "filesystem": filesystem,
        "hidden_dirs": hidden or [],
        "pid_namespace": pid_ns,
        "dedicated_uid": uid is not None,
        "uid": uid if uid is not None else os.getuid(),
        "nproc_limit": uid is not None,
        "python": config["python"],
        "notes": notes,
    }


def _exec_program(config: dict[str, Any]) -> None:
    """In the forked child: limits, drop privileges, exec the program (never returns)."""
    try:
        os.setsid()
        os.chdir(config["workdir"])
        libc = _libc()
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP: exec'd root gets no capabilities either
        uid = config["uid"]
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
        for name, (soft, hard) in config["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if uid is not None:
            os.setuid(uid)
        _check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")  # PR_SET_NO_NEW_PRIVS
        python = config["python"]
        os.execve(python, [python, "-I", "-S", "-B", config["program"]], config["env"])
    except BaseException as error:  # noqa: BLE001 - report anything, then die
        os.write(2, f"[sandbox] could not start the program: {error}\n".encode())
    os._exit(127)


def _kill_all(child: int, uid: int | None) -> None:
    """Kill every process of the sandbox: the whole PID namespace, else the session and the uid."""
    if os.getpid() == 1:
        with contextlib.suppress(ProcessLookupError):  # ESRCH: nothing left
            os.kill(-1, signal.SIGKILL)  # in a PID namespace: every process in it but us
        return
    with contextlib.suppress(OSError):
        os.killpg(child, signal.SIGKILL)
    if uid is None:
        return
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            pass


def _supervise(child: int, config: dict[str, Any]) -> tuple[int, float]:
    """Reap until the program's main process exits; kill and reap the rest; (wait status, CPU s)."""
    stop = threading.Event()

    def watch_control() -> None:  # caller asked us to stop, or died (EOF)
        try:
            os.read(config["ctrl_fd"], 1)
        finally:
            stop.set()
            _kill_all(child, config["uid"])

    threading.Thread(target=watch_control, daemon=True).start()
    main_status = None
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            main_status = status
            _kill_all(child, config["uid"])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return main_status if main_status is not None else 0, round(usage.ru_utime + usage.ru_stime, 3)


def _init_main(config: dict[str, Any]) -> None:
    """The init process: isolate, fork the program, supervise it, write the status JSON."""
    status_fd = config["status_fd"]
    for fd in (status_fd, config["ctrl_fd"]):
        os.set_inheritable(fd, False)
    if os.getpid() != 1:
        _libc().prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back to us
    report: dict[str, Any] = {}
    try:
        isolation = _isolate(config)
        child = os.fork()
        if child == 0:
            _exec_program(config)
        wait_status, cpu = _supervise(child, config)
        report = {"isolation": isolation, "cpu_seconds": cpu}
        if os.WIFSIGNALED(wait_status):
            report.update(signal=os.WTERMSIG(wait_status), exit_code=None)
        else:
            report.update(signal=None, exit_code=os.WEXITSTATUS(wait_status))
    except Exception as error:  # noqa: BLE001 - the caller gets the reason instead of a hang
        report["error"] = f"sandbox init failed: {error!r}"
    payload = json.dumps(report).encode()
    while payload:
        try:
            payload = payload[os.write(status_fd, payload) :]
        except OSError as error:
            if error.errno != errno.EINTR:
                break


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == INIT_FLAG:
    _init_main(json.loads(sys.argv[2]))
