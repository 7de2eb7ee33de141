"""GGUF for llama.cpp's ``kimi-linear`` graph: a Kimi-Linear-style k2lab model (KDA layers + NoPE MLA, DeepSeek
MoE), the part of ``k2lab export --format gguf`` that differs from the ``deepseek2`` file of
``k2lab.hf.gguf_export`` (which writes the globals, the MLA and MoE tensors and the tokenizer for both).

Metadata (``kimi-linear.*``, what llama.cpp's ``llama_model_kimi_linear`` reads): the ``deepseek2`` keys of the
MLA and the experts unchanged (``key_length`` r + d_rope, ``key_length_mla`` d_nope + d_rope, ...), except

* ``attention.head_count_kv``: one entry per layer, 0 for a KDA layer (llama.cpp marks it recurrent by that)
  and 1 for an MLA layer (run as MQA over the latent);
* ``ssm.conv_kernel`` W (the short convolution) and ``kda.head_dim`` K.

llama.cpp's KDA uses ``attention.head_count`` heads, so ``linear_num_heads`` must equal
``num_attention_heads``. Its MLA layers apply no rotation to the d_rope slice (NoPE, as ours with
``mla_rope=False``) and score with (d_nope + d_rope)^-1/2.

KDA tensors of layer i (``blk.i.``; numpy shapes, GGUF lists them reversed), ours -> GGUF:

* ``attn.{q,k,v}_proj`` [H·K, D] -> ``attn_q`` / ``attn_k`` / ``attn_v``; ``attn.o_proj`` -> ``attn_output``;
* ``attn.conv1d`` [3·H·K, 1, W] (channels q | k | v) -> ``ssm_conv1d_{q,k,v}`` [1, H·K, 1, W] each (the same
  taps, kernel position fastest, as llama.cpp's ``ssm_conv`` reads them);
* ``forget_gate.f_a_proj`` [K, D] -> ``ssm_f_a``, ``f_b_proj`` [H·K, K] -> ``ssm_f_b``,
  ``forget_gate.dt_bias`` [H·K] -> ``ssm_dt.bias``;
* ``forget_gate.A_log`` [H] -> ``ssm_a`` [1, 1, H, 1] holding **A = −exp(A_log)**, so that llama.cpp's
  g = A · softplus(W_fb W_fa x + dt_bias) is our log-decay;
* ``b_proj`` [H, D] -> ``ssm_beta`` (β = sigmoid); ``g_a_proj`` [K, D] -> ``ssm_g_a``, ``g_b_proj`` [H·K, K] ->
  ``ssm_g_b`` (the low-rank output gate); ``o_norm`` [K] -> ``ssm_norm`` (RMSNorm(o)·w·sigmoid(gate)).

The convolution taps and A stay fp32 in an fp16 / bf16 file (llama.cpp's ``ssm_conv`` and the decay product
take fp32). Refused with a ``ConfigError`` naming the setting: what Kimi Linear checkpoints cannot express
(K3's gated MLA, SiTU-GLU, LatentMoE, Block AttnRes, the lower-bounded gate, the full-rank output gate; RoPE
MLA, YaRN, a tied head: ``k2lab.hf.kimi_linear.config_to_hf``), and what llama.cpp's graph does not do: KDA
heads other than the attention heads, a q LoRA in the MLA (it reads no ``q_lora_rank``), top-k weights left unnormalised (it always renormalises), and
group-limited routing (it routes over all experts).
"""

from __future__ import annotations

import gguf
import torch

from k2lab.config import ConfigError, ModelConfig

__all__ = ["GGUF_ARCH", "check_kimi_linear_gguf", "kda_tensors", "keeps_fp32", "kimi_linear_metadata"]

GGUF_ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.KIMI_LINEAR]  # "kimi-linear"
T = gguf.MODEL_TENSOR
_KDA = {  # ours after ``layers.{i}.attn.`` -> (GGUF tensor, suffix)
    "q_proj.weight": (T.ATTN_Q, ".weight"),
    "k_proj.weight": (T.ATTN_K, ".weight"),
    "v_proj.weight": (T.ATTN_V, ".weight"),
    "forget_gate.f_a_proj.weight": (T.SSM_F_A, ".weight"),
    "forget_gate.f_b_proj.weight": (T.SSM_F_B, ".weight"),
    "forget_gate.dt_bias": (T.SSM_DT, ".bias"),
    "forget_gate.A_log": (T.SSM_A, ""),
    "b_proj.weight": (T.SSM_BETA, ".weight"),
    "g_a_proj.weight": (T.SSM_G_A, ".weight"),
    "g_b_proj.weight": (T.SSM_G_B, ".weight"),
    "o_norm.weight": (T.SSM_NORM, ".weight"),
    "o_proj.weight": (T.ATTN_OUT, ".weight"),
}
_CONV = "conv1d.weight"
_CONV_PARTS = (T.SSM_CONV1D_Q, T.SSM_CONV1D_K, T.SSM_CONV1D_V)
_FP32 = frozenset(gguf.TENSOR_NAMES[kind].split(".")[-1] for kind in (*_CONV_PARTS, T.SSM_A))


def keeps_fp32(name: str) -> bool:
    """Whether the GGUF tensor ``name`` (``blk.{i}.ssm_conv1d_q.weight``, ``blk.{i}.ssm_a`` ...) stays fp32."""
    parts = name.split(".")
    return len(parts) > 2 and parts[0] == "blk" and parts[2] in _FP32


def check_kimi_linear_gguf(config: ModelConfig) -> None:
    """Refuse what llama.cpp's ``kimi-linear`` graph would run differently (``ConfigError`` naming it); the
    Kimi Linear checkpoint refusals (``config_to_hf``) are checked by the caller."""
    problems = []
    if config.has_kda and config.linear_num_heads != config.num_attention_heads:
        problems.append(
            f"linear_num_heads {config.linear_num_heads} != num_attention_heads {config.num_attention_heads} "
            "(its KDA layers use attention.head_count heads)"
        )
    if config.q_lora_rank is not None and "mla" in config.layer_types:
        problems.append(
            f"q_lora_rank={config.q_lora_rank} (it reads no q LoRA rank, as Kimi Linear has none: llama-cpp-python "
            "0.3.36 stops at \"tensor 'blk.1.attn_q_a_norm.weight' has wrong shape; expected 0\"); use q_lora_rank=None"
        )
    if not config.norm_topk_prob:
        problems.append("norm_topk_prob=False (it always renormalises the top-k expert weights)")
    if config.n_group > 1 and config.topk_group < config.n_group:
        problems.append(
            f"group-limited routing (topk_group {config.topk_group} of n_group {config.n_group}; it routes "
            "over all experts)"
        )
    if problems:
        raise ConfigError("llama.cpp's kimi-linear graph cannot run this model: " + "; ".join(problems))


def _name(kind: gguf.MODEL_TENSOR, layer: int, suffix: str) -> str:
    return gguf.TENSOR_NAMES[kind].format(bid=layer) + suffix


def kda_tensors(layer: int, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for the KDA parameter ``layers.{layer}.attn.{name}`` as the module docstring says;
    an empty list for a name with no ``kimi-linear`` tensor."""
    if name == _CONV:
        channels, _, width = tensor.shape
        parts = tensor.reshape(3, 1, channels // 3, 1, width).unbind(0)  # [1, H·K, 1, W] each
        return [(_name(kind, layer, ".weight"), part) for kind, part in zip(_CONV_PARTS, parts, strict=True)]
    if name not in _KDA:
        return []
    kind, suffix = _KDA[name]
    if kind == T.SSM_A:
        tensor = -tensor.float().exp().reshape(1, 1, -1, 1)
    return [(_name(kind, layer, suffix), tensor)]


def kimi_linear_metadata(
    config: ModelConfig, deepseek2: dict[str, tuple[object, gguf.GGUFValueType]]
) -> dict[str, tuple[object, gguf.GGUFValueType]]:
    """``kimi-linear.*`` key -> (value, GGUF type), from the un-prefixed ``deepseek2`` values of the config."""
    u32 = gguf.GGUFValueType.UINT32
    values = dict(deepseek2)
    kv_heads = [1 if kind == "mla" else 0 for kind in config.layer_types]
    values["attention.head_count_kv"] = (kv_heads, gguf.GGUFValueType.ARRAY)
    values["ssm.conv_kernel"] = (config.linear_conv_kernel_dim, u32)
    values["kda.head_dim"] = (config.linear_head_dim, u32)
    return {f"{GGUF_ARCH}.{key}": value for key, value in values.items()}
