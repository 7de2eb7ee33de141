"""bf16 weights for the compiled CPU decode step: weight-only, activations, caches and sums stay fp32.

A CPU decode step is bound by the weights it streams from memory (k2-mini at batch 1 reads ≈ 26 MB of fp32
weights a token: two routed experts and the shared one in each MoE layer, the attention, the 8 MB head). The
step's products are reductions that inductor generates (``k2lab.nn.decode_linear``'s reduction tier, the
routed experts' gathered tier, ``reduced_latent_attention``):

    y_n = Σ_d W_od x_nd        W [O, D] read as bf16, each value widened to fp32 as it is loaded

so reading W in bf16 halves the bytes and changes nothing else: x, the products and the sums stay fp32.
The weights are rounded once to bf16 (8 bits of mantissa), which is what a model trained under bf16 autocast
already multiplied by at every training step. Measured on a Zen 5 (2 threads, k2-mini, compiled steps in one
process, alternating, 64 new tokens after a 64-token prompt, prefill included; two runs): batch 1 1.26–1.33×,
batch 4 1.36–1.41×; on the trained demo model the greedy tokens equal fp32 decoding's (docs/generation.md).

``bf16_twin(model)`` is the model the compiled step runs: a copy sharing every parameter and buffer of
``model`` except its matrices (the weights of ``nn.Linear`` layers and the routed experts' stacks), which are
bf16 copies, and whose ``nn.Linear`` layers run through ``decode_linear`` (which widens bf16 weights for fp32
rows). Embeddings, norms, the router and convolution taps stay shared fp32. One twin per model, kept while the
model lives (memory: half the matrices' fp32 bytes); ``refresh`` copies a matrix again whenever its source
was written since (an optimizer step in RL: each source's version counter and storage are compared at every
``decode_step``). The prefill and eager decoding read ``model``'s own fp32 weights. A draft's compiled
forwards follow the same option (``Draft.compile``): an EAGLE forward runs over the target's twin and its
block's.

``decode_weights_choice`` decides (``k2lab.hardware``'s rule for the ``decode_weights`` path): "auto" is bf16
where the hardware module picks bf16 (a CPU with native bf16, confirmed by its measurement) and fp32 elsewhere,
so a CPU without native bf16 rounds nothing unless asked; it applies only to the compiled CPU step (eager
decoding and CUDA decode the model's own dtype).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from pydantic import Field
from torch import nn

from k2lab.hardware import Choice, Precision, choose
from k2lab.nn.decode_linear import decode_linear
from k2lab.nn.experts import RoutedExperts

__all__ = [
    "Precision",
    "bf16_twin",
    "decode_weights_choice",
    "decode_weights_field",
    "matrices",
    "parameter_kinds",
]

_EXPERT_STACKS = ("gate_proj", "up_proj", "down_proj")
_TWINS: weakref.WeakKeyDictionary[nn.Module, _Twin] = weakref.WeakKeyDictionary()


def decode_weights_choice(requested: Precision | str, device: str, compiled: bool) -> Choice:
    """The dtype the decode step reads its matrices in, and why."""
    if not compiled or device != "cpu":
        where = "eager decoding" if not compiled else f"{device} decoding"
        return Choice(torch.float32, f"{where} reads the model's own weights")
    return choose("decode_weights", requested, device)


def decode_weights_field() -> Any:  # pydantic's Field(...), typed Any so that it can stand for a value
    """The ``decode_weights`` option of ``GenerationConfig`` and ``ServeConfig``: one default, one description."""
    return Field(
        default="auto",
        description="dtype of the matrices a compiled CPU decode step reads (k2lab.infer.decode_weights): "
        "bf16 halves the bytes streamed (weight-only; activations and sums stay fp32); auto = bf16 where "
        "the CPU runs bf16 natively (k2lab.hardware), fp32 elsewhere. Eager and CUDA decoding read the "
        "model's own weights.",
    )


def matrices(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every matrix the twin holds in bf16: ``nn.Linear`` weights (of that class
    itself: a subclass's own forward might not widen them) and the routed experts' stacks."""
    found: list[tuple[nn.Module, str]] = []
    for module in model.modules():
        if type(module) is nn.Linear:
            found.append((module, "weight"))
        elif isinstance(module, RoutedExperts):
            found.extend((module, name) for name in _EXPERT_STACKS)
    return found


class _TwinLinear(nn.Linear):
    """An ``nn.Linear`` of the twin: x [..., I] fp32, weight [O, I] bf16 -> [..., O] through ``decode_linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = decode_linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class _Twin:
    """The twin of one model and, for each bf16 matrix, its source parameter and the source's ``_stamp`` when
    it was copied."""

    def __init__(self, model: nn.Module) -> None:
        sources = matrices(model)
        # every tensor is shared (deepcopy finds it in its memo and keeps it); the matrices are then replaced
        # in the twin's modules only, so a weight tied to an embedding stays shared with the embedding
        memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
        with torch.no_grad():
            twin = copy.deepcopy(model, memo)
            copies = matrices(twin)
            self.pairs: list[tuple[nn.Parameter, nn.Parameter, tuple[int, int]]] = []
            for (module, name), (twin_module, _) in zip(sources, copies, strict=True):
                source = getattr(module, name)
                copied = nn.Parameter(source.detach().to(torch.bfloat16), requires_grad=False)
                setattr(twin_module, name, copied)
                self.pairs.append((source, copied, _stamp(source)))
                if isinstance(twin_module, nn.Linear):
                    twin_module.__class__ = _TwinLinear
        self.model = twin  # its shared parameters keep their own requires_grad (they are the model's)
        self.kinds = parameter_kinds(model)  # the model's when the twin was made

    def refresh(self, model: nn.Module) -> nn.Module:
        """The twin, its matrices copied again where the source changed since, in ``model``'s train/eval mode."""
        with torch.no_grad():
            for i, (source, copied, stamp) in enumerate(self.pairs):
                if _stamp(source) != stamp:
                    copied.copy_(source)
                    self.pairs[i] = (source, copied, _stamp(source))
        if self.model.training != model.training:
            self.model.train(model.training)
        return self.model


def _stamp(source: torch.Tensor) -> tuple[int, int]:
    """What changes when a parameter is written: its version counter (in place) and its storage (``.data =``)."""
    return source._version, source.data_ptr()


def bf16_twin(model: nn.Module) -> nn.Module:
    """``model`` with its matrices read from bf16 copies (module docstring), built at the first call (again
    when a parameter's dtype or device changed since) and refreshed at each."""
    twin = _TWINS.get(model)
    if twin is None or twin.kinds != parameter_kinds(model):
        twin = _TWINS[model] = _Twin(model)
    return twin.refresh(model)


def parameter_kinds(model: nn.Module) -> frozenset[tuple[torch.dtype, torch.device]]:
    """Every (dtype, device) among ``model``'s parameters: what a twin or a compiled step was made for."""
    return frozenset((p.dtype, p.device) for p in model.parameters())
