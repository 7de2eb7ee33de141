"""A matmul operand cast the way autocast would cast it, once for every product it feeds.

Autocast casts a matmul's operands to its low-precision dtype at each product, and it caches the cast only
for leaf tensors that require grad (parameters). An intermediate that feeds several products is therefore cast
once per product; casting it here first gives those products the same values for one pass over it.
"""

from __future__ import annotations

import torch

__all__ = ["matmul_dtype", "matmul_operand"]


def matmul_dtype(x: torch.Tensor, otherwise: torch.dtype | None = None) -> torch.dtype:
    """The dtype :func:`matmul_operand` gives ``x``: autocast's where it is on for ``x``'s device, else
    ``otherwise`` or ``x``'s own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype if otherwise is None else otherwise


def matmul_operand(x: torch.Tensor, otherwise: torch.dtype | None = None) -> torch.Tensor:
    """``x`` as autocast would hand it to a matmul (its low-precision dtype where autocast is on for ``x``'s
    device; else ``x`` in ``otherwise``, or unchanged): a tensor that feeds several products is then cast
    once, not at every product. The values reaching the products are the same either way."""
    return x.to(matmul_dtype(x, otherwise))
