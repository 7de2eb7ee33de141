"""KDA forget gates: per-channel log-decay g [B, T, H, K] from a low-rank projection of x.

    f = W_fb W_fa x + dt_bias                                   (low rank D -> K -> H·K)
    Kimi Linear:  g = −exp(A_log[h]) · softplus(f)              unbounded below
    K3:           g = g_min · sigmoid(exp(A_log[h]) · f)         in (g_min, 0), g_min = −5

The K3 form replaces the activation (it is not a clamp): every 16-token tile then accumulates a log-decay in
(16·g_min, 0] = (−80, 0], so the reciprocal decays of a chunked kernel stay inside bf16 range.
Init (flash-linear-attention / Kimi Linear): A_log = log U(1, 16); dt_bias = softplus⁻¹(dt) with dt
log-uniform in [1e-3, 0.1]. Both parameters stay fp32.

The report writes K3's gate as g_min·sigmoid(e^{A_h} z); in the released code (mlx-lm / vLLM ``kimi_k3``) z
already includes ``dt_bias`` (z = W_fb W_fa x + dt_bias, then scaled by e^{A_h} inside the sigmoid), which is
what ``lower_bounded_decay`` computes here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from k2lab.config import ModelConfig
from k2lab.nn.decode_linear import decode_linear


def softplus_decay(f: torch.Tensor, a_log: torch.Tensor) -> torch.Tensor:
    """Kimi Linear: f [B, T, H, K], a_log [H] -> −exp(A_log)·softplus(f) (fp32)."""
    return -a_log.float().exp()[:, None] * F.softplus(f.float())


def lower_bounded_decay(f: torch.Tensor, a_log: torch.Tensor, g_min: float = -5.0) -> torch.Tensor:
    """K3: f [B, T, H, K], a_log [H] -> g_min·sigmoid(exp(A_log)·f) ∈ (g_min, 0) (fp32)."""
    return g_min * torch.sigmoid(a_log.float().exp()[:, None] * f.float())


class ForgetGate(nn.Module):
    """x [B, T, D] -> log-decay g [B, T, H, K] (fp32)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        width = self.n_heads * self.head_dim
        self.kind = config.kda_gate
        self.g_min = config.kda_gate_lower_bound
        self.f_a_proj = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        f_low = decode_linear(decode_linear(x, self.f_a_proj.weight), self.f_b_proj.weight)
        f = (f_low.float() + self.dt_bias.float()).view(B, T, self.n_heads, self.head_dim)
        if self.kind == "lower_bound":
            return lower_bounded_decay(f, self.A_log, self.g_min)
        return softplus_decay(f, self.A_log)

    @torch.no_grad()
    def reset_decay(self, generator: torch.Generator | None = None) -> None:
        """A_log = log U(1, 16); dt_bias = softplus⁻¹(dt), dt = exp(U(ln 1e-3, ln 0.1))."""
        a = torch.empty(self.A_log.shape).uniform_(1.0, 16.0, generator=generator)
        self.A_log.copy_(a.log())
        dt = torch.empty(self.dt_bias.shape).uniform_(math.log(1e-3), math.log(0.1), generator=generator)
        dt = dt.exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
