"""decode_linear: F.linear's products in the other operand order, within fp32 rounding, only where it applies."""

import pytest
import torch
import torch.nn.functional as F

from k2lab.nn.decode_linear import COMPILED_MAX_ROWS, MAX_ROWS, decode_linear


@pytest.mark.parametrize("rows", [1, 2, 4, MAX_ROWS])
@pytest.mark.parametrize("shape", [(512, 64), (64, 64), (96, 32)])
def test_equals_linear_within_rounding(rows: int, shape: tuple[int, int], monkeypatch) -> None:
    monkeypatch.setattr("k2lab.nn.decode_linear.MIN_SINGLE_ROW", 0)  # the single-row swap at these sizes too
    torch.manual_seed(0)
    weight = torch.randn(shape)
    x = torch.randn(rows, 1, shape[1])  # [B, T, D] as a decode step feeds it
    with torch.no_grad():
        got = decode_linear(x, weight)
    assert got.shape == (rows, 1, shape[0]) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_falls_back_to_linear_exactly() -> None:
    """More rows than MAX_ROWS, one row of a small weight, a wide input (D > O), a gradient or bf16: the very
    F.linear call."""
    torch.manual_seed(1)
    weight = torch.randn(64, 32)
    cases = [
        (torch.randn(MAX_ROWS + 1, 32), weight),
        (torch.randn(1, 32), weight),
        (torch.randn(2, 64), torch.randn(32, 64)),
        (torch.randn(2, 32).bfloat16(), weight.bfloat16()),
    ]
    with torch.no_grad():
        for x, w in cases:
            assert torch.equal(decode_linear(x, w), F.linear(x, w))
    trained = weight.clone().requires_grad_()
    x = torch.randn(2, 32)
    out = decode_linear(x, trained)
    assert torch.equal(out, F.linear(x, trained)) and out.requires_grad


def _traced_ops(x: torch.Tensor, weight: torch.Tensor) -> set[str]:
    """The ops dynamo records for ``decode_linear(x, weight)`` (a capturing backend, no inductor build)."""
    seen: set[str] = set()

    def capture(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        seen.update(str(node.target) for node in graph_module.graph.nodes if node.op.startswith("call_"))
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(decode_linear, backend=capture, fullgraph=True)(x, weight)
    return seen


def test_compiled_few_rows_take_the_reduction_tier_only_in_fp32_inference() -> None:
    """Under torch.compile up to COMPILED_MAX_ROWS fp32 rows without gradient (more than the eager tier's
    MAX_ROWS) are the fused reduction (W[None] * x[:, None]).sum(-1), equal to F.linear within rounding; bf16,
    a gradient or more rows trace the plain F.linear."""
    torch.manual_seed(2)
    weight = torch.randn(96, 32)
    with torch.no_grad():
        for x in (torch.randn(1, 1, 32), torch.randn(2, 3, 32), torch.randn(MAX_ROWS + 1, 1, 32)):
            ops = _traced_ops(x, weight)
            assert any("sum" in op for op in ops) and not any("linear" in op for op in ops), ops
            got = torch.compile(decode_linear, backend="eager")(x, weight)
            torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
        x = torch.randn(1, 1, 32)
        assert any("linear" in op for op in _traced_ops(x.bfloat16(), weight.bfloat16()))
        assert any("linear" in op for op in _traced_ops(torch.randn(COMPILED_MAX_ROWS + 1, 32), weight))
    assert any("linear" in op for op in _traced_ops(x, weight.clone().requires_grad_()))


def test_compiled_large_weights_sum_weight_row_major(monkeypatch) -> None:
    """Above LARGE_WEIGHT_BYTES, several rows: the [O, N] reduction transposed, equal to F.linear within
    rounding; one row keeps the [N, O] form."""
    monkeypatch.setattr("k2lab.nn.decode_linear.LARGE_WEIGHT_BYTES", 96 * 32 * 4)
    torch.manual_seed(3)
    weight = torch.randn(96, 32)
    with torch.no_grad():
        for x in (torch.randn(3, 1, 32), torch.randn(2, 2, 32), torch.randn(1, 1, 32)):
            transposed = "contiguous" in _traced_ops(x, weight)  # the [O, N] result made row-major
            assert transposed == (x.shape[0] * x.shape[1] > 1)
            got = torch.compile(decode_linear, backend="eager")(x, weight)
            assert got.shape == (*x.shape[:-1], 96) and got.is_contiguous()
            torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)
