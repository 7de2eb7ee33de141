"""``torch.optim.Optimizer``'s bookkeeping without the ``torch._dynamo`` import it triggers.

torch wraps ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` in
``torch._disable_dynamo``, so that a compiled region that calls them does not trace them. The wrapper imports
``torch._dynamo`` at its first call to build the disabled function: 3.3–3.7 s on the 2-core Zen 4 VM (sympy
comes with it), paid by every process that builds an optimizer — a training run, SFT, or the RL stage of
``k2lab recipe agentic-mini`` (~5 % of its wall time).

Nothing can be compiling while ``torch._dynamo`` has not been imported, so until then the mixin below calls
the undecorated methods (``functools.wraps``' ``__wrapped__``), and from then on torch's own, wrapper and
all: what a compiled region sees is unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

_DYNAMO = "torch._dynamo"


def _unwrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` without its ``torch._disable_dynamo`` wrapper while dynamo is not loaded."""
    if _DYNAMO in sys.modules:
        return method
    return getattr(method, "__wrapped__", method)


class WithoutDynamoImport:
    """Mixin before a ``torch.optim.Optimizer`` subclass: ``class Muon(WithoutDynamoImport, Optimizer)``."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _unwrapped(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _unwrapped(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _unwrapped(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _unwrapped(torch.optim.Optimizer.load_state_dict)(self, state_dict)
