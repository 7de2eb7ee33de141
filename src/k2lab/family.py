"""Which model family a config belongs to: the one test of K3-only features that both the checkpoint
format (``k2lab.hf.formats``: a model with any is written as ``kimi_k3``) and the chat format
(``k2lab.runtime.chat_format``: such a model speaks K3's XTML) ask, so the two cannot disagree.

A K3-only feature is a setting that neither DeepseekV3/Kimi-K2 nor Kimi Linear checkpoints can express:
the gated MLA output (in a model with MLA layers), an MLP activation other than SwiGLU (SiTU-GLU),
LatentMoE (``moe_latent_size``), Block AttnRes, and in a model with KDA layers the lower-bounded forget
gate or the full-rank output gate.
"""

from __future__ import annotations

from k2lab.config import ModelConfig

__all__ = ["is_k3_family", "k3_features"]


def k3_features(config: ModelConfig) -> list[str]:
    """Our K3-only settings, which neither DeepseekV3/Kimi-K2 nor Kimi Linear checkpoints can express."""
    problems = []
    if config.mla_output_gate and "mla" in config.layer_types:
        problems.append("mla_output_gate=True (gated MLA)")
    if config.mlp_activation != "swiglu":
        problems.append(f"mlp_activation={config.mlp_activation!r} (only SwiGLU)")
    if config.moe_latent_size is not None:
        problems.append(f"moe_latent_size={config.moe_latent_size} (LatentMoE)")
    if config.attnres_block_size is not None:
        problems.append(f"attnres_block_size={config.attnres_block_size} (Block AttnRes)")
    if config.has_kda:
        if config.kda_gate != "softplus":
            problems.append(f"kda_gate={config.kda_gate!r} (only the softplus forget gate)")
        if config.kda_output_gate != "low_rank":
            problems.append(f"kda_output_gate={config.kda_output_gate!r} (only the low-rank output gate)")
    return problems


def is_k3_family(config: ModelConfig) -> bool:
    """Whether ``config`` has a K3-only feature (``k3_features``): a ``kimi_k3`` checkpoint, K3's chat
    format and tokenizer."""
    return bool(k3_features(config))
