"""Routed experts: E gated experts stored as 3-D weights, run once each on their sorted tokens.

Suffixes: N tokens, K picks per token, E experts, D expert input/output width (the model width, or the latent
width in Stable LatentMoE), F expert width.
Dispatch: flatten the (token, pick) pairs, stable-sort them by expert, gather x in that order, run one grouped
matmul per weight (``ops.grouped_mm``), scale each row by its routing weight (fp32) and scatter-add back:

    y_n = Σ_{k} w_{n,k} · W_down[e_{n,k}] act(W_gate[e_{n,k}] x_n, W_up[e_{n,k}] x_n)

``act`` is SwiGLU ``silu(g) ⊙ u`` by default, or SiTU-GLU (``k2lab.nn.activations``). The sum runs in
``out_dtype`` (default: x's dtype, as K2; fp32 for the latent branch, which normalises the sum next).
No loop over tokens and no compute for unselected experts.

Decode tier: with fewer (token, pick) rows than experts (one token at a time), the rows' own expert weights
are gathered ([NK, F, D] each) and applied with one batched matmul per weight instead of a grouped product
that visits every expert — the same products, fewer kernel launches (``gathered_forward``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from k2lab.nn.activations import swiglu
from k2lab.ops.grouped_mm import grouped_matmul


def expert_counts(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert [E] (int64) of expert ids ``indices`` (any shape): ``bincount`` with a static shape,
    so ``torch.compile`` keeps it in the graph."""
    flat = indices.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int64)
    )


class RoutedExperts(nn.Module):
    """Weights: gate_EFD, up_EFD [E, F, D] and down_EDF [E, D, F] (``[E, out, in]`` per expert)."""

    def __init__(
        self,
        n_experts: int,
        hidden_size: int,
        intermediate_size: int,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = swiglu,
    ) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.activation = activation
        self.gate_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(n_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden_size, intermediate_size))

    def forward(
        self,
        x_ND: torch.Tensor,
        indices_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        counts_E: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [N, D], indices/weights [N, K] (``Routing``), optional per-expert counts [E] -> [N, D].

        The weighted rows are summed in ``out_dtype`` (default ``x.dtype``), which is also the result's dtype.
        """
        out_dtype = x_ND.dtype if out_dtype is None else out_dtype
        if indices_NK.numel() < self.n_experts and not torch.is_grad_enabled():
            return self.gathered_forward(x_ND, indices_NK, weights_NK, out_dtype)
        top_k = indices_NK.shape[1]
        flat_expert = indices_NK.reshape(-1)
        order = flat_expert.argsort(stable=True)
        token_of_row = order // top_k
        if counts_E is None:
            counts_E = expert_counts(flat_expert, self.n_experts)

        # index_select/index_add_ rather than x[rows]: the backward of advanced indexing
        # (index_put_ with accumulate) is several times slower on CPU.
        x_sorted = x_ND.index_select(0, token_of_row)
        hidden = self.activation(
            grouped_matmul(x_sorted, self.gate_proj, counts_E),
            grouped_matmul(x_sorted, self.up_proj, counts_E),
        )
        y_sorted = grouped_matmul(hidden, self.down_proj, counts_E)
        row_weight = weights_NK.reshape(-1).index_select(0, order).unsqueeze(1)
        y_sorted = (y_sorted.float() * row_weight).to(out_dtype)
        return torch.zeros_like(x_ND, dtype=out_dtype).index_add_(0, token_of_row, y_sorted)

    def gathered_forward(
        self, x_ND: torch.Tensor, indices_NK: torch.Tensor, weights_NK: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The decode tier: each (token, pick) row r = (n, k) gathers its expert's weights and runs

            y_n = Σ_k w_{n,k} · W_down[e_r] act(W_gate[e_r] x_n, W_up[e_r] x_n)

        as batched matmuls over the NK rows: x [N, D] -> x_r [NK, 1, D], W[e_r] [NK, F, D] -> [N, D]."""
        N, K = indices_NK.shape
        flat = indices_NK.reshape(-1)
        x_R1D = x_ND.repeat_interleave(K, dim=0).unsqueeze(1)

        def apply(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # bmm follows autocast like mm
            return torch.bmm(h, w.index_select(0, flat).to(h.dtype).transpose(1, 2))

        hidden = self.activation(apply(x_R1D, self.gate_proj), apply(x_R1D, self.up_proj))
        y_R = apply(hidden, self.down_proj).squeeze(1).float() * weights_NK.reshape(-1, 1)
        return y_R.view(N, K, -1).sum(1).to(out_dtype)

    def extra_repr(self) -> str:
        E, F, D = self.gate_proj.shape
        return f"{E} experts, {D} -> {F} -> {D}, activation={getattr(self.activation, '__name__', self.activation)}"
