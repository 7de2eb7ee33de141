"""A draft's reduced vocabulary: the N most frequent tokens, a head over their lm_head rows equal to the full
head there (−∞ elsewhere) and refreshed when the weight changes, greedy speculative output still plain
decoding, the sampled distribution still the target's (chi-square), saved and loaded with the draft."""

from __future__ import annotations

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.errors import CheckpointError, K2LabError
from k2lab.infer import GenerationConfig, generate
from k2lab.infer.draft import DRAFT_DIR, EagleDraft, find_draft, load_draft, save_draft
from k2lab.infer.draft_vocab import DraftVocab, frequent_tokens
from k2lab.infer.speculative import speculative_generate
from tests.conftest import randomize
from tests.infer.test_speculative import chi_square, chi_square_bound, exact_joint

PROMPTS = [[5, 6, 7, 8], [9, 10]]


def target(**overrides):
    return randomize(build_model(load_preset("k2-nano", num_nextn_predict_layers=1, **overrides)))


def test_frequent_tokens_counts_ties_and_ignores_unknown():
    tokens = torch.tensor([[4, 4, 4, 2, 2, -100], [7, 7, 9, -100, -100, -100]])
    assert frequent_tokens(tokens, 10, 3).tolist() == [2, 4, 7]  # 4 ×3, then 2 and 7 ×2
    assert frequent_tokens(tokens, 10, 5).tolist() == [0, 2, 4, 7, 9]  # unseen ids fill up from 0
    for bad in (0, 11):
        with pytest.raises(K2LabError, match="between 1 and the target's vocabulary 10"):
            frequent_tokens(tokens, 10, bad)


def test_bad_vocabularies_are_refused():
    with pytest.raises(K2LabError, match="between 1 and"):
        DraftVocab(torch.arange(5), 4)
    with pytest.raises(K2LabError, match="between 1 and"):
        DraftVocab(torch.zeros(0, dtype=torch.long), 4)
    for ids in ([1, 1, 2], [2, 1], [0, 4]):
        with pytest.raises(K2LabError, match="ascending, distinct"):
            DraftVocab(torch.tensor(ids), 4)


def test_head_over_the_subset_and_its_refresh():
    """The reduced logits equal the full head's at the ids and are −∞ elsewhere; after an in-place change of
    the weight (``_version``) and a dtype change (a new tensor) the rows are taken again."""
    model = target()
    vocab = DraftVocab(torch.tensor([3, 17, 40, 100]), model.config.vocab_size)
    hidden = torch.randn(2, 3, model.config.hidden_size)
    with torch.inference_mode():
        got = vocab.logits(model.lm_head, hidden)
    full = model.lm_head(hidden).detach()
    assert got.shape == full.shape
    assert torch.allclose(got[..., vocab.ids], full[..., vocab.ids], atol=1e-5)
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[vocab.ids] = False
    assert torch.isneginf(got[..., outside]).all()
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert torch.allclose(
        vocab.logits(model.lm_head, hidden)[..., vocab.ids], 2 * full[..., vocab.ids], atol=1e-5
    )
    model.double()
    assert vocab.logits(model.lm_head, hidden.double()).dtype == torch.float64


def test_greedy_with_a_reduced_vocabulary_is_plain_decoding():
    model = target()
    config = GenerationConfig(max_new_tokens=9)
    plain = generate(model, PROMPTS, config)
    common = frequent_tokens(torch.tensor(plain), model.config.vocab_size, 24)
    draft = EagleDraft(model, model.mtp[0], DraftVocab(common, model.config.vocab_size))
    out, stats = speculative_generate(model, draft, PROMPTS, config, num_draft_tokens=3)
    assert out == plain and stats.steps > 0
    with torch.inference_mode():  # the caches speculative_generate left are inference tensors
        drafted, logits = draft.propose(3, lambda step: step.argmax(-1))
    assert torch.isin(drafted, common).all() and torch.isneginf(logits).any()


def test_sampling_with_a_reduced_vocabulary_preserves_the_target_distribution():
    """As ``test_sampling_preserves_the_target_distribution``, with an EAGLE draft that proposes among 5 of
    the 8 tokens: q is zero on the other 3, which only the residual draw can emit."""
    model = target(vocab_size=8)
    draft = EagleDraft(model, model.mtp[0], DraftVocab(torch.tensor([0, 2, 3, 5, 6]), 8))
    prompt = [3, 5, 1, 6]
    joint = exact_joint(model, prompt, 3, 1.0, 1.0)
    samples = []
    for seed in (0, 1):
        config = GenerationConfig(max_new_tokens=3, temperature=1.0, seed=seed)
        out, stats = speculative_generate(model, draft, [prompt] * 2500, config, num_draft_tokens=2)
        assert 0 < stats.accepted < stats.proposed
        samples += [tuple(row) for row in out]
    assert {1, 4, 7} & {token for row in samples for token in row[1:]}  # outside S, reached by residuals
    stat, dof = chi_square(samples, joint)
    assert dof > 10
    assert stat < chi_square_bound(dof), (stat, dof)


def test_the_saved_draft_keeps_its_vocabulary(tmp_path):
    model = target()
    vocab = DraftVocab(torch.tensor([2, 5, 9, 60]), model.config.vocab_size)
    save_draft(model.mtp[0], model.config, tmp_path / DRAFT_DIR, vocab=vocab)
    loaded = find_draft(tmp_path, model)
    assert loaded.vocab is not None and loaded.vocab.ids.tolist() == [2, 5, 9, 60]
    save_draft(model.mtp[0], model.config, tmp_path / DRAFT_DIR)
    assert find_draft(tmp_path, model).vocab is None
    too_big = DraftVocab(torch.tensor([2, 5, 9, 999]), 1000)  # an id beyond this target's vocabulary
    save_draft(model.mtp[0], model.config, tmp_path / "bad", vocab=too_big)
    with pytest.raises(CheckpointError, match="draft.safetensors: draft vocabulary ids"):
        load_draft(tmp_path / "bad", model)
