"""Routed experts: the gathered decode tier against the grouped tier."""

import pytest
import torch

from k2lab.nn.experts import RoutedExperts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_decode_tier_equals_grouped_tier(dtype: torch.dtype) -> None:
    """Fewer (token, pick) rows than experts take the gathered-weights tier: the same products as the
    grouped tier, so equal within the rounding of one matmul's reduction order."""
    torch.manual_seed(0)
    experts = RoutedExperts(16, 32, 24).to(dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(3, 32, dtype=dtype)
    indices = torch.tensor([[1, 7], [7, 3], [15, 0]])
    weights = torch.rand(3, 2)
    with torch.no_grad():
        gathered = experts(x, indices, weights)  # 6 rows < 16 experts
    grouped = experts(x, indices, weights)  # grad enabled: the grouped tier
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gathered, grouped.detach(), rtol=tol, atol=tol)
