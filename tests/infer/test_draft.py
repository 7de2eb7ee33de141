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


def _saved_draft(tmp_path, model, vocab=None):
    from k2lab.infer.draft import DRAFT_MANIFEST
    from k2lab.train.draft import draft_module

    module = draft_module(model, fresh=True, seed=0)  # initialised: a bare module's router is torch.empty
    directory = save_draft(module, model.config, tmp_path / "d", vocab=vocab)
    return directory, directory / DRAFT_MANIFEST


def _edit_manifest(manifest, **changes):
    import json

    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **changes}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"config": [1]}, "config \\[1\\] should be a JSON object"),
        ({"config": "x"}, "config 'x' should be a JSON object"),
        ({"version": 2}, "version 2 is not supported"),
        ({"version": "one"}, "version 'one' is not supported"),
        ({"kind": "medusa"}, "kind 'medusa' is unknown"),
        ({"draft_vocab": 7}, "draft_vocab 7 does not match the no ids stored"),
    ],
)
def test_a_draft_manifest_it_cannot_read_is_refused(tmp_path, change, message):
    model = target()
    directory, manifest = _saved_draft(tmp_path, model)
    _edit_manifest(manifest, **change)
    with pytest.raises(CheckpointError, match=message):
        load_draft(directory, model)


def test_draft_vocab_ids_must_match_the_manifest_and_be_1d_integers(tmp_path):
    from safetensors.torch import load_file, save_file

    from k2lab.infer.draft import DRAFT_WEIGHTS, VOCAB_KEY
    from k2lab.infer.draft_vocab import DraftVocab

    model = target()
    directory, manifest = _saved_draft(tmp_path, model, DraftVocab(torch.arange(0, 64, 2), 128))
    assert load_draft(directory, model).vocab is not None
    _edit_manifest(manifest, draft_vocab=31)
    with pytest.raises(CheckpointError, match="draft_vocab 31 does not match the 32 ids stored"):
        load_draft(directory, model)
    _edit_manifest(manifest, draft_vocab=32)
    state = load_file(directory / DRAFT_WEIGHTS)
    state[VOCAB_KEY] = state[VOCAB_KEY].float()
    save_file(state, str(directory / DRAFT_WEIGHTS))
    with pytest.raises(
        CheckpointError, match=f"{VOCAB_KEY} torch.float32 \\(32,\\) should be 1-D integer ids"
    ):
        load_draft(directory, model)


def test_draft_weights_that_do_not_fit_are_a_one_line_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from k2lab.infer.draft import DRAFT_WEIGHTS

    model = target()
    directory, _ = _saved_draft(tmp_path, model)
    state = load_file(directory / DRAFT_WEIGHTS)
    state["enorm.weight"] = torch.ones(3)
    state.pop("hnorm.weight")
    save_file(state, str(directory / DRAFT_WEIGHTS))
    with pytest.raises(
        CheckpointError,
        match="does not match the model config: 1 missing: hnorm.weight; 1 mis-shaped: enorm.weight \\(3,\\)",
    ) as error:
        load_draft(directory, model)
    assert "\n" not in str(error.value)


def test_save_draft_replaces_only_a_new_empty_or_earlier_draft_directory(tmp_path):
    """``save_draft`` swaps in the whole directory: one holding anything but an earlier draft (a model, the
    user's notes, a draft with notes added) is refused and left as it was."""
    model = target()
    module = randomize(build_model(load_preset("k2-nano", num_nextn_predict_layers=1)), seed=4).mtp[0]
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # new, then over the earlier draft
        save_draft(module, model.config, tmp_path / "d")
        save_draft(module, model.config, tmp_path / "empty")
    (tmp_path / "d" / "notes.txt").write_text("mine\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("mine\n")
    (tmp_path / "file").write_text("mine\n")
    for out, message in (
        ("d", "holds other files"),
        ("notes", "holds other files"),
        ("file", "not a directory"),
    ):
        with pytest.raises(CheckpointError, match=message):
            save_draft(module, model.config, tmp_path / out)
    assert (tmp_path / "d" / "notes.txt").is_file() and (tmp_path / "notes" / "notes.txt").is_file()
    assert load_draft(tmp_path / "d", model).module is not None
