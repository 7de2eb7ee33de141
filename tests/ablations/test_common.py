"""``train_or_reuse`` and ``train_runs``: a study replaces only directories that hold its own runs; its output
directory (``--out``) is checked before anything runs."""

from pathlib import Path

import pytest
from rich.console import Console

from k2lab.ablations import common
from k2lab.ablations.common import PlannedRun, train_or_reuse, train_runs
from k2lab.ablations.optimizer import AblationConfig
from k2lab.errors import K2LabError
from k2lab.train.config import TrainConfig
from k2lab.train.run_directory import RUN_MARKER
from tests.ablations.test_optimizer import run_cli


@pytest.fixture
def trained(monkeypatch) -> list[str]:
    """``run_training`` replaced by a stand-in that records the run directories it was given."""
    seen: list[str] = []

    def fake_run_training(config: TrainConfig, resume_hint: str) -> dict:
        assert resume_hint == common.RERUN_HINT  # a study has no --resume: Ctrl-C must not offer one
        Path(config.out).mkdir(parents=True, exist_ok=True)
        seen.append(config.out)
        return {"val_loss": 1.0}

    monkeypatch.setattr(common, "run_training", fake_run_training)
    return seen


def foreign(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("precious")
    return path


def test_a_folder_that_is_not_a_run_is_refused_untouched(tmp_path, trained):
    """``train_or_reuse`` wiped any directory at the run's place: a folder of notes at OUT/runs/none went."""
    run_dir = foreign(tmp_path / "runs" / "none")
    with pytest.raises(K2LabError, match=r"holds other files \(notes.txt\) and is not a k2lab run directory"):
        train_or_reuse(TrainConfig(out=str(run_dir)), keep_weights=False)
    assert (run_dir / "notes.txt").read_text() == "precious" and trained == []


@pytest.mark.parametrize("marker", [common.RUN_MARKER, RUN_MARKER, "checkpoints", "summary.json"])
def test_an_earlier_run_is_wiped_and_trained_again(tmp_path, trained, marker):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / marker).mkdir() if marker == "checkpoints" else (run_dir / marker).write_text("{}")
    (run_dir / "metrics.jsonl").write_text("{}\n")
    summary, reused = train_or_reuse(TrainConfig(out=str(run_dir)), keep_weights=False)
    assert not reused and summary["val_loss"] == 1.0 and trained == [str(run_dir)]
    assert sorted(p.name for p in run_dir.iterdir()) == [common.RUN_MARKER]


def test_a_study_refuses_before_training_any_run(tmp_path, trained):
    runs = [tmp_path / "runs" / "a", foreign(tmp_path / "runs" / "b")]
    plan = [PlannedRun(TrainConfig(out=str(path)), path.name, path.name) for path in runs]
    ablation = AblationConfig(out=str(tmp_path))
    with pytest.raises(K2LabError, match="runs/b holds other files"):
        train_runs(plan, ablation, Console(quiet=True), lambda *done: None)
    assert trained == [] and not runs[0].exists()


def test_the_balancing_study_keeps_a_foreign_folder(tmp_path, capsys):
    """The tester's case: ``k2lab ablate balancing`` exited 0 and notes.txt was gone."""
    notes = foreign(tmp_path / "runs" / "none") / "notes.txt"
    args = ("ablate", "balancing", "--out", tmp_path, "--steps", 3, "-p", "k3-nano", "--rules", "none")
    assert run_cli(*args, "--batch-size", 2, "--seq-len", 64, "--jobs", 1) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not a k2lab run directory" in err and "Traceback" not in err
    assert notes.read_text() == "precious"


@pytest.mark.parametrize("study", ["parl", "balancing", "optimizer", "vision-injection"])
def test_an_output_path_that_is_a_file_is_one_line(tmp_path, capsys, study):
    """``--out afile`` was a FileExistsError (NotADirectoryError for parl) traceback."""
    (tmp_path / "afile").write_text("keep")
    assert (
        run_cli("ablate", study, "--out", tmp_path / "afile", *(["--quick"] if study == "parl" else [])) == 2
    )
    err = " ".join(capsys.readouterr().err.split())
    assert "afile exists and is not a directory" in err and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "keep"
