"""Shared fixtures: small models with weights large enough that routing and logits are non-trivial."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.models import CausalLM

torch.set_num_threads(2)


def randomize(model: CausalLM, std: float = 0.15, bias_std: float = 0.05, seed: int = 0) -> CausalLM:
    """Re-draw every weight with a larger std and give the routers a random correction bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(bias_std * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.copy_(std * torch.randn(tensor.shape, generator=generator))
    return model.eval()


@pytest.fixture
def nano() -> CausalLM:
    return randomize(build_model(load_preset("k2-nano")))


def nano_variant(**overrides: object) -> CausalLM:
    return randomize(build_model(load_preset("k2-nano", **overrides)))
