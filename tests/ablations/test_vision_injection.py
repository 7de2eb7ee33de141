"""`k2lab ablate vision-injection` on tiny k25-nano runs: equal visual budgets, outputs, distinct arms."""

from __future__ import annotations

import json

import pytest

from k2lab.ablations.common import load_settings
from k2lab.ablations.vision_injection import (
    ARMS,
    VisionInjectionConfig,
    analyse,
    arm_config,
    summarize_arm,
    tables,
    total_rows,
    visual_rows,
)
from k2lab.errors import K2LabError
from tests.ablations.test_optimizer import PNG_MAGIC, run_cli

# k25-nano: the k2-nano decoder and a 1-layer, 32-wide tower, so the arms train in a few seconds each.
TINY_VLM = """
preset = "k25-nano"
vocab_size = 300
data = "{data}"
eval_batches = 1
precision = "fp32"

[schedule]
warmup_steps = 2

[vision]
eval_max_new_tokens = 8
"""


def test_vision_injection_outputs(tmp_path, tiny_corpus, capsys):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(TINY_VLM.format(data=tiny_corpus))
    out = tmp_path / "vision"
    args = ("ablate", "vision-injection", "--recipe", recipe, "--out", out, "--steps", 10)
    sizes = ("--batch-size", 4, "--seq-len", 256, "--eval-samples", 6, "--jobs", 1, "--threads", 1)
    assert run_cli(*args, *sizes) == 0
    printed = capsys.readouterr().out
    flat = "".join(printed.split())  # rich wraps long paths and cells
    assert "vision_injection.json" in flat
    for label in ("early10:90", "mid20:80", "late50:50"):
        assert label in flat, label

    results = json.loads((out / "vision_injection.json").read_text())
    runs = results["runs"]
    assert [run["arm"] for run in runs] == list(ARMS)
    # vision from step 0 / 5 / 8 of 10 at 10 % / 20 % / 50 % of 4 rows: 4 visual rows of 40 in every arm
    assert [run["start_step"] for run in runs] == [0, 5, 8]
    assert [(run["visual_rows"], run["total_rows"]) for run in runs] == [(4, 40)] * 3
    assert results["same_visual_rows"] and all(run["visual_fraction"] == 0.1 for run in runs)
    assert len({run["val_loss"] for run in runs}) == 3  # the arms really differ
    kinds = results["kinds"]
    assert len(kinds) == 6
    for run in runs:
        assert set(run["visual_scores"]) == {*kinds, "mean"}
        assert all(0.0 <= value <= 1.0 for value in run["visual_scores"].values())
        assert run["val_curve"][-1] == {"step": 10, "val_loss": run["val_loss"]}
        assert not run["reused"]

    table = (out / "vision_injection.md").read_text()
    for fragment in (
        "| early 10:90 | 0 (0%) | 4 (10.00%) |",
        "| mid 20:80 | 5 (50%) |",
        "| late 50:50 |",
        "## Budget (of 40 rows) and text loss",
        "| arm | chart | counting | grounding_box | grounding_point | ocr | segmentation | mean |",
    ):
        assert fragment in table, fragment
    image = out / "vision_injection.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 20_000

    # Repeating the command reuses every finished arm.
    assert run_cli(*args, *sizes) == 0
    again = json.loads((out / "vision_injection.json").read_text())
    assert all(run["reused"] for run in again["runs"])


def vision_injection_config(**base) -> VisionInjectionConfig:
    """The study's settings with these ``base`` recipe fields."""
    return load_settings(VisionInjectionConfig, **{f"base.{key}": value for key, value in base.items()})


def test_every_arm_spends_the_same_visual_rows():
    for steps, batch in ((60, 8), (100, 4), (30, 10), (200, 3)):
        settings = vision_injection_config(steps=steps, batch_size=batch)
        rows = [visual_rows(arm_config(settings, arm)) for arm in ARMS]
        assert rows == [total_rows(arm_config(settings, "early")) // 10] * 3, (steps, batch, rows)
    accum = vision_injection_config(steps=20, batch_size=2, grad_accum=3)  # counted per micro-batch
    assert [visual_rows(arm_config(accum, arm)) for arm in ARMS] == [12, 12, 12]


def test_settings_and_bad_input():
    default = vision_injection_config()
    assert default.base.preset == "k25-mini" and default.arms == list(ARMS)
    assert default.base.eval_every == 20 and default.base.save_every == default.base.steps == 200
    assert default.jobs == 3 and default.base.vision.eval_samples == 60
    assert arm_config(default, "late").vision.start == 0.8 and arm_config(default, "late").vision.ratio == 0.5
    with pytest.raises(K2LabError, match="different visual budgets"):
        vision_injection_config(steps=11, batch_size=8)
    with pytest.raises(
        K2LabError,
        match=r"\(visual rows \{'early': 2, 'mid': 2, 'late': 3\} with 7 steps\); take "
        "steps a multiple of 10",
    ):  # was accepted and reported as 'visual budgets equal'
        vision_injection_config(steps=7, batch_size=3)
    with pytest.raises(K2LabError, match="no visual budgets"):  # every arm 0 rows: nothing compared
        vision_injection_config(steps=5, batch_size=1)
    with pytest.raises(K2LabError, match="vision-language preset"):
        vision_injection_config(preset="k2-nano")
    with pytest.raises(K2LabError, match="arms"):
        load_settings(VisionInjectionConfig, arms=["middle"])


def test_the_report_gives_the_start_actually_used(tmp_path):
    """15 steps × 8 rows: 12 visual rows in every arm (accepted), but the mid arm starts at step 7 of 15, not at
    50 %; the table said the nominal "7 (50%)"."""
    settings = vision_injection_config(steps=15, batch_size=8)
    settings.out = str(tmp_path)
    configs = {arm: arm_config(settings, arm) for arm in ARMS}
    runs = [summarize_arm(arm, config, {"val_loss": 1.0}, False) for arm, config in configs.items()]
    results = analyse(settings, runs)
    assert results["same_visual_rows"] and [run["visual_rows"] for run in runs] == [12] * 3
    starts = [row[1] for row in tables(results)[0][2]]
    assert starts == ["0 (0%)", "7 (47%)", "12 (80%)"]
