"""``claim_run_directory``: a run's --out is new, empty or an earlier run, and never holds what the run reads."""

import json
import os
from pathlib import Path

import pytest

from k2lab.errors import K2LabError
from k2lab.train.run_directory import RUN_MARKER, claim_run_directory


def test_a_new_or_empty_directory_is_made_and_marked(tmp_path):
    run = claim_run_directory(tmp_path / "a" / "run", "train")
    assert json.loads((run / RUN_MARKER).read_text())["command"] == "train"
    (tmp_path / "empty").mkdir()
    assert (claim_run_directory(tmp_path / "empty", "rl") / RUN_MARKER).is_file()
    assert not (claim_run_directory(tmp_path / "b", "sft", write=False) / RUN_MARKER).exists()


def test_an_earlier_run_is_claimed_again(tmp_path):
    run = claim_run_directory(tmp_path / "run", "train")
    (run / "metrics.jsonl").write_text("{}\n")  # a run that stopped before its first checkpoint
    assert claim_run_directory(run, "train") == run
    for legacy in ("checkpoints", "summary.json"):  # runs from before the marker
        old = tmp_path / f"old-{legacy}"
        old.mkdir()
        (old / "metrics.jsonl").write_text("{}\n")
        (old / "checkpoints").mkdir() if legacy == "checkpoints" else (old / legacy).write_text("{}")
        assert claim_run_directory(old, "train") == old
        assert not (old / RUN_MARKER).exists()  # its command is unknown: a marker could misname it


@pytest.mark.parametrize(
    ("earlier", "command", "names"),
    [
        ("train", "mopd mopd", "`k2lab train` run; `k2lab mopd distill` writes"),
        ("train", "rl", "`k2lab train` run; `k2lab rl` writes"),
        ("rl", "mopd mopd", "`k2lab rl` run; `k2lab mopd distill` writes"),
        ("mopd mopd", "rl", "`k2lab mopd distill` run; `k2lab rl` writes"),
        ("train", "sft", "`k2lab train` run; `k2lab sft` writes"),
    ],
)
def test_a_run_of_another_command_is_refused_untouched(tmp_path, earlier, command, names):
    """``mopd distill`` into a ``train`` run cut its metrics.jsonl to the train checkpoint's step and wrote
    mopd.json there; ``rl`` into it failed with a KeyError traceback."""
    run = claim_run_directory(tmp_path / "run", earlier)
    (run / "metrics.jsonl").write_text('{"step": 6}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    with pytest.raises(K2LabError, match=f"{names} its own: pick a new --out"):
        claim_run_directory(run, command, write=False)
    with pytest.raises(K2LabError, match="pick a new --out"):
        claim_run_directory(run, command)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert claim_run_directory(run, earlier) == run  # the same command resumes it


def test_a_directory_of_other_files_is_refused_untouched(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_text("precious")
    (tmp_path / "notes.txt").write_text("notes")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(K2LabError, match="holds other files .*model, notes.txt.* not a k2lab run"):
        claim_run_directory(tmp_path, "train")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("out", ["run", "run/model", "."])
def test_a_directory_that_is_or_holds_a_source_is_refused(tmp_path, out):
    source = tmp_path / "run" / "model"
    source.mkdir(parents=True)
    with pytest.raises(K2LabError, match="which this run reads"):
        claim_run_directory(tmp_path / out, "rl", [None, source])
    assert not (tmp_path / "run" / RUN_MARKER).exists()


def test_an_empty_name_or_a_file_is_refused(tmp_path):
    with pytest.raises(K2LabError, match="is empty"):
        claim_run_directory("", "train")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(K2LabError, match="is not a directory"):
        claim_run_directory(tmp_path / "afile", "train")


def test_the_marker_is_written_only_after_every_check_and_the_hook(tmp_path):
    """Under torchrun rank 0 wrote run.json (through a temporary sibling) while rank 1 was still checking the
    directory, and rank 1 refused it as holding another's file; the ranks' barrier now runs in between."""
    seen = []
    run = tmp_path / "run"
    claim_run_directory(run, "train", checked=lambda: seen.append(sorted(p.name for p in run.iterdir())))
    assert seen == [[]] and (run / RUN_MARKER).is_file()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("x")
    with pytest.raises(K2LabError, match="not a k2lab run"):
        claim_run_directory(tmp_path / "foreign", "train", checked=lambda: seen.append("reached"))
    assert seen == [[]]  # a refused directory never reaches the hook


def test_an_existing_directory_that_cannot_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    """--resume into a run on a read-only file system failed with an OSError traceback from rewriting
    metrics.jsonl, after the corpus and the model were built; claiming it refuses at once, in one line."""
    run = claim_run_directory(tmp_path / "run", "train")
    (run / "metrics.jsonl").write_text("{}\n")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != run and real_access(path, mode))
    seen = []
    with pytest.raises(
        K2LabError, match=f"^cannot write to the run directory {run}: .*; choose another --out$"
    ):
        claim_run_directory(run, "train", checked=lambda: seen.append("reached"))
    assert seen == []
    if os.geteuid() != 0:  # root writes anywhere: only the patched check above applies there
        monkeypatch.undo()
        run.chmod(0o555)
        try:
            with pytest.raises(K2LabError, match="no permission to write there"):
                claim_run_directory(run, "train")
        finally:
            run.chmod(0o755)


def test_a_name_the_file_system_rejects_is_one_line(tmp_path):
    """A path component over 255 bytes raised OSError (File name too long) from run_dir.exists(), rc 1."""
    out = tmp_path / ("x" * 300)
    with pytest.raises(K2LabError, match=f"^cannot use the run directory {out}: File name too long$"):
        claim_run_directory(out, "train")


def test_claiming_an_earlier_run_removes_only_leftover_temporaries_of_its_files(tmp_path):
    """A kill during an atomic write left a hidden temporary (``.metrics.jsonl.k3j2x_ab``) in the run for
    good; claiming the run again removes it, and leaves every other file, however alike."""
    run = claim_run_directory(tmp_path / "run", "train")
    for name in ("metrics.jsonl", "dashboard.png"):
        (run / name).write_text("x")
    leftovers = [".metrics.jsonl.k3j2x_ab", ".dashboard.png.tel81qx4.png", ".run.json.a1b2c3d4"]
    kept = [
        ".notes.txt.abcdefgh",  # no notes.txt beside it
        ".metrics.jsonl.k3j2x_a",  # 7 characters, not tempfile's 8
        ".metrics.jsonl.K3J2X_AB",  # tempfile's names are lower case
        ".metrics.jsonl.k3j2x_ab.bak",
        ".dashboard.png.tel81qx4.jpg",
        "metrics.jsonl.k3j2x_ab",  # not hidden
    ]
    for name in leftovers + kept:
        (run / name).write_text("")
    (run / ".model.abcdefgh").mkdir()  # a directory: never removed here
    assert claim_run_directory(run, "train", write=False) == run  # the ranks that do not write leave them
    assert all((run / name).exists() for name in leftovers)
    claim_run_directory(run, "train")
    assert sorted(p.name for p in run.iterdir()) == sorted(
        [RUN_MARKER, "metrics.jsonl", "dashboard.png", ".model.abcdefgh", *kept]
    )


def test_a_directory_another_live_run_holds_is_refused(tmp_path):
    """Two runs into one --out interleaved their metrics lines; now the second is refused while the first
    lives, and the same process may claim its directory again (a resume in the same process)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    claim_run_directory(run, "train")
    claim_run_directory(run, "train")  # this process holds it already
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from k2lab.train.run_directory import claim_run_directory as c; c({str(run)!r}, 'train')",
        ],
        capture_output=True,
        text=True,
    )
    assert other.returncode != 0 and "is in use by another k2lab run" in other.stderr
    free = tmp_path / "free"
    free.mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from k2lab.train.run_directory import claim_run_directory as c; c({str(free)!r}, 'train')",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    claim_run_directory(free, "train")  # the process that held it has ended: free again
