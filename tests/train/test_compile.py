"""The compiled training step equals eager: hidden states, loss, gradients, QK-Clip maxima and expert loads."""

import copy

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.optim.qk_clip import QKClip
from k2lab.train.compile import compile_decision, compiled
from tests.conftest import randomize


def step(model, forward, ids):
    """Loss, head input and gradients of one forward+backward through ``forward`` (model's parameters),
    called as the trainer calls it: with labels, so eager runs the fused head + loss and the compiled graph
    the plain expression inductor fuses."""
    model.zero_grad(set_to_none=True)
    out = forward(ids[:, :-1], labels=ids[:, 1:], output_hidden=True)
    out.loss.backward()
    return (out.hidden.detach(), out.loss.detach()), {
        name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None
    }


# k3-nano cut to 2 layers (KDA then gated NoPE MLA, one dense and one LatentMoE SiTU-GLU layer, AttnRes
# blocks of 1): every K3 mechanism, and half the inductor build time of the 4-layer preset
PRESETS = {"k2-nano": {}, "k3-nano": {"num_hidden_layers": 2, "mla_layers": [2], "attnres_block_size": 1}}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_compiled_step_equals_eager(preset):
    torch.manual_seed(0)
    eager = randomize(build_model(load_preset(preset, **PRESETS[preset]))).train()
    ours = copy.deepcopy(eager)
    clips = QKClip(eager), QKClip(ours)
    for clip in clips:
        clip.record()
    ids = torch.randint(0, eager.config.vocab_size, (2, 17))
    want_outputs, want_grads = step(eager, eager, ids)
    forward = compiled(ours)
    for _ in range(2):  # the second call runs the cached graph
        got_outputs, got_grads = step(ours, forward, ids)
        torch.testing.assert_close(got_outputs, want_outputs, rtol=1e-4, atol=1e-5)
        assert got_grads.keys() == want_grads.keys()
        for name, grad in want_grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-3, atol=1e-5, msg=name)
        for moe_eager, moe_ours in zip(eager.moe_layers(), ours.moe_layers(), strict=True):
            assert torch.equal(moe_eager.last_expert_counts, moe_ours.last_expert_counts)
    if clips[0].layers:  # QK-Clip's recorded maxima come out of the compiled graph too
        for want, got in zip(clips[0].recorded_maxima(), clips[1].recorded_maxima(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compile_decision():
    assert compile_decision("on", "cpu") == (True, "requested")
    assert compile_decision("off", "cuda") == (False, "requested")
    assert compile_decision("auto", "cuda")[0] is True
    assert compile_decision("auto", "cpu")[0] is False
