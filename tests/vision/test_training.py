"""Joint vision-text training: the injection schedule, visual rows, a k25-nano run end to end with exact
resume, `k2lab generate --image` on its checkpoint, and a K3-style (KDA hybrid) language side."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from k2lab.data.corpus import load_corpus
from k2lab.data.tokenizer import IMAGE_PAD, MEDIA_BEGIN, MEDIA_END, train_tokenizer
from k2lab.errors import K2LabError
from k2lab.infer.cache import LatentCache
from k2lab.model_dir import load_model
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.train.config import load_train_config
from k2lab.train.metrics import read_metrics
from k2lab.train.sections import VisionDataConfig
from k2lab.train.trainer import run_training
from k2lab.vision.mixture import (
    IGNORE,
    EncodedSample,
    VisualStream,
    check_samples_fit,
    pack_visual_rows,
    vision_rows_at,
    visual_rows_total,
)
from k2lab.vision.tasks import make_task
from k2lab.vision.vlm import VisionLanguageModel, build_vlm
from tests.conftest import randomize


@pytest.mark.parametrize(("start", "ratio"), [(0.0, 0.1), (0.5, 0.2), (0.8, 0.5)])
def test_every_arm_spends_the_same_visual_budget(start, ratio):
    """Early 10:90, mid 20:80 and late 50:50 (K2.5) all give 10 % of 100 steps × 8 rows = 80 visual rows."""
    steps, rows = 100, 8
    config = VisionDataConfig(start=start, ratio=ratio)
    per_step = [vision_rows_at(s, rows, ratio, config.start_step(steps)) for s in range(steps)]
    assert sum(per_step) == 80
    assert all(n == 0 for n in per_step[: config.start_step(steps)])
    assert max(per_step) - min(per_step[config.start_step(steps) :]) <= 1  # spread evenly once started


@pytest.mark.parametrize(
    ("steps", "accum", "rows", "start", "ratio"),
    [(100, 1, 8, 0.5, 0.2), (7, 3, 2, 0.3, 0.1), (4, 1, 2, 0, 0.1)],
)
def test_the_runs_visual_rows_are_the_schedules_sum(steps, accum, rows, start, ratio):
    config = VisionDataConfig(start=start, ratio=ratio)
    micro = [vision_rows_at(m, rows, ratio, config.start_step(steps) * accum) for m in range(steps * accum)]
    assert visual_rows_total(steps, rows, accum, config) == sum(micro)


def test_a_sample_longer_than_a_row_is_skipped_and_counted_never_cut():
    def sample(length):
        return EncodedSample([7] * length, [True] * length, torch.zeros(4, 3), torch.tensor([[1, 2, 2]]), 1)

    batch, media, skipped = pack_visual_rows(iter([sample(5), sample(12), sample(4), sample(3)]), 1, 10, 0)
    assert skipped == 1 and media["image_grid_thw"].shape[0] == 2  # the 5- and 4-token samples
    assert batch.input_ids[0].tolist() == [7] * 9 + [0]


@pytest.fixture
def tokenizer(tiny_corpus):
    return train_tokenizer(load_corpus(str(tiny_corpus)), vocab_size=300)


def test_visual_rows_hold_whole_samples_with_their_images(tokenizer):
    vision = load_vlm_preset("k25-nano", tokenizer.special_tokens, vocab_size=300).vision
    stream = VisualStream(tokenizer, vision, ("counting", "ocr", "grounding_box"), seed=0)
    batch, media, skipped = pack_visual_rows(stream, rows=3, seq_len=160, pad_id=tokenizer.pad_id)
    assert skipped == 0
    special = tokenizer.special_tokens
    pad, begin, end = special[IMAGE_PAD], special[MEDIA_BEGIN], special[MEDIA_END]
    ids, labels = batch.input_ids, batch.labels
    # one image per media_begin, each with exactly its grid's placeholder count, in reading order
    counts = [(h // 2) * (w // 2) for _, h, w in media["image_grid_thw"].tolist()]
    assert int((ids == begin).sum()) == len(counts) == int((ids == end).sum())
    assert int((ids == pad).sum()) == sum(counts)
    flat = ids.flatten().tolist()
    runs, run = [], 0
    for token in flat:
        if token == pad:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    assert runs == counts
    # media markup is never a target; every other in-sample token is
    target_tokens = ids[:, 1:][labels[:, :-1] != IGNORE]
    assert not bool(((target_tokens == pad) | (target_tokens == begin) | (target_tokens == end)).any())
    assert media["pixel_values"].shape[0] == int(media["image_grid_thw"].prod(-1).sum())


def test_a_seq_len_too_short_for_the_visual_samples_is_refused_before_training(tokenizer):
    vision = load_vlm_preset("k25-nano", tokenizer.special_tokens, vocab_size=300).vision
    stream = VisualStream(tokenizer, vision, ("counting", "grounding_box"), seed=0)
    longest = max(len(stream.draw(i).ids) for i in range(8))
    check_samples_fit(stream, longest - 1, count=8)  # the longest just fits T + 1
    with pytest.raises(K2LabError, match=f"give --seq-len {longest - 1} or more"):
        check_samples_fit(stream, longest - 2, count=8)
    assert stream.index == 0  # the probe draws, it does not consume


def recipe(tmp_path, corpus, out, steps, preset="k25-nano", **vision):
    fields = {"start": 0.25, "ratio": 0.5, "eval_samples": 6, "eval_max_new_tokens": 6, **vision}
    table = "\n".join(f"{k} = {v!r}" for k, v in fields.items())
    path = tmp_path / f"{out.name}.toml"
    path.write_text(
        f"""
preset = "{preset}"
vocab_size = 300
data = "{corpus}"
steps = {steps}
batch_size = 2
seq_len = 256
eval_every = 4
eval_batches = 1
save_every = 3
keep_last = 5
precision = "fp32"
sample_tokens = 2
out = "{out}"
[optimizer]
lr = 0.01
[vision]
{table}
"""
    )
    return path


@pytest.mark.timeout(300)
def test_joint_run_resumes_exactly_and_generates_from_an_image(tmp_path, tiny_corpus):
    reference = tmp_path / "reference"
    summary = run_training(load_train_config(recipe(tmp_path, tiny_corpus, reference, steps=8)))
    assert set(summary["visual_scores"]) >= {"counting", "ocr", "mean"}
    assert summary["visual_rows"] == 6 and summary["visual_samples_skipped"] == 0  # ⌊(8 − 2)·2·0.5⌋
    assert all(0.0 <= v <= 1.0 for v in summary["visual_scores"].values())
    model = load_model(reference / "model")
    assert isinstance(model, VisionLanguageModel)

    # resume from the step-3 checkpoint (visual batches from step 2 on): the same losses afterwards
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    for folder in (resumed / "checkpoints").iterdir():
        if not folder.name.endswith("3"):
            shutil.rmtree(folder)
    config = load_train_config(recipe(tmp_path, tiny_corpus, resumed, steps=8))
    run_training(config, resume=True)
    losses = {r["step"]: r["loss"] for r in read_metrics(reference)}
    again = {r["step"]: r["loss"] for r in read_metrics(resumed)}
    assert again == losses

    image = tmp_path / "shapes.png"
    make_task("counting", 7).image.save(image)
    command = [
        sys.executable,
        "-m",
        "k2lab",
        "generate",
        "-c",
        str(reference / "model"),
        "--image",
        str(image),
    ]
    result = subprocess.run(
        [*command, "--prompt", "How many?", "--max-new-tokens", "3"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("How many?")
    bad = subprocess.run(
        [*command[:-1], str(tmp_path / "none.png"), "--prompt", "x"], capture_output=True, text=True
    )
    assert bad.returncode != 0 and "cannot read image" in bad.stderr


def test_k3_style_language_side_caches_like_a_full_forward(tokenizer):
    """A VLM over a KDA / gated-MLA hybrid: decoding with the cache after an image prompt matches the
    full forward, and left padding changes nothing."""
    from k2lab.vision.mixture import image_prompts

    config = load_vlm_preset("k3-vl-nano", tokenizer.special_tokens, vocab_size=300)
    model = randomize(build_vlm(config), seed=0)
    images = [make_task("counting", 1).image, make_task("ocr", 2).image]
    prompts, media = image_prompts(
        tokenizer, config.vision, images, ["How many?", "Read it: a longer question"]
    )
    width = max(map(len, prompts))
    ids = torch.zeros(2, width + 1, dtype=torch.long)
    valid = torch.zeros(2, width + 1, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) : width] = torch.tensor(prompt)
        valid[row, width - len(prompt) :] = True
    ids[:, width] = 7  # one more token, decoded with the cache
    with torch.no_grad():
        full = model(ids, attention_mask=valid, **media).logits
        cache = LatentCache(config.text, 2, width + 1)
        model(ids[:, :width], attention_mask=valid[:, :width], cache=cache, **media)
        step = model(ids[:, width:], cache=cache).logits
        first, first_media = image_prompts(tokenizer, config.vision, images[:1], ["How many?"])
        alone = model(torch.tensor([first[0] + [7]]), **first_media).logits
    assert (full[:, -1] - step[:, -1]).abs().max() < 1e-4
    assert (full[0, -1] - alone[0, -1]).abs().max() < 1e-4


def test_k25_preset_counts_on_the_meta_device():
    """K2.5 = K2's 1.03T decoder + a 0.42B MoonViT-3D (the seed's "~1T / 32B + 0.4B ViT")."""
    from k2lab import load_preset
    from k2lab.params import count_parameters
    from k2lab.presets.vision_language import vlm_parameter_counts
    from k2lab.vision.moonvit import num_parameters

    config = load_vlm_preset("k25")
    counts = vlm_parameter_counts(config)
    assert counts["language_model"] == count_parameters(load_preset("k2")).total == 1_026_408_232_448
    assert counts["vision_tower"] == num_parameters(config.vision, include_projector=False) == 416_866_032
    assert counts["vision_tower"] + counts["projector"] == num_parameters(config.vision)
    assert config.image_token_id == 163605  # K2.5's own ids with K2's vocabulary
