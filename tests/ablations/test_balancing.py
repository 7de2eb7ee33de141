"""`k2lab ablate balancing` on tiny k3-nano runs: same tokens, consistent balance figures, files, reuse."""

import json

import pytest
import torch

from k2lab.ablations.balancing import RULES, BalancingConfig, balance_curves
from k2lab.ablations.common import load_settings
from k2lab.errors import K2LabError
from k2lab.train.metrics import read_metrics
from tests.ablations.test_optimizer import PNG_MAGIC, run_cli
from tests.conftest import tiny_recipe


def test_balancing_ablation_outputs_and_reuse(tmp_path, tiny_corpus, capsys):
    recipe = tiny_recipe(tmp_path / "recipe.toml", tiny_corpus, preset="k3-nano")
    out = tmp_path / "balancing"
    args = ("ablate", "balancing", "--recipe", recipe, "--steps", 6, "--window", 3, "--out", out)
    assert run_cli(*args, "--threads", 1, "--jobs", 1) == 0
    printed = "".join(capsys.readouterr().out.split())  # rich wraps long paths
    assert "balancing.md" in printed and "QuantileBalancing" in printed

    results = json.loads((out / "balancing.json").read_text())
    s = results["settings"]
    assert s["preset"] == "k3-nano" and s["tokens"] == 6 * 64 and s["gamma"] == 1e-3
    assert [run["rule"] for run in results["runs"]] == list(RULES)
    # Fair: the same tokens and the same step-1 loss (same weights, same first batch, bias still zero).
    assert results["same_tokens"] and results["same_first_loss"]
    n_experts, top_k = s["n_experts"], s["top_k"]
    for run in results["runs"]:
        records = read_metrics(run["run_dir"])
        assert len(records) == run["steps"] == 6 and run["tail_steps"] == 2
        assert run["moe_layers"] == [1, 2, 3] and run["slots"] == 3 * n_experts
        for record in records:  # every token goes to top_k experts in every MoE layer
            for layer in run["moe_layers"]:
                assert sum(record[f"expert_load/layer{layer}"]) == 64 * top_k
        assert all(v >= 1.0 for v in run["imbalance_mean"] + run["imbalance_max"])
        assert run["tail_imbalance_max"] >= run["tail_imbalance_mean"] >= 1.0
        assert all(0 <= v <= run["slots"] for v in run["dead"] + run["dead_window"])
        assert all(w <= d for w, d in zip(run["dead_window"], run["dead"], strict=True))
        assert 0 <= run["dead_at_end"] == sum(run["dead_at_end_by_layer"]) <= run["slots"]
        assert run["final_val_loss"] == pytest.approx(records[-1]["val_loss"])
    assert results["runs"][0]["gamma"] is None and results["runs"][1]["gamma"] == 1e-3

    table = (out / "balancing.md").read_text()
    for fragment in (
        "# Router-bias ablation: k3-nano, 6 steps × 64 tokens",
        "step-1 losses equal",
        "| bias rule | mean max/mean load (last 2 steps) |",
        "| none |",
        "| DeepSeek-V3 sign (γ 0.001) |",
        "| Quantile Balancing |",
        "| bias rule | layer 1 | layer 2 | layer 3 |",
    ):
        assert fragment in table, fragment
    image = out / "balancing.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 20_000
    assert not (out / "runs" / "none" / "checkpoints").exists()  # weights dropped by default

    # A new γ retrains the sign rule's run alone; the other rules are reused.
    assert run_cli(*args, "--threads", 1, "--gamma", 0.01, "--rules", "deepseek,quantile") == 0
    again = json.loads((out / "balancing.json").read_text())
    assert [(run["rule"], run["reused"]) for run in again["runs"]] == [
        ("deepseek", False),
        ("quantile", True),
    ]
    assert again["runs"][1]["imbalance_mean"] == results["runs"][2]["imbalance_mean"]


def test_balance_curves_count_dead_experts_over_the_window():
    loads = torch.tensor(
        [[[4.0, 0.0, 2.0, 2.0]], [[4.0, 0.0, 0.0, 4.0]], [[2.0, 2.0, 0.0, 4.0]], [[4.0, 4.0, 0.0, 0.0]]]
    )  # [steps 4, layers 1, experts 4]
    curves = balance_curves(loads, window=2)
    assert curves["imbalance"][:, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert curves["dead"][:, 0].tolist() == [1, 2, 1, 2]
    assert curves["dead_window"][:, 0].tolist() == [1, 1, 1, 1]  # expert 1, 1, 2, 2 had nothing for 2 steps


def test_settings_and_bad_input(capsys):
    default = load_settings(BalancingConfig)
    assert default.base.preset == "k3-mini" and default.rules == list(RULES) and default.gamma == 1e-3
    assert default.base.eval_every == 20 and default.base.save_every == default.base.steps == 80
    assert default.jobs == 3
    chosen = load_settings(
        BalancingConfig, rules=["quantile", "none"], **{"base.steps": 40, "base.optimizer.lr": 1e-3}
    )
    assert chosen.rules == ["none", "quantile"] and chosen.jobs == 2 and chosen.base.eval_every == 10
    with pytest.raises(K2LabError, match="rules"):
        load_settings(BalancingConfig, rules=["aux-loss"])
    assert run_cli("ablate", "balancing", "--rules", "sign") == 2
    assert "rules must be a non-empty subset" in " ".join(capsys.readouterr().err.split())
