"""Background checkpoints: the state as it was when the save started, the atomic layout of a foreground
save, errors raised in the training thread."""

from __future__ import annotations

import threading

import pytest
import torch

from k2lab.train.background_checkpoint import BackgroundCheckpoint, snapshot
from k2lab.train.run_checkpoints import list_checkpoints, load_latest_checkpoint


def test_a_save_holds_the_state_of_its_start_while_training_goes_on(tmp_path, monkeypatch):
    import k2lab.train.background_checkpoint as module

    release = threading.Event()
    real = module.save_training_checkpoint

    def slow_save(*args, **kwargs):  # the writer holds until the trainer has changed its tensors
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "save_training_checkpoint", slow_save)
    weight = torch.zeros(4)
    state = {"model": {"w": weight}, "moments": [weight * 2, (weight, 3)], "note": "x"}
    writer = BackgroundCheckpoint()
    writer.start(tmp_path, 1, state, keep_last=2)
    weight.add_(1.0)  # the next iteration updates the live tensors in place
    assert list_checkpoints(tmp_path) == []  # not on disk yet
    release.set()
    writer.wait()
    step, saved = load_latest_checkpoint(tmp_path)
    assert step == 1 and torch.equal(saved["model"]["w"], torch.zeros(4))
    assert torch.equal(saved["moments"][1][0], torch.zeros(4)) and saved["moments"][1][1] == 3
    writer.start(tmp_path, 2, {"model": {"w": weight}}, keep_last=1)
    writer.start(tmp_path, 3, {"model": {"w": weight + 1}}, keep_last=1)  # waits for step 2 first
    writer.wait()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]


def test_errors_reach_the_training_thread(tmp_path):
    writer = BackgroundCheckpoint()
    with pytest.raises(TypeError, match="state"):
        writer.start(tmp_path, 1, {"bad": object()}, keep_last=1)  # refused before any thread starts
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")
    writer.start(blocker, 1, {"w": torch.ones(2)}, keep_last=1)
    with pytest.raises(OSError):
        writer.wait()
    writer.wait()  # reported once


def test_snapshot_copies_tensors_only():
    t = torch.ones(3)
    copy = snapshot({"a": [t, {"b": (t, "s")}], "n": 1})
    assert copy["a"][0] is not t and torch.equal(copy["a"][0], t)
    assert copy["a"][1]["b"][1] == "s" and copy["n"] == 1
    t.zero_()
    assert copy["a"][1]["b"][0].sum() == 3
