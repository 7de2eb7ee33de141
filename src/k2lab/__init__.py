"""k2lab: the Kimi K2 model family (K2, K2.5, K3) as tested PyTorch software."""

from k2lab.config import ModelConfig
from k2lab.models import CausalLM, build_model
from k2lab.presets import available_presets, load_preset

__version__ = "0.1.0"
__all__ = ["CausalLM", "ModelConfig", "available_presets", "build_model", "load_preset"]
