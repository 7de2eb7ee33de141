"""Inference: the latent KV cache and generation."""

from k2lab.infer.cache import LatentCache
from k2lab.infer.generate import GenerationConfig, generate

__all__ = ["GenerationConfig", "LatentCache", "generate"]
