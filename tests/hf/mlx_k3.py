"""mlx-lm's ``kimi_k3`` on MLX's CPU backend as an independent reference for the kimi_k3 checkpoint layout.

mlx-lm 0.32.2 (``mlx_lm/models/kimi_k3.py``) is a second implementation of the released K3 text model, written
from the released code by other people; it loads a released-layout directory through ``mlx_lm.utils.load_model``,
which runs the model's ``sanitize`` (fusing q/k/v and their convolutions, stacking experts, splitting
``kv_b_proj`` into ``embed_q`` / ``unembed_out``). This module holds what the reference tests need from it:

- ``text_config`` / ``released_config``: the released ``config.json`` (``model_type`` ``kimi_k3`` around a
  ``kimi_linear`` ``text_config``) of a ``ModelConfig``, written here by hand from the released field names,
  independently of ``k2lab.hf``'s writer;
- ``random_model``: an mlx ``kimi_k3.Model`` built from such a config with every parameter re-drawn;
- ``released_state``: its parameters in the released layout (mlx's ``sanitize`` undone: ``language_model.``
  prefixes, ``q/k/v_proj`` and ``{q,k,v}_conv1d`` [C, 1, W], per-expert ``experts.{e}.{w1,w3,w2}``,
  ``kv_b_proj`` rebuilt from ``embed_q`` / ``unembed_out``, ``block_sparse_moe`` naming);
- ``write_checkpoint`` / ``load`` / ``logits``: a directory on disk, mlx-lm's own loader, fp32 logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import kimi_k3
from mlx_lm.utils import load_model
from safetensors.numpy import save_file

from k2lab.config import ModelConfig

mx.set_default_device(mx.cpu)

TEXT = "language_model.model."


def text_config(config: ModelConfig) -> dict[str, Any]:
    """The released ``text_config`` (``kimi_linear`` field names) of a K3-style ``config``."""
    kda = [i + 1 for i, kind in enumerate(config.layer_types) if kind == "kda"]
    mla = [i + 1 for i, kind in enumerate(config.layer_types) if kind == "mla"]
    return {
        "model_type": "kimi_linear",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": "situ",
        "activation_situ_beta": config.situ_beta1,
        "activation_situ_linear_beta": config.situ_beta2,
        "attn_res_block_size": config.attnres_block_size,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "mla_use_nope": not config.mla_rope,
        "mla_use_output_gate": config.mla_output_gate,
        "num_experts": config.n_routed_experts,
        "num_experts_per_token": config.num_experts_per_tok,
        "num_shared_experts": config.n_shared_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": config.norm_topk_prob,
        "routed_scaling_factor": config.routed_scaling_factor,
        "first_k_dense_replace": config.first_k_dense_replace,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": config.n_group,
        "topk_group": config.topk_group,
        "topk_method": "noaux_tc",
        "routed_expert_hidden_size": config.moe_latent_size,
        "latent_moe_use_norm": config.moe_latent_norm,
        "num_nextn_predict_layers": config.num_nextn_predict_layers,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": mla,
            "num_heads": config.linear_num_heads,
            "head_dim": config.linear_head_dim,
            "short_conv_kernel_size": config.linear_conv_kernel_dim,
            "gate_lower_bound": config.kda_gate_lower_bound if config.kda_gate == "lower_bound" else None,
            "use_full_rank_gate": config.kda_output_gate == "full_rank",
        },
    }


def released_config(config: ModelConfig) -> dict[str, Any]:
    """The released top-level ``config.json``: ``kimi_k3`` around ``text_config`` (no vision tower)."""
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "text_config": text_config(config),
    }


def _redraw(name: str, shape: tuple[int, ...], rng: np.random.Generator, std: float) -> np.ndarray:
    if name.endswith("norm.weight"):
        return 1 + 0.1 * rng.standard_normal(shape)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * rng.standard_normal(shape)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        return 0.5 * rng.standard_normal(shape)
    return std * rng.standard_normal(shape)


def random_model(config: dict[str, Any], seed: int = 0, std: float = 0.1) -> kimi_k3.Model:
    """An mlx ``kimi_k3.Model`` of the released ``config`` with every parameter re-drawn (fp32): weights
    N(0, std²), norm weights 1 + N(0, 0.01), router biases N(0, 0.05²), A_log = log U(1, 16),
    dt_bias N(0, 0.25), so the AttnRes queries (zero at init) and norms are not trivial."""
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    params = [
        (name, mx.array(_redraw(name, tuple(value.shape), rng, std).astype(np.float32)))
        for name, value in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def _kda_weights(prefix: str, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Fused ``qkv_proj`` / ``qkv_conv`` [3C, W, 1] -> ``{q,k,v}_proj`` and ``{q,k,v}_conv1d`` [C, 1, W]."""
    out = {}
    projections = np.split(p.pop(f"{prefix}qkv_proj.weight"), 3)
    convs = np.split(p.pop(f"{prefix}qkv_conv.conv.weight"), 3)
    for part, projection, conv in zip("qkv", projections, convs, strict=True):
        out[f"{prefix}{part}_proj.weight"] = projection
        out[f"{prefix}{part}_conv1d.weight"] = np.ascontiguousarray(np.moveaxis(conv, 1, 2))
    return out


def _mla_weights(prefix: str, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``embed_q`` [H, C, n] and ``unembed_out`` [H, v, C] -> ``kv_b_proj`` [H·(n + v), C]."""
    w_uk = p.pop(f"{prefix}embed_q.weight").swapaxes(-1, -2)  # [H, n, C]
    w_uv = p.pop(f"{prefix}unembed_out.weight")  # [H, v, C]
    kv_b = np.concatenate([w_uk, w_uv], axis=1)
    return {f"{prefix}kv_b_proj.weight": kv_b.reshape(-1, kv_b.shape[-1])}


def _moe_weights(layer: str, p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mlx's ``mlp.switch_mlp`` stacks and ``mlp.*`` -> ``block_sparse_moe.experts.{e}.{w1,w3,w2}`` etc."""
    src, dst = f"{layer}mlp.", f"{layer}block_sparse_moe."
    out = {f"{dst}gate.e_score_correction_bias": p.pop(f"{src}e_score_correction_bias")}
    for mlx_name, released in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
        for expert, weight in enumerate(p.pop(f"{src}switch_mlp.{mlx_name}.weight")):
            out[f"{dst}experts.{expert}.{released}.weight"] = weight
    for name in [key for key in p if key.startswith(src)]:
        out[dst + name[len(src) :]] = p.pop(name)
    return out


def released_state(model: kimi_k3.Model) -> dict[str, np.ndarray]:
    """The parameters of an mlx ``kimi_k3.Model`` in the released checkpoint layout (``sanitize`` undone)."""
    p = {name: np.array(value) for name, value in tree_flatten(model.parameters())}
    out: dict[str, np.ndarray] = {}
    for i, layer in enumerate(model.language_model.model.layers):
        prefix = f"{TEXT}layers.{i}."
        if layer.is_linear:
            out |= _kda_weights(f"{prefix}self_attn.", p)
        else:
            out |= _mla_weights(f"{prefix}self_attn.", p)
        if isinstance(layer.mlp, kimi_k3.KimiK3SparseMoE):
            out |= _moe_weights(prefix, p)
    return out | p  # the rest already has its released name


def write_checkpoint(
    path: str | os.PathLike[str], config: dict[str, Any], state: dict[str, np.ndarray]
) -> Path:
    """``config.json`` + ``model.safetensors`` (fp32) of a released-layout ``state``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}
    save_file(tensors, str(root / "model.safetensors"))
    return root


def load(path: str | os.PathLike[str]) -> kimi_k3.Model:
    """A released-layout directory through mlx-lm's own loader (``load_model``: config, ``sanitize``, strict)."""
    model, _ = load_model(Path(path))
    return model


def logits(model: kimi_k3.Model, ids: np.ndarray) -> np.ndarray:
    """ids [B, T] -> fp32 logits [B, T, V] (MLX CPU, no cache)."""
    return np.array(model(mx.array(ids.astype(np.int32))).astype(mx.float32))
