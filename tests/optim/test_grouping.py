"""The optimizer recipe's validation."""

import math

import pytest
from pydantic import ValidationError

from k2lab.optim import OptimizerConfig


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
