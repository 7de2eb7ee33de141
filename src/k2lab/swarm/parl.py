"""PARL (K2.5): train only the orchestrator; sub-agents are frozen and their outputs are observations.

Reward of a finished episode y of task x at training iteration i::

    r_PARL(x, y) = λ1(i) · r_parallel + λ2(i) · r_finish + r_perf(x, y)

    r_parallel = min(1, subagents_used / target)            (against serial collapse)
    r_finish   = finished_subtasks / assigned_subtasks       (against spurious fan-out; 1 with none assigned)
    r_perf     = 1[final answer exact]                       (the task's verifier)

    λk(i) = λk(0) · max(0, 1 − i / (anneal_fraction · iterations))      (linear annealing to 0)

so after ``anneal_fraction`` of training only task quality is rewarded. A sub-agent is *used* when it ran on
at least one assigned task (``swarm_metrics``'s ``subagents_used``): one created and never given a task is not
parallel work. The update is K1.5's group objective (``k2lab.posttrain.objective.k15_loss`` over
``k2lab.posttrain.scoring.sequence_log_ratio``) on the orchestrator's own generated tokens only — sub-agent messages and tool results are observations, never
trained on::

    L(θ) = mean_groups (1/K) Σ_j ( r_j − r̄ − τ · Σ_{t ∈ orchestrator tokens of y_j} (log π_θ − log π_old) )²

minimised with Adam for ``updates_per_iteration`` steps per iteration; the optimizer holds only the
orchestrator's parameters, and a sub-agent model (when the workers are a ``LocalPolicy``) is put in eval
mode with ``requires_grad=False``.

Two orchestrators share the trainer:

* ``LMOrchestrator`` — the language-model path: a ``LocalPolicy`` over a ``CausalLM`` calls the tools in K2's
  chat format; its turns' completion ids are trained on (tested end-to-end on a tiny random model), with
  log π the model renormalised over the tokens the tool-call enforcer allowed (the policy that sampled, as
  in RL; the masks are replayed once per iteration).
* ``CompactOrchestrator`` — the compact path **used by ``k2lab ablate parl``**: a factorised categorical
  policy over discrete orchestration actions, with state = (turn t, bucket of shards still missing) and
  actions "query one shard myself" or "fan out (w, c)": create w sub-agents and give each c of the missing
  shards (wrapping around when w·c exceeds them). When no shard is missing it answers with
  the sum (a procedural aggregator). Each decision is one "token" (prompt id = state, completion id =
  action), trained by the same group-relative objective; sub-agents are the procedural frozen
  ``ShardWorker``.

Checkpoints are atomic and a restarted trainer resumes to the same metrics (``k2lab.posttrain.base``): every
task and sampling seed is derived from (seed, iteration, group, member).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from k2lab.agentic.episodes.env import Episode
from k2lab.agentic.episodes.rollout import LocalPolicy, Rollout, Turn, run_episode
from k2lab.posttrain.base import IterativeTrainer, rounded_mean
from k2lab.posttrain.objective import k15_loss
from k2lab.posttrain.scoring import sequence_log_ratio, turn_logprobs
from k2lab.swarm.orchestrator import SwarmEnv, swarm_metrics
from k2lab.swarm.tasks import parse_facts, split_seeds
from k2lab.train.divergence import check_finite_update
from k2lab.train.persistence import derive_seed

__all__ = [
    "CompactOrchestrator",
    "LMOrchestrator",
    "ParlConfig",
    "ParlTrainer",
    "evaluate",
    "lambda_at",
    "make_env",
    "parl_reward",
    "r_finish",
    "r_parallel",
]

WIDTHS = (2, 3, 4, 6, 8)
CHUNKS = (1, 2, 3, 6)
BUCKETS = (2, 5, 8, 12)  # remaining shards ≤ 2, ≤ 5, ≤ 8, ≤ 12, more


class ParlConfig(BaseModel):
    """PARL hyper-parameters (equations in the module docstring); every number finite."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    iterations: int = Field(default=40, ge=1)
    groups_per_iteration: int = Field(default=4, ge=1)
    group_size: int = Field(default=8, ge=2)
    tau: float = Field(default=0.5, gt=0)
    lr: float = Field(default=0.05, gt=0)
    updates_per_iteration: int = Field(default=4, ge=1)
    lambda_parallel: float = Field(default=0.5, ge=0)
    lambda_finish: float = Field(default=0.5, ge=0)
    anneal_fraction: float = Field(default=0.5, gt=0, le=1)
    subagent_target: int = Field(default=4, ge=1)
    max_turns: int = Field(default=3, ge=2, description="B_main: orchestrator turns per episode.")
    sub_max_steps: int = Field(default=4, ge=1, description="Steps per sub-agent run.")
    min_shards: int = Field(default=2, ge=1)
    max_shards: int = Field(default=24, ge=1)
    single_agent: bool = False
    solo_prior: float = Field(
        default=4.5, description="Initial logit of 'query myself' (single-agent start)."
    )
    eval_every: int = Field(default=2, ge=1)
    eval_tasks: int = Field(default=32, ge=1)
    checkpoint_every: int = Field(default=5, ge=1)
    keep_checkpoints: int | None = Field(default=2, ge=1)
    seed: int = 0


# ------------------------------------------------------------------------------------------ rewards


def lambda_at(iteration: int, start: float, iterations: int, anneal_fraction: float) -> float:
    """λ(i) = λ(0) · max(0, 1 − i / (anneal_fraction · iterations))."""
    return start * max(0.0, 1.0 - iteration / (anneal_fraction * iterations))


def r_parallel(subagents: int, target: int) -> float:
    """min(1, subagents / target), ``subagents`` = sub-agents that ran on an assigned task.

    K2.5: "r_parallel prevents serial collapse, where the orchestrator always works alone" and r_finish
    "prevents meaningless fan-out that farms a parallelism metric without completing useful subtasks". An
    orchestrator that creates sub-agents but never assigns them a task still works alone, so counting
    created sub-agents would let it farm r_parallel at no cost (r_finish is 1 when nothing is assigned).
    Counting only sub-agents that received a task keeps each term to the failure the spec names: the
    parallelism measured is work actually handed out, and r_finish judges whether that work was finished.
    (Scoring an unused sub-agent as an unfinished subtask instead would make r_finish also punish the
    orchestrator's bookkeeping, not just unfinished work.) The compact orchestrator assigns every
    sub-agent it creates, so its rewards are the same under either count.
    """
    return min(1.0, subagents / target)


def r_finish(finished: int, assigned: int) -> float:
    """finished / assigned subtasks; 1 when none was assigned (nothing was left unfinished).

    The term penalises fan-out that leaves subtasks unfinished; it must not reward fanning out as such.
    Scoring a serial episode 0 would make r_finish a second parallelism bonus (a finished fan-out beats
    working alone by λ2), so that dropping r_parallel could not show serial collapse.
    """
    return finished / assigned if assigned else 1.0


def parl_reward(episode: Episode, lambda1: float, lambda2: float, target: int) -> dict[str, float]:
    """r = λ1 · r_parallel + λ2 · r_finish + r_perf, with its terms."""
    m = swarm_metrics(episode)
    terms = {
        "r_perf": float(m["success"]),
        "r_parallel": r_parallel(m["subagents_used"], target),
        "r_finish": r_finish(m["finished"], m["assigned"]),
    }
    terms["reward"] = lambda1 * terms["r_parallel"] + lambda2 * terms["r_finish"] + terms["r_perf"]
    return terms


# ------------------------------------------------------------------------------------------ orchestrators


class LMOrchestrator:
    """The language-model path: a ``LocalPolicy`` orchestrator whose completion ids are trained on."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, temperature: float = 1.0, max_new_tokens: int = 64
    ):
        self.model = model
        self.policy = LocalPolicy(model, tokenizer, temperature, max_new_tokens)

    def parameters(self) -> Any:
        return self.model.parameters()

    def turn_logprobs(
        self, turns: Sequence[Turn], allowed: Sequence[torch.Tensor | None] | None = None
    ) -> list[torch.Tensor]:
        """log π(y_t | prompt, y_<t) of each turn's completion ids (temperature 1), 8 turns per forward:
        [len(completion)] per turn, renormalised over the ``allowed`` tokens (``enforcer_masks``) when given,
        log π(y_t) = z_t[y_t] − log Σ_{v∈A_t} exp z_t[v]."""
        return turn_logprobs(self.model, turns, 8, allowed)

    def enforcer_masks(self, pairs: Sequence[tuple[Rollout, Turn]]) -> list[torch.Tensor | None]:
        """The tool-call enforcer's allowed tokens at each completion position of each (rollout, turn)
        (``LocalPolicy.turn_masks``; packed uint8 [len(completion), ⌈V/8⌉] or None). The policy samples
        under the enforcer, so log π is the model renormalised over these tokens, as in RL
        (``k2lab.agentic.rl.trainer``): scored over the whole vocabulary, forced tokens the model puts little
        mass on would carry most of the gradient and push mass onto tokens that can never be sampled."""
        return self.policy.turn_masks(pairs)

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)


class CompactOrchestrator(torch.nn.Module):
    """The compact path (used by the ablation): a factorised policy over orchestration actions,

        π(solo | s) = softmax(θ_kind[s])_solo
        π(fan(w, c) | s) = softmax(θ_kind[s])_fan · softmax(θ_width[s])_w · softmax(θ_chunk[s])_c

    s = min(t, B_main − 1) · 5 + bucket(missing shards); a ∈ {solo} ∪ {fan(w, c): w ∈ WIDTHS, c ∈ CHUNKS}
    (only solo for the single-agent baseline). θ starts at 0 except θ_kind[·, solo] = ``solo_prior`` and
    θ_kind[·, fan] = log |WIDTHS × CHUNKS| (the flat start: every fan-out action as likely as an action
    logit of 0 next to a solo logit of ``solo_prior``): a start from a single-agent checkpoint, which
    prefers working alone. ``greedy`` decides solo-or-fan first, then w and c: with one categorical over
    all 21 actions, a policy that fans out most of the time could still pick solo greedily because its
    fan-out mass is spread over 20 actions.
    """

    def __init__(self, max_turns: int = 6, single_agent: bool = False, solo_prior: float = 0.0) -> None:
        super().__init__()
        self.single_agent = single_agent
        self.actions = [(0, 0)] + ([] if single_agent else [(w, c) for w in WIDTHS for c in CHUNKS])
        self.max_turns, self.greedy = max_turns, False
        states = max_turns * (len(BUCKETS) + 1)
        kind = torch.zeros(states, 1 if single_agent else 2)
        kind[:, 0] = solo_prior
        if not single_agent:
            kind[:, 1] = math.log(len(WIDTHS) * len(CHUNKS))
        self.logits = torch.nn.Parameter(kind)
        self.width_logits = torch.nn.Parameter(torch.zeros(states, len(WIDTHS)))
        self.chunk_logits = torch.nn.Parameter(torch.zeros(states, len(CHUNKS)))

    def action_log_probs(self) -> torch.Tensor:
        """log π(a | s) [states, actions] in ``self.actions`` order (solo, then w-major fan-outs)."""
        kind = self.logits.log_softmax(-1)
        if self.single_agent:
            return kind
        shape = self.width_logits.log_softmax(-1)[:, :, None] + self.chunk_logits.log_softmax(-1)[:, None, :]
        return torch.cat([kind[:, :1], kind[:, 1:] + shape.flatten(1)], dim=1)

    def greedy_action(self, state: int) -> int:
        """argmax of solo-or-fan, then of w and of c."""
        if self.single_agent or int(self.logits[state].argmax()) == 0:
            return 0
        width, chunk = int(self.width_logits[state].argmax()), int(self.chunk_logits[state].argmax())
        return 1 + width * len(CHUNKS) + chunk

    @classmethod
    def from_config(cls, config: ParlConfig) -> CompactOrchestrator:
        return cls(config.max_turns, config.single_agent, config.solo_prior)

    @property
    def policy(self) -> CompactOrchestrator:
        """The orchestrator is its own ``Policy``."""
        return self

    def state_of(self, messages: list[dict[str, Any]]) -> tuple[int, str, list[str], dict[str, int]]:
        """(state index, product, missing shards, facts gathered) of the conversation so far."""
        question = next(m["content"] for m in messages if m["role"] == "user")
        product = re.search(r"product (\w+)", question).group(1)  # type: ignore[union-attr]
        shards = re.findall(r"\bs\d{2}\b", question.split(". Each")[0])
        facts = parse_facts(" ".join(m.get("content") or "" for m in messages if m["role"] == "tool"))
        missing = [s for s in shards if s not in facts]
        turn = min(sum(m["role"] == "assistant" for m in messages), self.max_turns - 1)
        bucket = sum(len(missing) > b for b in BUCKETS)
        return turn * (len(BUCKETS) + 1) + bucket, product, missing, facts

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        return [self.state_of(messages)[0]]

    def respond(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, seed: int = 0
    ) -> tuple[dict[str, Any], list[int]]:
        state, product, missing, facts = self.state_of(messages)
        if not missing:
            return {"role": "assistant", "content": f"The total is {sum(facts.values())}"}, []
        with torch.no_grad():
            if self.greedy:
                action = self.greedy_action(state)
            else:
                generator = torch.Generator().manual_seed(seed)
                probs = self.action_log_probs()[state].exp()
                action = int(torch.multinomial(probs, 1, generator=generator))
        turn = sum(m["role"] == "assistant" for m in messages)
        return _action_message(self.actions[action], product, missing, turn), [action]

    def enforcer_masks(self, pairs: Sequence[tuple[Rollout, Turn]]) -> None:
        """No enforcer: every action can be sampled."""
        return None

    def turn_logprobs(self, turns: Sequence[Turn], allowed: None = None) -> list[torch.Tensor]:
        """log π_θ(a | s) per turn (prompt id s, completion id a); ``allowed`` is always None."""
        log_probs = self.action_log_probs()
        return [log_probs[t.prompt_ids[0], t.completion_ids] for t in turns]


def _call(tool: str, call_id: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(arguments)}}


def _action_message(action: tuple[int, int], product: str, missing: list[str], turn: int) -> dict[str, Any]:
    """Solo: one ``query_shard``. fan(w, c): w ``create_subagent`` + w ``assign_task`` calls in one turn."""
    width, chunk = action
    if width == 0:
        calls = [_call("query_shard", f"q{turn}", shard=missing[0], key=product)]
        return {"role": "assistant", "content": None, "tool_calls": calls}
    calls = []
    for i in range(width):
        name = f"a{turn}_{i}"
        part = [missing[(i * chunk + k) % len(missing)] for k in range(min(chunk, len(missing)))]
        prompt = "You query regional shards and report every fact as sNN=value."
        calls.append(
            _call("create_subagent", f"c{turn}_{i}", name=name, system_prompt=prompt, tools=["query_shard"])
        )
        task = f"Report key={product} shards={','.join(part)}"
        calls.append(_call("assign_task", f"t{turn}_{i}", agent=name, task=task))
    return {"role": "assistant", "content": None, "tool_calls": calls}


def make_env(config: ParlConfig, workers: Any = None, **kwargs: Any) -> SwarmEnv:
    """The ``SwarmEnv`` of ``config`` (frozen ``workers``: default the procedural ``ShardWorker``)."""
    return SwarmEnv(
        workers, config.max_turns, config.sub_max_steps, config.min_shards, config.max_shards,
        allow_subagents=not config.single_agent, **kwargs,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------ evaluation


def evaluate(env: SwarmEnv, orchestrator: Any, seeds: Sequence[int], sample_seed: int = 0) -> dict[str, Any]:
    """Held-out means of success, CriticalSteps, total tokens, tool calls, sub-agents, unfinished subtasks
    (the compact orchestrator greedy), and the success on wide tasks (shards ≥ B_main: serially impossible)."""
    greedy = getattr(orchestrator, "greedy", None)
    if greedy is not None:
        orchestrator.greedy = True
    try:
        rows = [
            swarm_metrics(run_episode(env, orchestrator.policy, s, sample_seed=sample_seed).episode)
            for s in seeds
        ]
    finally:
        if greedy is not None:
            orchestrator.greedy = greedy
    keys = ("success", "critical_steps", "total_tokens", "tool_calls", "subagents", "unfinished")
    result = {k: rounded_mean([float(r[k]) for r in rows]) for k in keys}
    wide = [float(r["success"]) for r in rows if r["shards"] >= env.max_turns]
    result["wide_success"] = rounded_mean(wide)
    return result


# ------------------------------------------------------------------------------------------ the trainer


class ParlTrainer(IterativeTrainer):
    """Train ``orchestrator`` (``CompactOrchestrator`` or ``LMOrchestrator``) on ``env`` with frozen workers.

    ``run()`` trains (resuming from ``out_dir/checkpoints`` when there are any) and appends one line per
    iteration to ``out_dir/metrics.jsonl`` (with an ``eval`` entry every ``eval_every`` iterations and at
    the end); checkpoints hold the orchestrator and the optimizer (``k2lab.posttrain.base``).
    """

    config: ParlConfig

    def __init__(self, orchestrator: Any, env: SwarmEnv, config: ParlConfig, out_dir: str | Path) -> None:
        self.orchestrator, self.env = orchestrator, env
        super().__init__(config, out_dir)
        frozen = getattr(env.workers, "model", None)
        if isinstance(frozen, torch.nn.Module):
            frozen.eval().requires_grad_(False)
        self.optimizer = torch.optim.Adam(list(orchestrator.parameters()), lr=config.lr)
        self.iteration = 0
        self.resume()

    # ---- persistence
    def state_parts(self) -> dict[str, Any]:
        return {"orchestrator": self.orchestrator.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_parts(self, state: dict[str, Any]) -> None:
        self.orchestrator.load_state_dict(state["orchestrator"])
        self.optimizer.load_state_dict(state["optimizer"])

    # ---- the loop
    def run(
        self, iterations: int | None = None, on_iteration: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Train until ``iterations`` (default ``config.iterations``); returns this call's metrics."""
        return self.run_loop(iterations or self.config.iterations, on_iteration)

    def advance(self) -> dict[str, Any]:
        return self.train_iteration()

    def lambdas(self, iteration: int) -> tuple[float, float]:
        c = self.config
        return (
            lambda_at(iteration, c.lambda_parallel, c.iterations, c.anneal_fraction),
            lambda_at(iteration, c.lambda_finish, c.iterations, c.anneal_fraction),
        )

    def train_iteration(self) -> dict[str, Any]:
        """Roll out G groups of K, reward them, ``updates_per_iteration`` optimizer steps; log the metrics."""
        started, i, c = time.perf_counter(), self.iteration, self.config
        lambda1, lambda2 = self.lambdas(i)
        groups = [self._roll_group(i, g) for g in range(c.groups_per_iteration)]
        terms = [[parl_reward(r.episode, lambda1, lambda2, c.subagent_target) for r in g] for g in groups]
        loss = self._update(groups, [[t["reward"] for t in ts] for ts in terms], i)
        self.iteration += 1
        metrics = self._metrics(i, lambda1, lambda2, groups, terms, loss)
        if self.iteration % c.eval_every == 0 or self.iteration == c.iterations:
            seeds = split_seeds("heldout", c.eval_tasks, c.seed)
            metrics["eval"] = evaluate(self.env, self.orchestrator, seeds, derive_seed(c.seed, "eval"))
        metrics["seconds"] = round(time.perf_counter() - started, 4)
        self.log_metrics(metrics)
        return metrics

    def _roll_group(self, iteration: int, index: int) -> list[Rollout]:
        c = self.config
        task_seed = 2 * (derive_seed(c.seed, "train-task", iteration, index) % 10**8)  # even: training split
        return [
            run_episode(
                self.env, self.orchestrator.policy, task_seed, iteration=iteration,
                sample_seed=derive_seed(c.seed, "sample", iteration, index, j),
            )
            for j in range(c.group_size)
        ]  # fmt: skip

    def _update(
        self, groups: list[list[Rollout]], rewards: list[list[float]], iteration: int
    ) -> float | None:
        """K1.5 steps on the orchestrator's generated tokens of this iteration; the last loss."""
        items = [
            (g, j, turn)
            for g, group in enumerate(groups)
            for j, member in enumerate(group)
            for turn in member.turns
            if turn.iteration == iteration and turn.completion_ids and turn.prompt_ids
        ]
        if not items:
            return None
        turns = [t for _, _, t in items]
        allowed = self.orchestrator.enforcer_masks([(groups[g][j], t) for g, j, t in items])
        with torch.no_grad():
            old = [x.detach() for x in self.orchestrator.turn_logprobs(turns, allowed)]
        targets = [torch.tensor(r, dtype=torch.float32) for r in rewards]
        loss = torch.zeros(())
        for _ in range(self.config.updates_per_iteration):
            ratios = [torch.zeros(len(r)) for r in rewards]
            for (g, j, _), new, before in zip(
                items, self.orchestrator.turn_logprobs(turns, allowed), old, strict=True
            ):
                log_ratio = sequence_log_ratio(new, before, torch.ones_like(before, dtype=torch.bool))
                ratios[g] = ratios[g].index_add(0, torch.tensor([j]), log_ratio[None])
            loss = sum(k15_loss(r, q, self.config.tau) for r, q in zip(targets, ratios, strict=True)) / len(
                groups
            )
            loss.backward()
            parameters = self.orchestrator.parameters()
            check_finite_update(
                self.iteration, loss, parameters, self.config.lr, self.out, "iteration", self.checkpoints
            )
            self.optimizer.step()
            self.optimizer.zero_grad()
        return float(loss.detach())

    def _metrics(
        self,
        iteration: int,
        lambda1: float,
        lambda2: float,
        groups: list[list[Rollout]],
        terms: list[list[dict[str, float]]],
        loss: float | None,
    ) -> dict[str, Any]:
        rows = [swarm_metrics(r.episode) for g in groups for r in g]
        flat = [t for ts in terms for t in ts]
        keys = ("critical_steps", "total_tokens", "tool_calls", "subagents", "unfinished")
        return {
            "iteration": iteration,
            "lambda_parallel": round(lambda1, 6),
            "lambda_finish": round(lambda2, 6),
            "episodes": len(rows),
            "loss": loss,
            **{k: rounded_mean([t[k] for t in flat]) for k in ("reward", "r_perf", "r_parallel", "r_finish")},
            **{k: rounded_mean([float(r[k]) for r in rows]) for k in keys},
        }
