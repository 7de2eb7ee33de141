"""In-memory bridge to transformers' ``DeepseekV3ForCausalLM`` (parity tests and side-by-side benchmarks).

transformers 5 keeps experts fused in memory: ``gate_up_proj`` [E, 2F, D] (gate rows then up rows) and
``down_proj`` [E, D, F]; on disk they are one tensor per expert (``k2lab.hf.mapping``).
"""

from __future__ import annotations

import torch

from k2lab.hf.mapping import config_to_hf, to_hf_names
from k2lab.models import CausalLM


def transformers_config(model: CausalLM):
    """The ``DeepseekV3Config`` equivalent to ``model.config``."""
    from transformers import DeepseekV3Config

    data = {key: value for key, value in config_to_hf(model.config).items() if key != "architectures"}
    return DeepseekV3Config(**data)


def transformers_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our weights under transformers' in-memory names (experts fused)."""
    state = dict(to_hf_names(model.state_dict()))
    config = model.config
    for layer in range(config.first_k_dense_replace, config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."

        def stack(projection: str, prefix: str = prefix) -> torch.Tensor:
            keys = [f"{prefix}{e}.{projection}.weight" for e in range(config.n_routed_experts)]
            return torch.stack([state.pop(key) for key in keys])

        gate, up, down = stack("gate_proj"), stack("up_proj"), stack("down_proj")
        state[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[prefix + "down_proj"] = down
    return state


def to_transformers(model: CausalLM):
    """A transformers ``DeepseekV3ForCausalLM`` with exactly our weights (same dtype, eval mode)."""
    from transformers import DeepseekV3ForCausalLM

    dtype = next(model.parameters()).dtype
    reference = DeepseekV3ForCausalLM(transformers_config(model)).to(dtype)
    reference.load_state_dict(transformers_state_dict(model), strict=True)
    return reference.eval()
