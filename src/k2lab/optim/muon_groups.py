"""Setting up one ``Muon`` parameter group: the checks and the resolved ``ns_dtype``, wherever a group comes
from (the constructor, ``add_param_group``, ``load_state_dict`` of a saved state or another optimizer's).

    kind            'muon' (2-D matrices, 3-D [E, out, in] experts) or 'adamw' (any real tensor)
    lr, weight_decay, eps, adam_eps   ≥ 0 and not NaN (``not 0 <= x``, as torch.optim checks)
    momentum        in [0, 1)
    ns_steps        an int in [1, 99];  ns_coefficients  three numbers (a, b, c)
    adjust_lr_fn    None, 'original' or 'match_rms_adamw'
    ns_dtype        None → what ``k2lab.hardware.choose`` picks for Newton–Schulz on the group's device;
                    the request (None or the dtype asked for) is kept as ``ns_dtype_request`` and is what
                    ``Muon.state_dict`` saves, so a state resumed on another machine is resolved there
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import torch

from k2lab.hardware import choose

KINDS = ("muon", "adamw")
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


def device_type(params: Iterable[torch.Tensor]) -> str:
    """``cuda`` or ``cpu``: where the first of ``params`` lives (and so its Newton–Schulz runs)."""
    first = next(iter(params), None)
    return "cpu" if first is None else first.device.type


def validate_hyperparameters(group: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the first out-of-range hyper-parameter of a group (or the defaults)."""
    for key in ("lr", "weight_decay", "eps", "adam_eps"):
        if key in group and not group[key] >= 0:  # NaN fails too
            raise ValueError(f"Muon's {key} must be >= 0 (not NaN), got {group[key]}")
    if not 0 <= group["momentum"] < 1:
        raise ValueError(f"Muon's momentum must be in [0, 1), got {group['momentum']}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not 0 < steps < 100:
        raise ValueError(f"ns_steps must be an int in [1, 99], got {steps!r}")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(
            f"ns_coefficients must be exactly 3 numbers (a, b, c) of the quintic, got {group['ns_coefficients']!r}"
        )
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(
            f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {group['adjust_lr_fn']!r}"
        )


def validate_params(group: dict[str, Any]) -> None:
    """The group's kind, and tensors Muon can update: real, and 2-D / 3-D in a 'muon' group."""
    if group["kind"] not in KINDS:
        raise ValueError(f"parameter group kind must be 'muon' or 'adamw', got {group['kind']!r}")
    for p in group["params"]:
        if p.is_complex():
            raise ValueError(f"Muon does not support complex parameters (got {p.dtype}): view them as real")
        if group["kind"] == "muon" and p.ndim not in (2, 3):
            raise ValueError(
                f"Muon takes 2-D matrices or 3-D [E, out, in] experts, got shape {tuple(p.shape)}; "
                "put it in a kind='adamw' group"
            )


def with_grads(group: dict[str, Any]) -> list[torch.Tensor]:
    """The group's parameters that have a gradient this step; a sparse gradient (``nn.Embedding(sparse=True)``)
    is refused, as torch.optim.Muon and AdamW refuse it."""
    params = [p for p in group["params"] if p.grad is not None]
    for p in params:
        if p.grad.is_sparse:
            raise ValueError(
                f"Muon does not support sparse gradients (a {tuple(p.shape)} parameter has one): build the "
                "embedding with sparse=False"
            )
    return params


def resolve_ns_dtype(group: dict[str, Any], request: torch.dtype | None) -> None:
    """Record ``request`` as the group's ``ns_dtype_request`` and set its ``ns_dtype``: the dtype asked for,
    or (None) what ``k2lab.hardware.choose`` picks for Newton–Schulz on this machine and the group's device."""
    group["ns_dtype_request"] = request
    if request is None:
        request = choose("newton_schulz", device=device_type(group["params"])).dtype
    group["ns_dtype"] = request


def setup_group(group: dict[str, Any]) -> None:
    """Check a group (filled with the defaults) and resolve its ``ns_dtype``, in place. A new or loaded group
    has no ``ns_dtype_request`` yet: its ``ns_dtype`` is the request (None: auto)."""
    validate_hyperparameters(group)
    validate_params(group)
    group["ns_coefficients"] = tuple(group["ns_coefficients"])
    resolve_ns_dtype(group, group.get("ns_dtype_request", group["ns_dtype"]))
