"""Activation maxima of the MoE layers, measured by forward hooks on the validation batches (off the hot
path).

Per MoE layer l (``k2lab.nn.moe``), over every token of the forwards run inside ``moe_activation_maxima``:

    moe_routed_max/layer{l} = max |u|     u = Σ_{i∈TopK(x)} p_i E_i(W_down x)   [N, L] (Stable LatentMoE:
                                          the latent routed sum before RMSNorm / W_up; K2: the full-width
                                          routed sum)
    moe_out_max/layer{l}    = max |y|     y = the MoE block's output             [B, T, D] (shared + routed)

These are what K3's Stable LatentMoE claim is about ("several consecutive matrix products produce exploding
activations inside the latent branch"): the hooks read the ``RoutedExperts`` output (u) and the ``MoE``
output (y), so no model code changes and training steps pay nothing. ``l`` is numbered as the trainer's
``expert_load/layer{l}`` keys (first MoE layer = ``first_k_dense_replace``); a layer that ran no forward
(an MTP block under validation) has no key. Under data parallelism each rank sees its rows; the caller
takes the maximum over ranks (``k2lab.train.distributed.all_reduce_max``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from k2lab.models import CausalLM

ROUTED_KEY = "moe_routed_max"
OUTPUT_KEY = "moe_out_max"


@contextmanager
def moe_activation_maxima(lm: CausalLM) -> Iterator[dict[str, float]]:
    """Hooks on every MoE layer of ``lm`` while the block runs; the yielded dict fills with the maxima
    (``{ROUTED_KEY}/layer{l}``, ``{OUTPUT_KEY}/layer{l}``: floats) of the forwards run inside it."""
    maxima: dict[str, float] = {}
    first = lm.config.first_k_dense_replace
    handles = []
    for index, moe in enumerate(lm.moe_layers()):
        layer = index + first
        handles.append(moe.experts.register_forward_hook(_recorder(maxima, f"{ROUTED_KEY}/layer{layer}")))
        handles.append(moe.register_forward_hook(_recorder(maxima, f"{OUTPUT_KEY}/layer{layer}")))
    try:
        yield maxima
    finally:
        for handle in handles:
            handle.remove()


def _recorder(maxima: dict[str, float], key: str):
    """A forward hook that raises ``maxima[key]`` to the module output's max |value|."""

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        value = float(output.detach().abs().amax()) if output.numel() else 0.0
        maxima[key] = max(maxima.get(key, 0.0), value)

    return hook
