"""turn_logprobs with shared prefixes: the turns of a group that share their prompt are scored from one
prefix pack, with the log-probs, enforcer-restricted log-probs, distributions and gradients of scoring
every row on its own."""

from __future__ import annotations

import random

import torch

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.rollout import Turn
from k2lab.posttrain import scoring
from k2lab.posttrain.scoring import turn_logprobs
from tests.conftest import randomize


def _group_turns(seed: int = 0) -> list[Turn]:
    """Two groups of four rollouts: each shares a 30-token prompt; some rollouts have a second turn."""
    rng = random.Random(seed)
    turns = []
    for _ in range(2):
        prompt = [rng.randrange(3, 300) for _ in range(30)]
        for _ in range(4):
            first = Turn(prompt, [rng.randrange(3, 300) for _ in range(rng.randrange(2, 8))])
            turns.append(first)
            if rng.random() < 0.5:
                tool = [rng.randrange(3, 300) for _ in range(4)]
                turns.append(Turn(first.prompt_ids + first.completion_ids + tool, [rng.randrange(3, 300)]))
    return turns


def _score(model, turns, share, monkeypatch, **kwargs):
    monkeypatch.setattr(scoring, "MIN_SHARED", 16 if share else None)
    model.zero_grad()
    values = turn_logprobs(model, turns, batch=3, **kwargs)
    sum(v.sum() for v in values).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return [v.detach() for v in values], grads


def test_shared_prefixes_score_as_separate_rows(monkeypatch):
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300))).eval()
    turns = _group_turns()
    generator = torch.Generator().manual_seed(0)
    allowed = [torch.rand(len(t.completion_ids), 300, generator=generator) < 0.3 for t in turns]
    for t, mask in zip(turns, allowed, strict=True):
        mask[torch.arange(len(t.completion_ids)), torch.tensor(t.completion_ids)] = True
    for kwargs in ({}, {"allowed": allowed}, {"full": True}):
        shared, shared_grad = _score(model, turns, True, monkeypatch, **kwargs)
        rows, rows_grad = _score(model, turns, False, monkeypatch, **kwargs)
        for got, want, turn in zip(shared, rows, turns, strict=True):
            assert got.shape[0] == len(turn.completion_ids)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # fp32 rounding of other products: ~5e-7 of the gradient's norm (the full distributions' gradient
        # reaches 500 in some entries, so compare norms, not entries)
        assert float((shared_grad - rows_grad).norm() / rows_grad.norm()) < 1e-5


def test_shared_prefixes_run_fewer_tokens(monkeypatch):
    """The packed forward sees each group's prompt once: count the tokens the model is given."""
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300))).eval()
    turns = _group_turns(1)
    seen = []
    hook = model.embed.register_forward_hook(lambda module, args, out: seen.append(int(args[0].numel())))
    with torch.no_grad():
        for share in (True, False):
            monkeypatch.setattr(scoring, "MIN_SHARED", 16 if share else None)
            seen.clear()
            turn_logprobs(model, turns, batch=100)
            (tokens,) = seen
            if share:
                packed = tokens
    hook.remove()
    assert packed < tokens / 2  # 8 rows of ≥ 32 tokens sharing 30: at most 2 × 30 + 8 × 13 in one pack
