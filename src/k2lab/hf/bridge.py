"""In-memory bridge to transformers' ``DeepseekV3ForCausalLM`` / ``KimiLinearForCausalLM`` (parity tests and
side-by-side benchmarks).

transformers 5 keeps experts fused in memory: ``gate_up_proj`` [E, 2F, D] (gate rows then up rows) and
``down_proj`` [E, D, F]; on disk they are one tensor per expert (``k2lab.hf.mapping``). Kimi Linear also
differs in memory: ``self_attn.conv1d`` (q | k | v), ``self_attn.forget_gate.*`` and ``mlp.*`` for the MoE
(``k2lab.hf.kimi_linear``). The model class follows ``hf_model_type``. transformers builds no MTP layers
(``DeepseekV3ForCausalLM`` ignores them on load): a model's MTP modules stay out of the bridge.
"""

from __future__ import annotations

import torch

from k2lab.hf import kimi_linear
from k2lab.hf.layout import TRANSFORMERS
from k2lab.hf.mapping import config_to_hf, hf_model_type, hf_tensors
from k2lab.hf.mtp import main_state
from k2lab.models import CausalLM


def _classes(model: CausalLM):
    import transformers  # lazy: optional dependency transformers (dev extra, 1 s to import)

    if hf_model_type(model.config) == kimi_linear.MODEL_TYPE:
        return transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM
    return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM


def transformers_config(model: CausalLM):
    """The ``DeepseekV3Config`` / ``KimiLinearConfig`` equivalent to ``model.config``."""
    config_class, _ = _classes(model)
    data = {key: value for key, value in config_to_hf(model.config).items() if key != "architectures"}
    return config_class(**data)


def transformers_state_dict(model: CausalLM) -> dict[str, torch.Tensor]:
    """Our weights under transformers' in-memory names (experts fused), without the MTP modules."""
    config = model.config.replace(num_nextn_predict_layers=0)
    return dict(hf_tensors(config, main_state(model.state_dict()), TRANSFORMERS))


def to_transformers(model: CausalLM):
    """A transformers model with exactly our weights (same dtype, eval mode).

    transformers always builds shared experts; without any (``n_shared_experts`` 0) they are empty tensors,
    the only ones left out of the state we load.
    """
    _, model_class = _classes(model)
    dtype = next(model.parameters()).dtype
    reference = model_class(transformers_config(model)).to(dtype)
    result = reference.load_state_dict(transformers_state_dict(model), strict=False)
    parameters = reference.state_dict()
    missing = [key for key in result.missing_keys if parameters[key].numel()]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"transformers model mismatch: missing {missing}, unexpected {result.unexpected_keys}"
        )
    return reference.eval()
