"""K1.5's group objective (RL and PARL minimise it) and the budget penalty (RL's rewards, MOPD's evaluation).

For one group of K responses to a prompt, with rewards r_j and sequence log-ratios
log(π_θ(y_j|x) / π_old(y_j|x)) (``k2lab.posttrain.scoring.sequence_log_ratio``)::

    L(θ) = (1/K) Σ_j ( r_j − r̄ − τ · log(π_θ(y_j|x) / π_old(y_j|x)) )²,     r̄ = (1/K) Σ_j r_j

and the penalty for n completion tokens against a budget B: λ · min(1, max(0, n − B) / B).
"""

from __future__ import annotations

import torch

__all__ = ["budget_penalty", "k15_loss"]


def budget_penalty(tokens: int, budget: int | None, weight: float) -> float:
    """λ · min(1, max(0, n − B) / B) for n completion tokens against budget B (0 when B is None)."""
    if not budget or weight == 0:
        return 0.0
    return weight * min(1.0, max(0, tokens - budget) / budget)


def k15_loss(rewards: torch.Tensor, log_ratios: torch.Tensor, tau: float) -> torch.Tensor:
    """L = (1/K) Σ_j (r_j − r̄ − τ · log_ratio_j)² for one group of K responses."""
    return ((rewards - rewards.mean() - tau * log_ratios) ** 2).mean()
