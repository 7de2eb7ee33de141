"""Kimi Linear interop: ``to_hf`` / ``from_hf`` against transformers' ``KimiLinearForCausalLM`` (its torch path).

Both directions are checked on logits (fp32, rel+abs 1e-4) for tiny hybrids that vary the number of layers
(2-4), where the MLA layers sit (first, middle, last, none, all), ``q_lora_rank`` None / set, shared experts
0 / 1, dense prefix 0 / 1 / 2, grouped routing, KDA heads / widths / conv kernel, at T = 37 and 70 (not
multiples of the 64-token chunk, so the chunked kernels pad). Weights are re-drawn large with a random router
bias so logits are O(1) and routing is non-trivial. The transformers -> ours direction starts from a model
transformers builds from its own config vocabulary (independent of our ``config_to_hf``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k2lab import ModelConfig, build_model, load_preset
from k2lab.config import ConfigError
from k2lab.errors import CheckpointError
from k2lab.hf import from_hf, to_hf
from k2lab.hf.bridge import to_transformers
from k2lab.hf.mapping import config_from_hf, config_to_hf
from k2lab.infer import GenerationConfig, generate
from tests.conftest import KIMI_LINEAR_STYLE, randomize

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

TOL = 1e-4
LENGTHS = (37, 70)


# name -> overrides of k3-nano (vocab 128, hidden 64, 2 MLA heads, 8 experts top-2) in Kimi Linear style.
CONFIGS: dict[str, dict] = {
    "L2-kda-mla-qlora-shared1-dense1": {
        "num_hidden_layers": 2,
        "mla_layers": (2,),
        "first_k_dense_replace": 1,
    },
    "L3-mla-first-noqlora-shared0-dense0-kernel3": {
        "num_hidden_layers": 3,
        "mla_layers": (1,),
        "q_lora_rank": None,
        "n_shared_experts": 0,
        "first_k_dense_replace": 0,
        "linear_num_heads": 4,
        "linear_head_dim": 8,
        "linear_conv_kernel_dim": 3,
        "routed_scaling_factor": 2.446,
    },
    "L4-mla-2-4-groups-dense0-1head32": {
        "mla_layers": (2, 4),
        "first_k_dense_replace": 0,
        "n_group": 2,
        "topk_group": 1,
        "linear_num_heads": 1,
        "linear_head_dim": 32,
        "norm_topk_prob": False,
    },
    "L3-mla-1-3-noqlora-shared0-dense2-head24": {
        "num_hidden_layers": 3,
        "mla_layers": (1, 3),
        "q_lora_rank": None,
        "n_shared_experts": 0,
        "first_k_dense_replace": 2,
        "linear_head_dim": 24,
    },
    "L2-kda-only": {"num_hidden_layers": 2, "mla_layers": (), "first_k_dense_replace": 1},
    "L2-nope-mla-only": {"num_hidden_layers": 2, "mla_layers": (1, 2), "q_lora_rank": None},
}


def _config(name: str) -> ModelConfig:
    return load_preset("k3-nano", **KIMI_LINEAR_STYLE, **CONFIGS[name])


def _tokens(vocab: int, length: int, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> float:
    assert ours.abs().max() > 0.5, "logits too small to make the comparison meaningful"
    torch.testing.assert_close(ours, reference, rtol=TOL, atol=TOL)
    return (ours - reference).abs().max().item()


def _max_diff(ours, reference, vocab: int) -> float:
    """Max |Δlogits| over T = 37 and 70 (asserted within 1e-4). transformers runs without a cache: with
    only KDA layers its forward cannot build one (``DynamicCache.get_seq_length`` needs an attention layer)."""
    worst = 0.0
    with torch.no_grad():
        for length in LENGTHS:
            ids = _tokens(vocab, length)
            expected = reference(ids, use_cache=False).logits
            worst = max(worst, _assert_logits_close(ours(ids).logits, expected))
    return worst


def _hf_load(path: Path):
    model, info = transformers.KimiLinearForCausalLM.from_pretrained(path, output_loading_info=True)
    # With no shared experts transformers still builds a zero-width shared MLP (it adds exactly 0).
    empty = {name for name, parameter in model.named_parameters() if parameter.numel() == 0}
    info["missing_keys"] = set(info.get("missing_keys", ())) - empty
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), f"transformers reports {kind}: {info[kind]}"
    return model.eval()


def _transformers_config(config: ModelConfig):
    """``KimiLinearConfig`` for ``config``, written directly in transformers' own argument names."""
    L = config.num_hidden_layers
    return transformers.KimiLinearConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=L,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        num_local_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        n_shared_experts=config.n_shared_experts,
        n_group=config.n_group,
        topk_group=config.topk_group,
        norm_topk_prob=config.norm_topk_prob,
        routed_scaling_factor=config.routed_scaling_factor,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        layer_types=[
            "full_attention" if kind == "mla" else "linear_attention" for kind in config.layer_types
        ],
        mlp_layer_types=["sparse" if config.is_moe_layer(i) else "dense" for i in range(L)],
        linear_num_heads=config.linear_num_heads,
        linear_head_dim=config.linear_head_dim,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def _scramble(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """transformers-side ``randomize``: weights ~ N(0, 0.15), norms ~ 1 + N(0, 0.1), random router bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def reference_models() -> dict[str, torch.nn.Module]:
    """One transformers model per config (built from its own config vocabulary)."""
    torch.manual_seed(0)
    return {
        name: _scramble(transformers.KimiLinearForCausalLM(_transformers_config(_config(name))))
        for name in CONFIGS
    }


# ---------------------------------------------------------------------------------------------------------
# Both directions, logits
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_to_hf_loads_in_transformers(name: str, tmp_path: Path):
    ours = randomize(build_model(_config(name)))
    to_hf(ours, tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["model_type"] == "kimi_linear"
    theirs = _hf_load(tmp_path / "ckpt")
    diff = _max_diff(ours, theirs, ours.config.vocab_size)
    print(f"[to_hf -> transformers] {name}: max |Δlogits| = {diff:.3g}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_hf_reads_save_pretrained(name: str, tmp_path: Path, reference_models):
    reference = reference_models[name]
    reference.save_pretrained(tmp_path / "ckpt")
    ours = from_hf(tmp_path / "ckpt").eval()
    assert ours.config == _config(name).replace(name=ours.config.name)
    diff = _max_diff(ours, reference, ours.config.vocab_size)
    print(f"[transformers -> from_hf] {name}: max |Δlogits| = {diff:.3g}")


def test_from_hf_reads_transformers_in_memory_names(tmp_path: Path, reference_models):
    """transformers' module names on disk (fused conv1d, forget_gate.*, mlp.experts.gate_up_proj ...) load the
    same weights as the save_pretrained layout (whose logits ``test_from_hf_reads_save_pretrained`` checks)."""
    reference = reference_models["L4-mla-2-4-groups-dense0-1head32"]
    reference.save_pretrained(tmp_path / "ckpt")
    expected = from_hf(tmp_path / "ckpt").state_dict()
    state = {key: value.contiguous() for key, value in reference.state_dict().items()}
    assert "model.layers.0.self_attn.conv1d.weight" in state
    assert "model.layers.0.self_attn.forget_gate.A_log" in state
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    loaded = from_hf(tmp_path / "ckpt").state_dict()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def test_from_hf_reads_original_moonshot_config(tmp_path: Path, reference_models):
    """The original config.json vocabulary (``linear_attn_config``, ``first_k_dense_replace`` ...) means for us
    what it means for transformers."""
    name = "L3-mla-1-3-noqlora-shared0-dense2-head24"
    reference = reference_models[name]
    reference.save_pretrained(tmp_path / "ckpt")
    from_hf_state = from_hf(tmp_path / "ckpt").state_dict()
    path = tmp_path / "ckpt" / "config.json"
    data = json.loads(path.read_text())
    layer_types, mlp_layer_types = data.pop("layer_types"), data.pop("mlp_layer_types")
    data["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, kind in enumerate(layer_types) if kind == "full_attention"],
        "kda_layers": [i + 1 for i, kind in enumerate(layer_types) if kind == "linear_attention"],
        "num_heads": data.pop("linear_num_heads"),
        "head_dim": data.pop("linear_head_dim"),
        "short_conv_kernel_size": data.pop("linear_conv_kernel_dim"),
    }
    data.update(first_k_dense_replace=mlp_layer_types.count("dense"), mla_use_nope=True, moe_layer_freq=1)
    path.write_text(json.dumps(data))
    theirs = transformers.KimiLinearConfig.from_pretrained(tmp_path / "ckpt")
    assert theirs.layer_types == layer_types and theirs.mlp_layer_types == mlp_layer_types
    assert theirs.linear_head_dim == _config(name).linear_head_dim
    ours = from_hf(tmp_path / "ckpt").eval()
    assert ours.config == _config(name).replace(name=ours.config.name)
    for key, value in ours.state_dict().items():  # the weights are those of the transformers layout
        assert torch.equal(value, from_hf_state[key]), key


def test_greedy_generation_identical():
    ours = randomize(build_model(_config("L4-mla-2-4-groups-dense0-1head32")))
    theirs = to_transformers(ours)
    prompt = _tokens(ours.config.vocab_size, 12, seed=1, batch=2)
    expected = theirs.generate(
        prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=6
    )[:, 12:]
    assert generate(ours, prompt.tolist(), GenerationConfig(max_new_tokens=6)) == expected.tolist()


# ---------------------------------------------------------------------------------------------------------
# On-disk layout and configs
# ---------------------------------------------------------------------------------------------------------


def test_checkpoint_layout_is_the_original_one(tmp_path: Path):
    """Per-projection convs, forget gate on self_attn, A_log [1, 1, H, 1], block_sparse_moe w1/w2/w3; A_log
    and dt_bias stay fp32 under a bf16 export."""
    config = _config("L2-kda-mla-qlora-shared1-dense1")
    ours = randomize(build_model(config))
    to_hf(ours, tmp_path / "ckpt", dtype=torch.bfloat16)
    H, K, W = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as handle:
        keys = set(handle.keys())
        attn = "model.layers.0.self_attn."
        assert handle.get_tensor(attn + "A_log").shape == (1, 1, H, 1)
        assert handle.get_tensor(attn + "A_log").dtype == torch.float32
        assert handle.get_tensor(attn + "dt_bias").dtype == torch.float32
        assert handle.get_tensor(attn + "q_proj.weight").dtype == torch.bfloat16
        conv = torch.cat([handle.get_tensor(f"{attn}{p}_conv1d.weight") for p in "qkv"]).float()
    assert conv.shape == (3 * H * K, 1, W)
    assert torch.equal(conv, ours.layers[0].attn.conv1d.weight.detach().bfloat16().float())
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # dense layer
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in keys
    assert "model.layers.1.block_sparse_moe.gate.e_score_correction_bias" in keys
    assert not any("forget_gate" in key or key.endswith("self_attn.conv1d.weight") for key in keys)


def test_real_kimi_linear_config_is_the_preset():
    """Moonshot's Kimi-Linear-48B-A3B config.json (original vocabulary) reads as our preset."""
    original = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": 27,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 72,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "model_max_length": 1048576,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
    }
    preset = load_preset("kimi-linear-48b-a3b")
    tokens = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    assert config_from_hf(original, name=preset.name) == preset.replace(**tokens)
    ignored = ("model_type", "rope_theta", "rope_scaling")
    reference = transformers.KimiLinearConfig(**{k: v for k, v in original.items() if k not in ignored})
    assert reference.layer_types == [
        "full_attention" if i + 1 in preset.mla_layers else "linear_attention" for i in range(27)
    ]
    # and back: our config.json carries both vocabularies consistently
    written = config_to_hf(preset)
    assert written["linear_attn_config"] == original["linear_attn_config"]
    assert config_from_hf(written, name=preset.name) == preset


def test_config_defaults_are_transformers_defaults():
    minimal = {"model_type": "kimi_linear", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 6}
    ours = config_from_hf(minimal)
    reference = transformers.KimiLinearConfig(
        **{k: v for k, v in minimal.items() if k != "model_type"},
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    assert ours.layer_types == tuple("mla" if t == "full_attention" else "kda" for t in reference.layer_types)
    assert [ours.is_moe_layer(i) for i in range(6)] == [t == "sparse" for t in reference.mlp_layer_types]
    for ours_key, theirs_key in [
        ("n_routed_experts", "num_local_experts"),
        ("num_experts_per_tok", "num_experts_per_tok"),
        ("n_shared_experts", "n_shared_experts"),
        ("routed_scaling_factor", "routed_scaling_factor"),
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("rms_norm_eps", "rms_norm_eps"),
        ("max_position_embeddings", "max_position_embeddings"),
        ("linear_num_heads", "linear_num_heads"),
        ("linear_head_dim", "linear_head_dim"),
        ("linear_conv_kernel_dim", "linear_conv_kernel_dim"),
    ]:
        assert getattr(ours, ours_key) == getattr(reference, theirs_key), ours_key


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_layer_types": ["sparse", "dense"]}, "mlp_layer_types: .* first_k_dense_replace form"),
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types: .*sliding_attention"),
        ({"mla_use_nope": False}, "mla_use_nope False is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func 'softmax'"),
        ({"num_key_value_heads": 1}, "num_key_value_heads 1"),
        ({"num_experts": 8, "num_local_experts": 16}, "num_experts / num_local_experts: conflicting"),
        (
            {"layer_types": None, "linear_attn_config": {"full_attn_layers": [2], "kda_layers": [2]}},
            "linear_attn_config: .* exactly once",
        ),
    ],
)
def test_unsupported_kimi_linear_configs(change: dict, message: str):
    data = config_to_hf(_config("L2-kda-mla-qlora-shared1-dense1"))
    data.update(change)
    if data.get("layer_types") is None:
        data.pop("layer_types", None)
    with pytest.raises(ConfigError, match=message):
        config_from_hf(data)


def test_unsupported_config_is_a_checkpoint_error(tmp_path: Path):
    to_hf(randomize(build_model(_config("L2-kda-mla-qlora-shared1-dense1"))), tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "mlp_layer_types": ["sparse", "dense"]}))
    with pytest.raises(CheckpointError, match="mlp_layer_types"):
        from_hf(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        ({**KIMI_LINEAR_STYLE, "mla_rope": True}, ["kimi_linear", "mla_rope=True"]),
        ({**KIMI_LINEAR_STYLE, "tie_word_embeddings": True}, ["kimi_linear", "tie_word_embeddings"]),
        # K3's features are written as kimi_k3 (tests/hf/test_kimi_k3.py), whose MLA is NoPE without YaRN
        ({"mla_rope": True}, ["kimi_k3", "mla_rope=True"]),
        (
            {"mla_rope": True, "rope_scaling": {"factor": 2.0, "original_max_position_embeddings": 128}},
            ["kimi_k3", "mla_rope=True", "rope_scaling"],
        ),
        # all-MLA with RoPE and K3 features: neither DeepseekV3 nor kimi_k3 holds it
        ({"mla_layers": None, "mla_rope": True, "mla_output_gate": False}, ["kimi_k3", "mla_rope=True"]),
    ],
)
def test_what_no_format_holds_is_refused_not_written(overrides: dict, fields: list[str], tmp_path: Path):
    model = build_model(load_preset("k3-nano", **overrides))
    with pytest.raises(ConfigError, match="cannot write") as error:
        to_hf(model, tmp_path / "ckpt")
    for field in fields:
        assert field in str(error.value)
    assert not (tmp_path / "ckpt").exists()
