"""Model assemblies built from ``k2lab.nn`` blocks."""

from k2lab.models.decoder import CausalLM, CausalLMOutput, build_model

__all__ = ["CausalLM", "CausalLMOutput", "build_model"]
