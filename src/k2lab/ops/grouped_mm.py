"""Grouped matrix multiply: one matmul per expert over that expert's contiguous rows.

``y[s_e:s_{e+1}] = x[s_e:s_{e+1}] @ w[e]ᵀ`` for rows sorted by expert, ``s`` the running sum of ``counts``.
Shapes: x [N, in], w [E, out, in], counts [E] (sum N) -> y [N, out].

The product is the custom op ``k2lab::grouped_mm`` (``torch.library``) so that ``torch.compile`` traces
through it: a fake-tensor rule gives the output's shape without running it, and its backward is two more
grouped products (``k2lab::grouped_mm_weight_grad`` for the weights):

    dx[s_e:s_{e+1}] = dy[s_e:s_{e+1}] @ w[e]        dw[e] = dy[s_e:s_{e+1}]ᵀ @ x[s_e:s_{e+1}]

Inside, ``torch._grouped_mm`` (one kernel for all experts) where this torch build supports the inputs, and a
loop over experts (never over tokens) otherwise. Both are checked against each other in the tests.

Eager code (anything not being compiled) calls the same kernels through ``_GroupedMatmul``, an
``autograd.Function`` with the same backward: ``torch.library``'s dispatch costs ~26 µs a call (a k2-mini
decode step makes 15 such calls) and imports ``torch._dynamo`` at the first one (2–3 s of every process that
runs a model, measured on the 2-core Zen 4 VM).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k2lab.ops.autocast import matmul_operand

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


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in], w [E, out, in] (x's dtype), offsets int32 [E] (running row counts) -> [N, out]."""
    if _grouped_mm_supported(x, x.shape[1], w.shape[1], w.shape[2]):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    return grouped_matmul_loop(x, w, _counts(offsets))


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """grad [N, out], x [N, in], offsets [E] -> dw [E, out, in] (zero for an expert without rows)."""
    if _grouped_mm_supported(x, x.shape[1], grad.shape[1]):
        return torch._grouped_mm(grad.t(), x, offs=offsets)
    counts = _counts(offsets)
    return torch.stack([g.T @ rows for g, rows in zip(grad.split(counts), x.split(counts), strict=True)])


def _grads(ctx, grad: torch.Tensor, matmul: Callable, weight_grad: Callable) -> tuple:  # noqa: ANN001
    """dx = dy @ w[e], dw[e] = dyᵀ x per expert, with the given kernels (custom ops or plain)."""
    x, w, offsets = ctx.saved_tensors
    grad = grad.contiguous()  # `.sum()` hands back a zero-stride gradient the fused kernel rejects
    grad_x = matmul(grad, w.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
    grad_w = weight_grad(grad, x, offsets) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


@torch.library.custom_op("k2lab::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``_grouped_mm`` as an op that ``torch.compile`` traces through."""
    return _grouped_mm(x, w, offsets)


@_grouped_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("k2lab::grouped_mm_weight_grad", mutates_args=())
def _weight_grad_op(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``_weight_grad`` as an op."""
    return _weight_grad(grad, x, offsets)


@_weight_grad_op.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grad.new_empty(offsets.shape[0], grad.shape[1], x.shape[1])


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 - torch.library's signature
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN202 - torch.library's signature
    return _grads(ctx, grad, _grouped_mm_op, _weight_grad_op)


_grouped_mm_op.register_autograd(_backward, setup_context=_setup_context)


class _GroupedMatmul(torch.autograd.Function):
    """The eager path: the op's kernels and backward without ``torch.library``'s dispatch."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        _setup_context(ctx, (x, w, offsets), None)
        return _grouped_mm(x, w, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        return _grads(ctx, grad, _grouped_mm, _weight_grad)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, w [E, out, in], counts [E] -> [N, out] in x's dtype.

    Under autocast both operands are cast to the autocast dtype, as autocast does for ``mm`` (it does not
    know this op); otherwise the weights are cast to the activations' dtype when they differ.
    """
    x = matmul_operand(x)
    if w.dtype != x.dtype:
        w = w.to(x.dtype)
    offsets = counts.cumsum(0).to(torch.int32)
    if torch.compiler.is_compiling():
        return _grouped_mm_op(x, w, offsets)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _GroupedMatmul.apply(x, w, offsets)
    return _grouped_mm(x, w, offsets)
