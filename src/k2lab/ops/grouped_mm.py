"""Grouped matrix multiply: one matmul per expert over that expert's contiguous rows.

``y[s_e:s_{e+1}] = x[s_e:s_{e+1}] @ w[e]ᵀ`` for rows sorted by expert, ``s`` the running sum of ``counts``.
Shapes: x [N, in], w [E, out, in], counts [E] (sum N) -> y [N, out].

Uses ``torch._grouped_mm`` (one kernel for all experts, with autograd) where this torch build has it, and a
loop over experts (never over tokens) otherwise. Both are checked against each other in the tests.
"""

from __future__ import annotations

import torch

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The fused kernel needs fp32/bf16 and rows whose byte strides are multiples of 16."""
    if (
        not _HAS_GROUPED_MM
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type not in ("cpu", "cuda")
    ):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all(dim * size % 16 == 0 for dim in (x.shape[1], w.shape[1], w.shape[2]))


def grouped_matmul_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference: a loop over experts with a plain matmul each."""
    chunks = x.split(counts)
    return torch.cat([chunk @ w[e].T for e, chunk in enumerate(chunks)], dim=0)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, w [E, out, in], counts [E] -> [N, out] in x's dtype.

    Weights are cast to the activations' dtype when they differ (as autocast does for ``mm``, which it
    does not do for the grouped kernel).
    """
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    if not _grouped_mm_supported(x, w):
        return grouped_matmul_loop(x, w, counts.tolist())
    offsets = counts.cumsum(0).to(torch.int32)
    y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    if y.requires_grad:
        # The CPU backward rejects zero-stride (expanded) gradients such as those from `.sum()`.
        y.register_hook(lambda grad: grad.contiguous())
    return y
