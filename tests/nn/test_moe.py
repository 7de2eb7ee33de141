"""Router, expert dispatch and MoE block against hand-derived values and a per-token reference."""

import pytest
import torch
import torch.nn.functional as F

from k2lab.nn.experts import RoutedExperts
from k2lab.nn.router import SigmoidRouter
from k2lab.ops.grouped_mm import grouped_matmul, grouped_matmul_loop
from k2lab.presets import load_preset


def make_router(**overrides):
    config = load_preset("k2-nano", hidden_size=4, **overrides)
    router = SigmoidRouter(config)
    torch.nn.init.zeros_(router.weight)
    return router, config


def router_with_scores(logits, **overrides):
    """A router whose fp32 logits for the one-hot input e_0 are exactly ``logits``."""
    router, config = make_router(n_routed_experts=len(logits), **overrides)
    with torch.no_grad():
        router.weight[:, 0] = torch.tensor(logits)
    return router, config, torch.tensor([[1.0, 0, 0, 0]])


def test_bias_selects_but_weights_use_unbiased_scores():
    logits = [2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0]
    router, config, x = router_with_scores(logits, n_group=1, topk_group=1)
    plain = router(x)
    assert sorted(plain.indices[0].tolist()) == [0, 1]
    router.e_score_correction_bias[5] = 10.0  # pushes expert 5 into the top-2
    biased = router(x)
    assert sorted(biased.indices[0].tolist()) == [0, 5]
    s = torch.sigmoid(torch.tensor(logits))
    expected = torch.stack([s[0], s[5]]) / (s[0] + s[5] + 1e-20) * config.routed_scaling_factor
    got = biased.weights[0][biased.indices[0].argsort()]
    torch.testing.assert_close(got, expected)


def test_group_limited_routing_picks_inside_best_groups():
    # 8 experts in 2 groups of 4, topk_group=1: group scores are sums of each group's top-2
    logits = [3.0, -9.0, -9.0, -9.0, 1.0, 1.0, 1.0, -9.0]
    router, _, x = router_with_scores(logits, n_group=2, topk_group=1)
    # group 0 top-2 sum: σ(3)+σ(-9) ≈ 0.953; group 1: σ(1)+σ(1) ≈ 1.462 -> group 1 wins although expert 0 is best
    assert set(router(x).indices[0].tolist()) <= {4, 5, 6}


def test_weights_renormalised_and_scaled():
    router, config = make_router()
    torch.nn.init.normal_(router.weight)
    routing = router(torch.randn(32, 4))
    torch.testing.assert_close(
        routing.weights.sum(-1), torch.full((32,), config.routed_scaling_factor), rtol=1e-5, atol=1e-6
    )


def test_router_bias_is_a_buffer_without_gradient():
    router, _ = make_router()
    names = [name for name, _ in router.named_parameters()]
    assert names == ["weight"]
    assert "e_score_correction_bias" in dict(router.named_buffers())


def per_token_reference(experts, x, indices, weights):
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for slot in range(indices.shape[1]):
            e = int(indices[n, slot])
            h = F.silu(experts.gate_proj[e] @ x[n]) * (experts.up_proj[e] @ x[n])
            out[n] += weights[n, slot] * (experts.down_proj[e] @ h)
    return out


def test_sorted_dispatch_matches_per_token_reference_and_grads():
    torch.manual_seed(0)
    experts = RoutedExperts(6, 8, 5)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.5)
    x = torch.randn(13, 8, requires_grad=True)
    indices = torch.stack([torch.randperm(6)[:2] for _ in range(13)])
    indices[:, 0] = 3  # expert 3 gets every token, some experts none
    weights = torch.rand(13, 2)
    got = experts(x, indices, weights)
    ref = per_token_reference(experts, x, indices, weights)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, [x, experts.gate_proj], g)
    ref_grads = torch.autograd.grad(ref, [x, experts.gate_proj], g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_each_expert_runs_once_on_exactly_its_tokens(monkeypatch):
    """No dense all-experts compute: the grouped matmul sees N·k rows, never N·E."""
    import k2lab.nn.experts as experts_module

    rows = []

    def spy(x, w, counts):
        rows.append((x.shape[0], counts.sum().item(), len(counts)))
        return grouped_matmul(x, w, counts)

    monkeypatch.setattr(experts_module, "grouped_matmul", spy)
    experts = RoutedExperts(16, 8, 4)
    for w in experts.parameters():
        torch.nn.init.normal_(w)
    x = torch.randn(10, 8)
    experts(x, torch.randint(0, 16, (10, 2)), torch.rand(10, 2))
    assert rows and all(r == (20, 20, 16) for r in rows)


@pytest.mark.parametrize("dims", [(6, 7), (16, 32)], ids=["unaligned-loop", "aligned-fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_matches_loop(dtype, dims):
    torch.manual_seed(0)
    d_in, d_out = dims
    counts = torch.tensor([0, 5, 0, 9, 1])
    x = torch.randn(15, d_in, dtype=dtype, requires_grad=True)
    w = torch.randn(5, d_out, d_in, dtype=dtype, requires_grad=True)
    got = grouped_matmul(x, w, counts)
    ref = grouped_matmul_loop(x, w, counts.tolist())
    torch.testing.assert_close(got, ref)
    # `.sum()` hands back an expanded (zero-stride) gradient, which the fused CPU backward rejects unless fixed
    grads = torch.autograd.grad(got.sum(), [x, w])
    ref_grads = torch.autograd.grad(ref.sum(), [x, w])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dims", [(6, 7), (16, 32)], ids=["unaligned-loop", "aligned-fused"])
def test_eager_path_equals_the_custom_op(dims):
    """Eager calls skip torch.library's dispatch (``_GroupedMatmul``); products and gradients are the op's."""
    from k2lab.ops.grouped_mm import _grouped_mm_op

    torch.manual_seed(1)
    d_in, d_out = dims
    counts = torch.tensor([4, 0, 7, 2])
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(13, d_in, requires_grad=True)
    w = torch.randn(4, d_out, d_in, requires_grad=True)
    upstream = torch.randn(13, d_out)
    eager = grouped_matmul(x, w, counts)
    op = _grouped_mm_op(x, w, offsets)
    assert eager.grad_fn is not None and "GroupedMatmul" in type(eager.grad_fn).__name__
    assert torch.equal(eager, op)
    for a, b in zip(
        torch.autograd.grad(eager, [x, w], upstream), torch.autograd.grad(op, [x, w], upstream), strict=True
    ):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert grouped_matmul(x, w, counts).grad_fn is None and torch.equal(grouped_matmul(x, w, counts), op)


def test_grouped_matmul_follows_autocast_like_mm():
    """Under bf16 autocast the grouped product runs in bf16, as ``x @ w[e].T`` would for each expert."""
    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 9, 4])
    x, w = torch.randn(16, 32), torch.randn(4, 48, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_matmul(x, w, counts)
        want = grouped_matmul_loop(x, w, counts.tolist())
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_routing_stays_fp32_under_bf16_autocast():
    config = load_preset("k2-nano")
    router = SigmoidRouter(config)
    torch.nn.init.normal_(router.weight, std=0.2)
    x = torch.randn(5, config.hidden_size)
    plain = router(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = router(x)
    assert cast.scores.dtype == torch.float32 and torch.equal(cast.scores, plain.scores)
    assert torch.equal(cast.indices, plain.indices) and torch.equal(cast.weights, plain.weights)
