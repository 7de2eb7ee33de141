"""The processor files of a ``kimi_k25`` export: what ``transformers.AutoProcessor.from_pretrained(path)``
reads to build ``Kimi_K25Processor`` (image processor + tokenizer + video processor), as engines do.

    processor_config.json           {"processor_class": "Kimi_K25Processor"}
    preprocessor_config.json        Kimi_K25ImageProcessor: patch_size (p), merge_size (k), max_patches (B),
                                    size {max_height, max_width} (S, patches per side), image_mean / image_std
    video_preprocessor_config.json  Kimi_K25VideoProcessor: the same with the per-frame budget
                                    (``video_max_patches``) as max_patches, and temporal_patch_size

Every value comes from ``ProcessorConfig.from_vision_config`` (the one k2lab's own preprocessing uses), and the
switches are spelt out as k2lab's pipeline runs them: bicubic resize (``resample`` 3, antialiased in both),
rescale by 1/255 fused with normalize, RGB conversion. transformers then resizes, pads and patchifies as
``k2lab.vision.processor`` does. Frame sampling (the video processor's ``do_sample_frames`` / ``fps``) is
left at transformers' defaults: k2lab's ``preprocess_videos`` takes frames already sampled.
A kimi_k3 export gets none: transformers has no kimi_k3 processor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from k2lab.hf.io import PROCESSOR_FILES
from k2lab.hf.vlm_formats import KIMI_K25_VLM, write_vlm_format
from k2lab.models import CausalLM
from k2lab.vision.processor import ProcessorConfig
from k2lab.vision.vlm import VisionLanguageModel

__all__ = [
    "IMAGE_PROCESSOR_FILE",
    "PROCESSOR_FILE",
    "VIDEO_PROCESSOR_FILE",
    "processor_files",
    "processor_files_for",
]

PROCESSOR_FILE, IMAGE_PROCESSOR_FILE, VIDEO_PROCESSOR_FILE = PROCESSOR_FILES
PROCESSOR_CLASS = "Kimi_K25Processor"
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' PILImageResampling.BICUBIC


def _common(config: ProcessorConfig, budget: int) -> dict[str, Any]:
    """The keys both processors read: sizes, the patch budget ``budget`` and the pixel pipeline."""
    side = config.max_patches_per_side
    return {
        "processor_class": PROCESSOR_CLASS,
        "patch_size": config.patch_size,
        "merge_size": config.merge_size,
        "max_patches": budget,
        "size": {"max_height": side, "max_width": side},
        "do_resize": True,
        "resample": BICUBIC,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(config.image_mean),
        "image_std": list(config.image_std),
        "do_convert_rgb": True,
    }


def processor_files(config: ProcessorConfig) -> dict[str, str]:
    """File name -> JSON text of the three processor files for ``config``."""
    image = {"image_processor_type": "Kimi_K25ImageProcessor", **_common(config, config.max_patches)}
    video = {
        "video_processor_type": "Kimi_K25VideoProcessor",
        **_common(config, config.video_max_patches),
        "temporal_patch_size": config.temporal_patch_size,
    }
    files = {PROCESSOR_FILE: {"processor_class": PROCESSOR_CLASS}, IMAGE_PROCESSOR_FILE: image}
    files[VIDEO_PROCESSOR_FILE] = video
    return {name: json.dumps(data, indent=2) + "\n" for name, data in files.items()}


def processor_files_for(
    model: CausalLM | VisionLanguageModel, log: Callable[[str], object]
) -> dict[str, str]:
    """The processor files of ``model``'s export: those of its tower's ``ProcessorConfig`` for a model
    written as kimi_k25, none for a text model or a kimi_k3 one, nor (said in ``log``) for a tower whose
    merge kernel is not square, which transformers' processor (one ``merge_size``) cannot describe."""
    if not isinstance(model, VisionLanguageModel) or write_vlm_format(model.config) is not KIMI_K25_VLM:
        return {}
    try:
        config = ProcessorConfig.from_vision_config(model.config.vision)
    except ValueError as error:
        log(f"no processor files written ({error}): transformers' Kimi_K25Processor takes one merge_size")
        return {}
    return processor_files(config)
