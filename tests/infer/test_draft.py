"""Drafts on disk: an EAGLE draft saved beside a model loads back to the same proposals, refuses another
model, and ``find_draft`` prefers the saved draft to the model's own MTP layer."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.errors import CheckpointError
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.draft import DRAFT_DIR, EagleDraft, find_draft, load_draft, save_draft
from k2lab.infer.speculative import speculative_generate
from k2lab.models.mtp import MultiTokenPrediction
from tests.conftest import randomize

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def target(**overrides):
    return randomize(build_model(load_preset("k2-nano", num_nextn_predict_layers=1, **overrides)))


def test_saved_draft_round_trips(tmp_path):
    model = target()
    module = randomize(build_model(load_preset("k2-nano", num_nextn_predict_layers=1)), seed=4).mtp[0]
    save_draft(module, model.config, tmp_path / DRAFT_DIR, {"note": "test"})
    loaded = find_draft(tmp_path, model)
    assert isinstance(loaded, EagleDraft) and loaded.module is not model.mtp[0]
    for key, value in module.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[key], value)
    config = GenerationConfig(max_new_tokens=7)
    out, _ = speculative_generate(model, loaded, PROMPTS, config, num_draft_tokens=2)
    assert out == generate(model, PROMPTS, config)


def test_find_draft_falls_back_to_the_mtp_layer_or_none(tmp_path):
    model = target()
    assert find_draft(tmp_path, model).module is model.mtp[0]
    assert find_draft(tmp_path, randomize(build_model(load_preset("k2-nano")))) is None


def test_a_draft_for_another_model_is_refused(tmp_path):
    model = target()
    save_draft(MultiTokenPrediction(model.config, 1), model.config, tmp_path / "d")
    other = target(hidden_size=32, q_lora_rank=16)
    with pytest.raises(CheckpointError, match="hidden_size 64 != 32"):
        load_draft(tmp_path / "d", other)
    with pytest.raises(CheckpointError, match="k2lab-draft.json"):
        load_draft(tmp_path / "missing", model)
