"""DeepSeek-style MoE block: ``y = Σ_k w_k E_k(x) + Σ_shared E_s(x)`` (K2: 384 routed top-8 + 1 shared)."""

from __future__ import annotations

import torch
from torch import nn

from k2lab.config import ModelConfig
from k2lab.nn.balancing import sequence_balance_loss
from k2lab.nn.experts import RoutedExperts
from k2lab.nn.mlp import SwiGLU
from k2lab.nn.router import SigmoidRouter


class MoE(nn.Module):
    """x: [B, T, D] -> [B, T, D].

    After each forward: ``last_expert_counts`` [E] holds the per-expert load, and ``aux_loss`` the
    sequence-wise balance loss when ``balance_alpha > 0`` in training (``k2lab.nn.balancing``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = SigmoidRouter(config)
        self.experts = RoutedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_experts = (
            SwiGLU(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )
        self.last_expert_counts: torch.Tensor | None = None
        self.balance_alpha = 0.0
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ND = x.reshape(-1, x.shape[-1])
        routing = self.router(x_ND)
        counts_E = torch.bincount(routing.indices.reshape(-1), minlength=self.experts.n_experts)
        self.last_expert_counts = counts_E
        if self.training and self.balance_alpha > 0:
            self.aux_loss = sequence_balance_loss(
                routing.scores, routing.indices, x.shape[0], self.balance_alpha
            )
        y = self.experts(x_ND, routing.indices, routing.weights, counts_E).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
