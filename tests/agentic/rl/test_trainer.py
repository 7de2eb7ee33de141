"""Joint RL: the K1.5 objective on a hand-computed case, token-level off-policy clipping, the temperature
schedule, budget penalties, rollouts (exact token ids, malformed output, partial rollouts persisted and
continued), the rubric critic, a tiny RL run that writes metrics / checkpoints / a plot, a SIGKILLed run
that resumes to the uninterrupted run's metrics, and EndpointPolicy against `k2lab serve`."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.agentic.episodes.rollout import (
    LocalPolicy,
    PolicyOutputError,
    Rollout,
    load_rollouts,
    parse_reply,
    run_episode,
    save_rollouts,
)
from k2lab.agentic.rl.critic import Preference, RubricCritic
from k2lab.agentic.rl.envs import ArithmeticEnv
from k2lab.agentic.rl.trainer import RLConfig, RLTrainer, rl_sources, temperature_at
from k2lab.cli import main
from k2lab.errors import CheckpointError
from k2lab.model_dir import checkpoint_fingerprint, load_model, save_model
from k2lab.posttrain.objective import budget_penalty, k15_loss
from k2lab.posttrain.scoring import offpolicy_mask, sequence_log_ratio, turn_logprobs, turn_rows
from k2lab.runtime.chat import SECTION_BEGIN, encode_chat, normalize_messages, render_assistant_body
from k2lab.runtime.chat_k3 import with_k3_tokens
from k2lab.runtime.enforcer import pack_token_mask, unpack_token_mask
from k2lab.train.run_checkpoints import list_checkpoints
from tests.conftest import randomize, serving

ROOT = Path(__file__).resolve().parents[3]


def nano_model():
    return randomize(build_model(load_preset("k2-nano", vocab_size=300, max_position_embeddings=2048)))


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, small_tokenizer):
    directory = tmp_path_factory.mktemp("policy")
    save_model(nano_model(), directory)
    small_tokenizer.save(directory / "tokenizer.json")
    return directory


# ---- the math


def test_k15_loss_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.5])
    log_ratios = torch.tensor([0.2, -0.1, 0.0])
    # r̄ = 0.5; terms: (1 − .5 − .5·.2)² = .16, (0 − .5 + .5·.1)² = .2025, (.5 − .5 − 0)² = 0
    expected = (0.16 + 0.2025 + 0.0) / 3
    assert float(k15_loss(rewards, log_ratios, tau=0.5)) == pytest.approx(expected)
    # at θ = θ_old the gradient w.r.t. the log-ratios is −(2τ/K)(r_j − r̄)
    ratios = torch.zeros(3, requires_grad=True)
    k15_loss(rewards, ratios, tau=0.5).backward()
    assert ratios.grad.tolist() == pytest.approx([-1 / 6, 1 / 6, 0.0])


def test_offpolicy_clipping_masks_exactly_the_far_tokens():
    old = torch.tensor([-1.0, -2.0, -3.0, -4.0])
    new = torch.tensor([-1.05, -2.5, -2.9, -6.0], requires_grad=True)
    mask = offpolicy_mask(new, old, threshold=0.2)
    assert mask.tolist() == [True, False, True, False]
    ratio = sequence_log_ratio(new, old, mask)
    assert float(ratio.detach()) == pytest.approx(-0.05 + 0.1)
    ratio.backward()
    assert new.grad.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert offpolicy_mask(new, old, None).all()
    assert float(sequence_log_ratio(new, old, offpolicy_mask(new, old, None)).detach()) == pytest.approx(
        -2.45 + 0.0
    )


def test_turns_of_one_conversation_share_a_row_with_the_same_logprobs():
    """A turn whose prompt extends the previous turn's prompt + completion is read from that row; the
    log-probs equal those of scoring every turn in its own forward."""
    from k2lab.agentic.episodes.rollout import Turn

    model = nano_model().eval()
    first = Turn([5, 6, 7], [8, 9])
    second = Turn([5, 6, 7, 8, 9, 10, 11], [12, 13, 14])  # extends first
    other = Turn([5, 6, 20], [21])  # same start, different continuation: a row of its own
    third = Turn([5, 6, 20, 21, 22], [23])  # extends other
    turns = [first, second, other, third]
    rows, places = turn_rows(turns)
    assert rows == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 20, 21, 22, 23]]
    assert places == [(0, 3), (0, 7), (1, 3), (1, 5)]
    with torch.no_grad():
        merged = turn_logprobs(model, turns, batch=2)
        distributions = turn_logprobs(model, turns, batch=2, full=True)
        alone = [turn_logprobs(model, [turn])[0] for turn in turns]
    for got, want, turn in zip(merged, alone, turns, strict=True):
        assert got.shape == (len(turn.completion_ids),)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
        with torch.no_grad():  # the reference: the full [T, V] logits of the turn alone
            full = model(ids).logits[0, :-1].log_softmax(-1)
        reference = full[len(turn.prompt_ids) - 1 :]
        torch.testing.assert_close(
            got, reference.gather(-1, ids[0, len(turn.prompt_ids) :, None]).squeeze(-1), rtol=1e-5, atol=1e-5
        )
        distribution = distributions[turns.index(turn)]  # full=True: the whole next-token distribution
        assert distribution.shape == (len(turn.completion_ids), full.shape[-1])
        torch.testing.assert_close(distribution, reference, rtol=1e-5, atol=1e-5)

    class FullLogits(torch.nn.Module):  # a model whose forward has no logits_mask: the full-logits path
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None):
            return self.inner(input_ids, attention_mask=attention_mask)

    with torch.no_grad():
        unmasked = turn_logprobs(FullLogits(model), turns, batch=2)
    for got, want in zip(unmasked, merged, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prompt ids"):
        turn_rows([Turn([], [1])])


def test_temperature_schedule():
    values = [temperature_at(i, start=1.0, floor=0.3, decay=0.5) for i in range(5)]
    assert values == pytest.approx([1.0, 0.5, 0.3, 0.3, 0.3])  # max(0.3, 1.0 · 0.5^i)
    assert temperature_at(3, 1.2, 0.0, 0.9) == pytest.approx(1.2 * 0.729)


def test_a_ptx_corpus_without_a_ptx_weight_is_refused():
    with pytest.raises(ValueError, match="ptx_weight is 0, so no PTX loss would be trained"):
        RLConfig(ptx_data="corpus")
    assert RLConfig(ptx_data="corpus", ptx_weight=0.1).ptx_data == "corpus"
    assert RLConfig(ptx_weight=0.1).ptx_data is None  # the embedded corpus


def test_budget_penalty_numbers():
    assert budget_penalty(10, 8, 0.1) == pytest.approx(0.1 * 2 / 8)
    assert budget_penalty(20, 8, 0.1) == pytest.approx(0.1)  # capped at λ
    assert budget_penalty(8, 8, 0.1) == 0.0
    assert budget_penalty(500, None, 0.1) == 0.0
    assert budget_penalty(12, 8, 0.0) == 0.0


# ---- rollouts


class Scripted:
    """Calls calculate on the question, then answers (correctly when the sample seed's group is odd)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.temperature = tokenizer, 1.0

    def encode_prompt(self, messages, tools):
        return encode_chat(self.tokenizer, messages, tools or None, add_generation_prompt=True).ids

    def respond(self, messages, tools, *, seed=0):
        if messages[-1]["role"] == "user":
            expression = messages[-1]["content"].removeprefix("What is ").removesuffix("?")
            arguments = json.dumps({"expression": expression})
            function = {"name": "calculate", "arguments": arguments}
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": function}],
            }
        else:
            message = {
                "role": "assistant",
                "content": messages[-1]["content"] if (seed // 1000) % 2 else "no idea",
            }
        body = render_assistant_body(normalize_messages([message])[0])
        return message, self.tokenizer.encode(body + "<|im_end|>")


def test_partial_rollout_persisted_and_continued(small_tokenizer, tmp_path):
    env, policy = ArithmeticEnv(), Scripted(small_tokenizer)
    rollout = run_episode(env, policy, seed=1, token_limit=1, iteration=0, sample_seed=1)
    assert rollout.partial and len(rollout.turns) == 1 and rollout.episode.tool_calls == 1
    assert rollout.turns[0].prompt_ids == policy.encode_prompt(env.reset(1).messages, env.reset(1).tools)
    path = save_rollouts(tmp_path / "partial.jsonl", [rollout.to_dict()])
    restored = Rollout.from_dict(load_rollouts(path)[0])
    assert restored.to_dict() == rollout.to_dict()
    run_episode(env, policy, seed=1, token_limit=1, rollout=restored, iteration=1, sample_seed=1)
    assert not restored.partial and restored.episode.outcome.reason == "solved"
    assert [t.iteration for t in restored.turns] == [0, 1]
    assert restored.episode.completion_tokens == sum(len(t.completion_ids) for t in restored.turns)


def test_malformed_output_ends_episode_with_reason(small_tokenizer):
    with pytest.raises(PolicyOutputError) as error:
        parse_reply("<|tool_calls_section_begin|><|tool_call_begin|>nope<|tool_calls_section_end|>")
    assert error.value.reason == "malformed"
    with pytest.raises(PolicyOutputError):
        parse_reply("hi <|im_user|> there")

    class Broken:
        def respond(self, messages, tools, *, seed=0):
            raise PolicyOutputError("malformed", [5, 6, 7], "bad section")

    rollout = run_episode(ArithmeticEnv(), Broken(), seed=1)
    assert rollout.episode.outcome.reason == "malformed" and rollout.episode.reward == 0.0
    assert rollout.turns[0].completion_ids == [5, 6, 7] and rollout.episode.completion_tokens == 3


def test_local_policy_records_exact_token_ids(small_tokenizer):
    torch.manual_seed(0)
    policy = LocalPolicy(nano_model(), small_tokenizer, temperature=1.0, max_new_tokens=8)
    env = ArithmeticEnv()
    rollout = run_episode(env, policy, seed=1, sample_seed=3)
    again = run_episode(env, policy, seed=1, sample_seed=3)
    assert rollout.to_dict() == again.to_dict()  # deterministic in the seeds
    episode = rollout.episode
    assert episode.done and episode.outcome.reason in {"truncated", "malformed", "wrong answer", "solved"}
    first = rollout.turns[0]
    start = env.reset(1)
    assert (
        first.prompt_ids
        == encode_chat(small_tokenizer, start.messages, start.tools, add_generation_prompt=True).ids
    )
    assert 0 < len(first.completion_ids) <= 8 and episode.completion_tokens >= len(first.completion_ids)


def test_rubric_critic_win_rates_and_refresh(small_tokenizer):
    critic = RubricCritic(nano_model(), small_tokenizer, lr=3e-3)
    rates = critic.win_rates("hello there", ["how are you", "Paris", "celsius days"])
    assert all(0 <= r <= 1 for r in rates) and sum(rates) == pytest.approx(1.5)  # Σ_j w_j = K/2
    preference = [Preference("What is 2+3?", "5", "describe")]
    before = float(critic.loss(preference).detach())
    critic.refresh(preference, steps=5)
    assert float(critic.loss(preference).detach()) < before
    assert critic.prefer_a("What is 2+3?", "5", "describe") > 0.5


def test_failed_open_ended_rollouts_get_no_critic_reward(small_tokenizer, tmp_path):
    """Failures fail their trajectory (reward 0): the critic's win rates are taken among the members that
    answered; a truncated one got ≈ 0.5 when its empty text was judged beside them."""
    from k2lab.agentic.rl.envs import OpenQAEnv
    from k2lab.agentic.rl.trainer import Group

    config = RLConfig(group_size=4, envs=["open_qa"], critic="self", budget_penalty=0)
    trainer = RLTrainer(nano_model(), small_tokenizer, config, tmp_path, critic_model=nano_model())
    env, members = OpenQAEnv(), []
    for text in ("Paris is the capital of France.", "The capital is Paris.", None, ""):
        episode = env.reset(5)
        if text is None:
            episode.finish(False, "truncated", reward=0.0)
        else:
            env.step(episode, {"role": "assistant", "content": text})
        members.append(Rollout(episode))
    rewards, _ = trainer._score(Group("0-0", 5, members))
    assert rewards[2:] == [0.0, 0.0]  # truncated, empty answer
    assert sum(rewards[:2]) == pytest.approx(1.0) and all(0 < r < 1 for r in rewards[:2])  # Σ w_j = K/2
    lone = Group("0-1", 5, [members[0], members[2]])
    assert trainer._score(lone)[0] == [0.5, 0.0]


def test_a_k3_critic_judges_in_k3s_format(small_tokenizer):
    """A K3-family critic with the XTML tokens reads the rubric prompt in K3's markup, as its rollouts and SFT
    render, and answers in the response channel (thinking off), so "A" / "B" is its next token."""
    tokenizer = with_k3_tokens(small_tokenizer)
    model = randomize(build_model(load_preset("k3-nano", vocab_size=tokenizer.vocab_size)))
    critic = RubricCritic(model, tokenizer)
    assert critic.chat_format.family == "k3" and not critic.chat_format.thinking
    assert critic.reserved[-4:] == ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
    rows = []
    model.forward = lambda ids, **kw: rows.append(ids) or type("Out", (), {"logits": torch.zeros(1, 400)})
    critic.prefer_a("2+3?", "5<|open|>", "describe")  # a stray markup token in an answer is dropped
    text = tokenizer.decode(rows[0][0].tolist())
    assert text.startswith('<|open|>message role="user"<|sep|>Compare two answers')
    assert text.endswith('Answer A: 5\n\nAnswer B: describe\n\nWhich answer is better? Reply A or B.'
                         '<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
                         '<|open|>response<|sep|>')  # fmt: skip
    assert RubricCritic(nano_model(), small_tokenizer).chat_format.family == "k2"  # K2: as before


# ---- training


def rl_args(policy_dir, out, **extra):
    args = {
        "--checkpoint": policy_dir,
        "--out": out,
        "--iterations": 2,
        "--group": 2,
        "--prompts": 2,
        "--envs": "arithmetic,instruction,open_qa",
        "--max-new-tokens": 6,
        "--offpolicy-clip": 0.5,
        "--critic": "self",
        "--threads": 2,
        **extra,
    }
    return [str(x) for item in args.items() for x in item]


def cli(args: list[str]) -> None:
    """``k2lab ARGS`` in this process (typer exits with SystemExit(0) on success)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 0


def strip_time(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.endswith("seconds")} for row in rows]


def test_rl_run_writes_metrics_checkpoints_and_resumes_after_sigkill(policy_dir, tmp_path):
    corpus = tmp_path / "ptx"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"p{i}.txt").write_text("hello there, how are you? " * 20)
    extra = {"--ptx-data": corpus, "--ptx-weight": 0.1}
    reference = tmp_path / "reference"
    cli(["rl", *rl_args(policy_dir, reference, **extra)])
    metrics = strip_time(reference / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["temperature"] == pytest.approx(max(0.3, 0.9 ** m["iteration"]))
        assert m["episodes"] == 4 and m["ptx_loss"] > 0 and m["loss"] is not None
        assert sum(m["failures"].values()) + round(m["success"] * 4) == 4
        assert {"mean_reward", "tool_calls_per_task", "tokens_per_task", "per_env"} <= set(m)
    assert [s for s, _ in list_checkpoints(reference)] == [2, 1]
    assert (reference / "rl_metrics.png").stat().st_size > 0
    assert (reference / "partial_rollouts.jsonl").is_file()
    assert load_model(reference / "model") is not None

    # the same run in a subprocess, SIGKILLed once iteration 1's checkpoint (written in the background)
    # is durable, then resumed here
    killed = tmp_path / "killed"
    script = (
        "import os, signal, sys\n"
        "from k2lab.cli import main\n"
        "from k2lab.agentic.rl import trainer as rl\n"
        "original = rl.RLTrainer.run\n"
        "def run(self, iterations=None, on_iteration=None):\n"
        "    def kill(m):\n"
        "        self.checkpoints.wait()\n"
        "        if m['iteration'] == 0: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return original(self, iterations, kill)\n"
        "rl.RLTrainer.run = run\n"
        "main(sys.argv[1:])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [sys.executable, "-c", script, "rl", *rl_args(policy_dir, killed, **extra)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert [s for s, _ in list_checkpoints(killed)] == [1]
    assert strip_time(killed / "metrics.jsonl") == metrics[:1]
    cli(["rl", *rl_args(policy_dir, killed, **extra)])
    assert strip_time(killed / "metrics.jsonl") == metrics
    resumed, uninterrupted = load_model(killed / "model"), load_model(reference / "model")
    for (name, a), (_, b) in zip(
        resumed.state_dict().items(), uninterrupted.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resuming_from_another_checkpoint_is_refused(policy_dir, small_tokenizer, tmp_path):
    """`rl -c policy --out R` then `rl -c other --out R` resumed the first run's weights with the other
    tokenizer (and copied it into R/model); the source checkpoint, its tokenizer and the critic's source
    are now settings a resumed run must share."""
    import shutil

    from k2lab.agentic.rl.trainer import run_rl

    config = RLConfig(iterations=1, group_size=2, groups_per_iteration=1, envs=["arithmetic"],
                      max_new_tokens=2, updates_per_iteration=1)  # fmt: skip
    run_rl(policy_dir, tmp_path / "run", config, threads=1)
    moved = shutil.copytree(policy_dir, tmp_path / "moved")  # the same checkpoint elsewhere resumes
    run_rl(moved, tmp_path / "run", config.model_copy(update={"iterations": 2}), threads=1)
    other = shutil.copytree(policy_dir, tmp_path / "other")
    (other / "tokenizer.json").write_text(json.dumps(json.loads((other / "tokenizer.json").read_text())))
    with pytest.raises(
        CheckpointError, match=r"other settings \(source_checkpoint_fingerprint: '[0-9a-f]+' then"
    ):
        run_rl(other, tmp_path / "run", config.model_copy(update={"iterations": 3}), threads=1)
    sources = rl_sources(policy_dir, "self")
    assert sources == rl_sources(moved, "self") and sources["critic_checkpoint_fingerprint"] == "self"
    assert rl_sources(policy_dir, "none")["critic_checkpoint_fingerprint"] is None
    assert rl_sources(policy_dir, str(other))["critic_checkpoint_fingerprint"] == checkpoint_fingerprint(
        other
    )
    before, model = checkpoint_fingerprint(moved), load_model(moved)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_model(model, moved)  # weights trained further, the same config and tokenizer
    assert checkpoint_fingerprint(moved) != before


def test_a_run_saved_without_sources_still_resumes(small_tokenizer, tmp_path):
    """Checkpoints written before the sources were recorded hold none: unknown, not a difference."""
    config = RLConfig(envs=["arithmetic"])
    RLTrainer(nano_model(), small_tokenizer, config, tmp_path).save_checkpoint()
    sources = {"source_checkpoint_fingerprint": "ab", "critic_checkpoint_fingerprint": None}
    resumed = RLTrainer(nano_model(), small_tokenizer, config, tmp_path, sources=sources)
    assert resumed.settings() == config.model_dump(mode="json") | sources
    resumed.save_checkpoint()
    with pytest.raises(CheckpointError, match="source_checkpoint_fingerprint: 'ab' then, 'cd' now"):
        RLTrainer(
            nano_model(),
            small_tokenizer,
            config,
            tmp_path,
            sources=sources | {"source_checkpoint_fingerprint": "cd"},
        )


def test_partial_rollouts_span_iterations_and_survive_resume(policy_dir, small_tokenizer, tmp_path):
    config = RLConfig(
        iterations=2,
        group_size=2,
        groups_per_iteration=1,
        envs=["arithmetic"],
        token_limit=1,
        max_new_tokens=8,
        updates_per_iteration=1,
    )

    def trainer(out):
        return RLTrainer(
            load_model(policy_dir), small_tokenizer, config, out, policy=Scripted(small_tokenizer)
        )

    first = trainer(tmp_path / "run").run(iterations=1)[0]
    assert first["groups"] == 0 and first["pending_groups"] == 1 and first["loss"] is None
    pending = load_rollouts(tmp_path / "run" / "partial_rollouts.jsonl")
    assert len(pending) == 1 and all(not m["episode"]["done"] for m in pending[0]["members"])
    resumed = trainer(tmp_path / "run")  # resumes from the checkpoint of iteration 1, pending group included
    assert resumed.iteration == 1 and len(resumed.pending) == 1
    second = resumed.run()[0]
    # the continued group finishes (trained on its second turns only); the new one parks after its tool call
    assert second["groups"] == 1 and second["episodes"] == 2 and second["pending_groups"] == 1
    assert second["tool_calls_per_task"] == 1.0 and second["loss"] is not None
    reasons = set(second["failures"]) | ({"solved"} if second["success"] else set())
    assert reasons <= {"solved", "wrong answer"}


# ---- the OpenAI-compatible endpoint


def test_endpoint_policy_against_k2lab_serve(small_tokenizer):
    pytest.importorskip("openai")
    from k2lab.agentic.episodes.rollout import EndpointPolicy
    from k2lab.serve import Engine
    from k2lab.serve.server import build_app

    engine = Engine(nano_model(), max_batch=2).start()
    try:
        with serving(build_app(engine, small_tokenizer, "nano", api_key="k")) as base:
            policy = EndpointPolicy(
                f"{base}/v1", "nano", api_key="k", max_new_tokens=8, tokenizer=small_tokenizer
            )
            rollout = run_episode(ArithmeticEnv(), policy, seed=1, sample_seed=2)
        episode = rollout.episode
        assert episode.done and episode.outcome.reason != "policy error", episode.outcome
        assert rollout.turns and rollout.turns[0].prompt_ids and episode.completion_tokens > 0
    finally:
        engine.shutdown()


def test_update_raises_the_better_response_of_a_group(small_tokenizer, tmp_path):
    """One K1.5 step at θ = θ_old is a group-relative policy gradient: log π(y_better) − log π(y_worse) grows."""
    from k2lab.agentic.episodes.env import Episode
    from k2lab.agentic.episodes.rollout import Turn
    from k2lab.agentic.rl.trainer import Group
    from k2lab.optim.grouping import OptimizerConfig

    config = RLConfig(envs=["arithmetic"], updates_per_iteration=1, optimizer=OptimizerConfig(lr=2e-2))
    trainer = RLTrainer(nano_model(), small_tokenizer, config, tmp_path)
    prompt = small_tokenizer.encode(
        "<|im_user|>user<|im_middle|>hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    turns = [Turn(prompt, small_tokenizer.encode(text), 0) for text in ("hello there", "celsius days")]
    members = []
    for turn in turns:
        episode = Episode(env="arithmetic", seed=0, task_id="t", messages=[])
        episode.finish(True, "solved")
        members.append(Rollout(episode, [turn]))
    with torch.no_grad():
        before = [float(x.sum()) for x in trainer.token_logprobs(turns)]
    losses = trainer._update([Group("g", 0, members)], [[1.0, 0.0]], iteration=0)
    with torch.no_grad():
        after = [float(x.sum()) for x in trainer.token_logprobs(turns)]
    assert losses["loss"] == pytest.approx(0.25)  # (1/2)·((1 − .5)² + (0 − .5)²) with zero log-ratios
    assert (after[0] - before[0]) - (after[1] - before[1]) > 0


def test_a_nan_update_is_refused_before_the_optimizer_step(small_tokenizer, tmp_path, monkeypatch):
    """An RL update whose loss is NaN (as a diverging policy's would be) raises and leaves the weights."""
    from k2lab.agentic.episodes.env import Episode
    from k2lab.agentic.episodes.rollout import Turn
    from k2lab.agentic.rl.trainer import Group
    from k2lab.train.divergence import TrainingDiverged

    trainer = RLTrainer(nano_model(), small_tokenizer, RLConfig(envs=["arithmetic"]), tmp_path)
    prompt = small_tokenizer.encode(
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    episode = Episode(env="arithmetic", seed=0, task_id="t", messages=[])
    episode.finish(True, "solved")
    members = [Rollout(episode, [Turn(prompt, small_tokenizer.encode(text), 0)]) for text in ("a", "b")]
    original = RLTrainer._rl_loss
    monkeypatch.setattr(RLTrainer, "_rl_loss", lambda self, *a: (original(self, *a)[0] * math.nan, 0))
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(
        TrainingDiverged, match="diverged at iteration 0: loss nan.*no checkpoint was written"
    ):
        trainer._update([Group("g", 0, members)], [[1.0, 0.0]], iteration=0)
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())


# ---- the enforced policy's log-probs


def test_logprobs_over_allowed_tokens_hand_computed():
    """log π_A(y_t) = z_t[y_t] − log Σ_{v∈A_t} exp z_t[v]; a None mask (or an all-true one) is the plain
    log-softmax."""
    from k2lab.agentic.episodes.rollout import Turn

    model = nano_model().eval()
    turns = [Turn([5, 6, 7], [8, 9, 10]), Turn([5, 6, 7, 8, 9, 10, 11], [12, 13]), Turn([3, 4], [40])]
    vocab = model.config.vocab_size
    allowed = []
    for turn in turns:
        mask = torch.zeros(len(turn.completion_ids), vocab, dtype=torch.bool)
        for position, token in enumerate(turn.completion_ids):
            mask[position, [token, 100 + position, 200]] = True
        allowed.append(mask)
    allowed[2] = None
    with torch.no_grad():
        got = turn_logprobs(model, turns, batch=2, allowed=allowed)
        plain = turn_logprobs(model, turns, batch=2)
        everything = turn_logprobs(
            model, turns, 2, [torch.ones(len(t.completion_ids), vocab, dtype=torch.bool) for t in turns]
        )
    for turn, mask, value in zip(turns[:2], allowed[:2], got[:2], strict=True):
        ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(turn.prompt_ids) - 1 : -1]
        expected = [
            logits[p, token] - torch.logsumexp(logits[p][mask[p]], -1)
            for p, token in enumerate(turn.completion_ids)
        ]
        torch.testing.assert_close(value, torch.stack(expected), rtol=1e-5, atol=1e-5)
        assert bool((value > plain[turns.index(turn)]).all())  # renormalising over fewer tokens raises each
    torch.testing.assert_close(got[2], plain[2])
    with torch.no_grad():
        packed = turn_logprobs(model, turns, 2, [m if m is None else pack_token_mask(m) for m in allowed])
    for a, b in zip(packed, got, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(everything, plain, strict=True):
        torch.testing.assert_close(a, b)


def test_enforcer_masks_replay_what_generation_applied(small_tokenizer, monkeypatch, tmp_path):
    """``LocalPolicy.allowed_tokens`` replays the tool-call enforcer over a completion and gets the mask
    generation applied at every position; the trainer scores with it unless ``enforced_logprobs`` is off."""
    from k2lab.runtime.enforcer import ToolCallConstraint

    applied: list[torch.Tensor | None] = []
    original = ToolCallConstraint.mask

    def recording(self, logits):
        applied.append(self.allowed_tokens())
        original(self, logits)

    monkeypatch.setattr(ToolCallConstraint, "mask", recording)
    policy = LocalPolicy(nano_model(), small_tokenizer, temperature=1.0, max_new_tokens=24)
    env = ArithmeticEnv()
    section = small_tokenizer.special_tokens[SECTION_BEGIN]
    for sample_seed in range(400):  # the first sample whose first turn opens a tool-call section
        applied.clear()
        rollout = run_episode(env, policy, seed=3, sample_seed=sample_seed)
        turn = rollout.turns[0]
        if section in turn.completion_ids[:-2]:
            break
    else:
        pytest.fail("no sample opened a tool-call section")
    tools = rollout.episode.tools
    assert tools
    generated = applied[: len(turn.completion_ids)]
    packed = policy.allowed_tokens(tools, turn.completion_ids)
    assert packed is not None
    vocab = policy.model.config.vocab_size
    assert packed.dtype == torch.uint8 and packed.shape == (len(turn.completion_ids), -(-vocab // 8))
    replayed = unpack_token_mask(packed, vocab)
    assert not bool(replayed[turn.completion_ids.index(section) + 1 :].all())  # the grammar constrained
    for position, mask in enumerate(generated):
        want = torch.ones(replayed.shape[1], dtype=torch.bool) if mask is None else mask.clone()
        want[turn.completion_ids[position]] = True
        assert torch.equal(replayed[position], want), position
    trainer = RLTrainer(
        policy.model, small_tokenizer, RLConfig(envs=["arithmetic"]), tmp_path / "on", policy=policy
    )
    assert trainer.enforcer_masks([(rollout, turn)])[0] is not None
    off = RLConfig(envs=["arithmetic"], enforced_logprobs=False)
    assert (
        RLTrainer(policy.model, small_tokenizer, off, tmp_path / "off", policy=policy).enforcer_masks(
            [(rollout, turn)]
        )
        is None
    )


def test_iteration_report_says_when_nothing_was_trained():
    """Every rollout failing as context overflow trained nothing, and the run printed only "RL done"."""
    from k2lab.agentic.rl.trainer import iteration_report

    metrics = {"iteration": 0, "mean_reward": 0.0, "success": 0.0, "episodes": 2, "groups": 1, "signal_groups": 0,
               "trained_tokens": 0, "seconds": 0.5, "failures": {"context overflow": 2}}  # fmt: skip
    line = iteration_report(metrics, 3)
    assert (
        line.startswith("iteration 1/3: mean reward 0.0")
        and "2 episodes, 0 of 1 groups with unequal rewards, 0 tokens trained" in line
    )
    assert line.endswith("nothing trained: no episode produced a completion (failures: context overflow 2)")
    trained = iteration_report({**metrics, "trained_tokens": 1234, "failures": {}}, 3)
    assert "1,234 tokens trained" in trained and "nothing trained" not in trained
    assert "nothing trained" not in iteration_report({**metrics, "episodes": 0}, 3)  # groups still pending


@pytest.mark.parametrize("field", ["temperature_start", "temperature_floor"])
def test_a_temperature_that_is_not_finite_is_refused(field):
    """An infinite sampling temperature passed gt=0 and sampled uniform noise."""
    with pytest.raises(ValueError, match="finite number"):
        RLConfig(**{field: math.inf})


def test_a_floor_above_the_start_temperature_is_refused():
    """--temperature-floor 2 with T_0 = 1 sampled at 2.0 from the first iteration: the "decay" went up."""
    with pytest.raises(ValueError, match="temperature_floor=2.0 is above temperature_start=1.0"):
        RLConfig(temperature_floor=2.0)
    assert (
        RLConfig(temperature_start=0.2).temperature_floor == 0.2
    )  # the default 0.3 floor follows a low start
    assert (
        RLConfig(temperature_start=0.5, temperature_floor=0.5).temperature_floor == 0.5
    )  # equal: a constant T


@pytest.mark.parametrize("field", ["tau", "budget_penalty", "ptx_weight"])
def test_a_loss_weight_that_is_not_finite_is_refused(field):
    """--tau inf ended in "training diverged ... lower the learning rate"."""
    with pytest.raises(ValueError, match=f"{field}\n  Input should be a finite number"):
        RLConfig(**{field: math.inf})


def test_bad_inputs_are_refused_before_the_output_directory_is_claimed(small_tokenizer, tmp_path, capsys):
    """`k2lab rl --envs nope` (or a missing critic / PTX corpus, or a wrong --env-weights count) left a
    run.json in --out, and the next command there was told it held a `k2lab rl` run."""
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        RLConfig(envs=["arithmetic", "nope"])
    with pytest.raises(ValueError, match="env_weights gives 1 weights for 2 environments"):
        RLConfig(envs=["arithmetic", "coding"], env_weights=[1.0])
    model = save_model(build_model(load_preset("k2-nano", vocab_size=300)), tmp_path / "m")
    small_tokenizer.save(model / "tokenizer.json")
    for extra in (
        ["--envs", "nope"],
        ["--critic", str(tmp_path / "gone")],
        ["--ptx-data", str(tmp_path / "gone")],
    ):
        out = tmp_path / "out"
        with pytest.raises(SystemExit) as exit_info:
            main(["rl", "-c", str(model), "--out", str(out), *extra, "--ptx-weight", "0.1"])
        assert exit_info.value.code == 2, capsys.readouterr()
        assert not out.exists(), extra
