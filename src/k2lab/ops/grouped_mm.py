"""Grouped matrix multiply: one matmul per expert over that expert's contiguous rows.

``y[s_e:s_{e+1}] = x[s_e:s_{e+1}] @ w[e]ᵀ`` for rows sorted by expert, ``s`` the running sum of ``counts``.
Shapes: x [N, in], w [E, out, in], counts [E] (sum N) -> y [N, out].

The product is the custom op ``k2lab::grouped_mm`` (``torch.library``) so that ``torch.compile`` traces
through it: a fake-tensor rule gives the output's shape without running it, and its backward is two more
grouped products (``k2lab::grouped_mm_weight_grad`` for the weights):

    dx[s_e:s_{e+1}] = dy[s_e:s_{e+1}] @ w[e]        dw[e] = dy[s_e:s_{e+1}]ᵀ @ x[s_e:s_{e+1}]

Inside, ``torch._grouped_mm`` (one kernel for all experts) where this torch build supports the inputs, and a
loop over experts (never over tokens) otherwise. Both are checked against each other in the tests.
"""

from __future__ import annotations

import torch

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def _grouped_mm_supported(x: torch.Tensor, *widths: int) -> bool:
    """The fused kernel needs fp32/bf16 (bf16 on CUDA) and, for x's element size, ``widths`` (the product's
    inner and outer row widths) whose byte strides are multiples of 16."""
    if (
        not _HAS_GROUPED_MM
        or x.dtype not in (torch.float32, torch.bfloat16)
        or x.device.type not in ("cpu", "cuda")
    ):
        return False
    if x.device.type == "cuda" and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all(width * size % 16 == 0 for width in widths)


def grouped_matmul_loop(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Reference: a loop over experts with a plain matmul each."""
    chunks = x.split(counts)
    return torch.cat([chunk @ w[e].T for e, chunk in enumerate(chunks)], dim=0)


def _counts(offsets: torch.Tensor) -> list[int]:
    return torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()


@torch.library.custom_op("k2lab::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in], w [E, out, in] (x's dtype), offsets int32 [E] (running row counts) -> [N, out]."""
    if _grouped_mm_supported(x, x.shape[1], w.shape[1], w.shape[2]):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    return grouped_matmul_loop(x, w, _counts(offsets))


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("k2lab::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad [N, out], x [N, in], offsets [E] -> dw [E, out, in] (zero for an expert without rows)."""
    if _grouped_mm_supported(x, x.shape[1], grad.shape[1]):
        return torch._grouped_mm(grad.t(), x, offs=offsets)
    counts = _counts(offsets)
    return torch.stack([g.T @ rows for g, rows in zip(grad.split(counts), x.split(counts), strict=True)])


@_weight_grad_op.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offsets.shape[0], grad.shape[1], x.shape[1])


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202 - torch.library's signature
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # `.sum()` hands back a zero-stride gradient the fused kernel rejects
    grad_x = _grouped_mm_op(grad, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    grad_w = _weight_grad_op(grad, x, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, w [E, out, in], counts [E] -> [N, out] in x's dtype.

    Under autocast both operands are cast to the autocast dtype, as autocast does for ``mm`` (it does not
    know this op); otherwise the weights are cast to the activations' dtype when they differ.
    """
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    return _grouped_mm_op(x, w, counts.cumsum(0).to(torch.int32))
