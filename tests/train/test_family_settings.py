"""K3's training rules (Quantile Balancing, Per-Head Muon) for K3-family presets unless the recipe says
otherwise; K2's unchanged; a resumed run keeps what it trained with."""

import json

import pytest

from k2lab.errors import CheckpointError
from k2lab.models import build_model
from k2lab.optim.grouping import OptimizerConfig
from k2lab.presets import load_preset
from k2lab.train.config import BalanceConfig, TrainConfig, load_train_config
from k2lab.train.family_settings import RESUMED, describe_choices, family_reasons
from k2lab.train.trainer import Trainer, run_training
from tests.conftest import tiny_recipe


def rules(config: TrainConfig) -> tuple[str, bool]:
    return config.balance.bias_rule, config.optimizer.per_head_muon


@pytest.mark.parametrize("preset", ["k3-nano", "k3-mini", "k3", "k3-vl-nano"])
def test_a_k3_family_preset_trains_with_k3s_rules(preset):
    config = load_train_config(preset=preset)
    assert rules(config) == ("quantile", True)
    reasons = family_reasons(config)
    assert reasons["balance.bias_rule"] == f"auto: preset {preset!r} is K3-family: K3's Quantile Balancing"
    assert reasons["optimizer.per_head_muon"].startswith("auto:")
    assert config.balance.model_fields_set == set()  # still "not given"


@pytest.mark.parametrize("preset", ["k2-nano", "k2-mini", "k25-nano", "deepseek-v3", "kimi-linear-48b-a3b"])
def test_k2_family_presets_keep_todays_defaults(preset):
    config = load_train_config(preset=preset)
    assert rules(config) == ("deepseek", False)
    assert config.balance == BalanceConfig() and config.optimizer == OptimizerConfig()
    assert family_reasons(config)["balance.bias_rule"].startswith(f"auto: preset {preset!r} is not K3-family")


def test_what_the_recipe_or_a_flag_sets_wins_on_a_k3_preset(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        'preset = "k3-nano"\n[balance]\nbias_rule = "deepseek"\n[optimizer]\nper_head_muon = false\n'
    )
    assert rules(load_train_config(recipe)) == ("deepseek", False)
    flags = load_train_config(preset="k3-nano", **{"balance.bias_rule": "none"})
    assert rules(flags) == ("none", True)
    assert describe_choices(flags) == [
        "router bias rule: none (requested)",
        "per-head Muon: on (auto: preset 'k3-nano' is K3-family: K3's Per-Head Muon)",
    ]
    given = OptimizerConfig(lr=1e-3)  # a section object passed in is left as it was
    assert TrainConfig(preset="k3-nano", optimizer=given).optimizer.per_head_muon and not given.per_head_muon
    stripped = load_train_config(preset="k3-nano", **{"model_overrides.mlp_activation": "swiglu"})
    assert rules(stripped) == ("quantile", True)  # k3-nano keeps LatentMoE, AttnRes ...: still K3-family


def test_the_trainer_records_scores_and_builds_head_blocks_for_k3(tmp_path):
    for preset, k3 in (("k3-nano", True), ("k2-nano", False)):
        config = load_train_config(preset=preset)
        trainer = Trainer(config, build_model(load_preset(preset)), iter([]), [], tmp_path)
        assert all(moe.record_scores == k3 for moe in trainer.lm.moe_layers())
        assert any(group.get("row_blocks") for group in trainer.muonclip.param_groups) == k3


def test_a_run_keeps_the_rules_it_was_started_with_on_resume(tmp_path, tiny_corpus, capsys):
    """A K3 run started before K3's rules were its family's defaults saved deepseek / whole-matrix Muon;
    resumed by the same command now, it continues with those (the optimizer state fits, no refusal)."""
    out = tmp_path / "run"
    path = tiny_recipe(
        tmp_path / "r.toml", tiny_corpus, preset="k3-nano", out=str(out), save_every=2, steps=2
    )
    old = {"balance.bias_rule": "deepseek", "optimizer.per_head_muon": False}  # what the old defaults gave
    run_training(load_train_config(path, **old))
    summary = run_training(load_train_config(path, steps=4), resume=True)
    assert summary["family_settings"] == {"balance.bias_rule": "deepseek", "optimizer.per_head_muon": False}
    assert set(summary["family_settings_reason"].values()) == {RESUMED}
    assert f"router bias rule: deepseek ({RESUMED})" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="balance.bias_rule: 'deepseek' then, 'quantile' now"):
        run_training(load_train_config(path, steps=6, **{"balance.bias_rule": "quantile"}), resume=True)


def test_a_new_k3_run_records_its_rules(tmp_path, tiny_corpus, capsys):
    out = tmp_path / "run"
    path = tiny_recipe(tmp_path / "r.toml", tiny_corpus, preset="k3-nano", out=str(out), steps=1)
    run_training(load_train_config(path))
    saved = json.loads((out / "summary.json").read_text())
    assert saved["family_settings"] == {"balance.bias_rule": "quantile", "optimizer.per_head_muon": True}
    assert saved["family_settings_reason"]["balance.bias_rule"].startswith("auto: preset 'k3-nano' is K3")
    assert "per-head Muon: on (auto: preset 'k3-nano' is K3-family" in capsys.readouterr().out
