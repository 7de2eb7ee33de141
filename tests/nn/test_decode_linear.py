"""decode_linear: F.linear's products in the other operand order, within fp32 rounding, only where it applies."""

import pytest
import torch
import torch.nn.functional as F

from k2lab.nn.decode_linear import MAX_ROWS, decode_linear


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
