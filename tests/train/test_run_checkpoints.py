"""Training checkpoints: atomic saves (incl. SIGKILL mid-save), checksums and fallback, pruning, RNG state."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.errors import CheckpointError
from k2lab.fsutil import staging_directory
from k2lab.optim import MuonClip, OptimizerConfig
from k2lab.train import run_checkpoints, state_file
from k2lab.train.persistence import capture_rng_state, restore_rng_state, resume_state
from k2lab.train.run_checkpoints import (
    CheckpointWarning,
    CheckpointWriter,
    checkpoint_directory,
    list_checkpoints,
    load_latest_checkpoint,
    save_training_checkpoint,
    verify_checkpoint,
)
from k2lab.train.state_file import StateBuffer


def make_state(step: int) -> dict:
    return {
        "model": {"w": torch.full((64, 32), float(step)), "b": torch.arange(5, dtype=torch.bfloat16)},
        "optimizer": {
            "state": {0: {"momentum": torch.ones(3) * step}},
            "param_groups": [{"lr": 0.1, "ns_dtype": torch.bfloat16}],
        },
        "scheduler": {"step": step},
        "data": {"epoch": 1, "position": 1234 + step, "shards": ["a.bin", "b.bin"]},
        "rng": capture_rng_state(),
        "config": {"preset": "k2-mini", "betas": (0.9, 0.95), "device": torch.device("cpu")},
    }


def steps_on_disk(run_dir: Path) -> list[int]:
    return sorted(step for step, _ in list_checkpoints(run_dir))


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    state = make_state(7)
    path = save_training_checkpoint(tmp_path, 7, state)
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert (
        manifest["step"] == 7 and manifest["files"]["state.pt"]["bytes"] == (path / "state.pt").stat().st_size
    )
    assert len(manifest["files"]["state.pt"]["sha256"]) == 64
    assert verify_checkpoint(path) == 7

    step, loaded = load_latest_checkpoint(tmp_path)
    assert step == 7
    assert torch.equal(loaded["model"]["w"], state["model"]["w"])
    assert loaded["model"]["b"].dtype == torch.bfloat16
    assert loaded["optimizer"]["param_groups"][0]["ns_dtype"] is torch.bfloat16
    assert loaded["data"] == state["data"] and loaded["config"]["betas"] == (0.9, 0.95)
    assert not any(p.name.startswith(".") for p in (tmp_path / "checkpoints").iterdir())


def test_resume_state_refuses_other_settings_before_touching_the_metrics(tmp_path: Path) -> None:
    settings = {"lr": 1e-3, "seed": 0, "iterations": 4, "keep_checkpoints": 2}
    save_training_checkpoint(tmp_path, 2, {"iteration": 2, "config": settings})
    lines = "".join(json.dumps({"iteration": i}) + "\n" for i in range(3))
    (tmp_path / "metrics.jsonl").write_text(lines)
    with pytest.raises(CheckpointError, match=r"lr: 0.001 then, 0.002 now; seed: 0 then, 1 now"):
        resume_state(tmp_path, "metrics.jsonl", "iteration", settings | {"lr": 2e-3, "seed": 1})
    assert (tmp_path / "metrics.jsonl").read_text() == lines
    # the run's length and retention may change, and a field only one side has (a k2lab upgrade) is ignored
    longer = {"lr": 1e-3, "iterations": 8, "keep_checkpoints": 1, "new_field": 1}
    assert resume_state(tmp_path, "metrics.jsonl", "iteration", longer)["iteration"] == 2
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # iteration 2 is redone


@pytest.mark.parametrize(
    ("state", "counter", "kind"),
    [
        ({"step": 6, "train_config": {"steps": 6}}, "step", "a `k2lab train`/`sft` run's"),
        ({"step": 6, "train_config": {"steps": 6}}, "iteration", "a `k2lab train`/`sft` run's"),
        ({"step": 2, "config": {}}, "iteration", "not counting iterations"),
    ],
)
def test_resume_state_refuses_a_checkpoint_of_another_kind_untouched(tmp_path: Path, state, counter, kind):
    """An RL run resumed a train run's checkpoint with a KeyError traceback ('iteration'); MOPD took its
    ``step`` for its own and cut the train run's metrics.jsonl at it (a run from before run.json)."""
    save_training_checkpoint(tmp_path, 6, state)
    lines = "".join(json.dumps({"step": i}) + "\n" for i in range(1, 7))
    (tmp_path / "metrics.jsonl").write_text(lines)
    with pytest.raises(CheckpointError, match=f"latest checkpoint in .* is {kind}"):
        resume_state(tmp_path, "metrics.jsonl", counter, {"steps": 6})
    assert (tmp_path / "metrics.jsonl").read_text() == lines


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path) is None


def test_rejects_objects_weights_only_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"state\['data'\]\['path'\].*PosixPath"):
        save_training_checkpoint(tmp_path, 1, {"data": {"path": Path("x")}})
    with pytest.raises(ValueError):
        save_training_checkpoint(tmp_path, -1, {})
    assert list_checkpoints(tmp_path) == []
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_model_and_muonclip_state_round_trip(tmp_path: Path) -> None:
    """A real optimizer state (Muon param groups hold a torch.dtype) loads under weights_only=True."""
    config = load_preset("k2-nano")
    model = build_model(config)
    optimizer = MuonClip(model, OptimizerConfig(), verbose=False)
    model(torch.randint(0, config.vocab_size, (1, 16))).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    save_training_checkpoint(tmp_path, 1, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    _, state = load_latest_checkpoint(tmp_path)
    fresh = build_model(config)
    fresh.load_state_dict(state["model"])
    restored = MuonClip(fresh, OptimizerConfig(), verbose=False)
    restored.load_state_dict(state["optimizer"])
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    momentum = [v["momentum_buffer"] for v in restored.optimizer.state.values() if "momentum_buffer" in v]
    assert momentum and all(torch.isfinite(m).all() for m in momentum)


def test_staging_directory_of_crashed_save_is_ignored_and_cleaned(tmp_path: Path) -> None:
    save_training_checkpoint(tmp_path, 1, make_state(1))
    staging = staging_directory(checkpoint_directory(tmp_path, 2))  # a save killed before its rename
    (staging / "state.pt").write_bytes(b"PK\x03\x04 half a zip")
    messages: list[str] = []
    step, _ = load_latest_checkpoint(tmp_path, on_skip=messages.append)
    assert step == 1 and messages == []
    save_training_checkpoint(tmp_path, 3, make_state(3))
    assert not staging.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "no_state", "bad_manifest"])
def test_damaged_latest_falls_back_with_one_line(tmp_path: Path, damage: str) -> None:
    save_training_checkpoint(tmp_path, 10, make_state(10))
    latest = save_training_checkpoint(tmp_path, 20, make_state(20))
    state_file = latest / "state.pt"
    data = bytearray(state_file.read_bytes())
    if damage == "truncate":
        state_file.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        state_file.write_bytes(data)
    elif damage == "no_manifest":
        (latest / "manifest.json").unlink()
    elif damage == "no_state":
        state_file.unlink()
    else:
        (latest / "manifest.json").write_text('{"format": "k2lab-tr')
    messages: list[str] = []
    step, state = load_latest_checkpoint(tmp_path, on_skip=messages.append)
    assert step == 10 and torch.equal(state["model"]["w"], torch.full((64, 32), 10.0))
    assert len(messages) == 1 and "\n" not in messages[0] and "step_00000020" in messages[0]
    expected = {
        "truncate": "truncated",
        "flip": "SHA-256",
        "no_manifest": "incomplete",
        "no_state": "missing",
        "bad_manifest": "not valid JSON",
    }
    assert expected[damage] in messages[0]
    with pytest.warns(CheckpointWarning, match="step_00000020"):
        assert load_latest_checkpoint(tmp_path)[0] == 10


def test_all_damaged_raises(tmp_path: Path) -> None:
    path = save_training_checkpoint(tmp_path, 5, make_state(5))
    (path / "state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="none of the 1 checkpoints"):
        load_latest_checkpoint(tmp_path, on_skip=lambda message: None)


def test_keep_last_prunes_old_and_broken(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_training_checkpoint(tmp_path, step, make_state(step), keep_last=2)
    assert steps_on_disk(tmp_path) == [4, 5]

    # An incomplete step 6 does not count towards keep_last and is removed by the next save.
    broken = checkpoint_directory(tmp_path, 6)
    broken.mkdir()
    (broken / "state.pt").write_bytes(b"partial")
    save_training_checkpoint(tmp_path, 7, make_state(7), keep_last=2)
    assert steps_on_disk(tmp_path) == [5, 7]

    # Checkpoints newer than the one being saved are never touched; keep_last=None keeps everything.
    save_training_checkpoint(tmp_path, 3, make_state(3), keep_last=1)
    assert steps_on_disk(tmp_path) == [3, 5, 7]
    save_training_checkpoint(tmp_path, 8, make_state(8), keep_last=None)
    assert steps_on_disk(tmp_path) == [3, 5, 7, 8]


def test_same_step_is_replaced(tmp_path: Path) -> None:
    save_training_checkpoint(tmp_path, 4, make_state(4))
    save_training_checkpoint(tmp_path, 4, {"marker": 2})
    assert load_latest_checkpoint(tmp_path) == (4, {"marker": 2})
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000004"]


SAVER = textwrap.dedent(
    """
    import sys, torch
    from k2lab.train.run_checkpoints import save_training_checkpoint
    run_dir = sys.argv[1]
    step = 0
    while True:
        step += 1
        state = {"step": step, "w": torch.full((1 << 21,), float(step)), "tail": list(range(step))}
        save_training_checkpoint(run_dir, step, state, keep_last=2)
        print(step, flush=True)
    """
)


@pytest.mark.parametrize("delay", [0.013, 0.047])
def test_sigkill_during_saves_leaves_a_complete_checkpoint(tmp_path: Path, delay: float) -> None:
    """Kill a process that saves 8 MB checkpoints back to back; the newest checkpoint on disk must load."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    child = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for _ in range(3):  # let it complete a few saves (and prunes), then kill it mid-loop
            assert child.stdout.readline(), "saver died"
        time.sleep(delay)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    messages: list[str] = []
    step, state = load_latest_checkpoint(tmp_path, on_skip=messages.append)
    assert messages == []
    assert step >= 3 and state["step"] == step and state["tail"] == list(range(step))
    assert torch.equal(state["w"], torch.full((1 << 21,), float(step)))


def test_rng_capture_restore_reproduces_draws(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.random(), np.random.standard_normal(), torch.randn(2)  # noqa: B018 (advance the generators)
    state = capture_rng_state()
    save_training_checkpoint(tmp_path, 1, {"rng": state})

    def draw() -> tuple:
        return (
            [random.random() for _ in range(3)],
            np.random.standard_normal(5).tolist(),  # standard_normal exercises numpy's cached gauss
            torch.randn(4).tolist(),
            torch.randint(0, 1000, (3,)).tolist(),
        )

    first = draw()
    restore_rng_state(state)
    assert draw() == first
    draw()
    restore_rng_state(load_latest_checkpoint(tmp_path)[1]["rng"])  # also after a weights_only round trip
    assert draw() == first


# ---- CheckpointWriter: the same checkpoints, written in the background -----------------------------------
def full_disk(buffer: StateBuffer, path: Path) -> dict:
    """A ``StateBuffer.write_to`` on a full disk."""
    raise OSError(28, "No space left on device")


def test_writer_snapshots_the_state_and_writes_the_same_checkpoint(tmp_path: Path) -> None:
    """The caller changes its tensors as soon as save returns: the checkpoint holds the values at the
    call, byte for byte the checkpoint save_training_checkpoint writes."""
    state = make_state(5)
    expected = save_training_checkpoint(tmp_path / "sync", 5, state)
    writer = CheckpointWriter()
    path = writer.save(tmp_path / "async", 5, state)
    state["model"]["w"].add_(100.0)  # the next optimizer step
    writer.wait()
    assert path == checkpoint_directory(tmp_path / "async", 5)
    assert (path / "state.pt").read_bytes() == (expected / "state.pt").read_bytes()
    files = [json.loads((p / "manifest.json").read_text())["files"] for p in (path, expected)]
    assert files[0] == files[1]
    assert torch.equal(load_latest_checkpoint(tmp_path / "async")[1]["model"]["w"], torch.full((64, 32), 5.0))


def test_writer_returns_before_the_write_and_waits_for_it(tmp_path: Path, monkeypatch) -> None:
    """save returns while the disk work is still held up; wait() returns once it is done."""
    release, written = threading.Event(), threading.Event()
    real_write_to = StateBuffer.write_to

    def held_write_to(self, path):
        assert release.wait(timeout=30), "save did not return before its write"
        record = real_write_to(self, path)
        written.set()
        return record

    monkeypatch.setattr(StateBuffer, "write_to", held_write_to)
    writer = CheckpointWriter()
    writer.save(tmp_path, 1, make_state(1))
    assert not written.is_set() and steps_on_disk(tmp_path) == []
    release.set()
    writer.wait()
    assert written.is_set() and steps_on_disk(tmp_path) == [1]


def test_writer_keeps_the_last_and_raises_a_failed_write(tmp_path: Path, monkeypatch) -> None:
    writer = CheckpointWriter()
    for step in (1, 2, 3):
        writer.save(tmp_path, step, make_state(step), keep_last=2)
    writer.wait()
    assert steps_on_disk(tmp_path) == [2, 3]

    monkeypatch.setattr(StateBuffer, "write_to", full_disk)
    writer.save(tmp_path, 4, make_state(4), keep_last=2)
    with pytest.raises(
        CheckpointError, match="step 4 .*No space left on device; .*earlier checkpoints are intact"
    ):
        writer.wait()
    writer.wait()  # reported once
    assert steps_on_disk(tmp_path) == [2, 3]  # no half checkpoint, nothing pruned
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_a_full_disk_is_one_line_naming_the_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A save on a full disk printed a 90-line OSError traceback from the background write; it is one
    CheckpointError naming the step, the directory and the reason, for every save path, and the earlier
    checkpoints stay as they were."""
    save_training_checkpoint(tmp_path, 1, make_state(1))

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_checkpoints, "write_synced", full)  # the manifest, written on every path
    expected = f"cannot save the checkpoint of step 2 in {tmp_path / 'checkpoints'}: No space left on device"
    with pytest.raises(CheckpointError, match=re.escape(expected)) as raised:
        save_training_checkpoint(tmp_path, 2, make_state(2))
    assert "\n" not in str(raised.value)
    for reuse_limit in (state_file.REUSE_LIMIT, 100):  # written in the background / synchronously (large)
        monkeypatch.setattr(state_file, "REUSE_LIMIT", reuse_limit)
        writer = CheckpointWriter()
        with pytest.raises(CheckpointError, match=re.escape(expected)):
            writer.save(tmp_path, 2, make_state(2))
            writer.wait()
    assert steps_on_disk(tmp_path) == [1]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_writer_checks_the_state_before_returning(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="cannot go into a training checkpoint"):
        CheckpointWriter().save(tmp_path, 1, {"bad": object()})
    with pytest.raises(ValueError, match="step"):
        CheckpointWriter().save(tmp_path, -1, make_state(1))


def test_writer_saves_a_large_state_synchronously(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(state_file, "REUSE_LIMIT", 100)
    monkeypatch.setattr(StateBuffer, "serialise", None)  # the buffered path must not be reached
    writer = CheckpointWriter()
    writer.save(tmp_path, 3, make_state(3))
    assert steps_on_disk(tmp_path) == [3]  # before any wait
    assert torch.equal(load_latest_checkpoint(tmp_path)[1]["model"]["w"], torch.full((64, 32), 3.0))


def test_writer_block_waits_on_exit_and_keeps_the_block_error(tmp_path: Path, monkeypatch) -> None:
    with CheckpointWriter() as writer:
        writer.save(tmp_path, 1, make_state(1))
    assert steps_on_disk(tmp_path) == [1]  # durable on leaving the block

    monkeypatch.setattr(StateBuffer, "write_to", full_disk)
    with pytest.raises(KeyboardInterrupt) as raised, CheckpointWriter() as writer:
        writer.save(tmp_path, 2, make_state(2))
        raise KeyboardInterrupt
    assert "No space" in "".join(getattr(raised.value, "__notes__", []))
    assert steps_on_disk(tmp_path) == [1]
