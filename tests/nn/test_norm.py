"""RMSNorm: the inference call (``F.rms_norm``) equals the written-out formula bit for bit."""

import pytest
import torch

from k2lab.nn.norm import RMSNorm


def formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("D", [16, 192, 256, 576, 7168])
@pytest.mark.parametrize("rows", [1, 3, 256])
def test_inference_norm_equals_the_formula_bit_for_bit(D, rows):
    generator = torch.Generator().manual_seed(D + rows)
    norm = RMSNorm(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=generator)
        x = torch.randn(rows, D, generator=generator) * torch.rand(rows, 1, generator=generator) * 10
        assert torch.equal(norm(x), formula(x, norm.weight, norm.eps))


def test_training_norm_keeps_its_gradients():
    norm = RMSNorm(64)
    x = torch.randn(4, 64, requires_grad=True)
    norm(x).square().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    formula(x2, norm.weight.detach(), norm.eps).square().sum().backward()
    assert norm.weight.grad is not None and torch.equal(x.grad, x2.grad)
