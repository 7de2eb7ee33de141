"""Batched rollouts: ``generate`` with one sampling seed per row, ``LocalPolicy.respond_batch`` and
``run_episodes`` against one-at-a-time ``run_episode`` (equal at batch size 1, deterministic batched, partial
rollouts continued), on a tiny random model with sampling at temperature 1."""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.episodes import rollout as rollout_module
from k2lab.agentic.episodes.rollout import LocalPolicy, Rollout, run_episode, run_episodes
from k2lab.agentic.recipe.mini import RecipeConfig, RecipeToolTasks
from k2lab.agentic.rl.envs import ArithmeticEnv
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.optim import QKClip
from tests.conftest import randomize


@pytest.fixture(scope="module")
def model(small_tokenizer):
    """A random k2-nano whose <|im_end|> logit is boosted: turns end (answers, tool calls, malformed text)
    as well as run out of tokens."""
    model = randomize(build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=4096)))
    with torch.no_grad():
        model.lm_head.weight[small_tokenizer.special_tokens["<|im_end|>"]] *= 3.0
    return model.eval()


def test_row_seeds_sample_each_row_as_it_would_alone(model):
    prompts = [[5, 6, 7], [9, 10, 11], [12, 13, 14]]
    config = GenerationConfig(max_new_tokens=12, temperature=1.0)
    batched = generate(model, prompts, config, row_seeds=[3, 4, 5])
    alone = [
        generate(model, [p], config.model_copy(update={"seed": s}))[0]
        for p, s in zip(prompts, [3, 4, 5], strict=True)
    ]
    assert batched == alone
    assert len({tuple(row) for row in batched}) > 1
    with pytest.raises(ValueError, match="row seeds"):
        generate(model, prompts, config, row_seeds=[1])


def episodes_of(rollouts):
    return [
        (r.episode.to_dict(), [(t.prompt_ids, t.completion_ids, t.iteration) for t in r.turns])
        for r in rollouts
    ]


@pytest.mark.parametrize("make_env", [ArithmeticEnv, lambda: RecipeToolTasks(RecipeConfig(max_turns=3), 0.3)])
def test_run_episodes_at_batch_one_equals_run_episode(model, small_tokenizer, make_env):
    env, seeds = make_env(), list(range(5))
    policy = LocalPolicy(model, small_tokenizer, temperature=1.0, max_new_tokens=24)
    alone = [run_episode(env, policy, s, sample_seed=100 + s) for s in seeds]
    together = run_episodes(
        env, policy, [Rollout(env.reset(s)) for s in seeds], [100 + s for s in seeds], batch_size=1
    )
    assert episodes_of(together) == episodes_of(alone)
    assert len({r.episode.outcome.reason for r in alone}) > 1  # a mix of outcomes, not one path


def test_batched_rollouts_are_deterministic_and_continue_partials(model, small_tokenizer):
    env = RecipeToolTasks(RecipeConfig(max_turns=4), 0.0)
    caller = copy.deepcopy(model)  # one that opens tool-call sections: episodes of several turns
    with torch.no_grad():
        caller.lm_head.weight[small_tokenizer.special_tokens["<|tool_calls_section_begin|>"]] *= 4.0
    policy = LocalPolicy(caller, small_tokenizer, temperature=1.0, max_new_tokens=48)

    def play(limit):
        rollouts = [Rollout(env.reset(s)) for s in range(12)]
        run_episodes(env, policy, rollouts, list(range(12)), token_limit=limit, batch_size=4)
        return rollouts

    assert episodes_of(play(None)) == episodes_of(play(None))
    partial = play(1)  # one turn each, then back partial (a turn is never split)
    assert all(len(r.turns) == 1 for r in partial) and any(r.partial for r in partial)
    run_episodes(env, policy, partial, list(range(6)), batch_size=4, iteration=1)
    assert not any(r.partial for r in partial)
    assert any(t.iteration == 1 for r in partial for t in r.turns)
    # the continued rollouts met the same batches and seeds as the uninterrupted ones: the same episodes
    drop_iteration = lambda rollouts: [(e, [t[:2] for t in turns]) for e, turns in episodes_of(rollouts)]  # noqa: E731
    assert drop_iteration(partial) == drop_iteration(play(None))


def test_a_policy_failure_in_a_batch_fails_only_its_rollout(model, small_tokenizer):
    class Flaky(LocalPolicy):
        def _grammar(self, tools):
            if any(t["function"]["name"] == "broken" for t in tools or []):
                raise RuntimeError("grammar build failed")
            return super()._grammar(tools)

    env, seeds = ArithmeticEnv(), list(range(4))
    policy = Flaky(model, small_tokenizer, temperature=1.0, max_new_tokens=24)
    rollouts = [Rollout(env.reset(s)) for s in seeds]
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object"}}}
    rollouts[1].episode.tools = [*rollouts[1].episode.tools, broken]
    run_episodes(env, policy, rollouts, seeds, batch_size=4)
    assert rollouts[1].episode.outcome.reason == "policy error"
    assert "grammar build failed" in rollouts[1].episode.outcome.details["error"]
    alone = [run_episode(env, policy, s, sample_seed=s) for s in seeds]
    for k in (0, 2, 3):
        assert rollouts[k].episode.outcome.reason != "policy error"
        assert episodes_of([rollouts[k]]) == episodes_of([alone[k]])


def test_prefix_cache_changes_no_rollout(model, small_tokenizer):
    """Tool episodes played with the policy's prefix cache and without it: the same episodes, and the cache
    served what rows share (tool declarations, a group's repeated task) and earlier turns."""
    env = RecipeToolTasks(RecipeConfig(max_turns=3), 0.0)
    cached = LocalPolicy(model, small_tokenizer, temperature=1.0, max_new_tokens=24)
    plain = LocalPolicy(model, small_tokenizer, temperature=1.0, max_new_tokens=24, prefix_cache_bytes=0)

    def play(policy):
        rollouts = [Rollout(env.reset(s)) for s in (0, 0, 1, 2)]  # a group of two samples of task 0
        return run_episodes(env, policy, rollouts, [5, 6, 7, 8], batch_size=4)

    assert episodes_of(play(cached)) == episodes_of(play(plain))
    assert plain.prefix_cache is None
    assert cached.prefix_cache.hit_tokens > 0


def test_dropping_finished_rows_changes_no_rollout(model, small_tokenizer):
    """Tool episodes whose rows leave the batched decode when their turn ends (``drop_finished``) and
    episodes decoded with every row to the end: the same episodes, with the prefix cache in use."""
    env = RecipeToolTasks(RecipeConfig(max_turns=3), 0.3)
    kwargs = dict(temperature=1.0, max_new_tokens=24)
    dropping = LocalPolicy(model, small_tokenizer, drop_finished=True, **kwargs)
    full = LocalPolicy(model, small_tokenizer, **kwargs)

    def play(policy):
        rollouts = [Rollout(env.reset(s)) for s in (0, 0, 1, 2, 3, 4)]
        return run_episodes(env, policy, rollouts, [5, 6, 7, 8, 9, 10], batch_size=6)

    played = play(dropping)
    assert episodes_of(played) == episodes_of(play(full))
    lengths = [len(t.completion_ids) for r in played for t in r.turns]
    assert min(lengths) < max(lengths)  # some rows ended before others: there was something to drop


def test_sampling_rollouts_record_no_max_logits(model, small_tokenizer):
    """A policy's rollouts are not the update's forwards: with QK-Clip recording on (MuonClip turns it on),
    sampling leaves no max logits behind, and recording is on again afterwards."""
    clip = QKClip(model)
    clip.record()
    try:
        policy = LocalPolicy(model, small_tokenizer, temperature=1.0, max_new_tokens=8)
        env = ArithmeticEnv()
        run_episodes(env, policy, [Rollout(env.reset(s)) for s in range(3)], [1, 2, 3])
        assert all(layer.max_logits is None for layer in clip.layers)
        assert all(layer.record_max_logits for layer in clip.layers)
        with torch.no_grad():
            model(torch.tensor([[5, 6, 7]]))
        assert all(layer.max_logits is not None for layer in clip.layers)  # an ordinary forward records
    finally:
        clip.recorded_maxima()
        clip.record(False)


def test_calls_from_several_threads_take_turns_and_answer_as_alone(model, small_tokenizer, monkeypatch):
    """PARL's ``SwarmEnv`` calls its workers from a thread pool. A ``LocalPolicy`` there shares its model,
    prefix cache and the model's mode switches, so its calls take turns: never two ``generate`` at once,
    each reply the one its request gets alone, and the model left in the mode it was in."""
    policy = LocalPolicy(model, small_tokenizer, temperature=1.0, max_new_tokens=12)
    requests = [([{"role": "user", "content": f"what is {s} + {s}?"}], [], s) for s in range(6)]

    def outcome(result):
        prompt, reply = result
        return prompt, (reply.reason, reply.completion_ids) if isinstance(reply, Exception) else reply

    alone = [outcome(policy.respond_batch([request])[0]) for request in requests]
    running, most = [0], [0]
    lock = threading.Lock()
    real = rollout_module.generate

    def watched(*args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)  # room for another thread to come in
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(rollout_module, "generate", watched)
    model.train()
    try:
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda request: outcome(policy.respond_batch([request])[0]), requests))
        assert model.training
    finally:
        model.eval()
    assert most[0] == 1
    assert together == alone
