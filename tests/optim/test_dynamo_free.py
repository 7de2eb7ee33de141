"""The optimizer bookkeeping mixin: torch's undecorated methods while dynamo is not loaded, its own after.

That no optimizer call imports ``torch._dynamo`` is checked in a fresh process by tests/test_startup.py."""

from __future__ import annotations

import sys

import pytest
import torch
import torch._dynamo  # noqa: F401 - loaded, as in any process that compiles
from torch.optim import Optimizer

from k2lab.optim.dynamo_free import _unwrapped
from k2lab.optim.muon import Muon


@pytest.mark.parametrize("name", ["add_param_group", "zero_grad", "state_dict", "load_state_dict"])
def test_torch_methods_are_unwrapped_only_while_dynamo_is_not_loaded(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    method = getattr(Optimizer, name)
    assert _unwrapped(method) is method
    monkeypatch.delitem(sys.modules, "torch._dynamo")
    assert _unwrapped(method) is method.__wrapped__


def test_a_compiled_region_still_leaves_the_bookkeeping_untraced() -> None:
    weight = torch.nn.Parameter(torch.ones(4, 4))
    optimizer = Muon([weight], lr=0.1)
    weight.grad = torch.ones(4, 4)

    @torch.compile(backend="eager")
    def clear_and_scale(x: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        return x * 2

    torch.testing.assert_close(clear_and_scale(torch.ones(3)), torch.full((3,), 2.0))
    assert weight.grad is None
    before = {k: v for k, v in optimizer.state_dict().items() if k != "state"}
    optimizer.load_state_dict(optimizer.state_dict())
    assert {k: v for k, v in optimizer.state_dict().items() if k != "state"} == before
