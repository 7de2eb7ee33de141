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
