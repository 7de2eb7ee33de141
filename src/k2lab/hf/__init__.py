"""Conversion to and from Hugging Face checkpoint formats (DeepseekV3 / Kimi-K2, Kimi Linear)."""

from k2lab.hf.io import dequantize_fp8, from_hf, read_hf_config, to_hf

__all__ = ["dequantize_fp8", "from_hf", "read_hf_config", "to_hf"]
