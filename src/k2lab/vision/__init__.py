"""The vision path of Kimi K2.5 / K3: MoonViT-3D and MoonViT-V2 towers, the projector and preprocessing."""

from k2lab.vision.config import VisionConfig
from k2lab.vision.hf_names import from_hf_vision_names, to_hf_vision_names
from k2lab.vision.moonvit import (
    MoonViT3D,
    MoonViTEncoder,
    MoonViTV2,
    VisionOutput,
    VisionProjector,
    num_parameters,
    pixel_shuffle,
    vision_token_counts,
)
from k2lab.vision.processor import (
    ImageBatch,
    ProcessorConfig,
    VideoBatch,
    num_image_tokens,
    preprocess_images,
    preprocess_videos,
)

__all__ = [
    "ImageBatch",
    "MoonViT3D",
    "MoonViTEncoder",
    "MoonViTV2",
    "ProcessorConfig",
    "VideoBatch",
    "VisionConfig",
    "VisionOutput",
    "VisionProjector",
    "from_hf_vision_names",
    "num_image_tokens",
    "num_parameters",
    "pixel_shuffle",
    "preprocess_images",
    "preprocess_videos",
    "to_hf_vision_names",
    "vision_token_counts",
]
