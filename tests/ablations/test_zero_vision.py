"""`k2lab ablate zero-vision` on a tiny k25-nano base: settings, the row length, a whole run and its reuse."""

from __future__ import annotations

import json

import pytest

from k2lab.ablations.common import load_settings
from k2lab.ablations.zero_vision import (
    ARMS,
    ZeroVisionSettings,
    arm_config,
    row_length,
    run_zero_vision,
    visual_rows,
)
from k2lab.data import load_tokenizer
from k2lab.errors import K2LabError
from k2lab.model_dir import save_model
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.vlm import build_vlm
from tests.ablations.test_optimizer import PNG_MAGIC, run_cli
from tests.conftest import trajectory_tokenizer
from tests.vision.test_rl import held_out_cross_entropy


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A random k25-nano model with a 400-token BPE tokenizer trained on trajectory text."""
    root = tmp_path_factory.mktemp("zero_vision_base")
    _, tokenizer, special = trajectory_tokenizer(root, count=12, seed=1)
    config = load_vlm_preset(
        "k25-nano",
        tokenizer.special_tokens,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=2048,
        **special,
    )
    save_model(build_vlm(config, seed=0), root / "model")
    tokenizer.save(root / "model" / "tokenizer.json")
    return root / "model"


def test_whole_tiny_study_writes_the_outputs_and_reuses_its_runs(base, tmp_path, capsys):
    out = tmp_path / "study"
    args = [
        "ablate", "zero-vision", "--base-checkpoint", base, "--out", out, "--count", 8, "--steps", 2,
        "--batch-size", 2, "--eval-samples", 2, "--eval-max-new-tokens", 3, "--rl-iterations", 1,
        "--jobs", 1, "--threads", 1, "--set", "base.eval_batches=1", "--set", "base.precision=fp32",
        "--set", "rl.prompts_per_iteration=1", "--set", "rl.group_size=2", "--set", "rl.eval_samples=2",
        "--set", "rl.max_new_tokens=3", "--set", "visual_ratio=0.5", "--set", "rl.text_eval_rows=2",
        "--set", "rl.text_eval_seq_len=16",
    ]  # fmt: skip
    assert run_cli(*args) == 0
    flat = "".join(capsys.readouterr().out.split())
    assert "zero_vision.json" in flat and "zero-visionSFT" in flat
    results = json.loads((out / "zero_vision.json").read_text())
    runs = {run["arm"]: run for run in results["runs"]}
    assert list(runs) == ["reference", *ARMS]
    # 2 steps × 2 rows at ratio 0.5: micro-batches 0 and 1 hold ⌊2·0.5⌋ = 1 visual row each
    assert runs["text-vision"]["visual_rows"] == 2 and runs["zero-vision"]["visual_rows"] == 0
    assert runs["zero-vision"]["total_rows"] == runs["text-vision"]["total_rows"] == 4
    s = results["settings"]
    assert s["seq_len"] % 64 == 0 and s["seq_len"] >= s["longest_trajectory"] - 1 > s["seq_len"] - 64
    for run in runs.values():
        for key in ("visual_scores", "visual_scores_blind"):
            assert set(run[key]) == {*results["kinds"], "mean"}
            assert all(0.0 <= value <= 1.0 for value in run[key].values())
        assert not run["reused"]
    for arm in ARMS:
        rl = runs[arm]["rl"]
        assert len(rl["rewards"]) == 1 and set(rl["after"]) == {"chat", "blind", "text_loss"} and rl["before"]
        assert len(runs[arm]["val_curve"]) >= 1
    assert runs["zero-vision"]["val_loss"] != runs["text-vision"]["val_loss"]  # the arms really differ
    # visual RL's text loss before: each arm's own model on 2 held-out stdlib rows of 16 tokens (by hand)
    tokenizer = load_tokenizer(base / "tokenizer.json")
    text_before = {arm: runs[arm]["rl"]["before"]["text_loss"] for arm in ARMS}
    for arm in ARMS:
        by_hand = held_out_cross_entropy(out / "runs" / arm / "model", tokenizer, None, 2, 16)
        assert text_before[arm] == pytest.approx(by_hand, abs=1e-5)
        assert runs[arm]["rl"]["after"]["text_loss"] > 0 and runs[arm]["rl"]["text_eval"]["rows"] == 2
    assert text_before["zero-vision"] != text_before["text-vision"]
    table = (out / "zero_vision.md").read_text()
    zero_row = next(line for line in table.splitlines() if line.startswith("| zero-vision SFT |"))
    assert zero_row.split(" | ")[-2:] == [
        f"{text_before['zero-vision']:.4f}",
        f"{runs['zero-vision']['rl']['after']['text_loss']:.4f} |",
    ]
    for fragment in ("| arm | SFT val loss | visual mean (chat) | gray-image mean |", "| no SFT (base) | — |",
                     "| gray after RL | text loss before RL | text loss after RL |",
                     "Text loss: the language model's mean next-token cross-entropy",
                     "| zero-vision SFT |", "## The claim and ours", "K2.5 (seed)"):  # fmt: skip
        assert fragment in table, fragment
    image = out / "zero_vision.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 20_000
    assert len(list(out.glob("zero_vision-n8-seed0.jsonl"))) == 1

    assert run_cli(*args) == 0  # repeated: every run reused
    again = json.loads((out / "zero_vision.json").read_text())
    assert all(run["reused"] for run in again["runs"])
    assert all(run["rl"]["reused"] for run in again["runs"] if run["rl"])
    assert again["runs"][1]["visual_scores"] == results["runs"][1]["visual_scores"]


def test_settings_and_bad_input(tmp_path):
    default = load_settings(ZeroVisionSettings)
    assert default.base.steps == 50 and default.base.batch_size == 8 and default.count == 600
    assert default.pretrain.preset == "k25-mini" and default.pretrain.steps == 200
    assert (default.pretrain.vision.start, default.pretrain.vision.ratio) == (0.0, 0.1)
    assert default.rl_config().iterations == 16 and default.rl.max_new_tokens == 96 and default.jobs == 2
    # RL's held-out text: the corpus the study pre-trains the base on, unless given or the base is given
    corpus = str(tmp_path)
    assert load_settings(ZeroVisionSettings, **{"pretrain.data": corpus}).rl_config().text_eval_data == corpus
    given = {"pretrain.data": corpus, "base_checkpoint": corpus}
    assert load_settings(ZeroVisionSettings, **given).rl_config().text_eval_data is None
    named = {"pretrain.data": corpus, "rl.text_eval_data": "other"}
    assert load_settings(ZeroVisionSettings, **named).rl_config().text_eval_data == "other"
    config = arm_config(default, "text-vision", tmp_path, tmp_path / "d.jsonl", 448)
    assert config.sft.visual_ratio == 0.3 and config.seq_len == 448
    assert visual_rows(config) == 50 * 8 * 3 // 10  # ⌊S·B·v⌋ = 120 of 400 rows
    assert arm_config(default, "zero-vision", tmp_path, tmp_path / "d.jsonl", 448).sft.visual_ratio == 0
    # the row: the longest trajectory (a row holds seq_len + 1 tokens) rounded up to 64, within the context
    assert [row_length(default, n, 4096) for n in (413, 449, 450, 65)] == [448, 448, 512, 64]
    with pytest.raises(K2LabError, match="longest zero-vision trajectory has 5000 tokens"):
        row_length(default, 5000, 4096)
    assert row_length(load_settings(ZeroVisionSettings, **{"base.seq_len": 256}), 5000, 4096) == 256
    with pytest.raises(K2LabError, match="rl_iterations"):
        load_settings(ZeroVisionSettings, **{"rl.iterations": 3})
    with pytest.raises(K2LabError, match="visual_ratio"):
        load_settings(ZeroVisionSettings, visual_ratio=1.0)
    with pytest.raises(K2LabError, match="tasks"):
        load_settings(ZeroVisionSettings, tasks=["colour"])
    with pytest.raises(K2LabError, match="vision-language preset"):
        load_settings(ZeroVisionSettings, **{"pretrain.preset": "k2-nano"})


def test_a_text_base_is_refused_before_any_arm_trains(tmp_path):
    """A text model as --base-checkpoint trained the zero-vision arm on it and failed only at the text-vision
    arm's start; now nothing is written."""
    from k2lab import build_model, load_preset

    save_model(build_model(load_preset("k2-nano")), tmp_path / "text")
    out = tmp_path / "study"
    settings = load_settings(ZeroVisionSettings, base_checkpoint=str(tmp_path / "text"), out=str(out))
    with pytest.raises(K2LabError, match="is a text model"):
        run_zero_vision(settings)
    assert not (out / "runs" / "zero-vision").exists()
