"""The optimizer recipe: its validation, its defaults and the learning rate of each group."""

import math

import pytest
from pydantic import ValidationError

from k2lab.optim import OptimizerConfig, build_optimizer
from tests.conftest import nano_variant


@pytest.mark.parametrize("field", ["lr", "weight_decay", "qk_clip_tau"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_numbers_are_refused(field: str, value: float):
    """An lr of inf passed gt=0, and every weight of the run became NaN with exit code 0."""
    with pytest.raises(ValidationError, match="finite number"):
        OptimizerConfig(**{field: value})


def test_kda_gate_rates_take_no_weight_decay():
    """flash-linear-attention's KDA layer marks A_log and dt_bias _no_weight_decay; k2lab decayed them."""
    import torch

    from k2lab import build_model, load_preset
    from k2lab.optim import build_optimizer

    model = build_model(load_preset("k3-nano"))
    config = OptimizerConfig(lr=0.01, weight_decay=0.1)
    optimizer = build_optimizer(model, config, verbose=False)
    gate = {n for n, _ in model.named_parameters() if n.endswith(("A_log", "dt_bias"))}
    assert gate
    for group in optimizer.param_groups:
        assert (group["weight_decay"] == 0.0) == bool(set(group["names"]) & gate)
        assert not set(group["names"]) & gate or set(group["names"]) <= gate
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        expected = before[name] if name in gate else before[name] * (1 - 0.01 * 0.1)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7, msg=name)


def test_defaults_are_the_k2_recipe():
    """facts.md: QK-Clip τ = 100 and α = 0.5 (K2 report, Algorithm 1), Muon weight decay 0.1, momentum 0.95
    with Nesterov, AdamW β = (0.9, 0.95) (Moonlight; torch.optim.Muon's defaults)."""
    config = OptimizerConfig()
    assert config.qk_clip_tau == 100.0 and config.qk_clip_alpha == 0.5
    assert config.weight_decay == 0.1 and config.momentum == 0.95 and config.nesterov
    assert config.betas == (0.9, 0.95)


def test_adamw_lr_sets_the_adamw_groups_and_defaults_to_lr():
    model = nano_variant()
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-2, adamw_lr=3e-4), verbose=False)
    lrs = {(g["kind"], g["lr"], g["initial_lr"]) for g in optimizer.param_groups}
    assert lrs == {("adamw", 3e-4, 3e-4), ("muon", 1e-2, 1e-2)}
    same = build_optimizer(model, OptimizerConfig(lr=1e-2), verbose=False)
    assert {(g["kind"], g["lr"]) for g in same.param_groups} == {("adamw", 1e-2), ("muon", 1e-2)}
