"""Routed experts: the decode tiers (looped in eager mode, gathered under torch.compile) against the grouped tier."""

import pytest
import torch

from k2lab.nn.experts import RoutedExperts


def _case(dtype: torch.dtype) -> tuple[RoutedExperts, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    experts = RoutedExperts(16, 32, 24).to(dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    x = torch.randn(4, 32, dtype=dtype)
    indices = torch.tensor([[1, 7], [7, 3], [15, 0], [7, 1]])  # expert 7 has three rows, 1 two
    return experts, x, indices, torch.rand(4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_tiers_equal_grouped_tier(dtype: torch.dtype) -> None:
    """Fewer (token, pick) rows than experts and no gradient take a decode tier: the same products as the
    grouped tier, so equal within the rounding of one matmul's reduction order — both the eager loop
    (what ``forward`` runs here) and the gathered tier that compiled graphs use."""
    experts, x, indices, weights = _case(dtype)
    grouped = experts(x, indices, weights).detach()  # grad enabled: the grouped tier
    with torch.no_grad():
        looped = experts(x, indices, weights)  # 8 rows < 16 experts, eager
        gathered = experts.gathered_forward(x, indices, weights, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(looped, grouped, rtol=tol, atol=tol)
    torch.testing.assert_close(gathered, grouped, rtol=tol, atol=tol)
