"""The vision path of Kimi K2.5: MoonViT-3D tower, temporal pooling and the MLP projector."""

from k2lab.vision.config import VisionConfig
from k2lab.vision.hf_names import from_hf_vision_names, to_hf_vision_names
from k2lab.vision.moonvit import MoonViT3D, MoonViTEncoder, VisionOutput, VisionProjector, vision_token_counts

__all__ = [
    "MoonViT3D",
    "MoonViTEncoder",
    "VisionConfig",
    "VisionOutput",
    "VisionProjector",
    "from_hf_vision_names",
    "to_hf_vision_names",
    "vision_token_counts",
]
