"""The text-vision SFT arm's replies: a hand-designed visual chain of thought, then an answer line that the
visual rewards score 1.0 against the task's truth."""

from __future__ import annotations

import pytest

from k2lab.vision.answers import final_answer
from k2lab.vision.rewards import TASK_KINDS, visual_reward
from k2lab.vision.tasks import generate_tasks
from k2lab.vision.visual_trajectories import visual_chain_of_thought, visual_reply


@pytest.mark.parametrize("sample", generate_tasks(36, seed=11), ids=lambda s: s.kind)
def test_the_reply_scores_full_reward(sample):
    reply = visual_reply(sample)
    assert reply.startswith(visual_chain_of_thought(sample) + "\nAnswer: ")
    assert visual_reward(sample.kind, reply, sample.truth) == 1.0


def test_answer_lines_by_hand():
    assert final_answer("counting", 3) == "Answer: 3"
    assert final_answer("chart", 7.0) == "Answer: 7" and final_answer("chart", "B") == "Answer: B"
    assert (
        final_answer("grounding_box", [(1, 2, 3, 4), (5, 6, 7, 8)])
        == "Answer: <box>1,2,3,4</box><box>5,6,7,8</box>"
    )
    assert final_answer("grounding_point", [(2.5, 4)]) == "Answer: <point>2.5,4</point>"
    assert final_answer("segmentation", [(0, 0), (4, 0), (0, 4)]) == "Answer: <polygon>0,0,4,0,0,4</polygon>"
    assert final_answer("ocr", "kimi") == "Answer: kimi"
    with pytest.raises(ValueError, match="unknown visual task kind"):
        final_answer("colour", 1)
    assert set(TASK_KINDS) == {"counting", "chart", "grounding_box", "grounding_point", "segmentation", "ocr"}
