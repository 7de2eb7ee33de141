"""Gated-linear-unit activations ``(gate, up) -> hidden`` shared by the dense MLP and the routed experts.

    SwiGLU    h = silu(g) ⊙ u                                          (K2)
    SiTU-GLU  h = [β1·tanh(g/β1) ⊙ σ(g)] ⊙ [β2·tanh(u/β2)],  β1 = 4, β2 = 25   (K3, every MLP)

g = W_gate x and u = W_up x, both [..., F]. SiTU-GLU caps the gate branch in (−β1, β1)·σ(g) and the up branch in
(−β2, β2), so |h| ≤ β1·β2 (= 100) for any input; it is computed in fp32 and cast back to the input dtype.
bf16 inputs on CPU (bf16 autocast) take the same values from tables over all 2¹⁶ bf16 patterns
(``k2lab.ops.situ_table``): bit-identical forward, ≈ 1.4–1.5× faster forward + backward; not under
``torch.compile``, whose fused kernel computes the chain itself.
Released K3 names: ``hidden_act: "situ"``, β1 = ``activation_situ_beta``, β2 = ``activation_situ_linear_beta``, on
the dense MLP, the shared experts and the routed experts alike (mlx-lm / vLLM ``kimi_k3``; the released code also
allows no β2, an uncapped up branch, which these configs cannot express).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from k2lab.config import ModelConfig
from k2lab.ops import situ_table

__all__ = ["GLUActivation", "mlp_activation", "situ_glu", "swiglu"]


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) ⊙ up in the input dtype (the K2 numerics, unchanged)."""
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    """β1·tanh(g/β1)·σ(g) ⊙ β2·tanh(u/β2), in fp32, cast back to ``gate.dtype``; |out| ≤ β1·β2.

    Each factor is bounded by its cap in floating point too (tanh ≤ 1, σ ≤ 1 and rounding is monotone), so the
    bound holds exactly, for inputs up to ±inf in the gate and any finite up value. bf16 CPU inputs outside
    ``torch.compile`` take the table tier (``k2lab.ops.situ_table``), bit-identical in the forward.
    """
    if _table_tier(gate, up):
        return situ_table.situ_glu_bf16(gate, up, beta1, beta2)
    g, u = gate.float(), up.float()
    out = (beta1 * torch.tanh(g / beta1)) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))
    return out.to(gate.dtype)


def _table_tier(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """bf16 CPU tensors of one shape, not being compiled (inductor fuses the fp32 chain instead)."""
    return situ_table.takes(gate, up) and gate.device.type == "cpu" and not torch.compiler.is_compiling()


@dataclass(frozen=True)
class GLUActivation:
    """A picklable ``(gate, up) -> hidden`` callable: ``kind`` names the rule, ``beta1/beta2`` SiTU's caps."""

    kind: Literal["swiglu", "situ_glu"] = "swiglu"
    beta1: float = 4.0
    beta2: float = 25.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return swiglu(gate, up)
        return situ_glu(gate, up, self.beta1, self.beta2)

    def __str__(self) -> str:
        return self.kind if self.kind == "swiglu" else f"situ_glu(β1={self.beta1:g}, β2={self.beta2:g})"


def mlp_activation(config: ModelConfig) -> GLUActivation:
    """The activation every MLP of ``config`` uses (``mlp_activation``, ``situ_beta1``, ``situ_beta2``)."""
    return GLUActivation(config.mlp_activation, config.situ_beta1, config.situ_beta2)
