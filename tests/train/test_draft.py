"""EAGLE draft training: the loss falls on the target's own continuations, the draft is saved beside the
model, and ``k2lab draft train`` / ``k2lab generate`` (speculative with the saved draft) run end to end."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from k2lab import build_model, load_preset
from k2lab.cli import main
from k2lab.errors import CheckpointError, K2LabError
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.draft import DRAFT_DIR, find_draft
from k2lab.infer.speculative import speculative_generate
from k2lab.model_dir import load_model, save_model
from k2lab.train.draft import train_draft
from k2lab.train.draft_config import DraftTrainConfig
from tests.conftest import randomize


@pytest.fixture
def model_dir(tmp_path, small_tokenizer):
    directory = tmp_path / "model"
    config = load_preset("k2-nano", vocab_size=300, num_nextn_predict_layers=1)
    save_model(randomize(build_model(config)), directory)
    small_tokenizer.save(directory / "tokenizer.json")
    return directory


SMALL = dict(
    prompts=8, prompt_len=10, continuation=8, batch_size=8, eval_prompts=1, eval_tokens=6, draft_tokens=2
)


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_training_lowers_the_loss_and_saves_the_draft(model_dir, tiny_corpus, draft_vocab):
    """The whole vocabulary (None: 1024 > V = 300) or the 40 most frequent continuation tokens."""
    config = DraftTrainConfig(
        model=model_dir, data=str(tiny_corpus), steps=10, lr=3e-3, draft_vocab=draft_vocab, **SMALL
    )
    summary = train_draft(config, log=lambda line: None)
    assert summary["loss"] < 0.8 * summary["first_loss"]
    assert summary["ce"] < summary["first_ce"]
    assert summary["draft_vocab"] == (draft_vocab or 300)
    assert 0 < summary["vocab_coverage_held_out"] <= 1 and 0 < summary["vocab_coverage_train"] <= 1
    model = load_model(model_dir)
    draft = find_draft(model_dir, model)
    assert (model_dir / DRAFT_DIR / "summary.json").is_file() and draft.module is not model.mtp[0]
    assert (draft.vocab is None) if draft_vocab is None else (len(draft.vocab) == draft_vocab)
    prompts = [[40, 41, 42], [50, 51, 52, 53]]
    out, _ = speculative_generate(model, draft, prompts, GenerationConfig(max_new_tokens=6), 3)
    assert out == generate(model, prompts, GenerationConfig(max_new_tokens=6))


def test_commands_train_and_use_the_draft(model_dir, tiny_corpus, capsys):
    args = ["draft", "train", "--model", model_dir, "--data", tiny_corpus, "--steps", "2", "--fresh"]
    args += [
        "--set",
        "eval_prompts=1",
        "--prompts",
        "8",
        "--continuation",
        "0",
        "--set",
        "prompt_len=8",
        "--set",
        "eval_tokens=4",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    assert not exit_info.value.code and (model_dir / DRAFT_DIR / "draft.safetensors").is_file()
    generate_args = ["generate", "-c", model_dir, "--prompt", "5 6 7", "--token-ids", "--max-new-tokens", "5"]
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in generate_args])
    assert not exit_info.value.code
    assert "tokens per target forward" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in [*generate_args, "--no-speculative"]])
    assert "tokens per target forward" not in capsys.readouterr().out
    sampled = [*generate_args, "--temperature", "1"]  # sampled on CPU: the draft is left unused unless forced
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in sampled])
    printed = capsys.readouterr().out
    assert "speculative decoding off: sampled" in printed and "tokens per target forward" not in printed
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in [*sampled, "--speculative"]])
    assert "tokens per target forward" in capsys.readouterr().out


def test_a_bad_draft_vocabulary_is_refused(model_dir, tiny_corpus):
    for bad in (0, -3):
        with pytest.raises(ValidationError, match="draft_vocab"):
            DraftTrainConfig(model=model_dir, draft_vocab=bad)
    config = DraftTrainConfig(model=model_dir, data=str(tiny_corpus), draft_vocab=301, **SMALL)
    with pytest.raises(K2LabError, match="between 1 and the target's vocabulary 300, got 301"):
        train_draft(config, log=lambda line: None)


def _snapshot(directory):
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*"))


@pytest.mark.parametrize("where", ["model", "parent", "notes", "file"])
def test_an_out_that_would_lose_files_is_refused_before_any_work(model_dir, tiny_corpus, where):
    """The draft replaces its whole directory: ``--out MODEL`` replaced the model's weights, manifest and
    tokenizer with the draft (exit 0), and a folder of the user's files lost them."""
    notes = model_dir.parent / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine\n")
    (model_dir.parent / "file").write_text("mine\n")
    out = {"model": model_dir, "parent": model_dir.parent, "notes": notes, "file": model_dir.parent / "file"}
    before = _snapshot(model_dir.parent)
    config = DraftTrainConfig(model=model_dir, data=str(tiny_corpus), out=out[where], **SMALL)
    lines = []
    with pytest.raises(CheckpointError, match="holds the model|holds other files|not a directory"):
        train_draft(config, log=lines.append)
    assert not lines and _snapshot(model_dir.parent) == before
    assert (notes / "notes.txt").read_text() == "mine\n"


def test_the_command_refuses_the_model_as_out(model_dir, tiny_corpus, capsys):
    args = ["draft", "train", "--model", model_dir, "--out", model_dir, "--data", tiny_corpus]
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "holds the model" in error
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()


def test_an_earlier_draft_or_an_empty_folder_is_replaced(model_dir, tiny_corpus):
    """New, empty and earlier-draft directories are written (the default MODEL/draft twice, too)."""
    empty = model_dir.parent / "empty"
    empty.mkdir()
    for out in (None, None, empty, empty):
        config = DraftTrainConfig(model=model_dir, data=str(tiny_corpus), out=out, steps=1, **SMALL)
        train_draft(config, log=lambda line: None)
        written = out or model_dir / DRAFT_DIR
        assert sorted(path.name for path in written.iterdir()) == [
            "draft.safetensors",
            "k2lab-draft.json",
            "summary.json",
        ]
    assert find_draft(model_dir, load_model(model_dir)) is not None


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            {"continuation": 247},
            "prompt_len 10 \\+ continuation 247 = 257 tokens exceed the model's context of 256",
        ),
        (
            {"eval_tokens": 300},
            "prompt_len 10 \\+ eval_tokens 300 = 310 tokens exceed the model's context of 256",
        ),
    ],
)
def test_sequences_past_the_context_are_refused(model_dir, tiny_corpus, setting, message):
    """k2-nano's context is 256 tokens: a continuation past it trained the draft on positions the model never
    saw, in silence."""
    config = DraftTrainConfig(model=model_dir, data=str(tiny_corpus), **{**SMALL, **setting})
    lines = []
    with pytest.raises(K2LabError, match=message):
        train_draft(config, log=lines.append)
    assert not lines and not (model_dir / DRAFT_DIR).exists()
