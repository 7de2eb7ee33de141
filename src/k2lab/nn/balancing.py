"""Router load balancing without an auxiliary loss, and the optional sequence-wise balance loss.

DeepSeek-V3 bias rule (auxiliary-loss-free), applied after each optimizer step with the step's loads c_i:
    b_i ← b_i + γ · sign(mean(c) − c_i),   then b ← b − mean(b)   (mean-centred as in torchtitan), γ = 1e-3
The bias only changes which experts are selected (``SigmoidRouter``), never the mixing weights.

Quantile Balancing (K3, replaces the rule above; no step size), on the m tokens of one batch with unbiased
sigmoid scores s [m, n] (n experts, top-k) and the bias b [n] in use when they were routed:
    α_i  = (k+1)-th largest of (s_i + b)                           per token          α [m]
    M_ij = s_ij + b_j − α_i                                        margin (> 0 ⇔ j ∈ TopK_i)   M [m, n]
    q    = ⌊m·k/n⌋                                                 target load per expert
    c_j  = (q+1)-th largest of M_·j,   b_j ← b_j − c_j
With the thresholds α_i held fixed, expert j then clears exactly q tokens ({i : M_ij − c_j > 0}) unless c_j = 0
(every token's (k+1)-th expert has margin exactly 0; an expert that is that runner-up for enough tokens keeps
its bias with load ≤ q). The update is computed on one batch and applied to the next (and frozen at
inference). Since α moves with b, top-k routing of the same batch under the new bias is close to, not exactly,
q per expert (tests/nn/test_balancing.py has the figures).

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


@torch.no_grad()
def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Quantile Balancing bias b − c [n] (fp32) from scores [m, n] routed under ``bias`` [n].

    Group-limited routing (``n_group > 1``) is ignored, as in the rule: α is the (k+1)-th largest biased score
    over all n experts. Returns ``bias`` unchanged when there is nothing to balance (k ≥ n, or no tokens).
    """
    m, n = scores.shape
    bias = bias.float()
    if top_k >= n or m == 0:
        return bias.clone()
    biased = scores.float() + bias.to(scores.device)  # [m, n]
    alpha = biased.topk(top_k + 1, dim=1).values[:, top_k]  # [m]  (k+1)-th largest per token
    margins = biased - alpha[:, None]  # [m, n]
    q = m * top_k // n  # floor; q < m because k < n
    cut = margins.kthvalue(m - q, dim=0).values  # [n]  (q+1)-th largest = (m−q)-th smallest
    return bias - cut.to(bias.device)


@torch.no_grad()
def quantile_bias_update(router: SigmoidRouter, scores: torch.Tensor, top_k: int | None = None) -> None:
    """Set ``router.e_score_correction_bias`` in place from this batch's unbiased scores [m, n] (fp32).

    The result is mean-centred (b − mean(b)): adding one constant to every b_j changes neither top-k nor the
    group scores, and without it the mean drifts steadily (−0.0044 per step in a 16-expert top-2 simulation,
    since unselected experts' margins are measured from α, the (k+1)-th score, not the k-th), which would
    erode fp32 resolution of b over a long run.

    Data parallel: the quantiles are taken over the global batch. Each rank's scores are all-gathered (exact:
    every rank computes the same bias as one process on the concatenated batch; cost m_rank·n·4 bytes per rank
    and layer, and ranks must hold the same number of tokens), so all ranks end with the same bias.
    """
    top_k = router.top_k if top_k is None else top_k
    scores = _all_gather_rows(scores.float())
    bias = router.e_score_correction_bias
    new = quantile_bias(scores, bias, top_k)
    bias.copy_(new - new.mean())


def quantile_balance(moe: torch.nn.Module) -> None:
    """Apply Quantile Balancing to one ``MoE`` from the scores it recorded (``record_scores``), then clear them.

    Trainer: set ``moe.record_scores = True`` once; after each optimizer step call this for every MoE layer
    (all micro-batches of the step form the batch; the new bias routes the next step).
    """
    if not moe.recorded_scores:
        return
    quantile_bias_update(moe.router, torch.cat(moe.recorded_scores))
    moe.recorded_scores.clear()


def _all_gather_rows(x: torch.Tensor) -> torch.Tensor:
    """Concatenate [m, n] over data-parallel ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


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
