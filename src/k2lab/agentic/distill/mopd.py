"""Multi-teacher on-policy distillation (MOPD, K3): nine effort experts merged into one student.

**The objective.** Each step draws ``prompts_per_step`` prompts, prompt i from grid cell
c_i = cells[(s · P + i) mod 9] (a (domain, effort) pair; ``EffortEnv`` puts the effort in the system prompt).
The *student* π_S samples the episode (every assistant turn, at ``temperature``); the teacher of the
prompt's own cell, π_T = teachers[c_i], scores the student's tokens. The per-token reward is the
teacher/student log-ratio (K3 kept it over a top-k distillation objective)

    A_t = log π_T(y_t | ctx_t) − log π_S(y_t | ctx_t)             (no gradient: sg(·))

and the loss is its policy gradient over the N generated tokens of the step (prompts and tool results are
context only)

    L(θ) = −(1/N) Σ_t sg(log π_T(y_t|ctx_t) − log π_θ(y_t|ctx_t)) · log π_θ(y_t|ctx_t)

    ∇L   = −(1/N) Σ_t A_t ∇ log π_θ(y_t|ctx_t)

i.e. REINFORCE with reward A_t per token and no credit to earlier tokens (discount 0); since
E_{y∼π_S}[Σ_t −A_t] = KL(π_S ‖ π_T) per token, it is reverse-KL distillation on the student's own
distribution. ``objective="dense"`` (the default) takes that expectation exactly at every sampled context
instead of estimating it from the one sampled token (the same objective and the same expected gradient,
without the sampling noise of y_t; each token then carries the teacher's whole next-token distribution, at
O(N · V) memory instead of O(N)). K3's report found a finer top-k objective no better at its scale and kept
the sampled reward (``objective="sampled"``); at this project's scale (~300 distillation episodes) the dense
student ends closer to its teachers on every evaluation and meets the 90 % goal on more cells (README):

    L(θ) = (1/N) Σ_t KL(π_θ(·|ctx_t) ‖ π_T(·|ctx_t)) = (1/N) Σ_t Σ_v π_θ(v|ctx_t) (log π_θ(v|ctx_t) − log π_T(v|ctx_t))

    ∇L   = (1/N) Σ_t E_{v∼π_θ}[(log π_θ(v) − log π_T(v)) ∇ log π_θ(v)] = E_y[∇L_sampled]   (since Σ_v ∇π_θ(v) = 0)

Either way log π is the model at temperature 1 renormalised over the tokens the student's tool-call enforcer
allowed at that position (``k2lab.agentic.rl.trainer``: the policy that sampled; the teacher is scored over
the same tokens), so forced tokens the model itself would not pick do not dominate A_t. One MuonClip step per
step; metrics.jsonl gets one line (loss, per-token reverse KL: the exact mean KL when dense, the estimate
mean(−A_t) when sampled, per-cell rewards).

**Baseline** (``mode="sft"``): the same prompts, but the *teacher* of each cell samples and the student
minimises plain cross-entropy on the teacher's tokens, L = −(1/N) Σ_t log π_θ(y_t|ctx_t) (SFT on teacher
samples, the off-policy alternative).

**Resume.** Every ``checkpoint_every`` steps ``save_training_checkpoint`` stores the student, the
optimizer, the step and the RNGs; prompts and sampling seeds are derived from (seed, step, i), so a killed
run restarted with the same arguments reproduces the uninterrupted run's metrics and weights.

**Report.** ``mopd_report`` scores teachers, the MOPD student, the SFT baseline and the student's starting
checkpoint (did the teachers move from it?) on held-out seeds of every
cell (mean environment reward R_env; goal: student ≥ 0.9 · teacher per cell) and writes report.json,
report.md and report.png (heatmaps of student/teacher and baseline/teacher).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from k2lab.agentic.distill.effort import EffortEnv, ExpertSpec, load_manifest, manifest_specs
from k2lab.agentic.episodes.env import Environment, Episode
from k2lab.agentic.episodes.evaluate import play_greedy
from k2lab.agentic.episodes.rollout import (
    LocalPolicy,
    Rollout,
    Turn,
    describe_failures,
    failure_counts,
    run_episode,
    run_episodes,
)
from k2lab.config import format_validation_error
from k2lab.data import load_tokenizer
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import atomic_write_text, make_directory, read_json_object, save_figure_atomically
from k2lab.model_dir import load_text_model, save_model
from k2lab.optim.grouping import OptimizerConfig
from k2lab.optim.muonclip import MuonClip
from k2lab.posttrain.base import IterativeTrainer, rounded_mean
from k2lab.posttrain.objective import budget_penalty
from k2lab.posttrain.scoring import turn_logprobs
from k2lab.train.data import language_model
from k2lab.train.divergence import check_finite_update
from k2lab.train.persistence import derive_seed
from k2lab.train.run_directory import claim_run_directory

__all__ = [
    "MOPDConfig",
    "MOPDTrainer",
    "TeacherRouter",
    "check_tokenizers",
    "check_trained",
    "check_vocab_sizes",
    "dense_reverse_kl",
    "evaluate_cells",
    "mopd_advantages",
    "mopd_dense_loss",
    "mopd_loss",
    "mopd_report",
    "run_mopd",
    "sft_loss",
    "teacher_logprobs",
]

GOAL = 0.9
RUN_RECORD = "mopd.json"  # a run_mopd run's inputs, mode and config


class MOPDConfig(BaseModel):
    """Hyper-parameters of ``k2lab mopd distill`` (see the module docstring for the equations)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(default=20, ge=1, description="Distillation steps.")
    prompts_per_step: int = Field(default=9, ge=1, description="Prompts per step (cells round-robin).")
    temperature: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="Student sampling temperature."
    )
    objective: Literal["sampled", "dense"] = Field(
        default="dense",
        description="dense: the per-token KL(student || teacher) over the whole next-token distribution, the "
        "exact expectation of the log-ratio reward (no sampling noise, tokens x vocab memory); sampled: the "
        "reward log pi_teacher - log pi_student of the sampled token (K3's estimator).",
    )
    optimizer: OptimizerConfig = OptimizerConfig(lr=2e-4)
    checkpoint_every: int = Field(default=1, ge=1, description="Checkpoint every N steps.")
    keep_checkpoints: int | None = Field(default=3, ge=1, description="Checkpoints kept (unset: all).")
    step_timeout_s: float = Field(default=30.0, gt=0)
    logprob_batch: int = Field(default=8, ge=1)
    seed: int = Field(default=0, description="Run seed (prompts and sampling).")


# ------------------------------------------------------------------------------------------ the math


def mopd_advantages(logp_teacher: torch.Tensor, logp_student: torch.Tensor) -> torch.Tensor:
    """A_t = sg(log π_T(y_t) − log π_S(y_t))."""
    return (logp_teacher - logp_student).detach()


def mopd_loss(logp_student: torch.Tensor, logp_teacher: torch.Tensor) -> torch.Tensor:
    """L = −(1/N) Σ_t sg(log π_T(y_t) − log π_S(y_t)) · log π_S(y_t) over N generated tokens."""
    if logp_student.numel() == 0:
        return logp_student.sum()
    return -(mopd_advantages(logp_teacher, logp_student) * logp_student).sum() / logp_student.numel()


def dense_reverse_kl(logp_student: torch.Tensor, logp_teacher: torch.Tensor) -> torch.Tensor:
    """KL(π_S ‖ π_T) per position, [N], from full log-distributions [N, V]: Σ_v π_S(v) (log π_S(v) − log π_T(v)).
    Tokens the enforcer ruled out are −inf in both and contribute 0."""
    allowed = torch.isfinite(logp_student)
    gap = torch.where(allowed, logp_student - logp_teacher, torch.zeros_like(logp_student))
    return (logp_student.exp() * gap).sum(-1)


def mopd_dense_loss(logp_student: torch.Tensor, logp_teacher: torch.Tensor) -> torch.Tensor:
    """L = (1/N) Σ_t KL(π_S(·|ctx_t) ‖ π_T(·|ctx_t)) over N generated positions (``objective="dense"``)."""
    if logp_student.numel() == 0:
        return logp_student.sum()
    return dense_reverse_kl(logp_student, logp_teacher).mean()


def sft_loss(logp_student: torch.Tensor) -> torch.Tensor:
    """L = −(1/N) Σ_t log π_S(y_t) on teacher tokens (the SFT baseline)."""
    if logp_student.numel() == 0:
        return logp_student.sum()
    return -logp_student.mean()


def trainable_turns(rollout: Rollout) -> list[Turn]:
    return [t for t in rollout.turns if t.prompt_ids and t.completion_ids]


# ------------------------------------------------------------------------------------------ teachers


class TeacherRouter:
    """The nine teachers by cell; ``route(episode)`` picks the one of the episode's (domain, effort)."""

    def __init__(self, teachers: dict[tuple[str, str], torch.nn.Module]) -> None:
        self.teachers = teachers
        for model in teachers.values():
            model.eval().requires_grad_(False)

    def route(self, episode: Episode) -> torch.nn.Module:
        key = (episode.state.get("domain"), episode.state.get("effort"))
        if key not in self.teachers:
            raise KeyError(f"no teacher for domain/effort {key}")
        return self.teachers[key]  # type: ignore[index]

    @classmethod
    def load(cls, experts_dir: str | Path, specs: Sequence[ExpertSpec]) -> TeacherRouter:
        return cls(
            {
                (s.domain, s.effort): load_text_model(Path(experts_dir) / s.key / "model", "MOPD (a teacher)")
                for s in specs
            }
        )


# ------------------------------------------------------------------------------------------ the trainer


class CellDispatch(Environment):
    """Steps each episode in its own cell's ``EffortEnv`` (``episode.env`` is the cell key), so episodes of
    several cells can play in one batched ``run_episodes``; episodes come from the cells' own ``reset``."""

    name = "cells"

    def __init__(self, envs: dict[str, EffortEnv]) -> None:
        self.envs = envs

    def reset(self, seed: int) -> Episode:
        raise TypeError("CellDispatch only steps episodes: reset one cell's EffortEnv instead")

    def step(self, episode: Episode, message: dict[str, Any]) -> None:
        self.envs[episode.env].step(episode, message)


class MOPDTrainer(IterativeTrainer):
    """On-policy multi-teacher distillation (``mode="mopd"``) or SFT on teacher samples (``"sft"``).

    Counts ``step``s; checkpoints hold the student and the optimizer, and a resumed run must share the
    config, the mode and ``sources`` (where the student and the teachers came from; ``k2lab.posttrain.base``
    for the loop, resume and cadence).
    """

    counter = "step"
    config: MOPDConfig

    def __init__(
        self,
        student: torch.nn.Module,
        tokenizer: Any,
        router: TeacherRouter,
        specs: Sequence[ExpertSpec],
        config: MOPDConfig,
        out_dir: str | Path,
        mode: Literal["mopd", "sft"] = "mopd",
        sources: dict[str, str] | None = None,
    ) -> None:
        self.student, self.tokenizer, self.router = student.eval(), tokenizer, router
        self.specs, self.mode, self.sources = list(specs), mode, dict(sources or {})
        self.envs = {s.key: EffortEnv(s, timeout_s=config.step_timeout_s) for s in self.specs}
        self.dispatch = CellDispatch(self.envs)
        self.enforcer = LocalPolicy(student, tokenizer)  # replays the samplers' tool-call masks
        super().__init__(config, out_dir)
        self.optimizer = MuonClip(student, config.optimizer, verbose=False)
        self.step = 0
        self.resume()

    # ---- persistence
    def state_parts(self) -> dict[str, Any]:
        return {"model": self.student.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_parts(self, state: dict[str, Any]) -> None:
        self.student.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def settings(self) -> dict[str, Any]:
        """The settings a resumed run must share with the checkpoint: the config, the mode and the
        ``sources`` (``run_mopd``: the resolved student and experts paths)."""
        return self.config.model_dump(mode="json") | {"mode": self.mode} | self.sources

    # ---- the loop
    def run(
        self, steps: int | None = None, on_step: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Train until ``steps`` (default ``config.steps``) are done; returns this call's metrics."""
        return self.run_loop(steps or self.config.steps, on_step)

    def advance(self) -> dict[str, Any]:
        return self.train_step()

    def cell(self, step: int, index: int) -> ExpertSpec:
        """c_i = cells[(s · P + i) mod |cells|]: every step covers the grid round-robin."""
        return self.specs[(step * self.config.prompts_per_step + index) % len(self.specs)]

    def _sample_step(self, step: int) -> list[tuple[ExpertSpec, Rollout, torch.nn.Module]]:
        """Roll out every prompt of ``step`` with the student (MOPD) or its cell's teacher (SFT): prompts
        with the same sampler and per-turn token limit play together (``run_episodes``); returns
        (cell, rollout, teacher) per prompt, in prompt order."""
        seed, samples = self.config.seed, []
        batches: dict[tuple[int, int], tuple[torch.nn.Module, list[Rollout], list[int]]] = {}
        for index in range(self.config.prompts_per_step):
            spec = self.cell(step, index)
            episode = self.envs[spec.key].reset(derive_seed(seed, "mopd-task", step, index))
            teacher = self.router.route(episode)
            sampler = self.student if self.mode == "mopd" else teacher
            rollout = Rollout(episode)
            samples.append((spec, rollout, teacher))
            _, rollouts, sample_seeds = batches.setdefault(
                (id(sampler), spec.max_new_tokens), (sampler, [], [])
            )
            rollouts.append(rollout)
            sample_seeds.append(derive_seed(seed, "s", step, index))
        for (_, limit), (sampler, rollouts, sample_seeds) in batches.items():
            policy = LocalPolicy(sampler, self.tokenizer, self.config.temperature, limit)
            run_episodes(self.dispatch, policy, rollouts, sample_seeds)
        return samples

    def train_step(self) -> dict[str, Any]:
        """Sample, score, one optimizer step on L(θ); returns (and logs) the metrics."""
        started, s = time.perf_counter(), self.step
        samples = self._sample_step(s)
        played = [(r, turn, teacher) for _, r, teacher in samples for turn in trainable_turns(r)]
        turns = [(turn, teacher) for _, turn, teacher in played]
        result: dict[str, Any] = {"loss": None, "reverse_kl": None, "trained_tokens": 0}
        if turns:
            batch = self.config.logprob_batch
            allowed = (  # SFT: cross-entropy over the whole vocabulary
                self.enforcer.turn_masks([(r, t) for r, t, _ in played]) if self.mode == "mopd" else None
            )
            dense = self.mode == "mopd" and self.config.objective == "dense"
            student_logp = torch.cat(
                turn_logprobs(self.student, [t for t, _ in turns], batch, allowed, full=dense)
            )
            if self.mode == "sft":
                loss = sft_loss(student_logp)
            elif dense:
                loss = mopd_dense_loss(
                    student_logp, torch.cat(teacher_logprobs(turns, batch, allowed, full=True))
                )
                result["reverse_kl"] = round(float(loss.detach()), 6)
            else:
                target = torch.cat(teacher_logprobs(turns, batch, allowed))
                loss = mopd_loss(student_logp, target)
                result["reverse_kl"] = round(float((student_logp.detach() - target).mean()), 6)
            loss.backward()
            lr = self.config.optimizer.lr
            check_finite_update(
                self.step, loss, self.student.parameters(), lr, self.out, pending=self.checkpoints
            )
            self.optimizer.step()
            self.optimizer.zero_grad()
            result.update(loss=round(float(loss.detach()), 6), trained_tokens=int(student_logp.shape[0]))
        self.step += 1
        metrics = {"step": s, "mode": self.mode, **result, **_reward_metrics(samples)}
        metrics["seconds"] = round(time.perf_counter() - started, 3)
        self.log_metrics(metrics)
        return metrics


def teacher_logprobs(
    turns: Sequence[tuple[Turn, torch.nn.Module]],
    batch: int = 8,
    allowed: Sequence[torch.Tensor | None] | None = None,
    full: bool = False,
) -> list[torch.Tensor]:
    """``turn_logprobs`` of each (turn, model) pair (over the turn's ``allowed`` tokens when given; whole
    next-token distributions with ``full``), the turns of one model scored together (no gradient); returned
    in the order of ``turns``."""
    by_model: dict[int, list[int]] = defaultdict(list)
    for index, (_, model) in enumerate(turns):
        by_model[id(model)].append(index)
    out: list[torch.Tensor | None] = [None] * len(turns)
    with torch.no_grad():
        for indices in by_model.values():
            model = turns[indices[0]][1]
            masks = None if allowed is None else [allowed[i] for i in indices]
            scored = turn_logprobs(model, [turns[i][0] for i in indices], batch, masks, full)
            for i, logp in zip(indices, scored, strict=True):
                out[i] = logp
    return out  # type: ignore[return-value]


def _reward_metrics(samples: Sequence[tuple[ExpertSpec, Rollout, Any]]) -> dict[str, Any]:
    per_cell: dict[str, list[float]] = defaultdict(list)
    for spec, rollout, _ in samples:
        per_cell[spec.key].append(float(rollout.episode.reward or 0.0))
    rewards = [r for rs in per_cell.values() for r in rs]
    tokens = [r.episode.completion_tokens for _, r, _ in samples]
    return {
        "mean_reward": rounded_mean(rewards),
        "tokens_per_task": round(sum(tokens) / len(tokens), 3),
        "per_cell": {k: rounded_mean(v) for k, v in sorted(per_cell.items())},
        "failures": failure_counts(r for _, r, _ in samples),
    }


def check_trained(history: Sequence[dict[str, Any]]) -> None:
    """Refuse (one line) a run none of whose steps trained a token, naming the episodes' failures (a student
    whose context every prompt overflows, say): its model would be the starting checkpoint."""
    if not history or any(m.get("trained_tokens") for m in history):
        return
    failures: Counter[str] = Counter()
    for metrics in history:
        failures.update(metrics.get("failures") or {})
    shown = describe_failures(dict(sorted(failures.items()))) or "none recorded"
    raise K2LabError(
        f"nothing trained in {len(history)} steps: no episode produced a completion to learn from "
        f"(failures: {shown}); no model saved"
    )


# ------------------------------------------------------------------------------------------ entry points


def run_mopd(
    experts_dir: str | Path,
    student_checkpoint: str | Path,
    out_dir: str | Path,
    config: MOPDConfig,
    mode: Literal["mopd", "sft"] = "mopd",
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """``k2lab mopd distill``: student from ``student_checkpoint``, teachers from ``experts_dir``; trains
    (resuming from ``OUT/checkpoints``, refused when the config, the mode, the student or the experts differ)
    and saves the student to ``OUT/model`` with the tokenizer. ``OUT/mopd.json`` records the inputs once the
    resume check has passed. A run whose steps trained no token at all is refused (``check_trained``)."""
    specs = manifest_specs(load_manifest(experts_dir))
    check_tokenizers(student_checkpoint, experts_dir, specs)
    out = claim_run_directory(out_dir, f"mopd {mode}", [experts_dir, student_checkpoint])
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(Path(student_checkpoint) / "tokenizer.json")
    student = load_text_model(student_checkpoint, "MOPD (the student)")
    sources = {
        "student": str(Path(student_checkpoint).resolve()),
        "experts": str(Path(experts_dir).resolve()),
    }
    router = TeacherRouter.load(experts_dir, specs)
    check_vocab_sizes(student, student_checkpoint, router, experts_dir, specs)
    trainer = MOPDTrainer(student, tokenizer, router, specs, config, out, mode, sources)
    atomic_write_text(
        out / RUN_RECORD,
        json.dumps(
            {
                "experts": sources["experts"],
                "student": sources["student"],
                "mode": mode,
                "config": config.model_dump(mode="json"),
            },
            indent=2,
        )
        + "\n",
    )
    history = trainer.run(on_step=on_step)
    check_trained(trainer.history())
    save_model(student, out / "model")
    tokenizer.save(out / "model" / "tokenizer.json")
    return history


def check_tokenizers(
    student_checkpoint: str | Path, experts_dir: str | Path, specs: Sequence[ExpertSpec]
) -> None:
    """Refuse (one line, before any work) experts whose tokenizer.json differs from the student's: teachers
    score the student's token ids, which name other text under another tokenizer."""
    student = load_tokenizer(Path(student_checkpoint) / "tokenizer.json").backend.to_str()
    for spec in specs:
        teacher = Path(experts_dir) / spec.key / "model"
        if load_tokenizer(teacher / "tokenizer.json").backend.to_str() != student:
            raise K2LabError(
                f"the student {student_checkpoint} and the teacher {teacher} have different tokenizers "
                "(tokenizer.json): distill from experts trained from the student's checkpoint"
            )


def check_vocab_sizes(
    student: torch.nn.Module,
    student_checkpoint: str | Path,
    router: TeacherRouter,
    experts_dir: str | Path,
    specs: Sequence[ExpertSpec],
) -> None:
    """Refuse (one line) teachers whose vocabulary (output size) differs from the student's: their
    next-token distributions are over other ids."""
    size = language_model(student).config.vocab_size
    for spec in specs:
        theirs = language_model(router.teachers[(spec.domain, spec.effort)]).config.vocab_size
        if theirs != size:
            raise K2LabError(
                f"the student {student_checkpoint} has a vocabulary of {size} tokens, the teacher "
                f"{Path(experts_dir) / spec.key / 'model'} one of {theirs}: the models must share one"
            )


# ------------------------------------------------------------------------------------------ evaluation


def evaluate_cells(
    model: torch.nn.Module,
    tokenizer: Any,
    router: TeacherRouter,
    specs: Sequence[ExpertSpec],
    episodes: int,
    temperature: float = 0.0,
    seed: int = 0,
    budget_weight: float = 0.1,
    batch_size: int = 16,
) -> dict[str, dict[str, float]]:
    """Per cell on held-out seeds derive_seed(seed, "heldout", cell, i): mean R_env (``score``), success,
    tokens, the budget-penalised reward and the per-token KL estimate mean(log π_model − log π_teacher)
    on the model's own samples. Greedy evaluation (``temperature`` 0) plays a cell's episodes together
    (``k2lab.agentic.episodes.evaluate.play_greedy``, the same outcomes as one at a time)."""
    results = {}
    for spec in specs:
        env = EffortEnv(spec)
        tasks = [derive_seed(seed, "heldout", spec.key, i) for i in range(episodes)]
        if temperature == 0:
            played = play_greedy(model, tokenizer, env, tasks, batch_size, spec.max_new_tokens)
            finished = [(r.episode, trainable_turns(r)) for r in played]
        else:
            policy = LocalPolicy(model, tokenizer, temperature, spec.max_new_tokens)
            rollouts = [
                run_episode(env, policy, task, sample_seed=derive_seed(seed, "eval", spec.key, i))
                for i, task in enumerate(tasks)
            ]
            finished = [(r.episode, trainable_turns(r)) for r in rollouts]
        results[spec.key] = _cell_scores(model, router, spec, finished, budget_weight)
    return results


def _cell_scores(
    model: torch.nn.Module,
    router: TeacherRouter,
    spec: ExpertSpec,
    finished: Sequence[tuple[Episode, list[Turn]]],
    budget_weight: float,
) -> dict[str, float]:
    rows: dict[str, list[float]] = defaultdict(list)
    scored: list[tuple[Turn, torch.nn.Module]] = []  # (turn, its teacher) where the teacher is not the model
    for e, turns in finished:
        rows["score"].append(float(e.reward or 0.0))
        rows["success"].append(float(bool(e.outcome and e.outcome.success)))
        rows["tokens"].append(e.completion_tokens)
        rows["penalized"].append(
            rows["score"][-1] - budget_penalty(e.completion_tokens, spec.budget, budget_weight)
        )
        teacher = router.route(e)
        if teacher is not model:
            scored += [(turn, teacher) for turn in turns]
    scores = {k: rounded_mean(v) for k, v in rows.items()}
    scores["kl"] = 0.0
    if scored:  # mean over tokens of log π_model − log π_teacher
        own = torch.cat(teacher_logprobs([(turn, model) for turn, _ in scored]))
        theirs = torch.cat(teacher_logprobs(scored))
        scores["kl"] = round(float((own - theirs).mean()), 6)
    return scores


def _ratio(value: float, reference: float) -> float | None:
    return round(value / reference, 4) if reference > 0 else None


def report_rows(
    specs: Sequence[ExpertSpec], scores: dict[str, dict[str, dict[str, float]]]
) -> list[dict[str, Any]]:
    """One row per cell: start (the student's initial checkpoint, when scored) / teacher / student / baseline
    scores, ratios, goal student ≥ 0.9 · teacher."""
    rows = []
    for spec in specs:
        t, s, b = (scores[who][spec.key] for who in ("teacher", "student", "baseline"))
        start = scores.get("start", {}).get(spec.key)
        rows.append(
            {
                "cell": spec.key,
                "domain": spec.domain,
                "effort": spec.effort,
                "budget": spec.budget,
                "start": None if start is None else start["score"],
                "teacher": t["score"],
                "student": s["score"],
                "baseline": b["score"],
                "student_ratio": _ratio(s["score"], t["score"]),
                "baseline_ratio": _ratio(b["score"], t["score"]),
                "goal_met": s["score"] >= GOAL * t["score"],
                "trivial": t["score"] <= 0,  # the teacher scores 0: the goal holds vacuously
                "start_kl": None if start is None else start["kl"],
                "student_kl": s["kl"],
                "baseline_kl": b["kl"],
                "success": {"teacher": t["success"], "student": s["success"], "baseline": b["success"]},
                "tokens": {"teacher": t["tokens"], "student": s["tokens"], "baseline": b["tokens"]}
                | ({} if start is None else {"start": start["tokens"]}),
            }
        )
    return rows


def _met(row: dict[str, Any]) -> str:
    return ("yes" if row["goal_met"] else "no") + ("*" if row["trivial"] else "")


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The report as a Markdown table (ratios "n/a" and goal "yes*" where the teacher scores 0)."""

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        "| cell | B | start | teacher | MOPD student | SFT baseline | student/teacher | baseline/teacher | ≥90% "
        "| KL start | KL student | KL baseline | tokens start / T / S / B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tokens = " / ".join(
            "n/a" if who not in r["tokens"] else f"{r['tokens'][who]:.0f}"
            for who in ("start", "teacher", "student", "baseline")
        )
        lines.append(
            f"| {r['cell']} | {r['budget']} | {fmt(r.get('start'))} | {r['teacher']:.3f} | {r['student']:.3f} "
            f"| {r['baseline']:.3f} | {fmt(r['student_ratio'])} | {fmt(r['baseline_ratio'])} | {_met(r)} "
            f"| {fmt(r.get('start_kl'))} | {r['student_kl']:.3f} | {r['baseline_kl']:.3f} | {tokens} |"
        )
    lines.append("\n*: the teacher scores 0 on this cell, so the goal holds vacuously.")
    return "\n".join(lines) + "\n"


def plot_report(rows: Sequence[dict[str, Any]], png_path: str | Path) -> Path:
    """Heatmaps (domain × effort) of student/teacher and baseline/teacher (grey: teacher scores 0)."""
    import matplotlib  # lazy: matplotlib (0.3 s) only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only to draw

    domains = list(dict.fromkeys(r["domain"] for r in rows))
    efforts = list(dict.fromkeys(r["effort"] for r in rows))
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for axis, key, title in zip(
        axes,
        ("student_ratio", "baseline_ratio"),
        ("MOPD student / teacher", "SFT baseline / teacher"),
        strict=True,
    ):
        grid = np.full((len(domains), len(efforts)), np.nan)
        for r in rows:
            if r[key] is not None:
                grid[domains.index(r["domain"]), efforts.index(r["effort"])] = r[key]
        image = axis.imshow(np.ma.masked_invalid(grid), cmap="RdYlGn", vmin=0, vmax=1.2)
        axis.set_facecolor("lightgrey")
        for (i, j), value in np.ndenumerate(grid):
            axis.text(j, i, "n/a" if math.isnan(value) else f"{value:.2f}", ha="center", va="center")
        axis.set_xticks(range(len(efforts)), efforts)
        axis.set_yticks(range(len(domains)), domains)
        axis.set_title(title)
        figure.colorbar(image, ax=axis, fraction=0.046)
    figure.tight_layout()
    save_figure_atomically(figure, Path(png_path), dpi=80)
    plt.close(figure)
    return Path(png_path)


def check_temperature(temperature: float) -> None:
    """A sampling temperature must be finite and >= 0 (0 = greedy); a one-line ``K2LabError`` otherwise."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise K2LabError(f"--temperature must be >= 0 and finite (0 = greedy), not {temperature}")


def load_run_record(run_dir: Path) -> dict[str, Any]:
    """``RUN_DIR/mopd.json`` of a ``run_mopd`` run, its ``config`` as a ``MOPDConfig``; a missing, unreadable
    or incomplete one is a one-line error naming it."""
    path = run_dir / RUN_RECORD
    if not path.is_file():
        raise K2LabError(f"{run_dir} has no {RUN_RECORD}: name a `k2lab mopd distill` run directory")
    run = read_json_object(path)
    if not all(isinstance(run.get(key), str) for key in ("experts", "student")):
        raise CheckpointError(f"{path} is not a distillation record: it names no experts and student")
    try:
        return run | {"config": MOPDConfig.model_validate(run.get("config"))}
    except ValidationError as error:
        raise CheckpointError(f"{path}: invalid config: {format_validation_error(error)}") from error


def check_finished_run(distill: Path, experts_dir: str | Path) -> dict[str, Any]:
    """The record of a finished distillation in ``distill`` that used the experts of ``experts_dir``."""
    run = load_run_record(distill)
    if Path(run["experts"]).resolve() != Path(experts_dir).resolve():
        raise K2LabError(
            f"{distill} was distilled from the experts in {run['experts']}, not {experts_dir}: "
            "report with the experts the run used"
        )
    if not (distill / "model" / "tokenizer.json").is_file():
        raise K2LabError(
            f"the distillation in {distill} has not finished (no model/): run `k2lab mopd distill` again "
            "with its settings to finish it"
        )
    return run


def check_baseline_steps(baseline_dir: Path, steps: int) -> None:
    """Refuse to reuse a finished baseline trained for other than ``steps`` steps (the report would compare
    with a baseline other than the one asked for)."""
    if not (baseline_dir / "model" / "tokenizer.json").is_file():
        return  # trained (or finished) by this report
    trained = load_run_record(baseline_dir)["config"].steps
    if trained != steps:
        raise K2LabError(
            f"the baseline in {baseline_dir} was trained for {trained} steps, not {steps}: pass "
            f"--baseline-steps {trained} to reuse it, or remove {baseline_dir} to retrain it"
        )


def mopd_report(
    experts_dir: str | Path,
    distill_dir: str | Path,
    out_dir: str | Path | None = None,
    episodes: int = 4,
    baseline_steps: int | None = None,
    temperature: float = 0.0,
    seed: int = 1,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """``k2lab mopd report``: trains the SFT baseline into ``DISTILL/baseline`` when missing (same config
    as the distillation, ``baseline_steps`` overriding its steps), scores teacher / student / baseline on
    ``episodes`` held-out seeds per cell, writes report.json, report.md and report.png to ``out_dir``
    (default ``DISTILL/report``); returns the report.

    Refused before any work, one line each: a temperature below 0 or not finite, a ``distill_dir`` that is
    not a finished distillation (its mopd.json, its model), ``experts_dir`` other than the experts the
    distillation used, a finished baseline trained for other than the wanted steps (``baseline_steps``,
    default the distillation's: remove ``DISTILL/baseline`` to retrain it) and an ``out_dir`` that is a file."""
    distill = Path(distill_dir)
    check_temperature(temperature)
    run = check_finished_run(distill, experts_dir)
    specs = manifest_specs(load_manifest(experts_dir))
    baseline_dir = distill / "baseline"
    config = run["config"].model_copy(update={"steps": baseline_steps or run["config"].steps})
    check_baseline_steps(baseline_dir, config.steps)
    out = make_directory(Path(out_dir) if out_dir else distill / "report", "the report directory")
    if not (baseline_dir / "model" / "tokenizer.json").is_file():
        log(f"baseline: SFT on teacher samples, {config.steps} steps")
        run_mopd(experts_dir, run["student"], baseline_dir, config, mode="sft")
    tokenizer = load_tokenizer(distill / "model" / "tokenizer.json")
    router = TeacherRouter.load(experts_dir, specs)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    started = time.perf_counter()
    for who in ("teacher", "student", "baseline", "start"):
        log(f"evaluating {who} on {episodes} held-out prompts per cell")
        if who == "teacher":
            scores[who] = {}
            for spec in specs:
                model = router.teachers[(spec.domain, spec.effort)]
                scores[who] |= evaluate_cells(model, tokenizer, router, [spec], episodes, temperature, seed)
            continue
        paths = {
            "student": distill / "model",
            "baseline": baseline_dir / "model",
            "start": Path(run["student"]),
        }
        model = load_text_model(paths[who], "MOPD's evaluation").eval()
        scores[who] = evaluate_cells(model, tokenizer, router, specs, episodes, temperature, seed)
    rows = report_rows(specs, scores)
    report = {
        "experts": str(experts_dir),
        "distill": str(distill),
        "episodes_per_cell": episodes,
        "temperature": temperature,
        "goal": f"student >= {GOAL} x teacher per cell",
        "cells_met": sum(r["goal_met"] for r in rows),
        "cells": rows,
        "scores": scores,
        "eval_seconds": round(time.perf_counter() - started, 1),
    }
    atomic_write_text(out / "report.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "report.md", markdown_table(rows))
    plot_report(rows, out / "report.png")
    return report
