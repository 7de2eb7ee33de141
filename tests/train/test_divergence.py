"""The divergence check: which steps stop a run, and what the error tells the user."""

import math

import pytest
import torch

from k2lab.train.divergence import TrainingDiverged, check_finite_step, check_finite_update, gradient_norm


def test_finite_steps_pass_and_any_nan_or_inf_stops(tmp_path):
    check_finite_step(3, 2.5, 1e30, 1e-3, tmp_path)
    for loss, norm in ((math.nan, 1.0), (1.0, math.inf), (-math.inf, 1.0)):
        with pytest.raises(TrainingDiverged, match="diverged at step 3"):
            check_finite_step(3, loss, norm, 1e-3, tmp_path)


def test_the_error_says_there_is_no_checkpoint_yet(tmp_path):
    with pytest.raises(TrainingDiverged) as error:
        check_finite_step(1, 4.2, math.inf, 0.02, tmp_path)
    text = str(error.value)
    assert (
        "gradient norm inf" in text
        and "no checkpoint was written yet" in text
        and "learning rate (now 0.02)" in text
    )
    assert error.value.step == 1 and "\n" not in text


def test_an_update_is_checked_on_its_gradients_global_norm():
    layer = torch.nn.Linear(2, 2)
    loss = layer(torch.ones(1, 2)).sum()
    loss.backward()
    check_finite_update(0, loss, layer.parameters(), 1e-3, None)  # finite: passes
    assert gradient_norm(layer.parameters()) == pytest.approx(
        float(torch.cat([p.grad.flatten() for p in layer.parameters()]).norm())
    )
    layer.weight.grad[0, 0] = math.inf
    with pytest.raises(
        TrainingDiverged, match="gradient norm inf; .*learning rate \\(now 0.001\\) and run it again"
    ):
        check_finite_update(7, loss, layer.parameters(), 1e-3, None)
