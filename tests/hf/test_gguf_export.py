"""``k2lab export --format gguf``: the file read back by ``gguf.GGUFReader`` (no llama.cpp needed) has the
deepseek2 metadata of the config, every weight of the model (the MLA up-projection after undoing its
k_b / v_b split), the tokenizer's tokens, types and merges, and the chat template; the errors are clear."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.config import ConfigError
from k2lab.data.tokenizer import Tokenizer
from k2lab.hf.chat_template import chat_template
from k2lab.hf.export import ExportConfig, export
from k2lab.hf.gguf_export import write_gguf
from k2lab.model_dir import load_model
from tests.hf.conftest import VOCAB


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "nano.gguf"
    return export(ExportConfig(out=out, format="gguf"), model_dir, log=lambda line: None)


@pytest.fixture(scope="module")
def reader(gguf_file: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(gguf_file)


def value(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def test_metadata_is_the_config(reader: gguf.GGUFReader, model_dir: Path):
    config = load_model(model_dir).config
    assert value(reader, "general.architecture") == "deepseek2"
    assert value(reader, "general.file_type") == 0  # all fp32
    expected = {
        "block_count": 2,
        "embedding_length": 64,
        "feed_forward_length": 128,
        "vocab_size": VOCAB,
        "context_length": 256,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.q_lora_rank": 32,
        "attention.kv_lora_rank": 16,
        "attention.key_length": 16 + 8,  # latent + rope
        "attention.value_length": 16,
        "attention.key_length_mla": 16 + 8,  # nope + rope
        "attention.value_length_mla": 16,
        "rope.dimension_count": 8,
        "leading_dense_block_count": 1,
        "expert_count": 8,
        "expert_used_count": 2,
        "expert_group_count": 2,
        "expert_group_used_count": 1,
        "expert_shared_count": 1,
        "expert_feed_forward_length": 32,
        "expert_gating_func": 2,  # sigmoid
        "expert_weights_norm": True,
        "rope.scaling.type": "yarn",
        "rope.scaling.original_context_length": 64,
    }
    for key, wanted in expected.items():
        assert value(reader, f"deepseek2.{key}") == wanted, key
    floats = {
        "rope.freq_base": config.rope_theta,
        "attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        "expert_weights_scale": config.routed_scaling_factor,
        "rope.scaling.factor": 4.0,
        "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0,
        "rope.scaling.yarn_log_multiplier": 0.1,  # 0.1 · mscale_all_dim (llama.cpp's convention)
    }
    for key, wanted in floats.items():
        assert value(reader, f"deepseek2.{key}") == pytest.approx(wanted, rel=1e-6), key


def gguf_weights(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    return {tensor.name: torch.from_numpy(np.array(tensor.data)) for tensor in reader.tensors}


def test_tensors_are_the_weights(reader: gguf.GGUFReader, model_dir: Path):
    model = load_model(model_dir)
    config = model.config
    ours = model.state_dict()
    theirs = gguf_weights(reader)
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    renames = {
        "embed.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
        "layers.0.attn.q_down.weight": "blk.0.attn_q_a.weight",
        "layers.1.attn.q_up.weight": "blk.1.attn_q_b.weight",
        "layers.1.attn.kv_down.weight": "blk.1.attn_kv_a_mqa.weight",
        "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
        "layers.1.mlp.router.weight": "blk.1.ffn_gate_inp.weight",
        "layers.1.mlp.router.e_score_correction_bias": "blk.1.exp_probs_b.bias",
        "layers.1.mlp.experts.gate_proj": "blk.1.ffn_gate_exps.weight",  # [E, F, D]
        "layers.1.mlp.experts.down_proj": "blk.1.ffn_down_exps.weight",  # [E, D, F]
        "layers.1.mlp.shared_experts.up_proj.weight": "blk.1.ffn_up_shexp.weight",
    }
    for key, name in renames.items():
        assert torch.equal(theirs[name], ours[key]), name
    for layer in range(config.num_hidden_layers):
        k_b = theirs[f"blk.{layer}.attn_k_b.weight"]  # [H, r, nope]: W_k of each head transposed
        v_b = theirs[f"blk.{layer}.attn_v_b.weight"]  # [H, v, r]
        assert k_b.shape == (heads, config.kv_lora_rank, nope) and v_b.shape == (
            heads,
            v,
            config.kv_lora_rank,
        )
        kv_up = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * (nope + v), -1)
        assert torch.equal(kv_up, ours[f"layers.{layer}.attn.kv_up.weight"])
    assert len(theirs) == len(ours) + config.num_hidden_layers  # kv_up -> k_b + v_b, nothing else added


def test_tokenizer_is_ours(reader: gguf.GGUFReader, tokenizer: Tokenizer):
    tokens = value(reader, "tokenizer.ggml.tokens")
    assert tokens == [tokenizer.backend.id_to_token(i) for i in range(VOCAB)]
    merges = json.loads(tokenizer.backend.to_str())["model"]["merges"]
    assert value(reader, "tokenizer.ggml.merges") == [" ".join(pair) for pair in merges]
    types = value(reader, "tokenizer.ggml.token_type")
    special = set(tokenizer.special_tokens.values())
    assert [i for i, kind in enumerate(types) if kind == gguf.TokenType.CONTROL] == sorted(special)
    assert all(kind == gguf.TokenType.NORMAL for i, kind in enumerate(types) if i not in special)
    assert value(reader, "tokenizer.ggml.model") == "gpt2" and value(reader, "tokenizer.ggml.pre") == "gpt-2"
    ids = ("bos_token_id", "eos_token_id", "padding_token_id")
    assert [value(reader, f"tokenizer.ggml.{key}") for key in ids] == [
        tokenizer.bos_id,
        tokenizer.eos_id,
        tokenizer.pad_id,
    ]
    assert value(reader, "tokenizer.ggml.add_bos_token") is False
    assert value(reader, "tokenizer.chat_template") == chat_template()


def test_half_precision_keeps_vectors_fp32(tmp_path: Path, model_dir: Path, tokenizer: Tokenizer):
    model = load_model(model_dir)
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "f16.gguf", "", torch.float16))
    kinds = {tensor.name: tensor.tensor_type for tensor in reader.tensors}
    assert kinds["blk.1.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.F16
    assert kinds["blk.1.exp_probs_b.bias"] == kinds["output_norm.weight"] == gguf.GGMLQuantizationType.F32
    weights = gguf_weights(reader)
    assert torch.equal(weights["output.weight"], model.lm_head.weight.detach().half())
    reader = gguf.GGUFReader(write_gguf(model, tokenizer, tmp_path / "bf16.gguf", "", torch.bfloat16))
    embed = next(tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
    assert embed.tensor_type == gguf.GGMLQuantizationType.BF16
    raw = torch.from_numpy(np.array(embed.data)).view(torch.bfloat16).reshape(VOCAB, -1)
    assert torch.equal(raw, model.embed.weight.detach().bfloat16())


def test_what_deepseek2_cannot_run_is_refused(tmp_path: Path, tokenizer: Tokenizer):
    k3 = build_model(load_preset("k3-nano"))  # Kimi Linear style models: tests/hf/test_gguf_kimi_linear.py
    with pytest.raises(ConfigError, match="no equivalent for: mla_output_gate"):
        write_gguf(k3, tokenizer, tmp_path / "k.gguf", "")
    yarn = dict(load_preset("k2-nano").rope_scaling.model_dump(), mscale=0.5)
    odd = build_model(load_preset("k2-nano", rope_scaling=yarn))
    with pytest.raises(ConfigError, match="mscale 0.5 != mscale_all_dim"):
        write_gguf(odd, tokenizer, tmp_path / "y.gguf", "")
    assert not list(tmp_path.iterdir())  # nothing half-written
