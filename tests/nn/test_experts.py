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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_tier_of_more_rows_than_experts_equals_grouped_tier(dtype: torch.dtype) -> None:
    """A compiled step with more (token, pick) rows than experts (a batch of chats, a verify window) takes the
    gathered tier with its rows in expert order: equal to the grouped tier within a reduction's rounding, a
    token's two picks of one expert included."""
    experts, _, _, _ = _case(dtype)
    x = torch.randn(12, 32, dtype=dtype)
    indices = torch.stack([torch.randperm(16)[:2] for _ in range(12)])  # 24 rows for 16 experts
    indices[3] = torch.tensor([5, 5])
    weights = torch.rand(12, 2)
    grouped = experts(x, indices, weights).detach()
    with torch.no_grad():
        gathered = experts.gathered_forward(x, indices, weights, dtype)
        compiled = torch.compile(experts, backend="eager", fullgraph=True)(x, indices, weights)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gathered, grouped, rtol=tol, atol=tol)
    torch.testing.assert_close(compiled, grouped, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_groups_equal_unpadded(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Enough rows per expert pad every group to a multiple of GROUP_ROWS on CPU: the products see only padded
    group sizes, and outputs and every gradient equal the unpadded grouping's (within a matmul's rounding)."""
    import k2lab.nn.experts as experts_module
    from k2lab.ops.grouped_mm import grouped_matmul

    torch.manual_seed(1)
    experts = RoutedExperts(4, 32, 24).to(dtype)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.2)
    N, K = 700, 2  # 1,400 rows ≥ PAD_MIN_GROUPS · GROUP_ROWS · 4 experts = 1,024
    x = torch.randn(N, 32, dtype=dtype)
    indices = torch.stack([torch.randperm(4)[:K] for _ in range(N)])
    weights, probe = torch.rand(N, K), torch.randn(N, 32)
    seen: list[list[int]] = []

    def spy(x, w, counts):
        seen.append(counts.tolist())
        return grouped_matmul(x, w, counts)

    monkeypatch.setattr(experts_module, "grouped_matmul", spy)

    def run(group_rows: int) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(experts_module, "GROUP_ROWS", group_rows)
        leaf = x.clone().requires_grad_()
        y = experts(leaf, indices, weights)
        grads = torch.autograd.grad((y.float() * probe).sum(), (leaf, *experts.parameters()))
        return (y, *grads)

    padded = run(32)
    assert seen and all(count % 32 == 0 for counts in seen for count in counts)
    assert sum(seen[0]) > N * K
    seen.clear()
    plain = run(0)
    assert all(sum(counts) == N * K for counts in seen)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(padded, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
