"""DeepSeek-style MoE block, optionally with K3's Stable LatentMoE routed branch.

K2 (``moe_latent_size`` None), x [N, D]:
    y = Σ_{i∈TopK(x)} p_i E_i(x) + E_shared(x)                                (K2: 384 routed top-8 + 1 shared)

Stable LatentMoE (``moe_latent_size`` = L), the router still reads the full x:
    u = Σ_{i∈TopK(x)} p_i E_i(W_down x)          W_down [L, D], E_i: L -> F -> L, sum in fp32     u [N, L]
    y = E_shared(x) + W_up RMSNorm(u)            W_up [D, L]                                     y [N, D]
(``moe_latent_norm`` False, the released ``latent_moe_use_norm: false``: y = E_shared(x) + W_up u.)

As in the released code (mlx-lm / vLLM ``kimi_k3``): the weighted routed sum u is formed, then normalised
(``latent_moe_use_norm``, true in K3, ε = ``rms_norm_eps``), then projected up, then the shared experts are added.

Shared experts: one gated MLP of width ``moe_intermediate_size · n_shared_experts`` on the full x. Routed and
shared experts use the configured activation (SwiGLU, or SiTU-GLU for K3).
"""

from __future__ import annotations

import torch
from torch import nn

from k2lab.config import ModelConfig
from k2lab.nn.activations import mlp_activation
from k2lab.nn.balancing import sequence_balance_loss
from k2lab.nn.decode_linear import decode_linear
from k2lab.nn.experts import RoutedExperts, expert_counts
from k2lab.nn.mlp import GatedMLP
from k2lab.nn.norm import RMSNorm
from k2lab.nn.router import SigmoidRouter


class MoE(nn.Module):
    """x: [B, T, D] -> [B, T, D].

    After each forward: ``last_expert_counts`` [E] holds the per-expert load, and ``aux_loss`` the
    sequence-wise balance loss when ``balance_alpha > 0`` in training (``k2lab.nn.balancing``).
    With ``record_scores`` set, each training forward appends its unbiased router scores [N, E] (fp32,
    detached) to ``recorded_scores`` for Quantile Balancing (``k2lab.nn.balancing.quantile_balance``).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        activation = mlp_activation(config)
        latent = config.moe_latent_size
        expert_width = config.hidden_size if latent is None else latent
        self.router = SigmoidRouter(config)
        self.latent_down = None if latent is None else nn.Linear(config.hidden_size, latent, bias=False)
        self.experts = RoutedExperts(
            config.n_routed_experts, expert_width, config.moe_intermediate_size, activation
        )
        use_norm = latent is not None and config.moe_latent_norm
        self.latent_norm = RMSNorm(latent, config.rms_norm_eps) if use_norm else None
        self.latent_up = None if latent is None else nn.Linear(latent, config.hidden_size, bias=False)
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, activation)
            if config.n_shared_experts
            else None
        )
        self.last_expert_counts: torch.Tensor | None = None
        self.balance_alpha = 0.0
        self.aux_loss: torch.Tensor | None = None
        self.record_scores = False
        self.recorded_scores: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_ND = x.reshape(-1, x.shape[-1])
        routing = self.router(x_ND)
        counts_E = expert_counts(routing.indices, self.experts.n_experts)
        self.last_expert_counts = counts_E
        if self.training and self.record_scores:
            self.recorded_scores.append(routing.scores.detach())
        if self.training and self.balance_alpha > 0:
            self.aux_loss = sequence_balance_loss(
                routing.scores, routing.indices, x.shape[0], self.balance_alpha
            )
        if self.latent_down is None:
            y = self.experts(x_ND, routing.indices, routing.weights, counts_E).view_as(x)
        else:
            u_NL = self.experts(
                decode_linear(x_ND, self.latent_down.weight),
                routing.indices,
                routing.weights,
                counts_E,
                out_dtype=torch.float32,
            )
            if self.latent_norm is not None:
                u_NL = self.latent_norm(u_NL)
            y = decode_linear(u_NL.to(x.dtype), self.latent_up.weight).view_as(x)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
