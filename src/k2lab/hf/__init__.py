"""Conversion to and from Hugging Face checkpoint formats (DeepseekV3 / Kimi-K2)."""
