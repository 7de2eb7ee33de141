"""`k2lab ablate k3-design` on tiny k3-nano runs: outputs, reuse, arms that differ only in their overrides,
refused arm names, and the MoE activation maxima checked against the branch recomputed by hand."""

import json
import math

import pytest
import torch

from k2lab.ablations.common import load_settings
from k2lab.ablations.k3_design import ARMS, K3DesignConfig, grad_spikes, train_config
from k2lab.errors import K2LabError
from k2lab.models import build_model
from k2lab.presets import load_preset
from k2lab.train.metrics import read_metrics
from k2lab.train.moe_telemetry import moe_activation_maxima
from k2lab.train.pretraining import PretrainingData
from tests.ablations.test_optimizer import PNG_MAGIC, run_cli
from tests.conftest import tiny_recipe


def test_k3_design_outputs_reuse_and_fair_arms(tmp_path, tiny_corpus, capsys):
    recipe = tiny_recipe(tmp_path / "recipe.toml", tiny_corpus, preset="k3-nano", sample_tokens=0)
    out = tmp_path / "k3"
    args = (
        "ablate",
        "k3-design",
        "--recipe",
        recipe,
        "--steps",
        4,
        "--set",
        "base.eval_every=2",
        "--out",
        out,
    )
    args = (*args, "--threads", 1)
    assert run_cli(*args, "--arms", "swiglu-no-norm,k3", "--jobs", 1) == 0
    printed = "".join(capsys.readouterr().out.split())  # rich wraps long paths
    assert "k3_design.md" in printed and "StableLatentMoE" in printed

    results = json.loads((out / "k3_design.json").read_text())
    assert results["settings"]["tokens"] == 4 * 64 and results["same_tokens"]
    assert [run["arm"] for run in results["runs"]] == ["k3", "swiglu-no-norm"]  # the order of ARMS
    assert set(results["verdicts"]) == {"stable_latent_moe"}
    for run in results["runs"]:
        records = read_metrics(run["run_dir"])
        assert run["steps"] == 4 and [p["step"] for p in run["val_curve"]] == [2, 4]
        assert run["final_val_loss"] == pytest.approx(records[-1]["val_loss"])
        # the maxima are logged with every validation, for the three MoE layers of k3-nano
        evals = [r for r in records if "val_loss" in r]
        assert all(f"moe_routed_max/layer{i}" in r for r in evals for i in (1, 2, 3))
        assert not any("moe_routed_max/layer1" in r for r in records if "val_loss" not in r)
        assert run["routed_max_peak"] == max(r[f"moe_routed_max/layer{i}"] for r in evals for i in (1, 2, 3))
        assert run["grad_norm_max"] == max(r["grad_norm"] for r in records) > 0
        assert run["params"]["total"] > run["params"]["active"] > 0
    k3, unstable = results["runs"]
    assert k3["params"]["total"] - unstable["params"]["total"] == 3 * 32  # the three latent RMSNorm weights
    table = (out / "k3_design.md").read_text()
    for fragment in (
        "# K3 design ablation: k3-nano, 4 steps × 64 tokens (256 tokens per arm)",
        "| K3 (preset) | (preset) |",
        "| SwiGLU, no latent norm | mlp_activation=swiglu, moe_latent_norm=False |",
        "- Stable LatentMoE (Design 6): the largest latent routed sum |u|",
    ):
        assert fragment in table, fragment
    assert (out / "k3_design.png").read_bytes()[:8] == PNG_MAGIC

    # Repeated: both runs reused, same figures.
    assert run_cli(*args, "--arms", "k3,swiglu-no-norm", "--jobs", 1) == 0
    again = json.loads((out / "k3_design.json").read_text())
    assert [run["reused"] for run in again["runs"]] == [True, True]
    assert again["runs"][1]["activations"] == unstable["activations"]

    # Every arm: the recipe differs only in the arm's model overrides (and run directory), same first batch.
    settings = load_settings(
        K3DesignConfig, recipe, **{"base.steps": 4, "base.eval_every": 2, "out": str(out)}
    )
    configs = {arm: train_config(settings, arm).model_dump() for arm in ARMS}
    first = {}
    for arm, config in configs.items():
        assert config.pop("out").endswith(f"runs/{arm}")
        assert config.pop("model_overrides") == ARMS[arm].overrides
        first[arm] = next(PretrainingData.from_config(train_config(settings, arm)).train_batches()).input_ids
        assert config == configs["k3"]
    assert all(torch.equal(ids, first["k3"]) for ids in first.values())


def test_bad_arms_are_refused(capsys):
    with pytest.raises(K2LabError, match=r"arms must be a non-empty subset of \['k3', 'no-attnres'"):
        load_settings(K3DesignConfig, arms=["k3", "no-kda"])
    assert run_cli("ablate", "k3-design", "--arms", "attnres") == 2
    assert "arms must be a non-empty subset" in " ".join(capsys.readouterr().err.split())
    default = load_settings(K3DesignConfig)
    assert default.arms == list(ARMS) and default.jobs == 2 and default.base.preset == "k3-mini"
    assert load_settings(K3DesignConfig, arms=["all-mla"]).jobs == 1


def test_grad_spikes_against_the_trailing_median():
    norms = [1.0, 1.0, 3.0, 1.0, 1.0, 2.5, math.nan]
    # 3 > 2·median(1, 1); 1 and 1 are not above 2·median(1, 3) = 4 or 2·median(3, 1); 2.5 > 2·1; NaN counts
    assert grad_spikes(norms, factor=2.0, window=2) == [2, 5, 6]


def _hand_moe(moe, x, situ: bool, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """u and y of one MoE block recomputed token by token from its weights (module docstring equations)."""

    def act(g, v):
        if situ:
            return (4 * torch.tanh(g / 4)) * torch.sigmoid(g) * (25 * torch.tanh(v / 25))
        return g * torch.sigmoid(g) * v

    scores = torch.sigmoid(x @ moe.router.weight.T)
    picks = (scores + moe.router.e_score_correction_bias).topk(2, dim=-1).indices
    h = x @ moe.latent_down.weight.T
    e = moe.experts
    u = torch.zeros(x.shape[0], h.shape[1])
    for n in range(x.shape[0]):
        weights = scores[n, picks[n]] / scores[n, picks[n]].sum()
        for w, i in zip(weights, picks[n], strict=True):
            u[n] += w * (e.down_proj[i] @ act(e.gate_proj[i] @ h[n], e.up_proj[i] @ h[n]))
    z = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) * moe.latent_norm.weight if norm else u
    s = moe.shared_experts
    y = (
        z @ moe.latent_up.weight.T
        + act(x @ s.gate_proj.weight.T, x @ s.up_proj.weight.T) @ s.down_proj.weight.T
    )
    return u, y


@pytest.mark.parametrize("arm", ["k3", "swiglu-no-norm"])
def test_activation_maxima_match_the_branch_by_hand(arm):
    overrides = ARMS[arm].overrides
    model = build_model(load_preset("k3-nano", **overrides), seed=3).eval()
    moe = model.moe_layers()[1]  # layer 2
    with torch.no_grad():
        moe.router.e_score_correction_bias.copy_(torch.linspace(-0.1, 0.1, 8))  # selection-only bias
    inputs = {}
    moe.register_forward_pre_hook(lambda module, args: inputs.setdefault("x", args[0].detach()))
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), moe_activation_maxima(model) as maxima:
        model(ids)
    assert len(maxima) == 6  # 3 MoE layers × (routed sum, output)
    assert not moe._forward_hooks and not moe.experts._forward_hooks  # removed after the block
    with torch.no_grad():
        u, y = _hand_moe(
            moe, inputs["x"].reshape(-1, 64).float(), arm == "k3", "moe_latent_norm" not in overrides
        )
    assert maxima["moe_routed_max/layer2"] == pytest.approx(float(u.abs().max()), rel=1e-5)
    assert maxima["moe_out_max/layer2"] == pytest.approx(float(y.abs().max()), rel=1e-5)
    assert maxima["moe_routed_max/layer2"] > 0
