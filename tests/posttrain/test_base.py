"""The iterative post-training base (``k2lab.posttrain.base``) on a tiny dummy trainer: an interrupted run
resumes to the uninterrupted run's metrics and weights (RNGs included), other settings are refused before
anything is touched, checkpoints follow the cadence, and the counter's name keys checkpoints and metrics."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from k2lab.errors import CheckpointError
from k2lab.posttrain.base import IterativeTrainer, rounded_mean
from k2lab.train.run_checkpoints import list_checkpoints, load_latest_checkpoint


class DummyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(default=5, ge=1)
    lr: float = 0.1
    checkpoint_every: int = Field(default=2, ge=1)
    keep_checkpoints: int | None = 3


class Interrupted(RuntimeError):
    """Raised from ``on_metrics`` to stop a run between checkpoints (as a kill would)."""


class Dummy(IterativeTrainer):
    """Fits w to noisy targets drawn from the global torch and Python RNGs (so resuming must restore them)."""

    config: DummyConfig

    def __init__(self, config: DummyConfig, out_dir: Path) -> None:
        super().__init__(config, out_dir)
        self.weight = torch.zeros(3, requires_grad=True)
        self.optimizer = torch.optim.Adam([self.weight], lr=config.lr)
        setattr(self, self.counter, 0)
        self.resumed = self.resume()

    def state_parts(self) -> dict[str, Any]:
        return {"weight": self.weight.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_parts(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.weight.copy_(state["weight"])
        self.optimizer.load_state_dict(state["optimizer"])

    def run(self, iterations: int | None = None, on_iteration: Any = None) -> list[dict[str, Any]]:
        return self.run_loop(iterations or self.config.iterations, on_iteration)

    def advance(self) -> dict[str, Any]:
        target = torch.randn(3) + random.random()
        loss = ((self.weight - target) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        metrics = {
            self.counter: self.completed,
            "loss": round(float(loss.detach()), 6),
            "draw": float(target[0]),
        }
        setattr(self, self.counter, self.completed + 1)
        self.log_metrics(metrics)
        return metrics


class StepDummy(Dummy):
    """The same trainer counting ``step``s (as MOPD does)."""

    counter = "step"


def seeded(make, *args):
    torch.manual_seed(0)
    random.seed(0)
    return make(*args)


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_rounded_mean():
    assert rounded_mean([1.0, 2.0, 2.0]) == 1.666667
    assert rounded_mean([]) is None


@pytest.mark.parametrize("make", [Dummy, StepDummy])
def test_a_run_stopped_between_checkpoints_resumes_to_the_uninterrupted_run(tmp_path, make):
    config = DummyConfig(iterations=5, checkpoint_every=2)
    straight = seeded(make, config, tmp_path / "a")
    expected = straight.run()
    assert [m[make.counter] for m in expected] == [0, 1, 2, 3, 4] and lines(tmp_path / "a") == expected

    def stop(metrics):
        if metrics[make.counter] == 2:  # iteration 2 is logged; the last checkpoint is of iteration 2's start
            raise Interrupted

    with pytest.raises(Interrupted):
        seeded(make, config, tmp_path / "b").run(None, stop)
    assert len(lines(tmp_path / "b")) == 3 and [s for s, _ in list_checkpoints(tmp_path / "b")] == [2]

    torch.manual_seed(123)  # the resumed run's RNGs come from the checkpoint, not from here
    random.seed(123)
    resumed = make(config, tmp_path / "b")
    assert resumed.resumed and resumed.completed == 2
    assert len(lines(tmp_path / "b")) == 2  # the line about to be redone is dropped
    assert resumed.run() == expected[2:]
    assert lines(tmp_path / "b") == expected == resumed.history()
    assert torch.equal(resumed.weight, straight.weight)


def test_resuming_with_other_settings_is_refused_and_touches_nothing(tmp_path):
    seeded(Dummy, DummyConfig(iterations=2, lr=0.1), tmp_path).run()
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"started with other settings \(lr: 0.1 then, 0.2 now\)"):
        Dummy(DummyConfig(iterations=2, lr=0.2), tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == before
    longer = Dummy(DummyConfig(iterations=4, lr=0.1, checkpoint_every=3), tmp_path)  # length and cadence may
    assert longer.resumed and longer.iteration == 2  # change
    assert [m["iteration"] for m in longer.run()] == [2, 3]


def test_no_checkpoint_starts_over_and_drops_old_metrics(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 0, "stale": true}\n')
    trainer = Dummy(DummyConfig(), tmp_path)
    assert not trainer.resumed and trainer.iteration == 0
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("every", "keep", "expected"), [(3, None, [7, 6, 3]), (3, 2, [7, 6]), (1, 2, [7, 6]), (10, 3, [7])]
)
def test_checkpoints_follow_the_cadence_and_the_last_iteration(tmp_path, every, keep, expected):
    newest: list[int | None] = []  # the newest checkpoint once the save started before on_metrics lands
    trainer = Dummy(DummyConfig(iterations=7, checkpoint_every=every, keep_checkpoints=keep), tmp_path)

    def record(metrics):
        trainer.checkpoints.wait()  # the save of this iteration is written in the background
        found = list_checkpoints(tmp_path)
        newest.append(found[0][0] if found else None)

    trainer.run(None, record)
    assert [s for s, _ in list_checkpoints(tmp_path)] == expected
    for i, top in enumerate(newest):  # a checkpoint after every `every` iterations and after the last
        if (i + 1) % every == 0 or i + 1 == 7:
            assert top == i + 1
        else:
            assert top is None or top < i + 1


def test_a_checkpoint_holds_the_counter_parts_rngs_and_settings(tmp_path):
    config = DummyConfig(iterations=2)
    StepDummy(config, tmp_path).run()
    step, state = load_latest_checkpoint(tmp_path)
    assert step == 2 and state["step"] == 2
    assert set(state) == {"step", "weight", "optimizer", "rng", "config"}
    assert state["config"] == config.model_dump(mode="json")
    assert {"python", "torch"} <= set(state["rng"])


def test_a_file_in_place_of_the_run_directory_is_one_line_error(tmp_path: Path) -> None:
    """``k2lab rl --out FILE`` ended in a FileExistsError traceback from the loop's mkdir."""
    from k2lab.errors import K2LabError

    taken = tmp_path / "notes.txt"
    taken.write_text("keep")
    with pytest.raises(K2LabError, match="notes.txt exists and is not a directory"):
        Dummy(DummyConfig(), taken)
    with pytest.raises(K2LabError, match="cannot make the run directory"):
        Dummy(DummyConfig(), taken / "run")
    assert taken.read_text() == "keep"
