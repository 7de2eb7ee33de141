"""K1.5's group objective (RL and PARL minimise it) and the budget penalty (RL's rewards, MOPD's evaluation).

For one group of K responses to a prompt, with rewards r_j and sequence log-ratios
log(π_θ(y_j|x) / π_old(y_j|x)) (``k2lab.posttrain.scoring.sequence_log_ratio``)::

    L(θ) = (1/K) Σ_j ( r_j − r̄ − τ · log(π_θ(y_j|x) / π_old(y_j|x)) )²,     r̄ = (1/K) Σ_j r_j

and the penalty for n completion tokens against a budget B: λ · min(1, max(0, n − B) / B).

A group whose K rewards are all equal carries no signal: its r_j − r̄ is exactly 0 here (``centred_rewards``).
Computed as written, r̄ of K equal floats is off by an ulp for most values (1/3, 0.1, 0.7: |r_j − r̄| ≈ 1e-8),
and the optimizer does not see the scale: where nothing else is in the update (no other group with signal,
no momentum yet), Muon orthogonalises that 1e-8-sized gradient into a full-size step in a direction set by
rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["budget_penalty", "centred_rewards", "k15_loss", "signal_groups"]


def budget_penalty(tokens: int, budget: int | None, weight: float) -> float:
    """λ · min(1, max(0, n − B) / B) for n completion tokens against budget B (0 when B is None)."""
    if not budget or weight == 0:
        return 0.0
    return weight * min(1.0, max(0, tokens - budget) / budget)


def centred_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """r_j − r̄ for one group's rewards [K]; exactly 0 when all K are equal (no rounding of r̄ left over)."""
    if bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    return rewards - rewards.mean()


def signal_groups(rewards: Sequence[Sequence[float]]) -> int:
    """How many groups have rewards that are not all equal: the ones K1.5's objective learns from."""
    return sum(len(set(group)) > 1 for group in rewards)


def k15_loss(rewards: torch.Tensor, log_ratios: torch.Tensor, tau: float) -> torch.Tensor:
    """L = (1/K) Σ_j (r_j − r̄ − τ · log_ratio_j)² for one group of K responses (rewards, log_ratios [K])."""
    return ((centred_rewards(rewards) - tau * log_ratios) ** 2).mean()
