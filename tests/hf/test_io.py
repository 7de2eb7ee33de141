"""Hugging Face checkpoint interop: ``k2lab.hf.to_hf`` / ``from_hf`` against transformers' DeepseekV3.

Both directions are checked on logits (fp32, rel+abs 1e-4) for tiny configs that cover grouped routing,
``q_lora_rank=None``, YaRN on/off, dense-prefix lengths, shared-expert counts and tied embeddings. Weights are
re-drawn with std 0.2 and a random correction bias so logits are O(1) and routing depends on the bias.
"""

from __future__ import annotations

import json
import math
import os
import random
import zlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k2lab import CausalLM, ModelConfig, build_model, load_preset
from k2lab.errors import CheckpointError
from k2lab.hf import dequantize_fp8, from_hf, to_hf
from k2lab.hf.io import INDEX_FILE, SINGLE_FILE

transformers = pytest.importorskip("transformers")

TOL = 1e-4
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448

# name -> overrides of k2-nano (vocab 128, hidden 64, 2 layers, 8 experts top-2, n_group 2, YaRN factor 4).
CONFIGS: dict[str, dict] = {
    "nano-default": {},
    "groups4-top2-noqlora-noyarn-dense0-shared2": {
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "q_lora_rank": None,
        "rope_scaling": None,
        "first_k_dense_replace": 0,
        "n_shared_experts": 2,
    },
    "groups2-top2-dense2-shared0-k2yarn-tied": {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 2,
        "n_shared_experts": 0,
        "n_group": 2,
        "topk_group": 2,
        "num_experts_per_tok": 3,
        "tie_word_embeddings": True,
        "rope_theta": 50000.0,
        # K2's YaRN shape (beta 1/1, mscale 1/1) at a tiny original context so positions pass it.
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 256,
    },
    "yarn-mscale-only-qlora-none-scaling1": {
        "q_lora_rank": None,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
        "max_position_embeddings": 128,
    },
}


def _random_config(seed: int) -> ModelConfig:
    """A tiny random K2-family config with at least one MoE layer and a real choice among experts."""
    rng = random.Random(seed)
    n_group = rng.choice([1, 2, 4])
    per_group = rng.choice([2, 3, 4])
    topk_group = rng.randint(1, n_group)
    layers = rng.randint(2, 3)
    yarn = rng.random() < 0.5
    factor = rng.choice([2.0, 4.0, 16.0])
    return load_preset(
        "k2-nano",
        hidden_size=rng.choice([32, 48, 64]),
        num_attention_heads=rng.choice([1, 2, 4]),
        q_lora_rank=rng.choice([None, 16, 24]),
        kv_lora_rank=rng.choice([8, 16]),
        qk_nope_head_dim=rng.choice([8, 16]),
        qk_rope_head_dim=rng.choice([4, 8]),
        v_head_dim=rng.choice([8, 12]),
        num_hidden_layers=layers,
        first_k_dense_replace=rng.randint(0, layers - 1),
        n_routed_experts=n_group * per_group,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=rng.randint(1, min(topk_group * per_group, n_group * per_group - 1)),
        n_shared_experts=rng.choice([0, 1, 2]),
        routed_scaling_factor=rng.choice([1.0, 2.5]),
        norm_topk_prob=rng.random() < 0.8,
        max_position_embeddings=int(16 * factor) if yarn else 256,
        rope_scaling=(
            {
                "type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": 16,
                "beta_fast": rng.choice([1.0, 32.0]),
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": rng.choice([0.0, 1.0]),
            }
            if yarn
            else None
        ),
    ).replace(name=f"random-{seed}")


ALL_CONFIGS = [(name, load_preset("k2-nano", **o).replace(name=name)) for name, o in CONFIGS.items()] + [
    (f"random-{seed}", _random_config(seed)) for seed in (3, 5, 17, 19, 20)
]


@torch.no_grad()
def _scramble(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights ~ N(0, 0.2) (norms ~ 1 + N(0, 0.2)) and a random router bias: O(1) logits, biased routing."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in model.named_parameters():
        noise = torch.randn(parameter.shape, generator=generator) * 0.2
        parameter.copy_(noise + 1.0 if "norm" in name else noise)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.5)
    return model


def _tokens(vocab: int, seed: int = 0, length: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed))


def _assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> float:
    assert ours.abs().max() > 0.5, "logits too small to make the comparison meaningful"
    torch.testing.assert_close(ours, reference, rtol=TOL, atol=TOL)
    return (ours - reference).abs().max().item()


def _hf_load(path: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    # With n_shared_experts=0 transformers still builds a zero-width shared MLP (it adds exactly 0); its
    # empty weights are the only tensors a checkpoint may lack.
    empty = {name for name, parameter in model.named_parameters() if parameter.numel() == 0}
    info["missing_keys"] = set(info.get("missing_keys", ())) - empty
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"transformers reports {kind}: {info[kind]}"
    return model.eval()


# ---------------------------------------------------------------------------------------------------------
# ours -> disk -> transformers (and back)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "config"), ALL_CONFIGS, ids=[name for name, _ in ALL_CONFIGS])
def test_to_hf_loads_in_transformers_with_same_logits(name: str, config: ModelConfig, tmp_path: Path):
    model = _scramble(build_model(config), seed=zlib.crc32(name.encode())).eval()
    to_hf(model, tmp_path / "ckpt")
    reference = _hf_load(tmp_path / "ckpt")
    ids = _tokens(config.vocab_size)
    with torch.no_grad():
        ours = model(ids).logits
        theirs = reference(ids).logits
        back = from_hf(tmp_path / "ckpt")(ids).logits
    diff = _assert_logits_close(ours, theirs)
    print(f"[to_hf -> transformers] {name}: max |Δlogits| = {diff:.3g}")
    assert torch.equal(back, ours)  # our own roundtrip is bit-exact


def test_to_hf_writes_expected_files(tmp_path: Path):
    config = load_preset("k2-nano")
    model = build_model(config)
    target = to_hf(model, tmp_path / "ckpt")
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", SINGLE_FILE]
    hf_config = json.loads((target / "config.json").read_text())
    assert hf_config["model_type"] == "deepseek_v3"
    assert hf_config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert hf_config["torch_dtype"] == "float32"
    generation = json.loads((target / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    with safe_open(target / SINGLE_FILE, "pt") as handle:
        keys = set(handle.keys())
        assert handle.metadata() == {"format": "pt"}
        assert handle.get_slice("model.layers.1.mlp.experts.7.down_proj.weight").get_shape() == [64, 32]
        torch.testing.assert_close(
            handle.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight"),
            model.layers[1].mlp.experts.gate_proj[3],
            rtol=0,
            atol=0,
        )
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys
    assert not any(".mlp.experts.gate_proj" in key or key.startswith("layers.") for key in keys)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging directory left behind"


def test_sharded_roundtrip(tmp_path: Path):
    config = load_preset("k2-nano", n_shared_experts=2)
    model = _scramble(build_model(config)).eval()
    target = to_hf(model, tmp_path / "ckpt", max_shard_bytes=40_000)
    index = json.loads((target / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (target / SINGLE_FILE).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for shard in shards:  # every shard within the limit unless it is a single big tensor
        with safe_open(target / shard, "pt") as handle:
            keys = list(handle.keys())
            size = sum(handle.get_tensor(k).numel() * 4 for k in keys)
            assert size <= 40_000 or len(keys) == 1
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in model.state_dict().values())
    loaded = from_hf(target)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = _tokens(config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        _assert_logits_close(model(ids).logits, _hf_load(target)(ids).logits)


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bfloat16"), (None, "float32")])
def test_a_kimi_k25_export_names_its_dtype_in_text_config_too(
    tmp_path: Path, dtype: torch.dtype | None, name: str
):
    from k2lab.presets.vision_language import load_vlm_preset
    from k2lab.vision.vlm import build_vlm

    model = build_vlm(load_vlm_preset("k25-nano"), seed=0)
    config = json.loads((to_hf(model, tmp_path / "k25", dtype=dtype) / "config.json").read_text())
    assert config["model_type"] == "kimi_k25"
    assert config["torch_dtype"] == config["text_config"]["torch_dtype"] == name


def test_to_hf_bf16_keeps_router_bias_fp32(tmp_path: Path):
    model = _scramble(build_model(load_preset("k2-nano")))
    target = to_hf(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    assert json.loads((target / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(target / SINGLE_FILE, "pt") as handle:
        assert handle.get_slice("model.layers.1.mlp.gate.e_score_correction_bias").get_dtype() == "F32"
        assert handle.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"
    loaded = from_hf(target, dtype=torch.bfloat16)
    router = loaded.layers[1].mlp.router
    assert loaded.embed.weight.dtype == torch.bfloat16
    assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
    torch.testing.assert_close(
        loaded.layers[1].mlp.experts.up_proj.float(),
        model.layers[1].mlp.experts.up_proj.to(torch.bfloat16).float(),
        rtol=0,
        atol=0,
    )


def test_to_hf_replaces_atomically_and_keeps_other_files(tmp_path: Path, monkeypatch):
    target = tmp_path / "ckpt"
    first = _scramble(build_model(load_preset("k2-nano")), seed=1)
    to_hf(first, target, max_shard_bytes=40_000)
    (target / "tokenizer.json").write_text("{}")
    second = _scramble(build_model(load_preset("k2-nano")), seed=2)

    # A failure half-way leaves the old checkpoint untouched and no staging directory behind.
    import k2lab.hf.io as hf_io

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "_write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        to_hf(second, target)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert torch.equal(from_hf(target).embed.weight, first.embed.weight)

    # A successful rewrite drops the stale shards and index but keeps the tokenizer.
    to_hf(second, target)
    assert sorted(os.listdir(target)) == sorted(
        ["config.json", "generation_config.json", SINGLE_FILE, "tokenizer.json"]
    )
    assert torch.equal(from_hf(target).embed.weight, second.embed.weight)


# ---------------------------------------------------------------------------------------------------------
# transformers -> disk -> ours
# ---------------------------------------------------------------------------------------------------------

TRANSFORMERS_CONFIGS = {
    "yarn-groups": dict(
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        q_lora_rank=24,
        first_k_dense_replace=1,
        n_shared_experts=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    ),
    "default-rope-noqlora-dense0-shared2": dict(
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        first_k_dense_replace=0,
        n_shared_experts=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}


@pytest.mark.parametrize("name", list(TRANSFORMERS_CONFIGS))
def test_transformers_save_pretrained_loads_with_same_logits(name: str, tmp_path: Path):
    config = transformers.DeepseekV3Config(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        **TRANSFORMERS_CONFIGS[name],
    )
    torch.manual_seed(0)
    reference = _scramble(transformers.DeepseekV3ForCausalLM(config)).eval()
    reference.save_pretrained(tmp_path / "ckpt")
    ours = from_hf(tmp_path / "ckpt").eval()
    assert ours.config.q_lora_rank == config.q_lora_rank
    assert (ours.config.rope_scaling is None) == (name.startswith("default"))
    ids = _tokens(96, length=48)
    with torch.no_grad():
        diff = _assert_logits_close(ours(ids).logits, reference(ids).logits)
    print(f"[transformers -> from_hf] {name}: max |Δlogits| = {diff:.3g}")


def test_from_hf_reads_fused_expert_keys(tmp_path: Path):
    """transformers-5 in-memory names (``experts.gate_up_proj`` / ``experts.down_proj``) on disk."""
    from k2lab.hf.bridge import transformers_state_dict

    model = _scramble(build_model(load_preset("k2-nano"))).eval()
    to_hf(model, tmp_path / "ckpt")
    state = {k: v.contiguous() for k, v in transformers_state_dict(model).items()}
    save_file(state, str(tmp_path / "ckpt" / SINGLE_FILE), metadata={"format": "pt"})
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "ckpt" / SINGLE_FILE)
    loaded = from_hf(tmp_path / "ckpt")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_from_hf_skips_mtp_layer_and_rotary_keys(tmp_path: Path):
    config = load_preset("k2-nano")
    model = _scramble(build_model(config)).eval()
    to_hf(model, tmp_path / "ckpt")
    _edit_config(tmp_path / "ckpt", num_nextn_predict_layers=1)
    path = tmp_path / "ckpt" / SINGLE_FILE
    state = load_file(path)
    state[f"model.layers.{config.num_hidden_layers}.eh_proj.weight"] = torch.zeros(64, 128)
    state[f"model.layers.{config.num_hidden_layers}.mlp.experts.0.up_proj.weight"] = torch.zeros(32, 64)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    save_file(state, str(path), metadata={"format": "pt"})
    loaded = from_hf(tmp_path / "ckpt", mtp=False)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    # Non-persistent buffers (rotary frequencies) are recomputed, not left uninitialised by to_empty.
    assert torch.equal(loaded.rotary.inv_freq, model.rotary.inv_freq)
    assert loaded.rotary.attention_factor == model.rotary.attention_factor


# ---------------------------------------------------------------------------------------------------------
# FP8 block-quantised checkpoints (DeepSeek-V3 / Kimi-K2 release format)
# ---------------------------------------------------------------------------------------------------------


def _quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax scaling to float8_e4m3fn; returns (fp8 weight, fp32 scale_inv [ceil, ceil])."""
    rows, cols = weight.shape
    b0, b1 = block
    n0, n1 = math.ceil(rows / b0), math.ceil(cols / b1)
    padded = torch.zeros(n0 * b0, n1 * b1)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(n0, b0, n1, b1)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    quantized = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.view(n0 * b0, n1 * b1)[:rows, :cols].contiguous(), scale


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (5, 130)])
def test_dequantize_fp8_matches_reference_within_fp8_rounding(shape: tuple[int, int]):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    weight[:50, :10] *= 30  # blocks with different ranges
    quantized, scale = _quantize_fp8(weight, (128, 128))
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    restored = dequantize_fp8(quantized, scale)
    assert restored.dtype == torch.float32 and restored.shape == weight.shape
    per_element_scale = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    # e4m3: 3 mantissa bits -> relative rounding <= 2^-4; subnormal spacing 2^-9 -> absolute <= 2^-10·scale.
    bound = weight.abs() * 2**-4 + per_element_scale * 2**-10
    assert ((restored - weight).abs() <= bound).all()
    # exactly the block-wise product, element by element
    for i, j in [(0, 0), (shape[0] - 1, shape[1] - 1), (shape[0] // 2, shape[1] - 1)]:
        expected = quantized[i, j].float() * scale[i // 128, j // 128]
        assert restored[i, j] == expected


def _kimi_config_json(config: ModelConfig, block: list[int]) -> dict:
    """A config.json written the way moonshotai/Kimi-K2-Instruct writes it (legacy rope, fp8 quantisation)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "model_type": "kimi_k2",
        "aux_loss_alpha": 0.001,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "ep_size": 1,
        "first_k_dense_replace": config.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "kv_lora_rank": config.kv_lora_rank,
        "max_position_embeddings": config.max_position_embeddings,
        "moe_intermediate_size": config.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": config.n_group,
        "n_routed_experts": config.n_routed_experts,
        "n_shared_experts": config.n_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": config.num_attention_heads,
        "num_experts_per_tok": config.num_experts_per_tok,
        "num_hidden_layers": config.num_hidden_layers,
        "num_key_value_heads": config.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": config.q_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": block,
        },
        "rms_norm_eps": config.rms_norm_eps,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 8,
            "type": "yarn",
        },
        "rope_theta": 50000.0,
        "routed_scaling_factor": config.routed_scaling_factor,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": config.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "v_head_dim": config.v_head_dim,
        "vocab_size": config.vocab_size,
    }


def _is_quantized_in_release(key: str) -> bool:
    """The public FP8 release quantises every linear weight except embeddings, head and router."""
    return key.endswith("proj.weight") or key.endswith("proj_with_mqa.weight")


@pytest.mark.parametrize("block", [[128, 128], [16, 32]], ids=["block128", "block16x32"])
def test_fp8_kimi_checkpoint_dequantises_exactly(block: list[int], tmp_path: Path):
    config = load_preset("k2-nano", n_group=2, topk_group=2, num_experts_per_tok=3)
    model = _scramble(build_model(config)).eval()
    to_hf(model, tmp_path / "plain")
    state = load_file(tmp_path / "plain" / SINGLE_FILE)

    fp8_state: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if _is_quantized_in_release(key):
            quantized, scale = _quantize_fp8(value, tuple(block))
            fp8_state[key], fp8_state[key + "_scale_inv"] = quantized, scale
            dequantized[key] = dequantize_fp8(quantized, scale, block)
            assert (dequantized[key] - value).abs().max() <= value.abs().max() * 2**-4
        else:
            fp8_state[key] = (
                value.to(torch.bfloat16) if value.ndim == 2 else value
            )  # embeddings, head, router
    ckpt = tmp_path / "kimi"
    ckpt.mkdir()
    save_file(fp8_state, str(ckpt / SINGLE_FILE), metadata={"format": "pt"})
    (ckpt / "config.json").write_text(json.dumps(_kimi_config_json(config, block)))

    loaded = from_hf(ckpt)
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling.factor == 32.0
    assert loaded.config.rope_theta == 50000.0

    # Reference: the same model with the dequantised (and bf16-rounded) weights put in directly.
    reference_config = config.replace(
        rope_theta=50000.0,
        rope_scaling=_kimi_config_json(config, block)["rope_scaling"],
        name=loaded.config.name,
        pad_token_id=None,
    )
    assert loaded.config == reference_config
    reference = build_model(reference_config)
    reference_state = {**{k: v.float() for k, v in fp8_state.items() if "_scale_inv" not in k}, **dequantized}
    reference_hf = reference.state_dict()
    with torch.no_grad():
        for key, value in _ours_from_hf_names(reference_hf, reference_state).items():
            reference_hf[key].copy_(value)
    for key, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    ids = _tokens(config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def _ours_from_hf_names(
    ours: dict[str, torch.Tensor], hf: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Independent re-assembly of our state dict from per-expert HF tensors (via the key plan)."""
    from k2lab.hf.mapping import hf_key_plan

    result = {key: value.clone() for key, value in ours.items()}
    for hf_key, (our_key, expert) in hf_key_plan(ours).items():
        if expert is None:
            result[our_key] = hf[hf_key]
        else:
            result[our_key][expert] = hf[hf_key]
    return result


def test_fp8_weight_without_scale_is_reported(tmp_path: Path):
    config = load_preset("k2-nano")
    to_hf(build_model(config), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / SINGLE_FILE
    state = load_file(path)
    key = "model.layers.0.self_attn.o_proj.weight"
    state[key] = state[key].to(torch.float8_e4m3fn)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{key}_scale_inv"):
        from_hf(tmp_path / "ckpt")


def test_fp8_scale_with_wrong_shape_is_reported(tmp_path: Path):
    config = load_preset("k2-nano")
    to_hf(build_model(config), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / SINGLE_FILE
    state = load_file(path)
    key = "model.layers.0.self_attn.o_proj.weight"
    state[key + "_scale_inv"] = torch.ones(2, 2)
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"mis-shaped.*o_proj.weight_scale_inv \(2, 2\)"):
        from_hf(tmp_path / "ckpt")


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    to_hf(build_model(load_preset("k2-nano")), tmp_path / "ckpt", max_shard_bytes=50_000)
    return tmp_path / "ckpt"


def _edit_shard_with(path: Path, key: str, edit) -> None:
    index = json.loads((path / INDEX_FILE).read_text())
    shard = path / index["weight_map"][key]
    state = load_file(shard)
    edit(state)
    save_file(state, str(shard), metadata={"format": "pt"})


def test_missing_tensor(saved: Path):
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    _edit_shard_with(saved, key, lambda state: state.pop(key))
    with pytest.raises(
        CheckpointError, match=r"1 missing tensor: model\.layers\.1\.mlp\.experts\.5\.up_proj"
    ):
        from_hf(saved)


def test_many_missing_tensors_are_summarised(tmp_path: Path):
    target = to_hf(build_model(load_preset("k2-nano")), tmp_path / "ckpt")
    state = {k: v for k, v in load_file(target / SINGLE_FILE).items() if ".experts." not in k}
    save_file(state, str(target / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as error:
        from_hf(target)
    message = str(error.value)
    assert "24 missing tensors" in message and "... and 14 more" in message


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_weights_holding_nan_or_inf_are_refused(saved: Path, bad: float):
    """As k2lab model directories are: a damaged export loaded in silence and generated garbage."""
    key = "model.layers.1.mlp.experts.5.up_proj.weight"
    _edit_shard_with(saved, key, lambda state: state[key].__setitem__((0, 0), bad))
    with pytest.raises(
        CheckpointError, match=r"NaN or infinite values in 1 tensors \(layers\.1\.mlp\.experts\.up_proj\)"
    ):
        from_hf(saved)


def test_unexpected_tensor(saved: Path):
    key = "model.norm.weight"
    _edit_shard_with(
        saved, key, lambda state: state.update({"model.layers.0.mlp.extra.weight": torch.ones(3)})
    )
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor: model\.layers\.0\.mlp\.extra\.weight"):
        from_hf(saved)


def test_misshaped_tensor(saved: Path):
    key = "model.layers.0.self_attn.q_b_proj.weight"
    _edit_shard_with(saved, key, lambda state: state.update({key: torch.zeros(47, 32)}))
    with pytest.raises(
        CheckpointError, match=r"mis-shaped tensor: .*q_b_proj\.weight \(47, 32\) \(expected \(48, 32\)\)"
    ):
        from_hf(saved)


def test_missing_directory(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist"):
        from_hf(tmp_path / "nowhere")


def test_missing_config(saved: Path):
    (saved / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        from_hf(saved)


def test_malformed_config(saved: Path):
    (saved / "config.json").write_text('{"model_type": "deepseek_v3",')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        from_hf(saved)


def test_wrong_model_type(saved: Path):
    data = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**data, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type 'llama' is not supported"):
        from_hf(saved)


def test_invalid_config_values(saved: Path):
    data = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**data, "num_experts_per_tok": 99}))
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        from_hf(saved)


def test_no_weights(saved: Path):
    for file in saved.glob("model*"):
        file.unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        from_hf(saved)


def test_missing_shard(saved: Path):
    index = json.loads((saved / INDEX_FILE).read_text())
    (saved / index["weight_map"]["model.norm.weight"]).unlink()
    with pytest.raises(CheckpointError, match="shard files that do not exist"):
        from_hf(saved)


def test_unsupported_quantization(saved: Path):
    data = json.loads((saved / "config.json").read_text())
    data["quantization_config"] = {"quant_method": "compressed-tensors"}
    (saved / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="quant_method 'compressed-tensors' is not supported"):
        from_hf(saved)


def test_errors_are_k2lab_errors():
    from k2lab.errors import K2LabError

    assert issubclass(CheckpointError, K2LabError)


def test_from_hf_returns_causal_lm(saved: Path):
    model = from_hf(saved)
    assert isinstance(model, CausalLM)
    assert all(p.device.type == "cpu" for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------
# config.json reading
# ---------------------------------------------------------------------------------------------------------


def test_absent_config_fields_take_transformers_defaults():
    """A config.json that omits routing fields means what transformers' DeepseekV3Config defaults say."""
    from k2lab.hf.mapping import config_from_hf

    minimal = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4}
    ours = config_from_hf(minimal)
    reference = transformers.DeepseekV3Config(**{k: v for k, v in minimal.items() if k != "model_type"})
    for key in (
        "q_lora_rank",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "num_experts_per_tok",
        "n_routed_experts",
        "n_shared_experts",
        "first_k_dense_replace",
        "norm_topk_prob",
        "kv_lora_rank",
        "max_position_embeddings",
        "rms_norm_eps",
    ):
        assert getattr(ours, key) == getattr(reference, key), key
    assert ours.rope_scaling is None and ours.rope_theta == 10000.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"moe_layer_freq": 2}, "moe_layer_freq 2 is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling type 'linear'"),
    ],
)
def test_unsupported_config_settings(saved: Path, change: dict, message: str):
    data = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**data, **change}))
    with pytest.raises(CheckpointError, match=message):
        from_hf(saved)


def test_default_rope_type_in_legacy_rope_scaling_means_no_scaling(saved: Path):
    data = json.loads((saved / "config.json").read_text())
    data["rope_scaling"] = {"rope_type": "default"}
    (saved / "config.json").write_text(json.dumps(data))
    assert from_hf(saved).config.rope_scaling is None


def test_full_size_k2_checkpoint_is_checked_before_any_allocation(tmp_path: Path):
    """A 1T-parameter config is planned on the meta device: a bad checkpoint fails fast, allocating nothing."""
    from k2lab.hf.mapping import config_to_hf

    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(load_preset("k2"))))
    save_file({"model.norm.weight": torch.ones(7168)}, str(tmp_path / SINGLE_FILE))
    with pytest.raises(CheckpointError, match=r"69974 missing tensors: .* and 69964 more"):
        from_hf(tmp_path)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints that disagree with their config.json, or with themselves
# ---------------------------------------------------------------------------------------------------------


def _edit_config(path: Path, **changes: object) -> None:
    data = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**data, **changes}))


def _edit_single(path: Path, edit) -> None:
    state = load_file(path / SINGLE_FILE)
    edit(state)
    save_file(state, str(path / SINGLE_FILE), metadata={"format": "pt"})


@pytest.fixture
def single(tmp_path: Path) -> Path:
    return to_hf(_scramble(build_model(load_preset("k2-nano"))), tmp_path / "one")


def test_a_layer_beyond_num_hidden_layers_without_mtp_layers_is_unexpected(single: Path):
    """One layer too few in config.json must not drop the last layer as if it were an MTP layer."""
    _edit_config(single, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.1\."):
        from_hf(single)


def test_a_tied_config_refuses_a_stored_head_that_is_not_the_embedding(single: Path):
    _edit_config(single, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="lm_head.weight differs from the embedding"):
        from_hf(single)
    _edit_single(
        single, lambda state: state.update({"lm_head.weight": state["model.embed_tokens.weight"].clone()})
    )
    loaded = from_hf(single)
    assert loaded.config.tie_word_embeddings
    assert torch.equal(loaded.lm_head.weight, load_file(single / SINGLE_FILE)["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8, torch.float8_e5m2])
def test_a_weight_of_a_non_float_dtype_is_refused(single: Path, dtype: torch.dtype):
    key = "model.layers.0.self_attn.o_proj.weight"
    _edit_single(single, lambda state: state.update({key: state[key].to(dtype)}))
    with pytest.raises(CheckpointError, match=rf"1 wrongly typed tensor: {key} (I32|BOOL|U8|F8_E5M2)"):
        from_hf(single)


@pytest.mark.parametrize(
    ("weight_dtype", "scale_dtype", "refused"),
    [
        (torch.float8_e5m2, torch.float32, "{key} F8_E5M2"),  # another FP8 format, even with its scales
        (torch.float8_e4m3fn, torch.int32, "{key}_scale_inv I32"),  # integer block scales
    ],
)
def test_fp8_weights_and_scales_of_other_dtypes_are_refused(
    single: Path, weight_dtype: torch.dtype, scale_dtype: torch.dtype, refused: str
):
    key = "model.layers.0.self_attn.o_proj.weight"

    def edit(state: dict[str, torch.Tensor]) -> None:
        state[key] = state[key].to(weight_dtype)
        state[key + "_scale_inv"] = torch.ones(1, 1, dtype=scale_dtype)

    _edit_single(single, edit)
    with pytest.raises(CheckpointError, match=f"wrongly typed tensor: {refused.format(key=key)}"):
        from_hf(single)


def test_block_scales_of_a_1d_tensor_are_refused(single: Path):
    key = "model.norm.weight"
    _edit_single(single, lambda state: state.update({key + "_scale_inv": torch.ones(1)}))
    with pytest.raises(
        CheckpointError, match=f"{key}_scale_inv \\(1,\\) \\(the 1-D tensor {key} has no block"
    ):
        from_hf(single)


@pytest.mark.parametrize("block", [[True, True], [128, 1.5], [0, 128], "128"])
def test_fp8_block_sizes_other_than_two_positive_integers_are_refused(single: Path, block: object):
    _edit_config(single, quantization_config={"quant_method": "fp8", "weight_block_size": block})
    with pytest.raises(CheckpointError, match="weight_block_size .* should be two positive integers"):
        from_hf(single)


@pytest.mark.parametrize("shard", [5, None, "", "/etc/passwd", "../outside.safetensors", "a/../../x"])
def test_index_shard_names_must_be_files_in_the_directory(saved: Path, shard: object):
    index = json.loads((saved / INDEX_FILE).read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (saved / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"weight_map\['model.norm.weight'\]"):
        from_hf(saved)


def test_index_listing_a_tensor_no_shard_holds_is_refused(saved: Path):
    index = json.loads((saved / INDEX_FILE).read_text())
    shard = index["weight_map"]["model.norm.weight"]
    index["weight_map"]["model.layers.0.ghost.weight"] = shard
    (saved / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=rf"1 absent tensor: model.layers.0.ghost.weight \(not in {shard}\)"
    ):
        from_hf(saved)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": "yarn"}, "rope_scaling 'yarn' should be a JSON object"),
        ({"rope_scaling": None, "rope_parameters": "yarn"}, "rope_parameters 'yarn' should be a JSON object"),
        ({"bos_token_id": []}, "bos_token_id is an empty list"),
        ({"eos_token_id": []}, "eos_token_id is an empty list"),
        ({"rope_theta": 1}, "rope_theta: Input should be greater than 1"),
        (
            {"rope_interleave": False},
            "rope_interleave False is not supported .*interleaved rotary layout only",
        ),
        ({"rope_interleave": None}, "rope_interleave None is not supported"),
        ({"rope_interleave": "yes"}, "rope_interleave 'yes' is not supported"),
        (
            {"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
            "rope_theta 10000.0 contradicts rope_parameters.rope_theta 50000.0",
        ),
    ],
)
def test_config_values_that_cannot_be_read_are_one_line_errors(single: Path, change: dict, message: str):
    _edit_config(single, **change)
    with pytest.raises(CheckpointError, match=message) as error:
        from_hf(single)
    assert "\n" not in str(error.value) and "config.json" in str(error.value)


def test_rope_theta_agreeing_in_both_places_loads(single: Path):
    _edit_config(single, rope_parameters={"rope_type": "default", "rope_theta": 10000})
    assert from_hf(single).config.rope_theta == 10000.0
