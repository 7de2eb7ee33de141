"""The PARL ablation's settings (arms, seeds, the shared config) and run directories are checked before any run."""

import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from k2lab.ablations import parl
from k2lab.ablations.parl import QUICK, ParlAblationSettings, run_parl_ablation
from k2lab.errors import K2LabError


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"seeds": []}, "one or more distinct seeds"),  # was min() of an empty sequence after training
        ({"seeds": [0, 0]}, "one or more distinct seeds"),  # one run counted twice
        ({"arms": ["bogus"]}, "non-empty subset of"),  # was a traceback
        ({"base": {"solo_prior": math.nan}}, "finite number"),
        ({"base": {"lr": math.inf}}, "finite number"),
    ],
)
def test_bad_settings_are_refused(settings: dict, message: str):
    with pytest.raises(ValidationError, match=message):
        ParlAblationSettings(**settings)


def test_arms_keep_the_studys_order():
    assert ParlAblationSettings(arms=["single_agent", "full"]).arms == ["full", "single_agent"]


def quick(out: Path, **update) -> ParlAblationSettings:
    """One arm, one seed, one iteration on four held-out tasks: the study's smallest run."""
    base = {**QUICK["base"], "iterations": 1, "eval_tasks": 4}
    return ParlAblationSettings(out=str(out), arms=["full"], seeds=[0], base=base, **update)


def test_a_folder_that_is_not_a_run_is_kept(tmp_path):
    """The probe's case: a folder of notes at OUT/runs/full/seed0 was deleted (no parl_config.json there)."""
    notes = tmp_path / "runs" / "full" / "seed0" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("precious")
    with pytest.raises(K2LabError, match=r"holds other files \(notes.txt\) and is not a k2lab run directory"):
        run_parl_ablation(quick(tmp_path), Console(quiet=True))
    with pytest.raises(K2LabError, match="not a k2lab run directory"):  # the run itself checks too
        parl._run_arm(quick(tmp_path), "full", 0, tmp_path, Console(quiet=True))
    assert notes.read_text() == "precious" and not (tmp_path / "parl.json").exists()


class Trained(Exception):
    """Raised by the stand-in trainer: the run got as far as training."""


def test_a_run_of_another_recipe_is_replaced(tmp_path, monkeypatch):
    def trainer(*args):
        raise Trained

    monkeypatch.setattr(parl, "ParlTrainer", trainer)
    run_dir = tmp_path / "runs" / "full" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / parl.PARL_MARKER).write_text("{}")
    (run_dir / "stale.json").write_text("{}")
    with pytest.raises(Trained):
        run_parl_ablation(quick(tmp_path), Console(quiet=True))
    assert sorted(path.name for path in run_dir.iterdir()) == [parl.PARL_MARKER]
