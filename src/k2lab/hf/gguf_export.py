"""GGUF for llama.cpp: a K2-family decoder (MLA + DeepSeek MoE) as llama.cpp's ``deepseek2`` graph, written
through the ``gguf`` package (``k2lab export --format gguf``), with the tokenizer llama.cpp needs. A model
with KDA layers or NoPE MLA (Kimi Linear style) is written as llama.cpp's ``kimi-linear`` graph instead: the
same globals, MLA, MoE and tokenizer, plus what ``k2lab.hf.gguf_kimi_linear`` adds and changes.

Metadata (``deepseek2.*``, what llama.cpp's ``llama_model_deepseek2`` reads): block/context/embedding/FFN
lengths, ``head_count`` H and ``head_count_kv`` 1 (MLA runs as MQA over the latent), ``attention.q_lora_rank``,
``attention.kv_lora_rank`` r, ``attention.key_length`` r + d_rope and ``attention.value_length`` r (the
latent head), ``attention.key_length_mla`` d_nope + d_rope and ``attention.value_length_mla`` d_v (the
decompressed head; the score scale is ``(d_nope + d_rope)^-1/2``), ``rope.dimension_count`` d_rope,
``rope.freq_base``, ``leading_dense_block_count``, the experts (``expert_count``, ``expert_used_count``,
``expert_group_count`` / ``expert_group_used_count``, ``expert_shared_count``, ``expert_feed_forward_length``),
``expert_gating_func`` sigmoid, ``expert_weights_norm`` (norm_topk_prob) and ``expert_weights_scale``
(routed_scaling_factor). YaRN as llama.cpp's converter writes it: ``rope.scaling.type`` yarn, ``factor``,
``original_context_length``, ``yarn_beta_fast`` / ``yarn_beta_slow`` and ``yarn_log_multiplier`` =
0.1 · mscale_all_dim (llama.cpp's convention; it can express only mscale = mscale_all_dim).

Tensors (numpy shapes; GGUF lists them reversed), ours -> GGUF, unchanged except where said:

* ``embed`` [V, D] -> ``token_embd``; ``norm`` -> ``output_norm``; ``lm_head`` [V, D] -> ``output`` (absent
  when tied: llama.cpp reuses ``token_embd``);
* per layer i (``blk.i.``): ``attn_norm``, ``attn_q_a`` [q_lora, D], ``attn_q_a_norm``, ``attn_q_b``
  [H·(d_nope+d_rope), q_lora] (or ``attn_q`` without a q LoRA), ``attn_kv_a_mqa`` [r + d_rope, D],
  ``attn_kv_a_norm``, ``attn_output`` [D, H·d_v], ``ffn_norm``; dense ``ffn_gate`` / ``ffn_up`` / ``ffn_down``;
  MoE ``ffn_gate_inp`` [E, D], ``exp_probs_b.bias`` [E] (the router's ``e_score_correction_bias``, fp32),
  ``ffn_{gate,up}_exps`` [E, F, D] and ``ffn_down_exps`` [E, D, F] (our stacked experts as they are),
  ``ffn_{gate,up,down}_shexp``;
* the MLA up-projection ``kv_up`` W [H·(d_nope+d_v), r], per head h rows ``[k_nope_h; v_h]``, is split for
  llama.cpp's absorbed attention: ``attn_k_b`` [H, r, d_nope] with ``k_b[h] = W_k[h]ᵀ`` and ``attn_v_b``
  [H, d_v, r] with ``v_b[h] = W_v[h]``.

RoPE needs no permutation: our rope features are interleaved pairs (``rope_interleave`` in the HF export),
which is llama.cpp's "normal" RoPE of ``deepseek2``. MTP layers are not written (llama.cpp's deepseek2
converter skips them too). ``dtype`` fp16 / bf16 casts the matrices; vectors (norms, the router bias) stay
fp32, as llama.cpp expects.

Tokenizer (``tokenizer.ggml.*``): model ``gpt2`` (byte-level BPE) with pre-tokenizer ``gpt-2`` (ByteLevel
with the GPT-2 split regex, which is what k2lab trains; anything else is refused), one token string per id up
to the model's vocabulary (``[PADi]`` of type UNUSED past the tokenizer's), token types (CONTROL for the
special tokens, USER_DEFINED for other added tokens, NORMAL), the merges as ``"left right"``, bos / eos / pad
ids, ``add_bos_token`` / ``add_eos_token`` false (k2lab adds no special tokens when encoding) and the chat
template. llama.cpp finds ``<|im_end|>`` as its end-of-turn token by name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from k2lab.config import ConfigError, ModelConfig
from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import K2LabError
from k2lab.fsutil import staged_file
from k2lab.hf import gguf_kimi_linear
from k2lab.hf.io import check_cast_range, model_state
from k2lab.hf.mapping import config_to_hf, hf_model_type
from k2lab.hf.mtp import main_state
from k2lab.models import CausalLM
from k2lab.vision.vlm import VisionLanguageModel

__all__ = ["GGUF_ARCH", "GGUF_MAGIC", "PRE_TOKENIZER", "gguf_metadata", "gguf_tensors", "write_gguf"]

GGUF_MAGIC = b"GGUF"  # the first four bytes of every GGUF file

GGUF_ARCH = "deepseek2"
PRE_TOKENIZER = "gpt-2"
T = gguf.MODEL_TENSOR
_GLOBAL = {"embed.weight": T.TOKEN_EMBD, "norm.weight": T.OUTPUT_NORM, "lm_head.weight": T.OUTPUT}
_LAYER = {
    "attn_norm.weight": T.ATTN_NORM,
    "attn.q_proj.weight": T.ATTN_Q,
    "attn.q_down.weight": T.ATTN_Q_A,
    "attn.q_norm.weight": T.ATTN_Q_A_NORM,
    "attn.q_up.weight": T.ATTN_Q_B,
    "attn.kv_down.weight": T.ATTN_KV_A_MQA,
    "attn.kv_norm.weight": T.ATTN_KV_A_NORM,
    "attn.out_proj.weight": T.ATTN_OUT,
    "mlp_norm.weight": T.FFN_NORM,
    "mlp.gate_proj.weight": T.FFN_GATE,
    "mlp.up_proj.weight": T.FFN_UP,
    "mlp.down_proj.weight": T.FFN_DOWN,
    "mlp.router.weight": T.FFN_GATE_INP,
    "mlp.router.e_score_correction_bias": T.FFN_EXP_PROBS_B,
    "mlp.experts.gate_proj": T.FFN_GATE_EXP,
    "mlp.experts.up_proj": T.FFN_UP_EXP,
    "mlp.experts.down_proj": T.FFN_DOWN_EXP,
    "mlp.shared_experts.gate_proj.weight": T.FFN_GATE_SHEXP,
    "mlp.shared_experts.up_proj.weight": T.FFN_UP_SHEXP,
    "mlp.shared_experts.down_proj.weight": T.FFN_DOWN_SHEXP,
}
_KV_UP = "attn.kv_up.weight"
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_FILE_TYPES = {
    torch.float32: gguf.LlamaFileType.ALL_F32,
    torch.float16: gguf.LlamaFileType.MOSTLY_F16,
    torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16,
}


def _name(kind: gguf.MODEL_TENSOR, layer: int | None = None) -> str:
    suffix = ".bias" if kind == T.FFN_EXP_PROBS_B else ".weight"
    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=layer) if layer is not None else base) + suffix


def check_gguf_config(config: ModelConfig) -> None:
    """Refuse what llama.cpp's ``deepseek2`` (or, for KDA / NoPE MLA, ``kimi-linear``) graph cannot run
    (``ConfigError`` naming it)."""
    config_to_hf(config)  # refuses K3-only features (gated MLA, SiTU-GLU, LatentMoE, Block AttnRes)
    if _is_kimi_linear(config):
        gguf_kimi_linear.check_kimi_linear_gguf(config)
        return
    yarn = config.rope_scaling
    if yarn is not None and yarn.mscale != yarn.mscale_all_dim:
        raise ConfigError(
            f"YaRN with mscale {yarn.mscale} != mscale_all_dim {yarn.mscale_all_dim}: llama.cpp's deepseek2 "
            "takes a single yarn_log_multiplier (0.1·mscale_all_dim) and assumes mscale equals it"
        )


def _is_kimi_linear(config: ModelConfig) -> bool:
    return hf_model_type(config) != "deepseek_v3"


def gguf_arch(config: ModelConfig) -> str:
    """``deepseek2``, or ``kimi-linear`` for KDA layers / NoPE MLA (``k2lab.hf.gguf_kimi_linear``)."""
    return gguf_kimi_linear.GGUF_ARCH if _is_kimi_linear(config) else GGUF_ARCH


def split_kv_up(weight: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_up`` [H·(d_nope+d_v), r] -> (``k_b`` [H, r, d_nope] = W_kᵀ per head, ``v_b`` [H, d_v, r])."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    per_head = weight.reshape(heads, nope + v, weight.shape[-1])
    k_b, v_b = per_head.split([nope, v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def gguf_tensors(config: ModelConfig, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, tensor) for our state dict (MTP layers left out), transformed as the module docstring says.

    Raises ``K2LabError`` naming any parameter with no ``deepseek2`` tensor."""
    unknown = []
    for key, tensor in main_state(state).items():
        if key in _GLOBAL:
            yield _name(_GLOBAL[key]), tensor
            continue
        match = _LAYER_KEY.match(key)
        layer, rest = (int(match.group(1)), match.group(2)) if match else (-1, key)
        kda = match is not None and layer < len(config.layer_types) and config.layer_types[layer] == "kda"
        if kda and rest.startswith("attn."):
            named = gguf_kimi_linear.kda_tensors(layer, rest.removeprefix("attn."), tensor)
            yield from named
            unknown += [] if named else [key]
        elif rest == _KV_UP and match:
            k_b, v_b = split_kv_up(tensor, config)
            yield _name(T.ATTN_K_B, layer), k_b
            yield _name(T.ATTN_V_B, layer), v_b
        elif rest in _LAYER and match:
            yield _name(_LAYER[rest], layer), tensor
        else:
            unknown.append(key)
    if unknown:
        raise K2LabError(f"no llama.cpp deepseek2 tensor for: {', '.join(unknown[:10])}")


def gguf_metadata(config: ModelConfig) -> dict[str, tuple[object, gguf.GGUFValueType]]:
    """``deepseek2.*`` key -> (value, GGUF type): the hyper-parameters of the module docstring."""
    u32, f32, boolean = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL
    r, rope = config.kv_lora_rank, config.qk_rope_head_dim
    values: dict[str, tuple[object, gguf.GGUFValueType]] = {
        "block_count": (config.num_hidden_layers, u32),
        "context_length": (config.max_position_embeddings, u32),
        "embedding_length": (config.hidden_size, u32),
        "feed_forward_length": (config.intermediate_size, u32),
        "vocab_size": (config.vocab_size, u32),
        "attention.head_count": (config.num_attention_heads, u32),
        "attention.head_count_kv": (1, u32),
        "attention.layer_norm_rms_epsilon": (config.rms_norm_eps, f32),
        "attention.kv_lora_rank": (r, u32),
        "attention.key_length": (r + rope, u32),
        "attention.value_length": (r, u32),
        "attention.key_length_mla": (config.qk_nope_head_dim + rope, u32),
        "attention.value_length_mla": (config.v_head_dim, u32),
        "rope.dimension_count": (rope, u32),
        "rope.freq_base": (config.rope_theta, f32),
        "leading_dense_block_count": (config.first_k_dense_replace, u32),
        "expert_count": (config.n_routed_experts, u32),
        "expert_used_count": (config.num_experts_per_tok, u32),
        "expert_group_count": (config.n_group, u32),
        "expert_group_used_count": (config.topk_group, u32),
        "expert_shared_count": (config.n_shared_experts, u32),
        "expert_feed_forward_length": (config.moe_intermediate_size, u32),
        "expert_gating_func": (int(gguf.ExpertGatingFuncType.SIGMOID), u32),
        "expert_weights_norm": (config.norm_topk_prob, boolean),
        "expert_weights_scale": (config.routed_scaling_factor, f32),
    }
    if config.q_lora_rank is not None:
        values["attention.q_lora_rank"] = (config.q_lora_rank, u32)
    yarn = config.rope_scaling
    if yarn is not None:
        values["rope.scaling.type"] = ("yarn", gguf.GGUFValueType.STRING)
        values["rope.scaling.factor"] = (yarn.factor, f32)
        values["rope.scaling.original_context_length"] = (yarn.original_max_position_embeddings, u32)
        values["rope.scaling.yarn_beta_fast"] = (yarn.beta_fast, f32)
        values["rope.scaling.yarn_beta_slow"] = (yarn.beta_slow, f32)
        if yarn.mscale_all_dim:
            values["rope.scaling.yarn_log_multiplier"] = (0.1 * yarn.mscale_all_dim, f32)
    if _is_kimi_linear(config):
        return gguf_kimi_linear.kimi_linear_metadata(config, values)
    return {f"{GGUF_ARCH}.{key}": value for key, value in values.items()}


def _tokenizer_json(tokenizer: Tokenizer) -> dict:
    data = json.loads(tokenizer.backend.to_str())
    model, pre = data.get("model", {}), data.get("pre_tokenizer") or {}
    gpt2_split = (
        pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space")
    )
    if model.get("type") != "BPE" or not gpt2_split or data.get("normalizer") is not None:
        raise K2LabError(
            "GGUF export writes byte-level BPE tokenizers with the GPT-2 split (llama.cpp's pre-tokenizer "
            f"'gpt-2'); this one has model {model.get('type')!r}, pre-tokenizer {pre.get('type')!r} "
            f"(add_prefix_space {pre.get('add_prefix_space')}), normalizer {data.get('normalizer')!r}"
        )
    return data


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Tokenizer, vocab_size: int, chat_template: str) -> None:
    """The ``tokenizer.ggml.*`` keys of the module docstring."""
    data = _tokenizer_json(tokenizer)
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    tokens, types = [], []
    for index in range(vocab_size):
        token = backend.id_to_token(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(token)
        if index in added:
            types.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [pair if isinstance(pair, str) else " ".join(pair) for pair in data["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokenizer.eos_id)
    if tokenizer.bos_id is not None:
        writer.add_bos_token_id(tokenizer.bos_id)
    if tokenizer.pad_id is not None:
        writer.add_pad_token_id(tokenizer.pad_id)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template)


def _file_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype GGUF tensor ``name`` is written in: fp32 for vectors and what Kimi Linear keeps in fp32
    (``gguf_kimi_linear.keeps_fp32``), else ``dtype``."""
    return torch.float32 if tensor.dim() < 2 or gguf_kimi_linear.keeps_fp32(name) else dtype


def _array(tensor: torch.Tensor, target: torch.dtype) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """Numpy data for the writer: ``tensor`` in ``target`` (bf16 as raw bytes)."""
    tensor = tensor.detach().to("cpu", target).contiguous()
    if target == torch.bfloat16:
        return tensor.view(torch.uint8).numpy(), gguf.GGMLQuantizationType.BF16
    return tensor.numpy(), None


def write_gguf(
    model: CausalLM | VisionLanguageModel,
    tokenizer: Tokenizer,
    path: str | os.PathLike[str],
    chat_template: str,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``model`` + ``tokenizer`` as one llama.cpp GGUF file at ``path`` (atomically: a temporary
    sibling, then a rename); returns the path. Raises ``ConfigError`` for what ``deepseek2`` cannot run."""
    if isinstance(model, VisionLanguageModel):
        raise ConfigError("GGUF export writes the text decoder only; export a K2 language model")
    config = model.config
    check_gguf_config(config)
    if dtype not in _FILE_TYPES:
        raise ValueError(f"GGUF tensors are fp32, fp16 or bf16, got {dtype}")
    with torch.no_grad():
        tensors = [
            (name, tensor, _file_dtype(name, tensor, dtype))
            for name, tensor in gguf_tensors(config, model_state(model))
        ]
    check_cast_range(tensors)  # before anything is written
    target = Path(path)
    with staged_file(target) as temporary:
        writer = gguf.GGUFWriter(temporary, gguf_arch(config))
        writer.add_name(config.name)
        writer.add_file_type(int(_FILE_TYPES[dtype]))
        for key, (value, kind) in gguf_metadata(config).items():
            writer.add_key_value(key, value, kind)
        add_tokenizer(writer, tokenizer, config.vocab_size, chat_template)
        for name, tensor, file_dtype in tensors:
            array, raw = _array(tensor, file_dtype)
            writer.add_tensor(name, array, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return target
