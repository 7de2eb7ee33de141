"""Inference: the latent KV cache, the automatic prefix cache and generation."""

from k2lab.infer.cache import LatentCache
from k2lab.infer.generate import GenerationCache, GenerationConfig, generate
from k2lab.infer.prefix_cache import PrefixCache

__all__ = ["GenerationCache", "GenerationConfig", "LatentCache", "PrefixCache", "generate"]
