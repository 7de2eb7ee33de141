"""Agent Swarm + PARL: CriticalSteps on hand-computed episodes, isolated and concurrent sub-agents, the
reward terms and their annealing, compact PARL training resuming exactly, the language-model path with
frozen sub-agents, an EndpointPolicy orchestrator against `k2lab serve`, and the tiny `ablate parl`."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.episodes.rollout import LocalPolicy, PolicyOutputError, run_episode
from k2lab.cli import main
from k2lab.posttrain import scoring
from k2lab.swarm.orchestrator import ShardWorker, SwarmEnv, critical_steps, swarm_metrics, tokenizer_counter
from k2lab.swarm.parl import (
    CompactOrchestrator,
    LMOrchestrator,
    ParlConfig,
    ParlTrainer,
    _action_message,
    _call,
    lambda_at,
    make_env,
    parl_reward,
    r_finish,
    r_parallel,
)
from k2lab.swarm.tasks import make_task, parse_facts, split_seeds, verify_answer
from tests.conftest import randomize, serving


def seed_with(shards: int) -> int:
    return next(s for s in range(0, 10_000, 2) if len(make_task(s, 2, 24).shards) == shards)


class Plan:
    """A scripted orchestrator: plays (width, chunk) actions ((0, 0) = query a shard itself), then answers."""

    def __init__(self, actions):
        self.actions, self.helper = actions, CompactOrchestrator()

    def respond(self, messages, tools, *, seed=0):
        _, product, missing, facts = self.helper.state_of(messages)
        turn = sum(m["role"] == "assistant" for m in messages)
        if not missing or turn >= len(self.actions):
            return {"role": "assistant", "content": f"The total is {sum(facts.values())}"}, [1]
        return _action_message(self.actions[turn], product, missing, turn), [1]


def nano_model(seed=0):
    return randomize(
        build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=2048)), seed=seed
    )


# ---- tasks and CriticalSteps


def test_tasks_deterministic_splits_disjoint_and_verifier():
    assert make_task(8) == make_task(8)
    train, heldout = split_seeds("train", 50), split_seeds("heldout", 50)
    assert not set(train) & set(heldout) and split_seeds("train", 50) == train
    task = make_task(seed_with(5), 2, 24)
    assert verify_answer(task, f"total: {task.answer}") and not verify_answer(task, f"{task.answer + 1}")


def test_critical_steps_formula():
    stages = [{"main": 1, "subs": [3, 2]}, {"main": 1, "subs": []}, {"main": 1, "subs": [4, 1, 1]}]
    assert critical_steps(stages) == (1 + 3) + (1 + 0) + (1 + 4)


@pytest.mark.parametrize(
    "plan, expected",
    [
        # 4 sub-agents × 3 shards: 3 queries + 1 answer each; then the final answer: (1 + 4) + (1 + 0)
        (
            [(4, 3)],
            dict(critical_steps=6, subagents=4, assigned=4, unfinished=0, tool_calls=8 + 12, success=True),
        ),
        # 2 × 6 shards cannot finish in 4 steps; then two solo queries and the budget ends: (1+4) + 1 + 1
        ([(2, 6), (0, 0), (0, 0)], dict(critical_steps=7, subagents=2, unfinished=2, tool_calls=4 + 8 + 2)),
        # the single agent alone: 3 queries, budget
        ([(0, 0)] * 3, dict(critical_steps=3, subagents=0, assigned=0, tool_calls=3, success=False)),
    ],
)
def test_critical_steps_of_played_episodes(plan, expected):
    env = SwarmEnv(max_turns=3, sub_max_steps=4, min_shards=2, max_shards=24)
    episode = run_episode(env, Plan(plan), seed_with(12)).episode
    metrics = swarm_metrics(episode)
    assert {k: metrics[k] for k in expected} == expected, episode.outcome
    runs = episode.state["runs"]
    assert (
        metrics["total_tokens"] == episode.state["orchestrator_tokens"] + sum(r["tokens"] for r in runs) > 0
    )


# ---- isolation and concurrency


class Recording(ShardWorker):
    def __init__(self, delay_s=0.0):
        super().__init__(delay_s)
        self.calls, self.lock = [], threading.Lock()

    def respond(self, messages, tools, *, seed=0):
        with self.lock:
            self.calls.append(json.loads(json.dumps(messages)))
        return super().respond(messages, tools, seed=seed)


def test_subagents_have_isolated_contexts():
    worker = Recording()
    env = SwarmEnv(worker, max_turns=3, min_shards=2, max_shards=24)
    episode = run_episode(env, Plan([(4, 3)]), seed_with(12)).episode
    assert episode.outcome.success
    tasks = [run["task"] for run in episode.state["runs"]]
    assert len(set(tasks)) == 4
    for messages in worker.calls:
        text = json.dumps(messages)
        assert messages[0]["role"] == "system" and messages[1]["role"] == "user"
        assert "Sum the sales" not in text  # nothing of the orchestrator's context
        assert sum(task in text for task in tasks) == 1  # nor another sub-agent's task
        own = messages[1]["content"].split("shards=")[1].split(",")
        facts = [m["content"].split("=")[0] for m in messages if m["role"] == "tool"]
        assert set(facts) <= set(own)
    for run in episode.state["runs"]:
        assert [m["role"] for m in run["messages"][:2]] == ["system", "user"]


def test_subagents_run_concurrently():
    env = SwarmEnv(ShardWorker(delay_s=0.1), max_turns=3, min_shards=2, max_shards=24)
    episode = env.reset(seed_with(12))
    started = time.perf_counter()
    env.step(
        episode,
        _action_message((4, 2), episode.state["task"]["product"], list(episode.state["task"]["shards"]), 0),
    )
    elapsed = time.perf_counter() - started
    runs = episode.state["runs"]
    assert len(runs) == 4 and all(r["steps"] == 3 for r in runs)  # 2 queries + answer, 0.1 s each
    assert max(r["started"] for r in runs) < min(r["ended"] for r in runs)  # all four overlap in time
    assert elapsed < 0.3 * 4 * 0.75  # serially they would take 1.2 s


# ---- rewards and annealing


def test_compact_orchestrator_factorised_policy_and_greedy_choice():
    orchestrator = CompactOrchestrator(max_turns=3, solo_prior=4.5)
    probs = orchestrator.action_log_probs().exp()
    assert probs.shape == (3 * 5, 21)
    torch.testing.assert_close(probs.sum(-1), torch.ones(15))
    # the start: solo against 20 equally likely fan-outs, as a flat categorical with a solo logit of 4.5
    flat = torch.cat([torch.tensor([4.5]), torch.zeros(20)]).softmax(-1)
    torch.testing.assert_close(probs[0], flat)
    assert orchestrator.greedy_action(0) == 0
    with torch.no_grad():  # 60 % of the mass on fanning out, spread so that no fan-out beats solo alone
        orchestrator.logits[0] = torch.tensor([0.0, math.log(1.5)])
    assert float(orchestrator.action_log_probs().detach()[0, 1:].exp().max()) < 0.4
    assert orchestrator.greedy_action(0) != 0  # a flat argmax over 21 actions would say solo
    with torch.no_grad():
        orchestrator.width_logits[0, 2] = 1.0
        orchestrator.chunk_logits[0, 1] = 1.0
    assert orchestrator.greedy_action(0) == 1 + 2 * 4 + 1  # fan(WIDTHS[2], CHUNKS[1])
    assert orchestrator.actions[orchestrator.greedy_action(0)] == (4, 2)
    single = CompactOrchestrator(max_turns=3, single_agent=True)
    assert single.action_log_probs().shape == (15, 1) and single.greedy_action(4) == 0


def test_reward_terms_and_annealing_schedule():
    assert r_parallel(2, 4) == 0.5 and r_parallel(9, 4) == 1.0 and r_parallel(0, 4) == 0.0
    assert r_finish(3, 4) == 0.75 and r_finish(0, 0) == 1.0  # nothing assigned: nothing unfinished
    assert [lambda_at(i, 0.5, 10, 0.5) for i in (0, 1, 4, 5, 9)] == pytest.approx([0.5, 0.4, 0.1, 0.0, 0.0])
    env = SwarmEnv(max_turns=3, min_shards=2, max_shards=24)
    episode = run_episode(env, Plan([(2, 6), (0, 0), (0, 0)]), seed_with(12)).episode
    terms = parl_reward(episode, 0.5, 0.25, target=4)
    assert terms == pytest.approx({"r_perf": 0.0, "r_parallel": 0.5, "r_finish": 0.0, "reward": 0.25})
    assert isinstance(episode, Episode)


class Script:
    """A scripted orchestrator: turn t sends the tool calls ``turns[t](product)`` (None: a truncated turn),
    then answers with the sum of the facts it has seen."""

    def __init__(self, turns):
        self.turns = turns

    def respond(self, messages, tools, *, seed=0):
        t = sum(m["role"] == "assistant" for m in messages)
        question = next(m["content"] for m in messages if m["role"] == "user")
        product = question.split("product ")[1].split()[0].strip(".,")
        if t >= len(self.turns):
            facts = parse_facts(" ".join(m.get("content") or "" for m in messages if m["role"] == "tool"))
            return {"role": "assistant", "content": f"The total is {sum(facts.values())}"}, [1]
        if self.turns[t] is None:
            raise PolicyOutputError("truncated", [1, 2, 3])
        calls = [_call(tool, f"c{t}_{i}", **kw) for i, (tool, kw) in enumerate(self.turns[t](product))]
        return {"role": "assistant", "content": None, "tool_calls": calls}, [1]


def create(*names):
    return lambda product: [
        ("create_subagent", dict(name=n, system_prompt="x", tools=["query_shard"])) for n in names
    ]


def query(shard):
    return lambda product: [("query_shard", dict(shard=shard, key=product))]


def assign(**shards):
    return lambda product: [
        ("assign_task", dict(agent=n, task=f"key={product} shards={s}")) for n, s in shards.items()
    ]


def test_subagents_created_but_never_assigned_earn_no_r_parallel():
    """K2.5: r_finish "prevents meaningless fan-out that farms a parallelism metric": creating four
    sub-agents and then working alone is serial work, rewarded as serial, below three assigned sub-agents."""
    env = SwarmEnv(max_turns=8, sub_max_steps=5, min_shards=5, max_shards=5)
    shards = [f"s{i:02d}" for i in range(5)]
    play = lambda turns: parl_reward(run_episode(env, Script(turns), 7).episode, 0.5, 0.5, 4)  # noqa: E731
    farmed = play([create("a", "b", "c", "d"), *map(query, shards)])
    serial = play(list(map(query, shards)))
    fanned = play([create("a", "b", "c"), assign(a="s00,s01", b="s02", c="s03,s04")])
    assert farmed == serial == {"r_perf": 1.0, "r_parallel": 0.0, "r_finish": 1.0, "reward": 1.5}
    assert fanned == {"r_perf": 1.0, "r_parallel": 0.75, "r_finish": 1.0, "reward": 1.875}


def test_compact_orchestrator_uses_every_subagent_it_creates():
    """The ablation's policy assigns each sub-agent it creates, so counting used rather than created
    sub-agents leaves its r_parallel (and the ablation's numbers) unchanged."""
    config = ParlConfig(solo_prior=0.0)
    orchestrator, env = CompactOrchestrator.from_config(config), make_env(config)
    rows = [swarm_metrics(run_episode(env, orchestrator, 2 * s, sample_seed=s).episode) for s in range(12)]
    assert sum(r["subagents"] for r in rows) > 12
    assert all(r["subagents_used"] == r["subagents"] for r in rows)


def test_orchestrator_turn_that_never_reaches_the_env_is_a_critical_step():
    env = SwarmEnv(max_turns=4, min_shards=5, max_shards=5)
    episode = run_episode(env, Script([query("s00"), None]), 7).episode
    assert episode.outcome.reason == "truncated" and episode.turns == 2
    assert swarm_metrics(episode)["critical_steps"] == 2


def tiny_config(**kw):
    return ParlConfig(iterations=4, groups_per_iteration=2, group_size=4, eval_every=2, eval_tasks=4,
                      checkpoint_every=1, **kw)  # fmt: skip


def test_trainer_anneals_and_resumes_to_identical_metrics(tmp_path):
    config = tiny_config()
    whole = ParlTrainer(CompactOrchestrator.from_config(config), make_env(config), config, tmp_path / "a")
    expected = whole.run()
    assert [m["lambda_parallel"] for m in expected] == pytest.approx([0.5, 0.25, 0.0, 0.0])
    assert "eval" in expected[1] and "eval" in expected[3]
    first = ParlTrainer(CompactOrchestrator.from_config(config), make_env(config), config, tmp_path / "b")
    first.run(iterations=2)
    (tmp_path / "b" / "metrics.jsonl").open("a").write(json.dumps({"iteration": 2, "stale": 1}) + "\n")
    resumed = ParlTrainer(CompactOrchestrator.from_config(config), make_env(config), config, tmp_path / "b")
    assert resumed.iteration == 2
    resumed.run()
    strip = [{k: v for k, v in m.items() if k != "seconds"} for m in expected]
    assert [{k: v for k, v in m.items() if k != "seconds"} for m in resumed.history()] == strip
    assert torch.equal(resumed.orchestrator.logits, whole.orchestrator.logits)


KILLED_RUN = """
import os, signal, sys
from k2lab.swarm.parl import CompactOrchestrator, ParlConfig, ParlTrainer, make_env
config = ParlConfig.model_validate_json(sys.argv[2])
trainer = ParlTrainer(CompactOrchestrator.from_config(config), make_env(config), config, sys.argv[1])
def hook(metrics):
    if sys.argv[3] == "durable":
        trainer.checkpoints.wait()  # the checkpoint of this iteration is written in the background
    if metrics["iteration"] == 1:
        os.kill(os.getpid(), signal.SIGKILL)
trainer.run(on_iteration=hook)
"""


@pytest.mark.parametrize("when", ["durable", "in-flight"])
def test_sigkilled_trainer_resumes_to_uninterrupted_metrics(tmp_path, when):
    """Killed once iteration 2's checkpoint is on disk, or while it may still be being written (then the
    run resumes from iteration 1's): either way the resumed run logs the uninterrupted run's metrics."""
    config = tiny_config()
    expected = ParlTrainer(
        CompactOrchestrator.from_config(config), make_env(config), config, tmp_path / "a"
    ).run()
    run_dir = tmp_path / "killed"
    process = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(run_dir), config.model_dump_json(), when],
        capture_output=True,
        timeout=60,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr.decode()[-2000:]
    resumed = ParlTrainer(CompactOrchestrator.from_config(config), make_env(config), config, run_dir)
    assert resumed.iteration == 2 if when == "durable" else resumed.iteration in (1, 2)
    resumed.run()
    drop = lambda rows: [{k: v for k, v in m.items() if k != "seconds"} for m in rows]  # noqa: E731
    assert drop(resumed.history()) == drop(expected)


# ---- the language-model path


def test_lm_orchestrator_trains_while_subagents_stay_frozen(small_tokenizer, tmp_path):
    torch.manual_seed(0)
    worker_model = nano_model(seed=1)
    frozen = {k: v.clone() for k, v in worker_model.state_dict().items()}
    orchestrator = LMOrchestrator(nano_model(), small_tokenizer, max_new_tokens=8)
    config = ParlConfig(iterations=2, groups_per_iteration=1, group_size=2, max_turns=2, eval_every=2,
                        eval_tasks=1, lr=1e-2, updates_per_iteration=1, max_shards=6)  # fmt: skip
    workers = LocalPolicy(worker_model, small_tokenizer, max_new_tokens=8)
    env = make_env(config, workers, token_count=tokenizer_counter(small_tokenizer))
    trainer = ParlTrainer(orchestrator, env, config, tmp_path)
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for p in orchestrator.parameters()}  # only the orchestrator is optimised
    assert not trained & {id(p) for p in worker_model.parameters()}
    history = trainer.run()
    assert len(history) == 2 and history[-1]["total_tokens"] > 0 and "eval" in history[-1]
    assert any(m["loss"] is not None for m in history)  # the orchestrator's own tokens were trained on
    assert all(torch.equal(frozen[k], v) for k, v in worker_model.state_dict().items())
    assert not any(p.requires_grad for p in worker_model.parameters())


def test_lm_orchestrator_scores_under_the_enforcer_masks_as_rl_does(small_tokenizer, tmp_path, monkeypatch):
    """The LM orchestrator samples under the tool-call enforcer, so PARL's log π is renormalised over the
    allowed tokens: the trainer scores with ``LocalPolicy.turn_masks`` (RL's ``enforcer_masks``)."""
    torch.manual_seed(0)
    orchestrator = LMOrchestrator(nano_model(), small_tokenizer, max_new_tokens=8)
    config = ParlConfig(iterations=1, groups_per_iteration=1, group_size=2, max_turns=2, eval_every=5,
                        eval_tasks=1, updates_per_iteration=1, max_shards=6)  # fmt: skip
    trainer = ParlTrainer(orchestrator, make_env(config), config, tmp_path)
    calls = []
    real = scoring.turn_logprobs

    def spy(model, turns, batch=8, allowed=None, full=False):
        calls.append((list(turns), allowed))
        return real(model, turns, batch, allowed, full)

    monkeypatch.setattr("k2lab.swarm.parl.turn_logprobs", spy)
    group = trainer._roll_group(0, 0)
    trainer._update([group], [[1.0, 0.0]], 0)
    assert len(calls) == 2 and calls[0][1] is calls[1][1]  # π_old, then one update, the same masks
    turns, allowed = calls[0]
    expected = orchestrator.policy.turn_masks([(r, t) for r in group for t in r.turns if t.completion_ids])
    assert allowed is not None and any(m is not None for m in allowed)
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(allowed, expected, strict=True))
    masked, free = real(orchestrator.model, turns, 8, allowed), real(orchestrator.model, turns, 8)
    assert not all(torch.allclose(a, b) for a, b in zip(masked, free, strict=True))


def test_lm_subagents_run_in_the_swarm(small_tokenizer):
    workers = LocalPolicy(nano_model(seed=2), small_tokenizer, max_new_tokens=12)
    env = SwarmEnv(workers, max_turns=2, sub_max_steps=2, min_shards=2, max_shards=24,
                   token_count=tokenizer_counter(small_tokenizer))  # fmt: skip
    episode = run_episode(env, Plan([(2, 1)]), seed_with(4)).episode
    runs = episode.state["runs"]
    assert len(runs) == 2 and all(r["steps"] >= 1 for r in runs)
    assert all(r["tokens"] > 0 or r["error"] for r in runs)
    assert swarm_metrics(episode)["critical_steps"] >= 2


def test_endpoint_orchestrator_against_k2lab_serve(small_tokenizer):
    pytest.importorskip("openai")
    from k2lab.agentic.episodes.rollout import EndpointPolicy
    from k2lab.serve import Engine
    from k2lab.serve.server import build_app

    engine = Engine(nano_model(), max_batch=4).start()
    try:
        with serving(build_app(engine, small_tokenizer, "nano", api_key="k")) as base:
            policy = EndpointPolicy(f"{base}/v1", "nano", api_key="k", max_new_tokens=24,
                                    tokenizer=small_tokenizer)  # fmt: skip
            env = SwarmEnv(ShardWorker(), max_turns=2, min_shards=2, max_shards=8)
            rollout = run_episode(env, policy, seed=4, sample_seed=1)
        episode = rollout.episode
        assert episode.done and episode.outcome.reason != "policy error", episode.outcome
        assert rollout.turns and swarm_metrics(episode)["critical_steps"] >= 1
    finally:
        engine.shutdown()


# ---- the ablation


def run_cli(argv):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code in (0, None)


def test_ablate_parl_quick_writes_outputs(tmp_path):
    out = tmp_path / "parl"
    run_cli(["ablate", "parl", "--quick", "--out", str(out)])
    results = json.loads((out / "parl.json").read_text())
    assert set(results["arms"]) == {"full", "no_parallel", "no_finish", "single_agent"}
    assert (out / "parl.png").stat().st_size > 0 and "CriticalSteps" in (out / "parl.md").read_text()
    assert results["arms"]["single_agent"]["subagents"] == 0
    first = (out / "parl.json").read_text()
    run_cli(["ablate", "parl", "--quick", "--out", str(out)])  # finished runs are reused
    again = json.loads((out / "parl.json").read_text())
    assert again["arms"]["full"]["success"] == json.loads(first)["arms"]["full"]["success"]


def test_ablate_parl_relaxed_budget_makes_every_task_serially_solvable(tmp_path):
    out = tmp_path / "relaxed"
    run_cli(["ablate", "parl", "--quick", "--max-turns", "26", "--arms", "single_agent", "--out", str(out)])
    results = json.loads((out / "parl.json").read_text())
    assert results["settings"]["base"]["max_turns"] == 26 and "B_main = 26" in (out / "parl.md").read_text()
    assert results["arms"]["single_agent"]["success"] == 1.0  # 24 shards at most: 25 turns suffice
