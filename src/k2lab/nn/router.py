"""Sigmoid top-k router with a selection-only bias and group-limited routing (DeepSeek-V3 ``noaux_tc``).

For token x (fp32):  s = sigmoid(W_r x)                                    [E]
selection:           groups scored by the sum of their top-2 of (s + b); keep ``topk_group`` groups;
                     top-k experts of (s + b) inside the kept groups
weights:             w_i = s_i / (Σ_{j∈top-k} s_j + 1e-20) · routed_scaling_factor   (unbiased scores)

The correction bias ``b`` (``e_score_correction_bias``) is a buffer: it gets no gradient and is moved by a
load balancer between steps. Shapes: x [N, D] -> weights [N, k] fp32, indices [N, k] int64.

Released K3 (mlx-lm / vLLM ``kimi_k3``; k = 16, one group) computes the same. Two corners differ between
references and are left as transformers' DeepseekV3 does them (the K2 parity tests): with k = 1 the weight is
still renormalised (to 1; DeepSeek's, mlx-lm's and vLLM's code keep the raw score when k = 1), and experts of
dropped groups are masked with −inf (as vLLM; mlx-lm zeroes them, which differs only when biased scores go
negative). Neither arises for K2 or K3 (k ≥ 8; K3 has one group).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k2lab.config import ModelConfig


@dataclass
class Routing:
    """The router's decision for N tokens."""

    weights: torch.Tensor  # [N, k] fp32, already × routed_scaling_factor
    indices: torch.Tensor  # [N, k] int64 expert ids
    scores: torch.Tensor  # [N, E] fp32 sigmoid scores (unbiased)


class SigmoidRouter(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(
            torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32)
        )
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )

    def forward(self, x: torch.Tensor) -> Routing:
        scores = self._scores(x)
        choice = scores.detach() + self.e_score_correction_bias
        if self.n_group > 1:
            choice = self._mask_unselected_groups(choice)
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.scaling, indices, scores)

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        """sigmoid(W_r x) in fp32 [N, E]; under bf16 autocast too (leaving it costs ~10 µs, so only then)."""
        if not torch.is_autocast_enabled(x.device.type):
            return F.linear(x.float(), self.weight.float()).sigmoid()
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float()).sigmoid()

    def _mask_unselected_groups(self, choice: torch.Tensor) -> torch.Tensor:
        grouped = choice.view(choice.shape[0], self.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        kept = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~keep_mask.unsqueeze(-1), float("-inf")).view_as(choice)
