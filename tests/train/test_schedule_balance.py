import math

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.nn.balancing import deepseek_bias_update, sequence_balance_loss
from k2lab.nn.router import SigmoidRouter
from k2lab.train.schedule import ScheduleConfig, lr_multiplier


def test_wsd_schedule_shape():
    schedule = ScheduleConfig(kind="wsd", warmup_steps=10, decay_fraction=0.2, min_lr_ratio=0.1)
    values = [lr_multiplier(s, 100, schedule) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(v == 1.0 for v in values[10:80])
    assert values[80] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in zip(values[80:], values[81:], strict=False))


def test_cosine_schedule_endpoints():
    schedule = ScheduleConfig(kind="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_multiplier(0, 50, schedule) == pytest.approx(1.0)
    assert lr_multiplier(25, 50, schedule) == pytest.approx(0.5)


def test_cosine_decay_starts_after_the_warmup():
    """Module docstring: after W warmup steps, m + (1 − m)·½(1 + cos(π (s − W)/(S − W))): the full lr at
    s = W, half of it midway through the S − W decay steps, m at the end."""
    schedule = ScheduleConfig(kind="cosine", warmup_steps=10, min_lr_ratio=0.0)
    assert lr_multiplier(10, 50, schedule) == pytest.approx(1.0)
    assert lr_multiplier(30, 50, schedule) == pytest.approx(0.5)
    assert lr_multiplier(49, 50, schedule) == pytest.approx(0.5 * (1 + math.cos(math.pi * 39 / 40)))


def test_deepseek_bias_rule_moves_toward_balance_and_is_centred():
    router = SigmoidRouter(load_preset("k2-nano"))
    loads = torch.tensor([10.0, 0, 5, 5, 5, 5, 5, 5])
    deepseek_bias_update(router, loads, gamma=1e-3)
    bias = router.e_score_correction_bias
    assert bias[0] < bias[2] < bias[1]  # overloaded expert pushed down, starved one pushed up
    assert bias.sum().abs() < 1e-7
    assert not router.e_score_correction_bias.requires_grad


def test_sequence_balance_loss_hand_value():
    # one sequence of 2 tokens, 4 experts, top-1
    scores = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0]])
    indices = torch.tensor([[0], [1]])
    # f = E/(K·T)·counts = 4/2·[1, 1, 0, 0] = [2, 2, 0, 0]; P = mean of row-normalised = [.25, .5, .25, 0]
    loss = sequence_balance_loss(scores, indices, batch=1, alpha=0.1)
    assert loss.item() == pytest.approx(0.1 * (2 * 0.25 + 2 * 0.5))


def test_moe_reports_balance_loss_in_training():
    model = build_model(load_preset("k2-nano"))
    for moe in model.moe_layers():
        moe.balance_alpha = 0.01
    model(torch.randint(0, 128, (2, 9)))
    assert all(moe.aux_loss is not None and moe.aux_loss.requires_grad for moe in model.moe_layers())


def test_bf16_autocast_forward_backward_runs_and_router_stays_fp32():
    model = build_model(load_preset("k2-nano", hidden_size=64))
    ids = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
    logits.float().sum().backward()
    assert model.layers[1].mlp.router.weight.grad.dtype == torch.float32
    full = model(ids).logits
    assert (logits.float() - full).abs().max() < 0.1 * full.abs().max()
