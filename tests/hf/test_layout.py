"""Checkpoint layouts (``k2lab.hf.layout``) against the reader's rule: transformers' fused experts."""

from __future__ import annotations

import torch

from k2lab import build_model, load_preset
from k2lab.hf.layout import TRANSFORMERS
from k2lab.hf.mapping import hf_tensors
from tests.conftest import randomize


def test_fused_gate_up_experts_compute_what_ours_compute():
    """transformers' ``DeepseekV3Experts.forward`` (5.x) computes expert e as ``gate, up = linear(x,
    gate_up_proj[e]).chunk(2, dim=-1)``, then ``linear(silu(gate) * up, down_proj[e])`` (its code, re-written
    here in fp64 so the test does not import it: 7 s on 2 CPU cores). Our fused tensors must give our
    experts' SwiGLU."""
    model = randomize(build_model(load_preset("k2-nano")))
    state = model.state_dict()
    disk = dict(hf_tensors(model.config, state, TRANSFORMERS))
    layer = next(
        i for i in range(model.config.num_hidden_layers) if f"layers.{i}.mlp.experts.gate_proj" in state
    )
    prefix, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
    gate, up, down = (state[ours + p].double() for p in ("gate_proj", "up_proj", "down_proj"))
    gate_up, fused_down = disk[prefix + "gate_up_proj"].double(), disk[prefix + "down_proj"].double()
    x = torch.randn(5, gate.shape[-1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    silu = torch.nn.functional.silu
    for e in range(gate.shape[0]):
        g, u = torch.nn.functional.linear(x, gate_up[e]).chunk(2, dim=-1)
        got = torch.nn.functional.linear(silu(g) * u, fused_down[e])
        expected = (silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e].T
        torch.testing.assert_close(got, expected)
