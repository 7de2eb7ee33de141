"""The execution sandbox: normal runs, and adversarial programs that must be contained and leave nothing behind.

Where an isolation is impossible on the machine, the test asserts the honest report instead of skipping.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import socket
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from k2lab.runtime import sandbox
from k2lab.runtime.sandbox import (
    INIT_FLAG,
    SANDBOX_UID_RANGE,
    SandboxInputError,
    SandboxLimits,
    namespace_support,
    restore,
    run_python,
    snapshot,
)

REPO = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(timeout_s=3, memory_mb=200, max_processes=16, max_output_bytes=65536)
NAMESPACES = namespace_support()[0] is not None


def _process(pid: int) -> tuple[int, int, str] | None:
    """(uid, parent pid, command line) of a running process, None once it is gone."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return uid, int(stat[stat.rindex(")") + 2 :].split()[1]), cmdline


def _of_sandbox(uid: int, cmdline: str) -> bool:
    """A sandbox's own process: its unshare, its init, or anything running as a sandbox uid."""
    return (
        SANDBOX_UID_RANGE[0] <= uid < SANDBOX_UID_RANGE[1]
        or INIT_FLAG in cmdline
        or cmdline.startswith(sandbox.UNSHARE)
    )


def _ancestors() -> set[int]:
    """This process and every process above it (where an orphan is re-parented: PID 1 or a subreaper)."""
    chain, pid = set(), os.getpid()
    while pid > 0 and pid not in chain:
        chain.add(pid)
        info = _process(pid)
        pid = info[1] if info else 0
    return chain | {0, 1}


def survivors() -> list[str]:
    """Sandbox processes this test process started, or orphans of any sandbox.

    Walking up from each sandbox process past the sandbox's own processes, the first other process decides:
    this test process or one of its ancestors (an orphan re-parented there) counts; a process elsewhere is
    another test worker running its own sandbox right now (pytest-xdist), which is not a leak of this test.
    """
    mine, found = _ancestors(), []
    for entry in os.listdir("/proc"):
        info = _process(int(entry)) if entry.isdigit() else None
        if info is None or not _of_sandbox(info[0], info[2]):
            continue
        owner = info[1]
        while (
            (parent := _process(owner)) is not None
            and owner not in mine
            and _of_sandbox(parent[0], parent[2])
        ):
            owner = parent[1]
        if owner in mine:
            found.append(f"{entry} uid={info[0]} {info[2][:120]}")
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind():
    yield
    assert survivors() == []


def run(code: str, stdin: str | None = None, **limits) -> tuple:
    """Run ``code`` with FAST limits (overridden by ``limits``); (result, seconds)."""
    start = time.monotonic()
    result = run_python(code, SandboxLimits(**{**FAST.__dict__, **limits}), stdin=stdin)
    return result, time.monotonic() - start


def test_normal_run_stdout_stderr_exit_code():
    result, _ = run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert result.killed_reason is None and not result.timed_out
    assert result.cpu_seconds is not None and result.wall_seconds < 3
    json.dumps(result.to_dict())  # JSON-able


def test_stdin_and_exception():
    result, _ = run("import sys\nprint(sys.stdin.read().upper())\n1/0", stdin="hello")
    assert result.stdout == "HELLO\n"
    assert result.exit_code == 1 and "ZeroDivisionError" in result.stderr and result.killed_reason is None


def test_clean_environment_and_isolated_python(monkeypatch):
    monkeypatch.setenv("K2LAB_SECRET_TOKEN", "hunter2")
    code = (
        "import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)\nimport json"
    )
    result, _ = run(code)
    assert result.exit_code == 0, result.stderr
    assert "K2LAB_SECRET_TOKEN" not in result.stdout and "hunter2" not in result.stdout
    assert result.stdout.splitlines()[1] == "1 1"


def test_isolation_report():
    result, _ = run("print('ok')")
    isolation = result.isolation
    assert {"network", "filesystem", "pid_namespace", "dedicated_uid", "notes"} <= set(isolation)
    if NAMESPACES:
        assert isolation["network"] and isolation["filesystem"] and isolation["pid_namespace"]
    else:
        assert not isolation["network"] and any("network" in note for note in isolation["notes"])


def test_infinite_loop_times_out():
    result, seconds = run("import time\nwhile True:\n    time.sleep(0.1)", timeout_s=1.5)
    assert result.timed_out and result.killed_reason == "timeout" and result.exit_code == -9
    assert seconds < 4


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
    ],
    ids=["burn", "ignores-SIGXCPU"],
)
def test_cpu_burn_hits_cpu_limit(code):
    result, seconds = run(code, cpu_s=1, timeout_s=8)
    assert result.killed_reason == "cpu" and not result.timed_out
    assert result.cpu_seconds >= 0.9 and seconds < 8


@pytest.mark.parametrize("code", ["x = bytearray(1 << 30)", "a = []\nwhile True:\n    a.append(' ' * 10**6)"])
def test_memory_bomb(code):
    result, seconds = run(code)
    assert result.killed_reason == "memory" and "MemoryError" in result.stderr
    assert seconds < 5


def test_fork_bomb_is_contained():
    code = "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.05)"
    result, seconds = run(code, timeout_s=2, max_processes=16)
    assert result.killed_reason == "timeout" and seconds < 6
    if not result.isolation["nproc_limit"]:
        assert any("NPROC" in note for note in result.isolation["notes"])


def test_process_limit_caps_children():
    code = (
        "import os, time\nmade = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
        "    made += 1\nprint(made)"
    )
    result, seconds = run(code, max_processes=8)
    assert result.exit_code == 0, result.stderr
    if result.isolation["nproc_limit"]:
        assert int(result.stdout) < 8  # the main process counts too
    assert seconds < 5  # sleeping children are killed when the main process exits


def test_daemonized_child_does_not_survive():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result, seconds = run(code, timeout_s=10)
    assert result.exit_code == 0 and result.stdout == "parent done\n" and seconds < 5


def test_network_is_unreachable():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # reachable from outside
        code = (
            f"import socket\nfor addr in [('127.0.0.1', {port}), ('1.1.1.1', 53)]:\n    try:\n"
            "        socket.create_connection(addr, timeout=1).close()\n        print('CONNECTED', addr)\n"
            "    except OSError as e:\n        print('blocked', addr, e.errno)"
        )
        result, _ = run(code)
    finally:
        server.close()
    assert result.exit_code == 0, result.stderr
    if NAMESPACES:
        assert result.isolation["network"] is True and "CONNECTED" not in result.stdout
        assert result.stdout.count("blocked") == 2
    else:
        assert result.isolation["network"] is False and result.isolation["notes"]


def test_host_unix_socket_is_unreachable():
    """A read-only mount does not stop connect() on a Unix socket: a host service on a 0777 socket in /tmp
    answered a sandbox that reported network isolation. /tmp (and /run, /dev/shm ...) are now empty inside,
    while the program's workdir under /tmp stays writable."""
    base = Path(tempfile.mkdtemp(prefix="k2lab-sock-", dir="/tmp"))
    base.chmod(0o755)
    path = base / "host.sock"
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(str(path))
        path.chmod(0o777)
        server.listen(4)
        socket.socket(socket.AF_UNIX).connect(str(path))  # reachable from outside
        code = (
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect({str(path)!r})\n"
            "    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e.errno)\nopen('in.txt', 'w').write('x')"
        )
        result = run_python(code, FAST, workdir=base / "work")
        assert result.exit_code == 0 and (base / "work" / "in.txt").read_text() == "x", result.stderr
    finally:
        server.close()
        shutil.rmtree(base)
    if NAMESPACES:
        assert result.stdout.startswith("blocked") and "CONNECTED" not in result.stdout
        assert result.isolation["filesystem"] and "/tmp" in result.isolation["hidden_dirs"]
    else:
        assert any("Unix sockets reachable" in note for note in result.isolation["notes"])


def test_writing_outside_workdir_fails(tmp_path):
    tag = secrets.token_hex(6)
    targets = [
        Path(f"/tmp/k2lab-sandbox-escape-{tag}"),
        REPO / f"k2lab-sandbox-escape-{tag}",
        tmp_path / f"k2lab-sandbox-escape-{tag}",
        Path(f"/dev/shm/k2lab-sandbox-escape-{tag}"),
    ]
    code = (
        f"import json\nresults = {{}}\nfor path in {json.dumps([str(t) for t in targets])} + ['inside.txt']:\n"
        "    try:\n        open(path, 'w').write('x')\n        results[path] = 'WROTE'\n"
        "    except OSError as e:\n        results[path] = e.strerror\nprint(json.dumps(results))"
    )
    work = tmp_path / "work"
    result = run_python(code, FAST, workdir=work)
    outcome = json.loads(result.stdout)
    assert outcome.pop("inside.txt") == "WROTE" and (work / "inside.txt").read_text() == "x"
    assert all(status != "WROTE" for status in outcome.values()), outcome
    assert not any(target.exists() for target in targets)


def test_workdir_owners_and_modes_come_back(tmp_path):
    """`--workdir` handed the tree to the run's uid, then gave every path to the directory's owner: files of
    1234 and 4321 ended 0:0 and a setuid bit was lost. Each path now gets back its own owner and mode; what
    the program made gets the directory's owner and no setuid bit. (Not root: one owner, nothing chowned.)"""
    root = os.geteuid() == 0
    mine, theirs = (1234, 4321) if root else (os.getuid(), os.getuid())
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "data.txt").write_text("a")
    for path, owner, mode in [("data.txt", mine, 0o640), ("sub", theirs, 0o2750), ("suid", mine, 0o4755)]:
        (work / path).touch()
        os.chown(work / path, owner, owner)
        (work / path).chmod(mode)
    before = {name: (work / name).lstat() for name in ("data.txt", "sub", "suid")}
    code = (
        "import os\nopen('data.txt', 'a').write('b')\nopen('sub/new.txt', 'w').write('n')\n"
        "open('made', 'w').write('m')\nos.chmod('made', 0o4755)\nprint(os.listdir('.'))"
    )
    result = run_python(code, FAST, workdir=work)
    assert result.exit_code == 0, result.stderr
    for name, stat in before.items():
        now = (work / name).lstat()
        assert (now.st_uid, now.st_gid, now.st_mode) == (stat.st_uid, stat.st_gid, stat.st_mode), name
    assert (work / "data.txt").read_text() == "ab"
    top = work.stat()
    for made in (work / "made", work / "sub" / "new.txt"):
        assert (made.stat().st_uid, made.stat().st_gid) == (top.st_uid, top.st_gid)
    assert (work / "made").stat().st_mode & 0o7777 == (0o755 if result.isolation["dedicated_uid"] else 0o4755)


def test_gigabyte_of_output_is_cut_at_the_limit():
    code = "import sys\nchunk = b'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.buffer.write(chunk)"
    result, seconds = run(code, max_output_bytes=65536, timeout_s=10)
    assert result.killed_reason == "output_limit" and result.stdout_truncated
    assert len(result.stdout) == 65536 and seconds < 5


def test_file_size_limit():
    code = "open('big.bin', 'wb').write(b'x' * (4 << 20))"
    result, _ = run(code, max_file_bytes=1 << 20)
    assert result.killed_reason == "file_size" and result.exit_code != 0


def test_snapshot_restore_resumes_state(tmp_path):
    work = tmp_path / "work"
    step = (
        "import json, os\nstate = json.load(open('state/s.json')) if os.path.exists('state/s.json') else "
        "{'count': 0}\nstate['count'] += 1\nos.makedirs('state', exist_ok=True)\n"
        "json.dump(state, open('state/s.json', 'w'))\nprint(state['count'])"
    )
    assert run_python(step, FAST, workdir=work).stdout == "1\n"
    snap = snapshot(work)
    assert isinstance(snap, bytes)
    for child in work.iterdir():  # wipe
        (child / "s.json").unlink()
        child.rmdir()
    assert list(work.iterdir()) == []
    restore(snap, work)
    assert run_python(step, FAST, workdir=work).stdout == "2\n"
    path = snapshot(work, tmp_path / "snap.tar.gz")
    restore(path, tmp_path / "other")
    assert json.loads((tmp_path / "other" / "state" / "s.json").read_text()) == {"count": 2}


def _tar_gz(members: list[tarfile.TarInfo]) -> bytes:
    """A gzipped tar of empty ``members`` (a hand-made snapshot)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for member in members:
            tar.addfile(member, io.BytesIO(b"") if member.isreg() else None)
    return buffer.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type, member.linkname = kind, linkname
    return member


def _listing(work: Path) -> dict[str, str]:
    """Every path under ``work``: a link's target, 'fifo', 'dir' or a file's text."""
    found = {}
    for path in sorted(work.rglob("*")):
        kind = "fifo" if path.is_fifo() else "dir" if path.is_dir() else None
        found[str(path.relative_to(work))] = (
            f"-> {os.readlink(path)}" if path.is_symlink() else kind or path.read_text()
        )
    return found


def test_restore_takes_every_snapshot_and_keeps_the_workdir_when_it_fails(tmp_path):
    """restore emptied the workdir, then refused what snapshot had stored without complaint (a venv's
    absolute bin/python link: AbsoluteLinkError, a FIFO: SpecialFileError): the files were gone. Links and
    FIFOs now come back (made last, never written through); a snapshot that cannot be restored changes
    nothing."""
    work = tmp_path / "work"
    (work / "proj" / "bin").mkdir(parents=True)
    (work / "proj" / "notes.txt").write_text("work")
    (work / "proj" / "bin" / "python").symlink_to("/usr/bin/python3")
    (work / "up").symlink_to("../../outside")
    os.mkfifo(work / "pipe")
    before = _listing(work)
    restore(snapshot(work), work)
    assert _listing(work) == before
    outside = tmp_path / "outside"
    outside.mkdir()
    for members in [
        [_member("fine.txt"), _member("../escape.txt")],
        [_member("fine.txt"), _member("dev", tarfile.CHRTYPE)],
        [_member("a", tarfile.SYMTYPE, str(outside)), _member("a/p", tarfile.FIFOTYPE)],
    ]:
        with pytest.raises(tarfile.TarError):
            restore(_tar_gz(members), work)
        assert _listing(work) == before and list(outside.iterdir()) == []
    assert not (tmp_path / "escape.txt").exists()
    with pytest.raises(ValueError, match="a device file"):  # snapshot refuses what restore would
        sandbox._no_devices(_member("dev", tarfile.CHRTYPE))


def test_cli_runs_file_and_reports_usage_errors(tmp_path, capsys):
    from k2lab.cli import main

    program = tmp_path / "p.py"
    program.write_text("print('from cli')\nraise SystemExit(5)")
    with pytest.raises(SystemExit) as exit_info:
        main(["sandbox", "run", "--timeout", "3", "--memory", "200", str(program)])
    assert exit_info.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["exit_code"] == 5 and printed["stdout"] == "from cli\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["sandbox", "run", str(tmp_path / "missing.py")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "does not exist" in " ".join(err.split()) and "Traceback" not in err


def test_without_namespaces_the_report_is_honest(monkeypatch):
    monkeypatch.setattr(sandbox, "namespace_support", lambda: (None, "disabled for this test"))
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    result, seconds = run(code)
    isolation = result.isolation
    assert result.stdout == "done\n" and seconds < 5  # the setsid'd child is still killed (by uid)
    assert isolation["network"] is False and isolation["filesystem"] is False
    assert isolation["pid_namespace"] is False
    assert any("disabled for this test" in note for note in isolation["notes"])
    assert any("network: NOT isolated" in note for note in isolation["notes"])


def test_cli_limits_come_from_sandbox_limits_recipe_set_and_options(tmp_path, monkeypatch, capsys):
    """`sandbox run` runs a SandboxRun whose defaults are SandboxLimits' own; recipe < --set < options."""
    from dataclasses import fields

    from k2lab.cli import main
    from k2lab.cli.runtime import SandboxRun

    assert SandboxRun().limits() == SandboxLimits()
    assert {f.name for f in fields(SandboxLimits)} <= set(SandboxRun.model_fields)
    seen = []

    def fake_run(file, limits, workdir=None):
        seen.append((limits, workdir))
        return sandbox.SandboxResult(0, "", "", False, None, 0.0, None)

    monkeypatch.setattr(sandbox, "run_python", fake_run)
    program = tmp_path / "p.py"
    program.write_text("pass")
    recipe = tmp_path / "limits.toml"
    recipe.write_text("timeout_s = 2.5\nmax_processes = 4\nmemory_mb = 100\n")
    args = ["--recipe", recipe, "--set", "memory_mb=300", "--memory", "256", "--cpu", "1.5", program]
    with pytest.raises(SystemExit) as exit_info:
        main(["sandbox", "run", *map(str, args)])
    assert exit_info.value.code == 0
    limits = SandboxLimits(timeout_s=2.5, cpu_s=1.5, memory_mb=256, max_processes=4)
    assert seen == [(limits, None)]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["sandbox", "run", "--timeout", "0", str(program)])
    assert exit_info.value.code == 2 and "timeout_s" in capsys.readouterr().err and len(seen) == 1


def test_undecodable_program_and_file_workdir_are_one_line_errors(tmp_path, capsys):
    """A program that is not UTF-8 (UnicodeDecodeError) and a --workdir that is a file (FileExistsError)
    ended in tracebacks; now one line, exit code 2, nothing run. A declared encoding (PEP 263) still runs."""
    from k2lab.cli import main

    latin = tmp_path / "l.py"
    latin.write_bytes(b'print("h\xe9")')
    good = tmp_path / "ok.py"
    good.write_text("print(1)")
    for args, fragment in [
        ([latin], "is not Python source text"),
        (["--workdir", latin, good], "exists and is not a directory"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["sandbox", "run", *map(str, args)])
        assert exit_info.value.code == 2
        captured = capsys.readouterr()
        assert fragment in " ".join(captured.err.split()) and "Traceback" not in captured.err
        assert captured.out == ""
    later = tmp_path / "later.py"
    later.write_bytes(b'x = 1\n\nprint("h\xe9")\n')  # past the lines an encoding declaration may be on
    with pytest.raises(SandboxInputError, match="codec can't decode"):
        run_python(later, FAST)
    declared = tmp_path / "declared.py"
    declared.write_bytes(b'# -*- coding: latin-1 -*-\nprint("h\xe9")\n')
    assert run_python(declared, FAST).stdout == "h\xe9\n"
