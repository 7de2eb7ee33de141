"""`k2lab plot` and `k2lab ablate optimizer` on tiny runs: files, tables, same tokens, stress verdict, reuse."""

import json
import math
import shutil

import pytest

from k2lab.ablations.common import load_settings
from k2lab.ablations.optimizer import QUICK, AblationConfig, tokens_to_reach
from k2lab.cli import main
from k2lab.errors import K2LabError
from k2lab.train.metrics import MetricsLogger, read_metrics
from tests.conftest import tiny_recipe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    return exit_info.value.code


def test_plot_writes_the_dashboard(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False) as metrics:
        for step in range(1, 6):
            metrics.log(
                step,
                {
                    "loss": 5.0 - 0.1 * step,
                    "lr": 1e-3,
                    "max_logit": 2.0 * step,
                    "max_logit/layer0": 2.0 * step,
                    "qk_clipped_heads": float(step > 3),
                    "expert_load/layer1": [3.0, 5.0, 4.0, 4.0],
                },
            )
    assert run_cli("plot", tmp_path, "--tau", 7) == 0
    image = tmp_path / "dashboard.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 10_000
    assert "dashboard.png" in capsys.readouterr().out


def test_plot_without_metrics_is_a_clean_error(tmp_path, capsys):
    assert run_cli("plot", tmp_path) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no metrics.jsonl" in err and "Traceback" not in err
    assert not (tmp_path / "dashboard.png").exists()


def test_ablation_tables_json_png_reuse_and_workers(tmp_path, tiny_corpus):
    recipe = tiny_recipe(tmp_path / "recipe.toml", tiny_corpus)
    out = tmp_path / "ablation"
    args = (
        "ablate",
        "optimizer",
        "--recipe",
        recipe,
        "--steps",
        4,
        "--lrs",
        "1e-2,3e-2",
        "--stress-lr",
        0.05,
        "--stress-tau",
        0.08,
        "--out",
        out,
        "--threads",
        1,
    )
    assert run_cli(*args) == 0

    results = json.loads((out / "ablation.json").read_text())
    assert results["settings"]["preset"] == "k2-nano" and results["settings"]["tokens"] == 4 * 64
    assert {(r["optimizer"], r["lr"]) for r in results["runs"]} == {
        (name, lr) for name in ("adamw", "muon", "muonclip") for lr in (0.01, 0.03)
    }
    # Same initial weights and the same first batch: every run's step-1 loss (before any update) is equal.
    first = {read_metrics(r["run_dir"])[0]["loss"] for r in [*results["runs"], *results["stress_runs"]]}
    assert len(first) == 1
    # Same evaluation points for every run, and the best run is the one with the lowest final loss.
    assert len({tuple(p["tokens"] for p in r["val_curve"]) for r in results["runs"]}) == 1
    for name, best in results["best"].items():
        runs = [r for r in results["runs"] if r["optimizer"] == name]
        assert best == min(runs, key=lambda r: r["final_val_loss"])["name"]
    target = results["target_loss"]
    assert target == pytest.approx(max(row["final_val_loss"] for row in results["comparison"].values()))
    assert results["comparison"]["adamw"]["token_efficiency_vs_adamw"] == pytest.approx(1.0)
    assert set(results["equal_tokens"]["val_loss"]) == {"adamw", "muon", "muonclip"}

    stress = results["stress"]
    muon, clip = stress["runs"]["muon"], stress["runs"]["muonclip"]
    assert stress["demonstrated"] and muon["peak_max_logit"] > 0.08 and muon["clipped_heads_total"] == 0
    assert clip["peak_max_logit_clipped"] <= 0.08 * (1 + 1e-6) and clip["clipped_heads_total"] > 0
    stress_runs = {r["optimizer"]: r for r in results["stress_runs"]}
    assert all(v <= 0.08 * (1 + 1e-6) for v in stress_runs["muonclip"]["max_logit_clipped"])

    table = (out / "ablation.md").read_text()
    for fragment in (
        "# Optimizer ablation: k2-nano, 4 steps × 64 tokens",
        "| optimizer | lr 0.01 | lr 0.03 | best lr |",
        "| AdamW |",
        "| Muon |",
        "| MuonClip |",
        "Validation loss at equal tokens",
        f"Tokens to reach validation loss {target:.3f}",
        "## Stress: lr 0.05, τ = 0.08, 4 steps",
        "Muon's max logit ran past τ while MuonClip kept every head at or below τ",
    ):
        assert fragment in table, fragment
    image = out / "ablation.png"
    assert image.read_bytes()[:8] == PNG_MAGIC and image.stat().st_size > 20_000
    assert not (out / "runs" / "adamw-lr0.01" / "checkpoints").exists()  # weights dropped by default

    # Again on 2 worker processes, one run removed: that one trains again (identically), the rest is reused.
    shutil.rmtree(out / "runs" / "muon-lr0.03")
    assert run_cli(*args, "--jobs", 2) == 0
    again = json.loads((out / "ablation.json").read_text())
    assert [r["name"] for r in again["runs"] if not r["reused"]] == ["muon-lr0.03"]
    assert all(r["reused"] for r in again["stress_runs"])
    for before, after in zip(results["runs"], again["runs"], strict=True):
        assert after["loss"] == before["loss"] and after["final_val_loss"] == before["final_val_loss"]
    assert (out / "logs" / "sweep-muon-lr0.03.log").read_text().count("validation loss") == 1


def test_tokens_to_reach_interpolates_between_evaluations():
    curve = [
        {"tokens": 100, "val_loss": 5.0},
        {"tokens": 200, "val_loss": 4.0},
        {"tokens": 300, "val_loss": 3.0},
    ]
    assert tokens_to_reach(curve, 3.5) == pytest.approx(250)
    assert tokens_to_reach(curve, 6.0) == 100
    assert tokens_to_reach(curve, 2.0) is None
    assert tokens_to_reach([{"tokens": 1, "val_loss": math.nan}, *curve], 4.5) == pytest.approx(150)


def test_settings_and_bad_input(capsys):
    quick = load_settings(AblationConfig, overlay=QUICK)
    assert quick.base.preset == "k2-nano" and quick.stress is not None and len(quick.lrs) == 3
    assert quick.threads == 1 and quick.out == "runs/ablation-quick" and quick.stress.tau == 2.0
    full = AblationConfig.model_validate({"base": {"steps": 40}, "stress": None})
    assert full.base.preset == "k2-mini" and full.base.eval_every == 4 and full.stress is None
    assert full.base.save_every == 40 and full.tau == full.base.optimizer.qk_clip_tau == 100.0
    assert load_settings(AblationConfig, lrs=[3e-3, 1e-3, 3e-3]).lrs == [1e-3, 3e-3]
    with pytest.raises(K2LabError, match="optimizers"):
        load_settings(AblationConfig, optimizers=["sgd"])
    assert run_cli("ablate", "optimizer", "--lrs", "fast") == 2
    assert "--lrs takes float values" in " ".join(capsys.readouterr().err.split())


def test_study_settings_refuse_booleans_for_numbers(tmp_path):
    """`steps = true` in a study's recipe trained 1 step a run (`true` read as 1)."""
    recipe = tmp_path / "study.toml"
    recipe.write_text("[base]\nsteps = true\n")
    with pytest.raises(
        K2LabError, match=r"^invalid ablation setting: base.steps: takes an integer, not true$"
    ):
        load_settings(AblationConfig, recipe)


def test_recipe_is_the_settings_or_a_training_recipe_for_base(tmp_path):
    settings = tmp_path / "study.toml"
    settings.write_text(
        'lrs = [0.01]\nout = "o"\n[stress]\nlr = 0.2\n[base]\nsteps = 20\n[base.schedule]\nwarmup_steps = 1\n'
    )
    study = load_settings(AblationConfig, settings, overlay=QUICK, **{"base.seq_len": 32})
    assert study.lrs == [0.01] and study.out == "o" and study.stress.lr == 0.2 and study.stress.tau == 2.0
    base = study.base
    assert (base.preset, base.steps, base.seq_len, base.eval_every) == ("k2-nano", 20, 32, 2)
    assert base.schedule.warmup_steps == 1 and base.schedule.decay_fraction == 0.2
    training = tmp_path / "train.toml"
    training.write_text('steps = 20\nout = "ignored"\n[optimizer]\nweight_decay = 0.0\n')
    study = load_settings(AblationConfig, training)
    assert (
        study.base.steps == 20 and study.base.optimizer.weight_decay == 0.0 and study.out == "runs/ablation"
    )


@pytest.mark.parametrize("lr", [math.inf, math.nan, 0.0])
def test_a_learning_rate_that_is_not_positive_and_finite_is_refused(lr):
    """--lrs inf trained NaN runs and reported "best lr inf"."""
    with pytest.raises(ValueError, match="positive and finite"):
        AblationConfig(lrs=[1e-3, lr])
