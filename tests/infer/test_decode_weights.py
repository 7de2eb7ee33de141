"""bf16 decode weights: the twin shares all but its matrices, follows in-place updates, and its compiled step
equals eager decoding of the same bf16-rounded weights within fp32 rounding."""

import copy

import pytest
import torch
from torch import nn

from k2lab import build_model, load_preset
from k2lab.errors import K2LabError
from k2lab.hardware import Choice
from k2lab.infer.compiled import decode_step
from k2lab.infer.decode_weights import _TwinLinear, bf16_twin, decode_weights_choice, matrices
from k2lab.nn.experts import RoutedExperts
from tests.conftest import randomize
from tests.infer.test_compiled import decode_logits


def rounded(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose matrices hold their bf16-rounded values (in fp32)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for module, name in matrices(model):
            weight = getattr(module, name)
            weight.copy_(weight.bfloat16().float())
    return model


def test_decode_weights_choice(monkeypatch):
    """Eager and CUDA steps read the model's weights; a compiled CPU step as requested, "auto" per
    ``k2lab.hardware`` (which K2LAB_PRECISION overrides)."""
    monkeypatch.delenv("K2LAB_PRECISION", raising=False)
    for requested in ("auto", "bf16"):
        eager = decode_weights_choice(requested, "cpu", compiled=False)
        assert eager.dtype == torch.float32 and eager.reason == "eager decoding reads the model's own weights"
        assert decode_weights_choice(requested, "cuda", compiled=True).dtype == torch.float32
    assert decode_weights_choice("bf16", "cpu", compiled=True) == Choice(torch.bfloat16, "requested")
    assert decode_weights_choice("fp32", "cpu", compiled=True) == Choice(torch.float32, "requested")
    native = Choice(torch.bfloat16, "CPU with native bf16")
    monkeypatch.setattr("k2lab.hardware.auto_choice", lambda device="cpu": native)
    assert decode_weights_choice("auto", "cpu", compiled=True) == native
    monkeypatch.setenv("K2LAB_PRECISION", "fp32")
    assert decode_weights_choice("auto", "cpu", compiled=True).dtype == torch.float32
    with pytest.raises(K2LabError, match="auto, fp32 or bf16"):
        decode_weights_choice("fp16", "cpu", compiled=True)


def test_twin_shares_all_but_its_matrices_and_follows_updates():
    """k3-nano (KDA, gated MLA, latent MoE, a tied head): the twin's matrices are bf16 copies, its other
    tensors the model's own; the model is untouched; an in-place update is copied at the next call."""
    model = build_model(load_preset("k3-nano", tie_word_embeddings=True)).eval()
    twin = bf16_twin(model)
    assert bf16_twin(model) is twin
    ours = dict(model.named_parameters(remove_duplicate=False))
    theirs = dict(twin.named_parameters(remove_duplicate=False))
    assert ours.keys() == theirs.keys()
    names = {f"{n}.weight" for n, module in model.named_modules() if type(module) is nn.Linear}
    names |= {
        f"{n}.{p}"
        for n, module in model.named_modules()
        if isinstance(module, RoutedExperts)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert names & ours.keys() == names and len(names) > 20
    for name, param in ours.items():
        assert param.dtype == torch.float32 and param.requires_grad
        if name in names:
            assert theirs[name].dtype == torch.bfloat16 and not theirs[name].requires_grad
            torch.testing.assert_close(theirs[name], param.bfloat16(), rtol=0, atol=0)
        else:
            assert theirs[name] is param
    assert twin.embed.weight is model.embed.weight  # tied: the embedding stays the model's fp32 table
    assert all(type(m) is _TwinLinear for m in twin.modules() if isinstance(m, nn.Linear))
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.mul_(2)  # RL's optimizer step, in place
    assert bf16_twin(model) is twin
    torch.testing.assert_close(
        twin.layers[0].attn.q_proj.weight, model.layers[0].attn.q_proj.weight.bfloat16(), rtol=0, atol=0
    )
    head = model.lm_head.weight
    head.data = torch.ones_like(head)  # new storage, no version bump
    assert bf16_twin(model) is twin
    torch.testing.assert_close(twin.lm_head.weight, torch.ones_like(twin.lm_head.weight), rtol=0, atol=0)
    model.train()
    assert bf16_twin(model).training and not bf16_twin(model.eval()).training
    model.double()  # a dtype change: a new twin of the new weights
    assert bf16_twin(model) is not twin


@pytest.mark.parametrize("preset", ["k2-nano", "k3-nano"])
def test_compiled_bf16_step_equals_eager_on_rounded_weights(preset, monkeypatch):
    """The compiled step on bf16 matrices (six one-token steps and a 3-token window, batch 2) gives eager
    decoding's logits for the same bf16-rounded weights within fp32 rounding; fp32 weights are asked for
    and get the model itself."""
    monkeypatch.setattr("k2lab.infer.compiled.CPP_WRAPPER_DEVICES", ())  # guards only: the quicker build
    torch.manual_seed(0)
    model = rounded(randomize(build_model(load_preset(preset))))
    vocab = model.config.vocab_size
    prompt, tokens = torch.randint(0, vocab, (2, 7)), torch.randint(0, vocab, (2, 6))
    with torch.inference_mode():
        step = decode_step(model, "on", "bf16")
        assert decode_step(model, "on", "bf16") is step
        assert decode_step(model, "on", "fp32") is not step and decode_step(model, "off", "bf16") is model
        want = decode_logits(model, model, prompt, tokens)
        got = decode_logits(model, step, prompt, tokens)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_drafts_compile_over_twins():
    """bf16 weights: an EAGLE draft's compiled forward runs over the target's twin (the one its own step runs)
    and its block's, built once; fp32 and eager keep the model's own. A model draft compiles its twin."""
    from k2lab.infer.compiled import built_step
    from k2lab.infer.draft import EagleDraft, ModelDraft

    model = build_model(load_preset("k2-nano", num_nextn_predict_layers=1)).eval()
    draft = EagleDraft(model, model.mtp[0])
    draft.compile("on", "bf16")  # builds nothing until called
    forward = draft._bf16
    assert forward.target is bf16_twin(model) and forward.module is bf16_twin(model.mtp[0])
    assert forward.module.eh_proj.weight.dtype == torch.bfloat16 and built_step(forward) is draft.run
    draft.compile("on", "bf16")
    assert draft._bf16 is forward
    draft.compile("off", "bf16")
    assert draft.run is draft.eager
    small = build_model(load_preset("k2-nano")).eval()
    ModelDraft(small).compile("on", "bf16")
    assert built_step(bf16_twin(small)) is not None and built_step(small) is None
