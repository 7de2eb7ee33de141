"""Zero-vision SFT trajectories: each answer is the scene's truth by the visual rewards (an independent check
of the description and its program), the printed output is the program's, the file is deterministic and
loads as `k2lab sft` data, and `k2lab data zero-vision` writes it."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from k2lab.agentic.sft import load_conversations
from k2lab.cli import app
from k2lab.vision.rewards import TASK_KINDS, parse_text, visual_reward
from k2lab.vision.text_trajectories import (
    ZeroVisionConfig,
    run_program,
    scene_program,
    write_zero_vision,
    zero_vision_trajectories,
)

TRAJECTORIES = zero_vision_trajectories(90, seed=5)


@pytest.mark.parametrize("trajectory", TRAJECTORIES, ids=lambda t: t.sample.kind)
def test_the_final_answer_scores_full_reward_against_the_scenes_truth(trajectory):
    sample, (user, assistant) = trajectory.sample, trajectory.messages
    reply = assistant["content"]
    assert sample.prompt in user["content"] and user["role"] == "user"
    assert visual_reward(sample.kind, reply, sample.truth) == 1.0  # the whole reply, by its answer line
    if sample.kind == "ocr":
        assert parse_text(reply) == sample.truth
    _, scene, program = scene_program(sample)
    assert f"```python\n{scene}\n```" in user["content"] and f"```python\n{program}\n```" in reply
    assert f"```output\n{run_program(scene, program)}\n```\nAnswer: " in reply


def test_every_kind_is_drawn_and_the_seed_decides_everything():
    assert Counter(t.sample.kind for t in TRAJECTORIES) == {kind: 15 for kind in TASK_KINDS}
    again = zero_vision_trajectories(12, seed=5)
    assert [t.record() for t in again] == [t.record() for t in zero_vision_trajectories(12, seed=5)]
    other = zero_vision_trajectories(12, seed=6)
    assert [t.record() for t in other] != [t.record() for t in again]


def test_the_command_writes_sft_conversations(tmp_path):
    out = tmp_path / "zv.jsonl"
    result = CliRunner().invoke(
        app, ["data", "zero-vision", "--out", str(out), "--count", "8", "--seed", "5"]
    )
    assert result.exit_code == 0, result.output
    conversations = load_conversations(out)
    expected = zero_vision_trajectories(8, seed=5)
    assert [c.messages for c in conversations] == [t.messages for t in expected]
    assert json.loads(out.read_text().splitlines()[0])["task"] == expected[0].sample.kind
    assert (
        write_zero_vision(ZeroVisionConfig(out=tmp_path / "b.jsonl", count=8, seed=5)).read_text()
        == out.read_text()
    )
    bad = CliRunner().invoke(app, ["data", "zero-vision", "--out", str(out), "--tasks", "colour"])
    assert bad.exit_code != 0 and "subset of" in str(bad.exception)


def test_a_directory_as_out_is_refused_before_any_work(tmp_path):
    """``--out`` naming a directory got an IsADirectoryError traceback after every trajectory was drawn."""
    from k2lab.errors import K2LabError

    with pytest.raises(K2LabError, match="directory"):
        write_zero_vision(ZeroVisionConfig(out=tmp_path, count=2))
    out = write_zero_vision(ZeroVisionConfig(out=tmp_path / "new" / "zv.jsonl", count=2))
    assert len(out.read_text().splitlines()) == 2 and not [p for p in out.parent.iterdir() if p != out]
