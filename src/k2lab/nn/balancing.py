"""Router load balancing without an auxiliary loss, and the optional sequence-wise balance loss.

DeepSeek-V3 bias rule (auxiliary-loss-free), applied after each optimizer step with the step's loads c_i:
    b_i ← b_i + γ · sign(mean(c) − c_i),   then b ← b − mean(b)   (mean-centred as in torchtitan), γ = 1e-3
The bias only changes which experts are selected (``SigmoidRouter``), never the mixing weights.

Sequence-wise balance loss (DeepSeek-V3, complementary, small α), per sequence of T tokens:
    f_i = E/(K·T) · Σ_t 1[i ∈ TopK(t)],   P_i = 1/T · Σ_t s_{i,t} / Σ_j s_{j,t},   L = α Σ_i f_i P_i
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k2lab.nn.router import SigmoidRouter


@torch.no_grad()
def deepseek_bias_update(router: SigmoidRouter, loads: torch.Tensor, gamma: float = 1e-3) -> None:
    """Move the router's correction bias toward balance from per-expert token counts [E]."""
    loads = loads.float()
    step = gamma * torch.sign(loads.mean() - loads)
    bias = router.e_score_correction_bias
    bias.add_(step.to(bias.device))
    bias.sub_(bias.mean())


def all_reduce_loads(loads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum per-layer expert loads over data-parallel ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or not loads:
        return loads
    flat = torch.cat([load.float().reshape(-1) for load in loads])
    dist.all_reduce(flat)
    return list(flat.split([load.numel() for load in loads]))


def sequence_balance_loss(
    scores: torch.Tensor, indices: torch.Tensor, batch: int, alpha: float
) -> torch.Tensor:
    """scores [B·T, E] (sigmoid, with grad), indices [B·T, K] -> α Σ_i f_i P_i averaged over sequences."""
    tokens, n_experts = scores.shape
    seq = tokens // batch
    top_k = indices.shape[1]
    chosen = torch.zeros_like(scores).scatter_(1, indices, 1.0).view(batch, seq, n_experts)
    f = chosen.sum(1) * n_experts / (top_k * seq)  # [B, E]
    p = (scores / scores.sum(-1, keepdim=True)).view(batch, seq, n_experts).mean(1)  # [B, E]
    return alpha * (f.detach() * p).sum(-1).mean()
