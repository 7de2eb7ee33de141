"""A kimi_k25 export carries the processor files transformers' ``AutoProcessor`` reads, with k2lab's sizes.

The export is a k25-nano with a non-default tower (patch 8, volumes of 2 frames), so values copied from
transformers' class defaults (patch 14, 4 frames) would fail. transformers' Kimi-K2.5 image / video
processors need torchvision, which the project's venv does not carry: the end-to-end comparison skips
without it; the files, the values transformers reads from them and transformers' own ``navit_resize`` (taken
from its source) against k2lab's token counts are checked everywhere.

Bound of the pixel comparison: both resize the same uint8 pixels with PyTorch's uint8 antialiased bicubic
kernel (identical bytes) and normalise as (x − 255μ) / (255σ) in fp32 with the same rounded constants, so
the values are expected bit-identical; ``PIXEL_TOL`` = 4 ulp(1) = 2⁻²¹ only admits the two fp32 roundings
of the fused normalisation taken in another order (|x̂| ≤ 1).
"""

from __future__ import annotations

import ast
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from k2lab.data.tokenizer import IMAGE_PAD, Tokenizer
from k2lab.hf.export import ExportConfig, export
from k2lab.hf.processor_files import IMAGE_PROCESSOR_FILE, PROCESSOR_FILE, VIDEO_PROCESSOR_FILE
from k2lab.vision.processor import ProcessorConfig, num_image_tokens, preprocess_images, preprocess_videos
from tests.hf.conftest import k25_config

PIXEL_TOL = 2.0**-21
# odd sizes: one padded only, two past the 16,384-patch budget at p = 8 (resized), one past the side cap
IMAGE_SIZES = [(37, 53), (1100, 1300), (1500, 700)]


@pytest.fixture(scope="module")
def ours(tokenizer: Tokenizer) -> ProcessorConfig:
    return ProcessorConfig.from_vision_config(k25_config(tokenizer).vision)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_the_files_transformers_reads_hold_our_processor_config(k25_export: Path, ours: ProcessorConfig):
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    assert all((k25_export / name).is_file() for name in (PROCESSOR_FILE, VIDEO_PROCESSOR_FILE))
    processor = json.loads((k25_export / PROCESSOR_FILE).read_text())
    image, _ = ImageProcessingMixin.get_image_processor_dict(str(k25_export), local_files_only=True)
    video, _ = BaseVideoProcessor.get_video_processor_dict(str(k25_export), local_files_only=True)
    assert processor["processor_class"] == image["processor_class"] == "Kimi_K25Processor"
    assert image["image_processor_type"] == "Kimi_K25ImageProcessor"
    assert video["video_processor_type"] == "Kimi_K25VideoProcessor"
    side = {"max_height": ours.max_patches_per_side, "max_width": ours.max_patches_per_side}
    for data, budget in ((image, ours.max_patches), (video, ours.video_max_patches)):
        assert (data["patch_size"], data["merge_size"], data["max_patches"]) == (8, 2, budget)
        assert data["size"] == side
        assert data["image_mean"] == list(ours.image_mean) and data["image_std"] == list(ours.image_std)
        assert data["resample"] == 3 and data["rescale_factor"] == 1 / 255
    assert video["temporal_patch_size"] == ours.temporal_patch_size == 2


def _transformers_navit_resize() -> Callable[..., tuple[tuple[int, int], tuple[int, int]]]:
    """transformers' ``navit_resize``, compiled from its installed source alone (the module imports
    torchvision, which the sizing rule does not use)."""
    import transformers.models.kimi_k25 as package

    source = (Path(inspect.getfile(package)).parent / "image_processing_kimi_k25.py").read_text()
    tree = ast.parse(source)
    (function,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize"]
    scope: dict = {"math": math}
    exec(compile(ast.Module([function], type_ignores=[]), "navit_resize", "exec"), scope)
    return scope["navit_resize"]


def test_transformers_sizing_of_the_exported_config_gives_our_token_counts(
    k25_export: Path, ours: ProcessorConfig
):
    config = json.loads((k25_export / IMAGE_PROCESSOR_FILE).read_text())
    navit_resize = _transformers_navit_resize()
    sizes = [*IMAGE_SIZES, (1, 1), (8, 8), (9, 17), (4100, 30), (5000, 5000), (2049, 2047)]
    for h, w in sizes:
        _, (pad_h, pad_w) = navit_resize(
            h,
            w,
            patch_size=config["patch_size"],
            merge_kernel_size=config["merge_size"],
            max_patches=config["max_patches"],
            max_size_per_side=config["size"]["max_height"],
        )
        tokens = (
            (pad_h // config["patch_size"]) * (pad_w // config["patch_size"]) // config["merge_size"] ** 2
        )
        assert tokens == num_image_tokens(h, w, ours), (h, w)


def test_auto_processor_preprocesses_like_k2lab(k25_export: Path, ours: ProcessorConfig):
    pytest.importorskip("torchvision", reason="transformers' Kimi-K2.5 processors need torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(k25_export), local_files_only=True)
    assert type(processor).__name__ == "Kimi_K25Processor"
    images = [_image(h, w, seed) for seed, (h, w) in enumerate(IMAGE_SIZES)]
    text = " ".join(f"{IMAGE_PAD} image {i}" for i in range(len(images)))
    theirs = processor(text=[text], images=images, return_tensors="pt")
    mine = preprocess_images(images, ours)
    assert torch.equal(theirs["image_grid_thw"], mine.image_grid_thw)
    assert theirs["pixel_values"].shape == mine.pixel_values.shape
    assert (theirs["pixel_values"] - mine.pixel_values).abs().max().item() <= PIXEL_TOL
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    placed = int((theirs["input_ids"] == image_id).sum())
    assert placed == sum(num_image_tokens(h, w, ours) for h, w in IMAGE_SIZES)


def test_auto_processor_preprocesses_videos_like_k2lab(k25_export: Path, ours: ProcessorConfig):
    pytest.importorskip("torchvision", reason="transformers' Kimi-K2.5 processors need torchvision")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(k25_export), local_files_only=True)
    videos = [np.stack([_image(530, 610, s) for s in range(5)]), np.stack([_image(40, 70, 9)] * 3)]
    theirs = processor.video_processor(videos=videos, do_sample_frames=False, return_tensors="pt")
    mine = preprocess_videos(videos, ours)
    assert torch.equal(theirs["video_grid_thw"], mine.video_grid_thw)
    assert theirs["num_chunks_per_video"].tolist() == mine.volumes_per_video == [3, 2]
    assert (theirs["pixel_values_videos"] - mine.pixel_values_videos).abs().max().item() <= PIXEL_TOL


def test_a_text_export_over_a_vision_language_one_drops_its_processor_files(
    k25_export: Path, model_dir: Path, tmp_path: Path
):
    """Files of an earlier export that the new one does not write are carried over (a README, eval results);
    the processor files describe the old model's preprocessing, so a text model written over it drops them."""
    import shutil

    out = tmp_path / "hf"
    shutil.copytree(k25_export, out)
    (out / "NOTES.md").write_text("mine\n")
    export(ExportConfig(out=out), model_dir, log=lambda line: None)
    assert (out / "NOTES.md").read_text() == "mine\n"
    for name in (PROCESSOR_FILE, IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE):
        assert not (out / name).exists(), name
