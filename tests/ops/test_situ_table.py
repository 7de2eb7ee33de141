"""SiTU-GLU's bf16 table tier (``k2lab.ops.situ_table``) against the fp32 chain it replaces (forward, bit for
bit, over every bf16 gate value) and against the float64 derivative of the formula (gradients)."""

from __future__ import annotations

import pytest
import torch

from k2lab.nn.activations import situ_glu
from k2lab.ops.situ_table import situ_glu_bf16, situ_tables

B1, B2 = 4.0, 25.0
ALL_BF16 = torch.arange(-32768, 32768, dtype=torch.int16).view(torch.bfloat16)


def chain(gate: torch.Tensor, up: torch.Tensor, b1: float = B1, b2: float = B2) -> torch.Tensor:
    """The plain fp32 chain of ``situ_glu`` (what fp32 inputs take), rounded once to bf16."""
    return situ_glu(gate.float(), up.float(), b1, b2).bfloat16()


def reference_grads(
    gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of Σ dh ⊙ h in float64 at the same (bf16) inputs, by hand: ∂h/∂g = B(u)·A'(g),
    ∂h/∂u = A(g)·B'(u), with sech² as 1/cosh² (autograd's 1 − tanh² cancels to nothing in float64 once
    |x| ≳ 17)."""
    g, u, d = gate.double(), up.double(), dh.double()
    s = torch.sigmoid(g)
    a = B1 * torch.tanh(g / B1) * s
    da = torch.cosh(g / B1).pow(-2) * s + B1 * torch.tanh(g / B1) * s * (1 - s)
    b, db = B2 * torch.tanh(u / B2), torch.cosh(u / B2).pow(-2)
    return d * b * da, d * a * db


def autograd_grads(
    gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same by float64 autograd of the formula (independent of the hand derivation; exact for
    |x| ≲ 10)."""
    g, u = gate.double().requires_grad_(), up.double().requires_grad_()
    h = B1 * torch.tanh(g / B1) * torch.sigmoid(g) * (B2 * torch.tanh(u / B2))
    h.backward(dh.double())
    return g.grad, u.grad


def grads(fn, gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, ...]:
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    out = fn(g, u)
    out.backward(dh)
    return out, g.grad, u.grad


def test_forward_equals_the_fp32_chain_at_every_bf16_gate_value():
    up = (torch.randn(ALL_BF16.numel(), generator=torch.Generator().manual_seed(0)) * 30).bfloat16()
    out = situ_glu_bf16(ALL_BF16, up, B1, B2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, chain(ALL_BF16, up), rtol=0, atol=0, equal_nan=True)
    # and every up value against a few gates, with other caps
    for gate_value in (-7.5, -1.25, 0.0, 0.5, 3.0):
        gate = torch.full_like(ALL_BF16, gate_value)
        torch.testing.assert_close(
            situ_glu_bf16(gate, ALL_BF16, 2.0, 10.0),
            chain(gate, ALL_BF16, 2.0, 10.0),
            rtol=0,
            atol=0,
            equal_nan=True,
        )


def test_situ_glu_takes_the_table_tier_for_bf16_only():
    g32 = torch.randn(8, 16, requires_grad=True)
    assert "SituTable" not in type(situ_glu(g32, g32).grad_fn).__name__
    gb = g32.detach().bfloat16().requires_grad_()
    assert "SituTable" in type(situ_glu(gb, gb * 2).grad_fn).__name__


@pytest.mark.parametrize("scale", [0.5, 3.0, 40.0])
def test_gradients_are_the_exact_derivative_within_bf16_rounding(scale):
    generator = torch.Generator().manual_seed(1)
    gate, up = ((torch.randn(4096, 64, generator=generator) * scale).bfloat16() for _ in range(2))
    dh = torch.randn(4096, 64, generator=generator).bfloat16()
    out, dg, du = grads(lambda g, u: situ_glu_bf16(g, u, B1, B2), gate, up, dh)
    want_g, want_u = reference_grads(gate, up, dh)
    if scale < 10:
        torch.testing.assert_close(autograd_grads(gate, up, dh), (want_g, want_u), rtol=1e-9, atol=1e-12)
    # one rounding to bf16 of the exact value, plus a few fp32 roundings before it; below fp32's normal
    # range (products of tiny factors, |x| < 1e-37) fp32 rounds to denormals or zero
    for got, want in ((dg, want_g), (du, want_u)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=2**-8 * 1.01, atol=1e-37)
    # autograd through the fp32 chain: its 1 − tanh² cancels in fp32 for |g/β1| ≳ 4 (0, or off by percents)
    if scale > 10:
        return
    # for moderate inputs it agrees to one bf16 step, up to its own fp32 rounding of the two terms of A'
    # (which cancel near A''s zero, g ≈ −1.3)
    _, chain_g, chain_u = grads(lambda g, u: situ_glu(g.float(), u.float()).bfloat16(), gate, up, dh)
    g, d = gate.double(), (dh.double() * B2 * torch.tanh(up.double() / B2)).abs()
    s = torch.sigmoid(g)
    terms = d * (torch.cosh(g / B1).pow(-2) * s + B1 * torch.tanh(g / B1).abs() * s * (1 - s))
    assert ((dg.double() - chain_g.double()).abs() <= 2**-7 * chain_g.double().abs() + 1e-6 * terms).all()
    torch.testing.assert_close(du, chain_u, rtol=2**-7, atol=1e-37)


def test_limits_infinities_and_nan():
    gate = torch.tensor([float("inf"), float("-inf"), 1e30, -1e30, 0.0, float("nan")]).bfloat16()
    up = torch.tensor([float("inf"), 1e30, float("-inf"), 3.0, 7.0, 1.0]).bfloat16()
    out, dg, du = grads(lambda g, u: situ_glu_bf16(g, u, B1, B2), gate, up, torch.ones(6).bfloat16())
    torch.testing.assert_close(out, chain(gate, up), rtol=0, atol=0, equal_nan=True)
    assert dg[:4].tolist() == [0.0] * 4 and du[:3].tolist() == [0.0] * 3
    assert dg[5].isnan() and du[5].isnan()
    assert dg[4].item() == pytest.approx(0.5 * 25 * torch.tanh(torch.tensor(7 / 25)).item(), rel=2**-8)


def test_tables_and_errors():
    tables = situ_tables(B1, B2, torch.device("cpu"))
    assert tables.shape == (4, 65536) and tables.dtype == torch.float32
    assert situ_tables(B1, B2, torch.device("cpu")) is tables  # built once
    with pytest.raises(ValueError, match="bf16 gate and up of one shape"):
        situ_glu_bf16(torch.zeros(3), torch.zeros(3), B1, B2)
    with pytest.raises(ValueError, match="one shape"):
        situ_glu_bf16(torch.zeros(3).bfloat16(), torch.zeros(4).bfloat16(), B1, B2)
    g = torch.randn(5).bfloat16().requires_grad_()
    (dg,) = torch.autograd.grad(situ_glu_bf16(g, g.detach(), B1, B2).sum(), g, create_graph=True)
    with pytest.raises(RuntimeError):  # once_differentiable: no silent second derivative
        dg.sum().backward()
