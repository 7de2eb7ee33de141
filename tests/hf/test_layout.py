"""Checkpoint layouts (``k2lab.hf.layout``) against the module that reads them: transformers' fused experts."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.hf.layout import TRANSFORMERS
from k2lab.hf.mapping import hf_tensors
from tests.conftest import randomize

transformers = pytest.importorskip("transformers")


def test_fused_gate_up_experts_compute_what_ours_compute():
    """transformers' ``DeepseekV3Experts`` splits ``gate_up_proj[e] @ x`` with ``chunk(2)`` into (gate, up)
    and ``down_proj[e]`` maps back: loaded with our fused tensors, expert e's SwiGLU equals ours."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    model = randomize(build_model(load_preset("k2-nano")))
    state = model.state_dict()
    disk = dict(hf_tensors(model.config, state, TRANSFORMERS))
    layer = next(
        i for i in range(model.config.num_hidden_layers) if f"layers.{i}.mlp.experts.gate_proj" in state
    )
    prefix, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
    gate, up, down = (state[ours + p] for p in ("gate_proj", "up_proj", "down_proj"))
    E, F, D = gate.shape
    hf_config = transformers.DeepseekV3Config(
        hidden_size=D, moe_intermediate_size=F, n_routed_experts=E, hidden_act="silu"
    )
    experts = DeepseekV3Experts(hf_config)
    experts.gate_up_proj.data.copy_(disk[prefix + "gate_up_proj"])
    experts.down_proj.data.copy_(disk[prefix + "down_proj"])
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
    for e in range(E):
        index = torch.full((5, 1), e)
        got = experts(x, index, torch.ones(5, 1))
        expected = (torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
