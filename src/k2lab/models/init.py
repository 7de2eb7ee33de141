"""Weight initialisation, in one place: N(0, initializer_range) for every matrix (dense, expert, router,
embedding), U(±1/√kernel) for the KDA short convolution, ones for norms, zeros for the router's correction bias (as in the
DeepSeek-V3 reference), the KDA decay parameters as in Kimi Linear (``ForgetGate.reset_decay``) and zero AttnRes pseudo-queries.
Multi-token-prediction modules (``k2lab.models.mtp``) follow the same rules; registered last, they are drawn
after everything else, so a model's main weights at a seed do not depend on ``num_nextn_predict_layers``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from k2lab.nn.attnres import AttnRes
from k2lab.nn.experts import RoutedExperts
from k2lab.nn.kda_gate import ForgetGate
from k2lab.nn.norm import RMSNorm
from k2lab.nn.rope import RotaryEmbedding
from k2lab.nn.router import SigmoidRouter


class _SkipInitOnMeta(TorchFunctionMode):
    """Returns the tensor untouched from every ``torch.nn.init`` initialiser called on a meta tensor.

    Module constructors initialise their parameters (``nn.Linear``: ``kaiming_uniform_``); on the meta device
    that runs the initialisers' Python reference kernels, whose first call imports ``torch._dynamo`` (2–3 s,
    measured on the 2-core Zen 4 VM) to produce no data at all.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")  # handle_torch_function passes it by name
        if (
            getattr(func, "__module__", None) == "torch.nn.init"
            and isinstance(tensor, torch.Tensor)
            and tensor.is_meta
        ):
            return tensor
        return func(*args, **kwargs)


@contextmanager
def constructing_on(device: torch.device | str) -> Iterator[None]:
    """``with torch.device(device)`` for constructing a model; on meta its initialisers are skipped."""
    skip = _SkipInitOnMeta() if torch.device(device).type == "meta" else nullcontext()
    with skip, torch.device(device):
        yield


@torch.no_grad()
def init_weights(model: nn.Module, seed: int | None = 0) -> None:
    std = model.config.initializer_range
    generator = None
    if seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(tensor: torch.Tensor) -> None:
        values = torch.empty(tensor.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        tensor.copy_(values)

    for module in model.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            normal_(module.weight)
        elif isinstance(module, nn.Conv1d):  # torch's default bound 1/sqrt(fan_in) for a depthwise kernel
            bound = module.weight[0].numel() ** -0.5
            module.weight.copy_(torch.empty(module.weight.shape).uniform_(-bound, bound, generator=generator))
        elif isinstance(module, ForgetGate):
            module.reset_decay(generator)
        elif isinstance(module, AttnRes):  # zero pseudo-query: a uniform average over sources at init
            module.reset_parameters()
        elif isinstance(module, RoutedExperts):
            for weight in (module.gate_proj, module.up_proj, module.down_proj):
                normal_(weight)
        elif isinstance(module, SigmoidRouter):
            normal_(module.weight)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


def materialize(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """Allocate a meta-device model on ``device`` without initialising weights (they are loaded next).

    Non-persistent buffers (rotary frequencies) are recomputed, since no checkpoint holds them. What
    ``Module.to_empty`` does, with ``torch.empty`` for its ``torch.empty_like``: that one runs the meta
    tensors' Python reference kernel, whose first call imports sympy (~2 s, measured on the 2-core Zen 4 VM).
    """
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
        # parameters are re-created one by one, untying a tied head
        if hasattr(module, "lm_head") and getattr(module.config, "tie_word_embeddings", False):
            module.lm_head.weight = module.embed.weight
    return model


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast parameters to ``dtype``; routers stay fp32 (as transformers keeps ``mlp.gate`` and its bias)."""
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, SigmoidRouter):
            module.float()
    return model
