"""K2's joint RL at small scale: verifiable environments + self-critique rubric rewards, K1.5's objective.

Each iteration i:

1. The sampling temperature is ``T_i = max(T_floor, T_0 · γ^i)`` (exploration early, reliable generation
   late; K2 decays temperature).
2. ``groups_per_iteration`` new prompts x are drawn from the environment mixture (task seeds derived from
   the run seed and i), each with a group of K rollouts; unfinished groups from earlier iterations
   (partial rollouts) continue. With ``token_limit`` an episode generates at most about that many tokens
   per iteration before it is parked (turns are never split) and resumed in the next iteration.
3. A group is trained on in the iteration all its K members finish. Rewards:

       r_j = R_env(y_j) − λ · min(1, max(0, n_j − B) / B)        (budget penalty; B = episode.token_budget,
                                                                 n_j = completion tokens, 0 without B)

   where R_env is the verifier's reward, or, for open-ended prompts, the rubric critic's win rate among
   the group's members that answered (``k2lab.agentic.rl.critic``); a failed member keeps R_env = 0.
4. The K1.5 objective (K2 inherits it), per group, with π_old the weights at the start of the iteration:

       L(θ) = (1/K) Σ_j ( r_j − r̄ − τ · log(π_θ(y_j|x) / π_old(y_j|x)) )²,     r̄ = (1/K) Σ_j r_j

       log(π_θ(y_j|x) / π_old(y_j|x)) = Σ_{t ∈ y_j} m_t · (log π_θ(y_t | ctx_t) − log π_old(y_t | ctx_t))

   The sum runs over the tokens the policy generated (every assistant turn's completion ids; prompts and
   tool results are context only) sampled in this iteration (turns of a partial rollout sampled in earlier
   iterations are context, as in K1.5). m_t = 1, except with K2.5's token-level off-policy clipping
   (``offpolicy_clip = δ``): m_t = 1[|log π_θ − log π_old| ≤ δ] (computed without gradient), so tokens that
   drifted too far get no gradient. log π is the policy that sampled, at temperature 1: with a local
   policy's tool-call enforcer (``enforced_logprobs``, default) the model's distribution renormalised over
   the tokens the enforcer allowed at that position, log π(y_t) = z_t[y_t] − log Σ_{v∈A_t} exp z_t[v].
   Scored over the whole vocabulary instead, the few forced tokens per episode where the model puts most
   of its mass on tokens the grammar rules out (p(y_t) < 0.1) carry most of the gradient, and a negative
   advantage pushes mass onto tokens that can never be sampled. The loss is averaged over the groups and
   minimised for ``updates_per_iteration`` MuonClip steps; the first step sees θ = θ_old, where the gradient is
   −(2τ/K) Σ_j (r_j − r̄) ∇ log π_θ(y_j|x): a group-relative policy gradient.
5. PTX (optional): ``L + α · CE(next token)`` on packed pre-training batches (``k2lab.data``).
6. The critic is refreshed on pairs from verifiable groups whose rewards differ.
7. metrics.jsonl gets one line; every ``checkpoint_every`` iterations an atomic training checkpoint (model,
   optimizer, iteration, RNG, pending partial rollouts, PTX position, critic) is written: a killed run
   restarted with the same arguments resumes and reproduces the uninterrupted run's metrics.

Failures (malformed output, truncation, unknown tools, tool errors, hangs, sandbox timeouts) fail their
trajectory (reward 0) and are counted per reason in ``failures``; training goes on.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from k2lab.agentic.episodes.env import Environment
from k2lab.agentic.episodes.rollout import (
    LocalPolicy,
    Policy,
    Rollout,
    Turn,
    describe_failures,
    failure_counts,
    run_episode,
    run_episodes,
    save_rollouts,
)
from k2lab.agentic.rl.critic import Preference, RubricCritic
from k2lab.agentic.rl.envs import EnvMixture, build_env, check_env_name
from k2lab.data import PackedBatches, load_corpus, load_tokenizer
from k2lab.errors import K2LabError
from k2lab.fsutil import save_figure_atomically
from k2lab.model_dir import check_model_directory, checkpoint_fingerprint, load_text_model
from k2lab.optim.grouping import OptimizerConfig
from k2lab.optim.muonclip import MuonClip
from k2lab.posttrain.base import METRICS, IterativeTrainer, open_run, rounded_mean, save_policy
from k2lab.posttrain.objective import budget_penalty, k15_loss, signal_groups
from k2lab.posttrain.scoring import offpolicy_mask, sequence_log_ratio, turn_logprobs
from k2lab.train.divergence import check_finite_update
from k2lab.train.persistence import derive_seed

__all__ = [
    "Group",
    "RLConfig",
    "RLTrainer",
    "iteration_report",
    "plot_metrics",
    "rl_sources",
    "run_rl",
    "settle_temperature_floor",
    "temperature_at",
]

PARTIALS = "partial_rollouts.jsonl"


class RLConfig(BaseModel):
    """Hyper-parameters of ``k2lab rl`` (see the module docstring for the equations)."""

    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(default=10, ge=1, description="RL iterations.")
    groups_per_iteration: int = Field(default=2, ge=1, description="New prompts (groups) per iteration.")
    group_size: int = Field(default=4, ge=2, description="K responses per prompt.")
    envs: list[str] = Field(
        default=["arithmetic", "instruction", "coding"],
        description="Environments: arithmetic, instruction, coding, open_qa, tools[:DOMAIN], mini-tools[:DOMAIN].",
    )
    env_weights: list[float] | None = Field(
        default=None, description="Mixture weights, one per environment; unset: equal."
    )
    max_new_tokens: int = Field(default=64, ge=1, description="Tokens per assistant turn.")
    token_limit: int | None = Field(
        default=None, ge=1, description="Tokens per episode per iteration (partial rollouts)."
    )
    temperature_start: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="Sampling temperature T_0 of the first iteration (then decays).",
    )
    temperature_floor: float = Field(default=0.3, ge=0, allow_inf_nan=False, description="Temperature floor.")
    temperature_decay: float = Field(default=0.9, gt=0, le=1, description="γ in T_i = max(floor, T_0 γ^i).")
    tau: float = Field(default=0.5, gt=0, allow_inf_nan=False, description="τ of the K1.5 objective.")
    offpolicy_clip: float | None = Field(
        default=None, gt=0, description="K2.5 token-level clip δ on |log π_θ − log π_old|."
    )
    budget_penalty: float = Field(
        default=0.1, ge=0, allow_inf_nan=False, description="λ of the token-budget penalty."
    )
    updates_per_iteration: int = Field(default=2, ge=1, description="Optimizer steps per iteration.")
    ptx_data: str | None = Field(
        default=None, description="PTX corpus directory (unset: the embedded corpus, when ptx_weight > 0)."
    )
    ptx_weight: float = Field(
        default=0.0, ge=0, allow_inf_nan=False, description="α of the PTX loss (0: off)."
    )
    ptx_batch_size: int = Field(default=2, ge=1)
    ptx_seq_len: int = Field(default=64, ge=2)
    critic: str = Field(
        default="none", description='Rubric critic: "none", "self" (a copy of the policy) or a checkpoint.'
    )
    critic_refresh_steps: int = Field(default=2, ge=0)
    critic_lr: float = Field(default=1e-4, gt=0)
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-3)
    checkpoint_every: int = Field(default=1, ge=1, description="Checkpoint every N iterations.")
    keep_checkpoints: int | None = Field(default=3, ge=1, description="Checkpoints kept (unset: all).")
    step_timeout_s: float = Field(default=30.0, gt=0)
    logprob_batch: int = Field(default=8, ge=1)
    enforced_logprobs: bool = Field(
        default=True,
        description="Score log π over the tokens the decoding enforcer allowed (the policy that sampled).",
    )
    rollout_batch: int = Field(
        default=16, ge=1, description="Rows per batched generate call of local rollouts (1: one at a time)."
    )
    drop_finished: bool = Field(
        default=True,
        description="Local rollouts: a row that ends its turn leaves the batched decode (GenerationConfig).",
    )
    seed: int = Field(default=0, description="Run seed (tasks and sampling).")

    @model_validator(mode="after")
    def _floor_not_above_start(self) -> RLConfig:
        settle_temperature_floor(self)
        return self

    @model_validator(mode="after")
    def _ptx_data_needs_a_weight(self) -> RLConfig:
        if self.ptx_data is not None and self.ptx_weight == 0:
            raise ValueError(
                f"ptx_data={self.ptx_data!r} is set but ptx_weight is 0, so no PTX loss would be trained: "
                "give ptx_weight > 0 (--ptx-weight) or leave ptx_data unset"
            )
        return self

    @model_validator(mode="after")
    def _environments_exist(self) -> RLConfig:
        """Known environment names and one weight per environment: checked with the config, before ``k2lab
        rl`` claims its output directory (a refused run left a run.json that the next command tripped on)."""
        for name in self.envs:
            check_env_name(name)
        if self.env_weights is not None and len(self.env_weights) != len(self.envs):
            raise ValueError(
                f"env_weights gives {len(self.env_weights)} weights for {len(self.envs)} environments: give one "
                "per environment"
            )
        return self


# ------------------------------------------------------------------------------------------ the math


def temperature_at(iteration: int, start: float, floor: float, decay: float) -> float:
    """T_i = max(T_floor, T_0 · γ^i)."""
    return max(floor, start * decay**iteration)


def settle_temperature_floor(config: BaseModel) -> None:
    """A floor above T_0 would sample at the floor from the first iteration (the "decay" going up): the
    default floor under a low start becomes the start (a constant T_0); a floor given above it is refused
    (``ValueError``). For a config with ``temperature_start`` / ``temperature_floor`` (RL, visual RL)."""
    if config.temperature_floor <= config.temperature_start:
        return
    if "temperature_floor" not in config.model_fields_set:
        config.temperature_floor = config.temperature_start
        return
    raise ValueError(
        f"temperature_floor={config.temperature_floor} is above temperature_start="
        f"{config.temperature_start}: T_i = max(floor, T_0 · γ^i) would sample at the floor from the first "
        "iteration on instead of decaying from T_0; give a floor at most the start temperature "
        "(--temperature-floor, or --set temperature_floor=...)"
    )


# ------------------------------------------------------------------------------------------ groups


@dataclass
class Group:
    """K rollouts of one prompt (``task_seed`` of the environment mixture)."""

    group_id: str
    task_seed: int
    members: list[Rollout]

    @property
    def done(self) -> bool:
        return all(not member.partial for member in self.members)

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "task_seed": self.task_seed,
            "members": [m.to_dict() for m in self.members],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Group:
        return cls(data["group_id"], data["task_seed"], [Rollout.from_dict(m) for m in data["members"]])


def _answer(rollout: Rollout) -> str:
    """The last assistant message's text (tool calls as JSON), "" when there is none."""
    for message in reversed(rollout.episode.messages):
        if message.get("role") == "assistant":
            text = message.get("content") or ""
            calls = message.get("tool_calls")
            return text + (json.dumps(calls) if calls else "")
    return ""


def _question(rollout: Rollout) -> str:
    users = [m.get("content") for m in rollout.episode.messages if m.get("role") == "user"]
    return str(users[0]) if users else ""


# ------------------------------------------------------------------------------------------ the trainer


class RLTrainer(IterativeTrainer):
    """Joint RL over an environment mixture with a local policy; ``run()`` trains (resuming if possible).

    ``env`` defaults to ``EnvMixture`` of ``config.envs``; ``critic_model`` enables rubric rewards for
    open-ended environments. Checkpoints hold the model, optimizer, pending partial rollouts, PTX position
    and critic (``k2lab.posttrain.base`` for the loop, resume and cadence). ``sources`` (``run_rl``: what
    the policy and the critic are, ``rl_sources``) join the settings a resumed run must share.
    """

    config: RLConfig

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        config: RLConfig,
        out_dir: str | Path,
        env: Environment | None = None,
        critic_model: torch.nn.Module | None = None,
        policy: Policy | None = None,
        sources: dict[str, str | None] | None = None,
    ) -> None:
        self.model, self.tokenizer, self.sources = model.eval(), tokenizer, dict(sources or {})
        super().__init__(config, out_dir)
        weights = config.env_weights or [1.0] * len(config.envs)  # one per environment (RLConfig)
        self.env = env or EnvMixture(
            [(build_env(name), w) for name, w in zip(config.envs, weights, strict=True)],
            config.step_timeout_s,
        )
        self.policy = policy or LocalPolicy(
            model,
            tokenizer,
            config.temperature_start,
            config.max_new_tokens,
            drop_finished=config.drop_finished,
        )
        self.optimizer = MuonClip(model, config.optimizer, verbose=False)
        self.ptx = self._ptx_stream()
        self.critic = RubricCritic(critic_model, tokenizer, lr=config.critic_lr) if critic_model else None
        self.pending: list[Group] = []
        self.iteration = 0
        self.resume()

    # ---- setup and persistence
    def _ptx_stream(self) -> Any:
        config = self.config
        if config.ptx_weight == 0:
            return None
        corpus = load_corpus(config.ptx_data)
        docs = corpus.train or corpus.val
        return PackedBatches(
            docs, self.tokenizer, config.ptx_batch_size, config.ptx_seq_len, seed=config.seed
        )

    def settings(self) -> dict[str, Any]:
        """The settings a resumed run must share with the checkpoint: the config and the ``sources``. A
        checkpoint saved without a source (before they were recorded) is not refused for it."""
        return self.config.model_dump(mode="json") | self.sources

    def state_parts(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "pending": json.dumps([g.to_dict() for g in self.pending]),
            "ptx": json.dumps(self.ptx.state_dict()) if self.ptx else None,
            "critic": self.critic.state_dict() if self.critic else None,
        }

    def load_state_parts(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.pending = [Group.from_dict(g) for g in json.loads(state["pending"])]
        if self.ptx and state.get("ptx"):
            self.ptx.load_state_dict(json.loads(state["ptx"]))
        if self.critic and state.get("critic"):
            self.critic.load_state_dict(state["critic"])
        save_rollouts(self.out / PARTIALS, [g.to_dict() for g in self.pending])

    # ---- the loop
    def run(
        self, iterations: int | None = None, on_iteration: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Train until ``iterations`` (default ``config.iterations``) are done, then plot the metrics
        (rl_metrics.png); returns this call's metrics."""
        history = self.run_loop(iterations or self.config.iterations, on_iteration)
        plot_metrics(self.out / METRICS, self.out / "rl_metrics.png")
        return history

    def advance(self) -> dict[str, Any]:
        return self.train_iteration()

    def train_iteration(self) -> dict[str, Any]:
        """Roll out, score, update once per ``updates_per_iteration``; returns (and logs) the metrics."""
        started, i, config = time.perf_counter(), self.iteration, self.config
        temperature = temperature_at(
            i, config.temperature_start, config.temperature_floor, config.temperature_decay
        )
        if hasattr(self.policy, "temperature"):
            self.policy.temperature = temperature
        groups = self.pending + [self._new_group(i, g) for g in range(config.groups_per_iteration)]
        self._roll(groups, i)
        rolled = time.perf_counter()
        finished = [g for g in groups if g.done]
        self.pending = [g for g in groups if not g.done]
        save_rollouts(self.out / PARTIALS, [g.to_dict() for g in self.pending])
        scored = [self._score(g) for g in finished]
        critic_loss = self._refresh_critic(finished, scored)
        losses = self._update(finished, [r for r, _ in scored], i)
        self.iteration += 1
        metrics = self._metrics(i, temperature, finished, scored, losses, critic_loss)
        metrics["seconds"] = round(time.perf_counter() - started, 3)
        metrics["rollout_seconds"] = round(rolled - started, 3)
        self.log_metrics(metrics)
        return metrics

    def _new_group(self, iteration: int, index: int) -> Group:
        task_seed = derive_seed(self.config.seed, "task", iteration, index)
        members = [Rollout(self.env.reset(task_seed)) for _ in range(self.config.group_size)]
        return Group(f"{iteration}-{index}", task_seed, members)

    def _roll(self, groups: Sequence[Group], iteration: int) -> None:
        """Play every unfinished member of ``groups`` (up to ``token_limit`` tokens each): batched through
        ``run_episodes`` for a ``LocalPolicy``, one at a time for other policies (endpoints)."""
        members = [
            (member, derive_seed(self.config.seed, "sample", iteration, group.group_id, j))
            for group in groups
            for j, member in enumerate(group.members)
            if member.partial
        ]
        if isinstance(self.policy, LocalPolicy):
            rollouts, seeds = [m for m, _ in members], [s for _, s in members]
            run_episodes(
                self.env, self.policy, rollouts, seeds, self.config.token_limit, iteration,
                self.config.rollout_batch,
            )  # fmt: skip
            return
        for member, sample_seed in members:
            run_episode(
                self.env, self.policy, member.episode.seed, self.config.token_limit, member, iteration,
                sample_seed,
            )  # fmt: skip

    # ---- rewards and critic
    def _score(self, group: Group) -> tuple[list[float], list[float]]:
        """(r_j after penalties, the penalties) of a finished group."""
        episodes = [m.episode for m in group.members]
        base = [float(e.reward or 0.0) for e in episodes]
        if self.critic is not None and all(e.state.get("open_ended") for e in episodes):
            base = self._critic_rewards(group)
        penalties = [
            budget_penalty(e.completion_tokens, e.token_budget, self.config.budget_penalty) for e in episodes
        ]
        return [b - p for b, p in zip(base, penalties, strict=True)], penalties

    def _critic_rewards(self, group: Group) -> list[float]:
        """R_env of an open-ended group: the critic's win rate w_j among the members that answered
        (``outcome.success``), 0 for the failed ones (truncated, malformed, empty, ...), whose text is no
        answer to judge."""
        assert self.critic is not None
        answered = [j for j, m in enumerate(group.members) if m.episode.outcome and m.episode.outcome.success]
        rates = self.critic.win_rates(
            _question(group.members[0]), [_answer(group.members[j]) for j in answered]
        )
        base = [0.0] * len(group.members)
        for j, rate in zip(answered, rates, strict=True):
            base[j] = rate
        return base

    def _refresh_critic(
        self, groups: Sequence[Group], scored: Sequence[tuple[list[float], list[float]]]
    ) -> float | None:
        if self.critic is None or self.config.critic_refresh_steps == 0:
            return None
        preferences = []
        for group in groups:
            if group.members[0].episode.state.get("open_ended"):
                continue
            rewards = [float(m.episode.reward or 0.0) for m in group.members]
            for j, a in enumerate(group.members):
                for k, b in enumerate(group.members):
                    if rewards[j] > rewards[k]:
                        preferences.append(Preference(_question(a), _answer(a), _answer(b)))
        return self.critic.refresh(preferences[:8], self.config.critic_refresh_steps)

    # ---- the update
    def _update(
        self, groups: Sequence[Group], rewards: Sequence[list[float]], iteration: int
    ) -> dict[str, Any]:
        """``updates_per_iteration`` MuonClip steps on mean_groups L(θ) (+ α · PTX); returns the last losses."""
        items = [
            (g, j, turn)
            for g, group in enumerate(groups)
            for j, member in enumerate(group.members)
            for turn in member.turns
            if turn.iteration == iteration and turn.completion_ids and turn.prompt_ids
        ]
        result: dict[str, Any] = {"loss": None, "ptx_loss": None, "clipped_tokens": 0, "trained_tokens": 0}
        if not items and self.ptx is None:
            return result
        reward_tensors = [torch.tensor(r, dtype=torch.float32) for r in rewards]
        turns = [t for _, _, t in items]
        allowed = self.enforcer_masks([(groups[g].members[j], t) for g, j, t in items])
        old: list[torch.Tensor] | None = None
        for _ in range(self.config.updates_per_iteration):
            total = torch.zeros(())
            if items:
                new = self.token_logprobs(turns, allowed)
                if old is None:  # the first step runs at θ = θ_old: its log-probs are π_old's
                    old = [x.detach() for x in new]
                rl_loss, clipped = self._rl_loss(items, new, old, reward_tensors, len(groups))
                total = total + rl_loss
                result.update(loss=float(rl_loss.detach()), clipped_tokens=clipped)
                result["trained_tokens"] = sum(len(t.completion_ids) for t in turns)
            if self.ptx is not None:
                ptx_loss = self._ptx_loss()
                total = total + self.config.ptx_weight * ptx_loss
                result["ptx_loss"] = float(ptx_loss.detach())
            total.backward()
            lr = self.config.optimizer.lr
            check_finite_update(
                self.iteration, total, self.model.parameters(), lr, self.out, "iteration", self.checkpoints
            )
            self.optimizer.step()
            self.optimizer.zero_grad()
        return result

    def _rl_loss(
        self,
        items: list[tuple[int, int, Turn]],
        new: list[torch.Tensor],
        old: list[torch.Tensor],
        rewards: list[torch.Tensor],
        count: int,
    ) -> tuple[torch.Tensor, int]:
        ratios = [torch.zeros(len(r)) for r in rewards]
        clipped = 0
        for (g, j, _), logp_new, logp_old in zip(items, new, old, strict=True):
            mask = offpolicy_mask(logp_new, logp_old, self.config.offpolicy_clip)
            clipped += int((~mask).sum())
            ratios[g] = ratios[g].index_add(
                0, torch.tensor([j]), sequence_log_ratio(logp_new, logp_old, mask)[None]
            )
        losses = [k15_loss(r, ratio, self.config.tau) for r, ratio in zip(rewards, ratios, strict=True)]
        return torch.stack(losses).sum() / count, clipped

    def token_logprobs(
        self, turns: Sequence[Turn], allowed: Sequence[torch.Tensor | None] | None = None
    ) -> list[torch.Tensor]:
        """log π(y_t | prompt, y_<t) of each turn's completion tokens (temperature 1), in chunks; over the
        ``allowed`` tokens of each position when given."""
        return turn_logprobs(self.model, turns, self.config.logprob_batch, allowed)

    def enforcer_masks(self, items: Sequence[tuple[Rollout, Turn]]) -> list[torch.Tensor | None] | None:
        """Per (rollout, turn): the enforcer's allowed tokens at each completion position (None: scoring
        over the whole vocabulary, for policies without an enforcer or with ``enforced_logprobs`` off)."""
        replay = getattr(self.policy, "turn_masks", None)
        if not self.config.enforced_logprobs or replay is None:
            return None
        return replay(items)

    def _ptx_loss(self) -> torch.Tensor:
        batch = next(self.ptx)
        device = next(self.model.parameters()).device
        return self.model(batch.input_ids.to(device), labels=batch.labels.to(device)).loss

    # ---- metrics
    def _metrics(
        self,
        iteration: int,
        temperature: float,
        groups: Sequence[Group],
        scored: Sequence[tuple[list[float], list[float]]],
        losses: dict[str, Any],
        critic_loss: float | None,
    ) -> dict[str, Any]:
        members = [m for g in groups for m in g.members]
        rewards = [r for rs, _ in scored for r in rs]
        penalties = [p for _, ps in scored for p in ps]
        per_env: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for member, reward in zip(members, rewards, strict=True):
            e = member.episode
            row = per_env[e.env]
            row["reward"].append(reward)
            row["success"].append(float(bool(e.outcome and e.outcome.success)))
            row["tool_calls"].append(e.tool_calls)
            row["tokens"].append(e.completion_tokens)
        return {
            "iteration": iteration,
            "temperature": round(temperature, 6),
            "groups": len(groups),
            "signal_groups": signal_groups([rs for rs, _ in scored]),
            "episodes": len(members),
            "pending_groups": len(self.pending),
            "mean_reward": rounded_mean(rewards),
            "success": rounded_mean(
                [float(bool(m.episode.outcome and m.episode.outcome.success)) for m in members]
            ),
            "tool_calls_per_task": rounded_mean([m.episode.tool_calls for m in members]),
            "tokens_per_task": rounded_mean([m.episode.completion_tokens for m in members]),
            "budget_penalty": rounded_mean(penalties),
            "failures": failure_counts(members),
            "per_env": {
                env: {k: rounded_mean(v) for k, v in row.items()} | {"episodes": len(row["reward"])}
                for env, row in sorted(per_env.items())
            },
            "critic_loss": critic_loss,
            **losses,
        }


# ------------------------------------------------------------------------------------------ plot


def plot_metrics(metrics_path: str | Path, png_path: str | Path) -> Path | None:
    """A 2×2 PNG of mean reward, success, tool calls per task and tokens per task over iterations."""
    path = Path(metrics_path)
    if not path.is_file():
        return None
    import matplotlib  # lazy: matplotlib (0.3 s) only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only to draw

    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        ("mean_reward", "mean reward"),
        ("success", "success rate"),
        ("tool_calls_per_task", "tool calls per task"),
        ("tokens_per_task", "tokens per task"),
    )
    for axis, (key, title) in zip(axes.flat, panels, strict=True):
        points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label="all")
        for env in sorted({e for r in rows for e in r.get("per_env", {})}):
            field = {
                "mean_reward": "reward",
                "success": "success",
                "tool_calls_per_task": "tool_calls",
                "tokens_per_task": "tokens",
            }[key]
            env_points = [
                (r["iteration"], r["per_env"][env][field]) for r in rows if env in r.get("per_env", {})
            ]
            axis.plot([p[0] for p in env_points], [p[1] for p in env_points], linestyle="--", label=env)
        axis.set_title(title)
        axis.set_xlabel("iteration")
    axes.flat[0].legend(fontsize=7)
    figure.tight_layout()
    save_figure_atomically(figure, Path(png_path), dpi=80)
    plt.close(figure)
    return Path(png_path)


# ------------------------------------------------------------------------------------------ entry point


def run_rl(
    checkpoint: str | Path,
    out_dir: str | Path,
    config: RLConfig,
    resume: bool = True,
    threads: int | None = None,
    on_iteration: Callable[[dict[str, Any]], None] | None = None,
    env: Environment | None = None,
) -> list[dict[str, Any]]:
    """``k2lab rl``: load ``checkpoint`` (a model directory with tokenizer.json), train, save the policy to
    ``OUT/model`` (with the tokenizer). Resumes from ``OUT/checkpoints`` when there are any (``resume``
    False refuses to run over them instead), refused when the config or the ``rl_sources`` differ (another
    --checkpoint would splice its tokenizer onto the old run's weights; a moved or copied one is the same). ``env`` replaces the mixture of
    ``config.envs``."""
    checkpoint, out = check_model_directory(checkpoint), Path(out_dir)
    if not (checkpoint / "tokenizer.json").is_file():
        raise K2LabError(f"{checkpoint} has no tokenizer.json: RL renders chats with the model's tokenizer")
    critic = config.critic if config.critic not in ("self", "none") else None  # a checkpoint
    if critic is not None:  # the inputs, before the output directory is claimed
        check_model_directory(critic)
    if config.ptx_data is not None and not Path(config.ptx_data).expanduser().exists():
        raise K2LabError(f"ptx_data {config.ptx_data} does not exist")
    open_run(out, "rl", [checkpoint, critic], resume, threads, config.seed)
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    model = load_text_model(checkpoint, "RL")
    critic_model = None
    if config.critic == "self":
        critic_model = load_text_model(checkpoint, "RL's critic").eval()
    elif config.critic != "none":
        critic_model = load_text_model(config.critic, "RL's critic").eval()
    sources = rl_sources(checkpoint, config.critic)
    trainer = RLTrainer(model, tokenizer, config, out, env=env, critic_model=critic_model, sources=sources)
    history = trainer.run(on_iteration=on_iteration)
    save_policy(model, tokenizer, out)
    return history


def rl_sources(checkpoint: Path, critic: str) -> dict[str, str | None]:
    """What a run's policy and critic are, compared on resume: the content fingerprint of the policy
    checkpoint (``checkpoint_fingerprint``: weights, config, tokenizer; the same after the run is moved or
    copied) and of the critic's ("self" for the policy, None for "none")."""
    critic_source = (
        critic if critic == "self" else None if critic == "none" else checkpoint_fingerprint(Path(critic))
    )
    return {
        "source_checkpoint_fingerprint": checkpoint_fingerprint(checkpoint),
        "critic_checkpoint_fingerprint": critic_source,
    }


def iteration_report(metrics: dict[str, Any], total: int) -> str:
    """One console line for an RL iteration's metrics line; it says so when finished episodes left nothing to
    train on (every rollout failed before a completion: a context that cannot hold the prompt, say), which
    otherwise passed unseen: the run ended "done" with the policy unchanged."""
    line = (
        f"iteration {metrics['iteration'] + 1}/{total}: mean reward {metrics['mean_reward']}, success "
        f"{metrics['success']}, {metrics['episodes']} episodes, {metrics['signal_groups']} of "
        f"{metrics['groups']} groups with unequal rewards, {metrics['trained_tokens']:,} tokens trained, "
        f"{metrics['seconds']:.1f} s"
    )
    if metrics["episodes"] and not metrics["trained_tokens"]:
        failures = describe_failures(metrics["failures"]) or "none"
        line += f"; nothing trained: no episode produced a completion (failures: {failures})"
    return line
