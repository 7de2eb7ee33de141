"""K1.5's group objective: a group whose rewards are all equal teaches nothing and moves nothing."""

from __future__ import annotations

import pytest
import torch

from k2lab.optim.muon import Muon
from k2lab.posttrain.objective import centred_rewards, k15_loss, signal_groups

# Rewards whose float32 mean over 8 copies is not the value itself (0.1, 1/3, 0.7, 2/3, 0.9), and dyadic ones.
EQUAL_VALUES = [0.0, 1.0, 0.75, 0.1, 1 / 3, 0.7, 2 / 3, 0.9, 0.753]


@pytest.mark.parametrize("value", EQUAL_VALUES)
def test_equal_rewards_centre_to_exactly_zero(value: float):
    rewards = torch.full((8,), value, dtype=torch.float32)
    assert centred_rewards(rewards).tolist() == [0.0] * 8


def test_unequal_rewards_centre_on_their_mean():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert centred_rewards(rewards).tolist() == [0.5, -0.5, 0.0, 0.0]


@pytest.mark.parametrize("value", EQUAL_VALUES)
def test_equal_reward_groups_leave_the_weights_where_they_are(value: float):
    """At θ = θ_old the gradient is −(2τ/K) Σ_j (r_j − r̄) ∇log π(y_j); with r̄ rounded it was ≈ 1e-9 in norm,
    and Muon orthogonalised it into a full-size step (‖ΔW‖ 0.025 at lr 0.02 for 0.1, the size of a real one)."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(64, 64, bias=False)
    before = policy.weight.detach().clone()
    optimizer = Muon([policy.weight], lr=0.02, weight_decay=0.0)
    features = torch.randn(2, 8, 64)
    loss = torch.zeros(())
    for group in features:  # two groups of K = 8, every answer rewarded the same within its group
        logp = policy(group).log_softmax(-1)[:, 0]
        rewards = torch.full((8,), value, dtype=torch.float32)
        loss = loss + k15_loss(rewards, logp - logp.detach(), tau=0.1)
    loss.backward()
    assert float(policy.weight.grad.abs().max()) == 0.0
    optimizer.step()
    assert torch.equal(policy.weight.detach(), before)


def test_a_group_with_signal_still_moves_the_weights():
    torch.manual_seed(0)
    policy = torch.nn.Linear(64, 64, bias=False)
    before = policy.weight.detach().clone()
    optimizer = Muon([policy.weight], lr=0.02, weight_decay=0.0)
    logp = policy(torch.randn(8, 64)).log_softmax(-1)[:, 0]
    k15_loss(torch.tensor([0.1] * 7 + [0.2]), logp - logp.detach(), tau=0.1).backward()
    optimizer.step()
    assert float((policy.weight.detach() - before).norm()) > 1e-3


def test_signal_groups_counts_groups_with_unequal_rewards():
    assert signal_groups([[0.1, 0.1, 0.1], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [1 / 3, 1 / 3, 0.3]]) == 2
    assert signal_groups([]) == 0
