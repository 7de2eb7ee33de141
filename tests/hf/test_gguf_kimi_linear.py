"""``k2lab export --format gguf`` of a Kimi-Linear-style model (KDA + NoPE MLA): read back by
``gguf.GGUFReader`` (no llama.cpp needed), the file has llama.cpp's kimi-linear metadata (per-layer KV head
counts, the KDA sizes, the MLA sizes of deepseek2), and every weight of the model once its transforms are
undone (conv1d split q | k | v, A = −exp(A_log), the MLA k_b / v_b split); what the graph cannot run is refused."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.config import ConfigError
from k2lab.data.tokenizer import Tokenizer
from k2lab.hf.chat_template import chat_template
from k2lab.hf.gguf_export import write_gguf
from k2lab.models import CausalLM
from tests.conftest import KIMI_LINEAR_STYLE
from tests.hf.conftest import VOCAB, nano_for


def kimi_linear(tokenizer: Tokenizer, **overrides: object) -> CausalLM:
    """k3-nano in Kimi Linear style (layers KDA, MLA, KDA, MLA; no q LoRA, as Kimi-Linear-48B) with the
    tokenizer's vocabulary."""
    return nano_for(tokenizer, "k3-nano", **{**KIMI_LINEAR_STYLE, "q_lora_rank": None, **overrides})


@pytest.fixture(scope="module")
def model(tokenizer: Tokenizer) -> CausalLM:
    return kimi_linear(tokenizer)


@pytest.fixture(scope="module")
def reader(
    tmp_path_factory: pytest.TempPathFactory, model: CausalLM, tokenizer: Tokenizer
) -> gguf.GGUFReader:
    path = tmp_path_factory.mktemp("gguf") / "kimi.gguf"
    return gguf.GGUFReader(write_gguf(model, tokenizer, path, chat_template()))


def value(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def weights(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    return {tensor.name: torch.from_numpy(np.array(tensor.data)) for tensor in reader.tensors}


def test_metadata_is_the_config(reader: gguf.GGUFReader, model: CausalLM):
    config = model.config
    assert config.layer_types == ("kda", "mla", "kda", "mla")
    assert value(reader, "general.architecture") == "kimi-linear"
    expected = {
        "block_count": 4,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "vocab_size": VOCAB,
        "attention.head_count": 2,
        "attention.head_count_kv": [0, 1, 0, 1],  # 0 = KDA (recurrent), 1 = MLA as MQA over the latent
        "ssm.conv_kernel": 4,
        "kda.head_dim": 16,
        "attention.kv_lora_rank": 16,
        "attention.key_length": 16 + 8,  # latent + (unrotated) rope slice
        "attention.value_length": 16,
        "attention.key_length_mla": 16 + 8,
        "attention.value_length_mla": 16,
        "rope.dimension_count": 8,
        "leading_dense_block_count": 1,
        "expert_count": 8,
        "expert_used_count": 2,
        "expert_shared_count": 1,
        "expert_feed_forward_length": 32,
        "expert_gating_func": 2,  # sigmoid
        "expert_weights_norm": True,
    }
    for key, wanted in expected.items():
        assert value(reader, f"kimi-linear.{key}") == wanted, key
    assert value(reader, "kimi-linear.attention.layer_norm_rms_epsilon") == pytest.approx(config.rms_norm_eps)
    assert value(reader, "kimi-linear.expert_weights_scale") == pytest.approx(config.routed_scaling_factor)
    assert not [name for name in reader.fields if name.startswith("deepseek2.") or "q_lora" in name]
    assert value(reader, "tokenizer.ggml.pre") == "gpt-2" and value(reader, "tokenizer.chat_template")


def test_tensors_are_the_weights(reader: gguf.GGUFReader, model: CausalLM):
    config = model.config
    ours = {key: tensor.detach() for key, tensor in model.state_dict().items()}
    theirs = weights(reader)
    renames = {
        "layers.0.attn.q_proj.weight": "blk.0.attn_q.weight",
        "layers.0.attn.k_proj.weight": "blk.0.attn_k.weight",
        "layers.2.attn.v_proj.weight": "blk.2.attn_v.weight",
        "layers.0.attn.forget_gate.f_a_proj.weight": "blk.0.ssm_f_a.weight",
        "layers.0.attn.forget_gate.f_b_proj.weight": "blk.0.ssm_f_b.weight",
        "layers.0.attn.forget_gate.dt_bias": "blk.0.ssm_dt.bias",
        "layers.0.attn.b_proj.weight": "blk.0.ssm_beta.weight",
        "layers.2.attn.g_a_proj.weight": "blk.2.ssm_g_a.weight",
        "layers.2.attn.g_b_proj.weight": "blk.2.ssm_g_b.weight",
        "layers.0.attn.o_norm.weight": "blk.0.ssm_norm.weight",
        "layers.0.attn.o_proj.weight": "blk.0.attn_output.weight",
        "layers.1.attn.out_proj.weight": "blk.1.attn_output.weight",
        "layers.1.attn.q_proj.weight": "blk.1.attn_q.weight",
        "layers.3.attn.kv_down.weight": "blk.3.attn_kv_a_mqa.weight",
        "layers.1.mlp.router.e_score_correction_bias": "blk.1.exp_probs_b.bias",
        "layers.1.mlp.experts.gate_proj": "blk.1.ffn_gate_exps.weight",
        "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
        "lm_head.weight": "output.weight",
    }
    for key, name in renames.items():
        assert torch.equal(theirs[name], ours[key]), name
    width = config.linear_num_heads * config.linear_head_dim
    kda = [i for i, kind in enumerate(config.layer_types) if kind == "kda"]
    for layer in kda:
        parts = [theirs[f"blk.{layer}.ssm_conv1d_{p}.weight"] for p in "qkv"]
        assert all(part.shape == (1, width, 1, config.linear_conv_kernel_dim) for part in parts)
        conv = torch.cat([part.reshape(width, 1, -1) for part in parts])  # ours: [3·H·K, 1, W], q | k | v
        assert torch.equal(conv, ours[f"layers.{layer}.attn.conv1d.weight"])
        a = theirs[f"blk.{layer}.ssm_a"]  # A = −exp(A_log), [1, 1, H, 1]
        assert a.shape == (1, 1, config.linear_num_heads, 1) and (a < 0).all()
        a_log = ours[f"layers.{layer}.attn.forget_gate.A_log"]
        assert torch.equal(a.reshape(-1), -a_log.float().exp())
    mla = len(config.layer_types) - len(kda)
    # conv1d -> 3 tensors per KDA layer, kv_up -> k_b + v_b per MLA layer, nothing else added or dropped
    assert len(theirs) == len(ours) + 2 * len(kda) + mla


def test_half_precision_keeps_conv_and_decay_fp32(tmp_path: Path, model: CausalLM, tokenizer: Tokenizer):
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "f16.gguf", "", torch.float16))
    kinds = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    f32, f16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    assert kinds["blk.0.ssm_conv1d_k.weight"] == kinds["blk.0.ssm_a"] == kinds["blk.0.ssm_dt.bias"] == f32
    assert kinds["blk.0.attn_q.weight"] == kinds["blk.1.attn_k_b.weight"] == f16


def test_what_kimi_linear_cannot_run_is_refused(tmp_path: Path, tokenizer: Tokenizer):
    cases = {
        "no equivalent for: mla_output_gate": build_model(load_preset("k3-nano")),  # K3 as it is
        "linear_num_heads 4 != num_attention_heads 2": kimi_linear(tokenizer, linear_num_heads=4),
        "norm_topk_prob=False": kimi_linear(tokenizer, norm_topk_prob=False),
        "q_lora_rank=32": kimi_linear(tokenizer, q_lora_rank=32),
        "group-limited routing": kimi_linear(tokenizer, n_group=2, topk_group=1),
    }
    for message, candidate in cases.items():
        with pytest.raises(ConfigError, match=message):
            write_gguf(candidate, tokenizer, tmp_path / "k.gguf", "")
    assert not list(tmp_path.iterdir())  # nothing half-written
