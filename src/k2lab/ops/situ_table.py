"""SiTU-GLU of bf16 inputs by table lookup: every bf16 value's gate and up factors computed once.

    h = A(g) · B(u),   A(g) = [β1·tanh(g/β1)] · σ(g),   B(u) = β2·tanh(u/β2)
    ∂h/∂g = B(u) · A'(g),   A'(g) = sech²(g/β1)·σ(g) + β1·tanh(g/β1)·σ(g)·(1 − σ(g))
    ∂h/∂u = A(g) · B'(u),   B'(u) = sech²(u/β2)

Under bf16 autocast the expert products hand the activation bf16 ``g`` and ``u``: each is one of 2¹⁶ bit
patterns, so A and B (and their derivatives) are functions on 65,536 points. The tables hold them for every
pattern ([65536] fp32 each, 256 KiB; a pass reads two of them); a value's row is its int16 bits + 32768.
The forward is two gathers and one product instead of two fp32 ``tanh`` (each 6–8× a ``sigmoid`` on the
Zen 5 measured) and ten more elementwise passes, and the backward two gathers and four products instead of
autograd's chain (docs/performance.md: SiTU-GLU 1.4–1.5× faster forward + backward on a Zen 5).

Numerics: A and B are computed by the same fp32 ops as ``k2lab.nn.activations.situ_glu`` (on the fp32 value
of each pattern), and h = (A·B) rounded once to bf16 as there, so the forward is bit-identical to the plain
fp32 chain. A' and B' are evaluated in fp64 and rounded to fp32, so the gradients are the exact derivative
to within a few fp32 roundings (autograd's chain loses relative precision where A' has a zero, near g ≈ −1.3);
they differ from the chain's in the last bf16 bit of < 0.1 % of entries. Infinities and NaNs follow the
formula: A(±inf) = ±β1·{1, 0}, derivatives 0 at ±inf, NaN stays NaN.

Shapes: gate, up [..., F] bf16 (same shape) -> h [..., F] bf16.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

__all__ = ["situ_glu_bf16", "situ_tables", "takes"]

# the int16 bit patterns in table order: row j holds the bf16 value whose bits are j − 32768
_OFFSET = 32768


@functools.lru_cache(maxsize=8)
@torch.inference_mode(False)  # cached across calls: must not be an inference tensor, which autograd refuses
@torch.no_grad()
def situ_tables(beta1: float, beta2: float, device: torch.device) -> torch.Tensor:
    """[4, 65536] fp32: rows A, B, A', B' (module docstring) at every bf16 value, in int16-bit order."""
    values = torch.arange(-_OFFSET, _OFFSET, dtype=torch.int16).view(torch.bfloat16).float()
    gate = (beta1 * torch.tanh(values / beta1)) * torch.sigmoid(values)  # situ_glu's fp32 ops and order
    up = beta2 * torch.tanh(values / beta2)
    x = values.double()
    s = torch.sigmoid(x)
    gate_grad = torch.cosh(x / beta1).pow(-2) * s + beta1 * torch.tanh(x / beta1) * s * (1 - s)
    up_grad = torch.cosh(x / beta2).pow(-2)  # sech²; cosh overflows to inf far out, giving 0
    return torch.stack((gate, up, gate_grad.float(), up_grad.float())).to(device)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """bf16 x [...] -> its table rows [numel] (int32)."""
    return x.reshape(-1).view(torch.int16).to(torch.int32).add_(_OFFSET)


def _factors(tables: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(rows of gate, rows of up, A(gate), B(up)), flat."""
    rows_g, rows_u = _rows(gate), _rows(up)
    return rows_g, rows_u, tables[0].index_select(0, rows_g), tables[1].index_select(0, rows_u)


class _SituTable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, tables):  # noqa: ANN001, ANN205 - autograd.Function protocol
        rows_g, rows_u, a, b = _factors(tables, gate, up)
        ctx.save_for_backward(rows_g, rows_u, a, b, tables)
        return (a * b).to(torch.bfloat16).view(gate.shape)

    @staticmethod
    @once_differentiable  # a second derivative through it would be silently wrong: an error instead
    def backward(ctx, dh):  # noqa: ANN001, ANN205 - autograd.Function protocol
        rows_g, rows_u, a, b, tables = ctx.saved_tensors
        d = dh.reshape(-1).float()
        dg = (d * b).mul_(tables[2].index_select(0, rows_g))
        du = (d * a).mul_(tables[3].index_select(0, rows_u))
        return dg.to(torch.bfloat16).view(dh.shape), du.to(torch.bfloat16).view(dh.shape), None


def takes(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the tables serve these inputs: both bf16, of one shape."""
    return gate.dtype == up.dtype == torch.bfloat16 and gate.shape == up.shape


def situ_glu_bf16(gate: torch.Tensor, up: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """SiTU-GLU of bf16 ``gate`` and ``up`` (same shape) by table lookup -> bf16 (module docstring)."""
    if not takes(gate, up):
        raise ValueError(
            f"situ_glu_bf16 takes bf16 gate and up of one shape, got {gate.dtype} {tuple(gate.shape)} "
            f"and {up.dtype} {tuple(up.shape)}"
        )
    tables = situ_tables(float(beta1), float(beta2), gate.device)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SituTable.apply(gate, up, tables)
    _, _, a, b = _factors(tables, gate, up)
    return (a * b).to(torch.bfloat16).view(gate.shape)
