"""SFT of a vision-language checkpoint (K2.5): zero-vision SFT trains the language model on text rows and
leaves the vision tower bit for bit, saves a vision-language model and scores visual tasks in chat; the
text-vision arm's visual rows carry images with assistant-only targets and resume exactly; a text
checkpoint is refused visual rows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.sft import IGNORE, SFTData, SFTDataError
from k2lab.data.tokenizer import IMAGE_PAD
from k2lab.model_dir import load_model, save_model
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.runtime.chat import IM_END
from k2lab.train.config import load_sft_config
from k2lab.train.metrics import read_metrics
from k2lab.train.sections import SFTConfig
from k2lab.train.trainer import run_training
from k2lab.vision.visual_trajectories import visual_reply
from k2lab.vision.vlm import VisionLanguageModel, build_vlm
from tests.conftest import trajectory_tokenizer

STEPS, SEQ_LEN = 4, 256


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A random k25-nano checkpoint with a BPE tokenizer (trained on trajectory text), zero-vision
    trajectories, a k2-nano text checkpoint and a recipe."""
    root = tmp_path_factory.mktemp("sft_vision")
    data, tokenizer, special = trajectory_tokenizer(root, count=24, seed=0)
    text = dict(vocab_size=tokenizer.vocab_size, max_position_embeddings=1024, **special)
    save_model(build_vlm(load_vlm_preset("k25-nano", tokenizer.special_tokens, **text), seed=0), root / "vlm")
    save_model(build_model(load_preset("k2-nano", **text), seed=0), root / "text")
    for name in ("vlm", "text"):
        tokenizer.save(root / name / "tokenizer.json")
    recipe = root / "recipe.toml"
    recipe.write_text(
        f"steps = {STEPS}\nbatch_size = 2\nseq_len = {SEQ_LEN}\neval_every = 2\neval_batches = 1\n"
        'save_every = 2\nkeep_last = 5\nprecision = "fp32"\nsample_tokens = 2\n'
        "[optimizer]\nlr = 0.01\n[sft]\nvisual_eval_samples = 6\nvisual_eval_max_new_tokens = 4\n"
    )
    return {"root": root, "vlm": root / "vlm", "text": root / "text", "data": data, "recipe": recipe}


def sft_config(setup, out: Path, checkpoint: str = "vlm", **overrides):
    return load_sft_config(
        setup["recipe"],
        out=str(out),
        **{"sft.init_checkpoint": str(setup[checkpoint]), "sft.data": str(setup["data"]), **overrides},
    )


def losses(run: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(run)}


@pytest.mark.timeout(200)
def test_zero_vision_sft_trains_the_language_model_and_keeps_the_tower(setup):
    out = setup["root"] / "zero_vision"
    summary = run_training(sft_config(setup, out))
    before, after = load_model(setup["vlm"]), load_model(out / "model")
    assert isinstance(after, VisionLanguageModel) and after.config == before.config
    assert json.loads((out / "model" / "k2lab.json").read_text())["kind"] == "vlm"
    tower, trained = before.vision.state_dict(), after.vision.state_dict()
    assert all(torch.equal(tower[key], trained[key]) for key in tower)  # no gradient, no update, no decay
    embed = "embed.weight"
    assert not torch.equal(
        before.language_model.state_dict()[embed], after.language_model.state_dict()[embed]
    )
    rows = losses(out)
    assert len(rows) == STEPS and rows[STEPS] < rows[1]
    for key in ("visual_scores", "visual_scores_blind"):  # asked in chat, with images and on gray ones
        assert set(summary[key]) >= {"mean"} and all(0.0 <= v <= 1.0 for v in summary[key].values())
    assert "visual_samples_skipped" not in summary


def test_visual_rows_carry_pixels_and_only_the_assistants_tokens_are_targets(setup):
    data = SFTData.from_config(sft_config(setup, setup["root"] / "unused", **{"sft.visual_ratio": 0.5}))
    tokenizer, stream = data.tokenizer, data.batches.visual
    batch = next(data.batches)  # micro-batch 0: ⌊2·0.5⌋ = 1 visual row after 1 conversation row
    assert batch.input_ids.shape == (2, SEQ_LEN) and batch.media is not None
    image = tokenizer.special_tokens[IMAGE_PAD]
    assert not (batch.input_ids[0] == image).any()
    grids = batch.media["image_grid_thw"]
    merge = data.model.config.vision.merge_kernel_size
    expected = int(sum(t * h * w // (merge[0] * merge[1]) for t, h, w in grids.tolist()))
    assert int((batch.input_ids[1] == image).sum()) == expected > 0
    assert batch.media["pixel_values"].shape[0] == int(grids.prod(dim=1).sum())
    # the targets of the visual row are exactly each packed sample's reply and its <|im_end|>
    samples = [stream.draw(i).sample for i in range(stream.index)]
    assert len(samples) == grids.shape[0]
    targets = batch.labels[1][batch.labels[1] != IGNORE].tolist()
    end = tokenizer.special_tokens[IM_END]
    replies = [tokenizer.encode(visual_reply(s), allow_special=False) + [end] for s in samples]
    assert targets == [token for reply in replies for token in reply]
    assert data.model(batch.input_ids, segment_ids=batch.segment_ids, **batch.media).logits.isfinite().all()


@pytest.mark.timeout(300)
def test_the_text_vision_arm_resumes_exactly(setup, tmp_path):
    reference = tmp_path / "reference"
    summary = run_training(sft_config(setup, reference, **{"sft.visual_ratio": 0.5}))
    assert summary["visual_samples_skipped"] == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    for folder in (resumed / "checkpoints").iterdir():  # as if killed after step 2's checkpoint
        if not folder.name.endswith("2"):
            shutil.rmtree(folder)
    (resumed / "summary.json").unlink()
    shutil.rmtree(resumed / "model")
    run_training(sft_config(setup, resumed, **{"sft.visual_ratio": 0.5}), resume=True)
    assert losses(resumed) == losses(reference)  # every step, bit for bit
    before, after = load_model(setup["vlm"]).vision.state_dict(), load_model(reference / "model").vision
    assert any(not torch.equal(before[k], v) for k, v in after.state_dict().items())  # images train the tower


def test_visual_rows_need_a_vision_language_checkpoint(setup):
    config = sft_config(setup, setup["root"] / "unused", checkpoint="text", **{"sft.visual_ratio": 0.25})
    with pytest.raises(
        SFTDataError, match=r"visual_ratio 0.25 needs a vision-language checkpoint.*text model"
    ):
        SFTData.from_config(config)
    with pytest.raises(ValueError, match="must stay below 1"):
        SFTConfig(init_checkpoint="x", data="y", ptx_ratio=0.5, visual_ratio=0.5)
