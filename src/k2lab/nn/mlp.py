"""Gated feed-forward: ``y = W_down act(W_gate x, W_up x)``. x: [..., D] -> [..., D].

``act`` is SwiGLU ``silu(g) ⊙ u`` by default (K2) or SiTU-GLU (K3), see ``k2lab.nn.activations``. With a
decode step's few rows and no gradient the products run as ``k2lab.nn.decode_linear`` (the same products in
CPU BLAS's faster operand order); ``F.linear`` everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from k2lab.nn.activations import swiglu
from k2lab.nn.decode_linear import decode_linear

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class GatedMLP(nn.Module):
    """Dense gated MLP (the first ``first_k_dense_replace`` layers and the shared experts).

    ``activation``: ``(gate [..., F], up [..., F]) -> [..., F]``; build it from a config with
    ``k2lab.nn.activations.mlp_activation(config)``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, activation: GLU = swiglu) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(
            decode_linear(x, self.gate_proj.weight), decode_linear(x, self.up_proj.weight)
        )
        return decode_linear(hidden, self.down_proj.weight)

    def extra_repr(self) -> str:
        return f"activation={getattr(self.activation, '__name__', self.activation)}"


SwiGLU = GatedMLP  # the K2 name: ``SwiGLU(hidden, inter)`` is the default-activation GatedMLP
