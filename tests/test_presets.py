"""The one preset registry: text and vision-language presets as data, every listed preset usable by name."""

import json
import subprocess
import sys

import pytest

from k2lab.config import ConfigError, ModelConfig
from k2lab.presets import available_presets, get_preset, language_model_config, load_preset
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.vlm import VLMConfig


def test_registry_holds_both_kinds():
    text, vision = available_presets("text"), available_presets("vision-language")
    assert {"k2", "k2-mini", "k3", "kimi-linear-48b-a3b"} <= set(text)
    assert set(vision) == {"k25", "k25-mini", "k25-nano", "k3-vl", "k3-vl-mini", "k3-vl-nano"}
    assert sorted(text + vision) == available_presets()


@pytest.mark.parametrize("name", available_presets())
def test_every_preset_builds_its_config(name):
    preset = get_preset(name)
    decoder = language_model_config(name)
    assert isinstance(decoder, ModelConfig)
    if preset.is_vision_language:
        config = load_vlm_preset(name)
        assert isinstance(config, VLMConfig) and config.text.name == decoder.name
    else:
        assert load_preset(name) == decoder


def test_text_only_loader_refuses_a_vlm_preset_with_the_reason():
    with pytest.raises(ConfigError, match="vision-language preset .*language model 'k2-mini'"):
        load_preset("k25-mini")
    with pytest.raises(ConfigError, match="is a text preset; vision-language presets: k25"):
        load_vlm_preset("k2-mini")


def test_vlm_preset_towers_as_before():
    """The data files reproduce the towers the code once built (sizes and variant)."""
    mini = load_vlm_preset("k3-vl-mini").vision
    assert (mini.hidden_size, mini.num_hidden_layers, mini.patch_size) == (128, 2, 14)
    assert not mini.is_moonvit_3d_family
    full = load_vlm_preset("k25").vision
    assert (full.hidden_size, full.num_hidden_layers) == (1152, 27) and full.is_moonvit_3d_family


def _k2lab(*args):
    return subprocess.run([sys.executable, "-m", "k2lab", *args], capture_output=True, text=True)


@pytest.mark.parametrize("name", available_presets("vision-language"))
def test_params_accepts_every_listed_vlm_preset(name):
    result = _k2lab("params", "--preset", name, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    vision = report["vision_language"]
    assert vision["language_model"] == report["total"]
    assert vision["total"] == vision["language_model"] + vision["vision_tower"] + vision["projector"]


@pytest.mark.parametrize(
    "command",
    [["init", "--out", "unused"], ["stability"], ["ablate", "optimizer", "--quick"], ["ablate", "balancing"]],
)
def test_text_only_commands_refuse_a_vlm_preset_with_the_reason(command):
    result = _k2lab(*command, "--preset", "k25-nano")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "vision-language preset" in result.stderr and "k2-nano" in result.stderr


# K3's released text_config (vLLM's and mlx-lm's kimi_k3 config classes and the engines' fixtures,
# ../shared/spec/facts.md "K3 as released"): the values the k3 preset must write.
RELEASED_K3_TEXT = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 93,
    "num_attention_heads": 96,
    "num_experts": 896,
    "num_experts_per_token": 16,
    "num_shared_experts": 2,
    "routed_expert_hidden_size": 3584,
    "moe_intermediate_size": 3072,
    "intermediate_size": 33792,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "attn_res_block_size": 12,
    "latent_moe_use_norm": True,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 1.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 1048576,
}
RELEASED_K3_LINEAR_ATTN = {
    "full_attn_layers": [*range(4, 93, 4), 93],
    "num_heads": 96,
    "head_dim": 128,
    "short_conv_kernel_size": 4,
    "gate_lower_bound": -5.0,
    "use_full_rank_gate": True,
}


def test_k3_preset_takes_the_released_values():
    from k2lab.hf import kimi_k3

    written = kimi_k3.config_to_hf(load_preset("k3"))
    assert written["model_type"] == "kimi_k3"
    text = written["text_config"]
    assert {key: text.get(key) for key in RELEASED_K3_TEXT} == RELEASED_K3_TEXT
    linear = text["linear_attn_config"]
    assert {key: linear.get(key) for key in RELEASED_K3_LINEAR_ATTN} == RELEASED_K3_LINEAR_ATTN
    mla = set(RELEASED_K3_LINEAR_ATTN["full_attn_layers"])
    assert linear["kda_layers"] == [i for i in range(1, 94) if i not in mla]
    # and the released dict reads back as the preset (name aside)
    read = kimi_k3.config_from_hf(written)
    assert read.replace(name="k3") == load_preset("k3")


def test_model_overrides_refuse_booleans_for_numbers():
    """A recipe's `model_overrides = {num_hidden_layers = true}` built a one-layer model."""
    with pytest.raises(ConfigError, match=r"num_hidden_layers: takes an integer, not true"):
        load_preset("k2-nano", num_hidden_layers=True)
    assert load_preset("k2-nano", tie_word_embeddings=True).tie_word_embeddings
