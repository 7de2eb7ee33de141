"""K2.5's visual RL: outcome-based RL on synthetic visual tasks that cannot be solved without the image.

Each iteration i (``VisualRLTrainer``):

1. The sampling temperature is ``T_i = max(T_floor, T_0 · γ^i)`` (as K2's RL, ``temperature_at``).
2. ``prompts_per_iteration`` fresh tasks x (``k2lab.vision.tasks.generate_tasks`` over ``tasks``, seeded from
   (seed, i)) are asked in K2.5's chat (``visual_chat_prompt``: the image, then the question in the user
   turn); K answers y_1..y_K per image are sampled at T_i with the image's pixel inputs, each row with its
   own seed from (seed, i, prompt, j), up to ``max_new_tokens`` or the turn's ``<|im_end|>``.
3. r_j = visual_reward(kind, y_j, truth) ∈ [0, 1] (K2.5: grounding = soft IoU or point F1, segmentation =
   mask IoU, OCR = 1 − normalised edit distance, counting = the absolute count error's reward; malformed
   answers score 0). A truncated answer is scored as it stands, as the held-out evaluation scores it.
4. K1.5's objective per group, with π_old the weights at the start of the iteration (``k15_loss``)::

       L(θ) = (1/K) Σ_j ( r_j − r̄ − τ · Σ_{t ∈ y_j} m_t (log π_θ(y_t|x, y_<t) − log π_old(y_t|x, y_<t)) )²

   log π is the vision-language model run over prompt + completion with the same pixel inputs, at
   temperature 1, over the tokens the sampler could draw (image / video placeholders excluded, as
   ``generate`` excludes them): ``k2lab.vision.rl_scoring``. m_t = 1, or with ``offpolicy_clip`` = δ K2.5's
   token-level clip 1[|log π_θ − log π_old| ≤ δ]. The loss is averaged over the groups and minimised for
   ``updates_per_iteration`` MuonClip steps; π_old's log-probs are the first step's (θ = θ_old), detached.
   Language model, projector and tower are all trained (joint RL) unless ``freeze_vision``.
5. metrics.jsonl gets one line (mean reward overall and per task kind, loss, tokens, temperature); every
   ``checkpoint_every`` iterations a checkpoint (model, optimizer, RNG; ``k2lab.posttrain.base``): a killed
   run restarted with the same arguments reproduces the uninterrupted run's metrics and weights.

Held-out chat evaluation (``evaluate_visual_tasks(chat=True)`` and its gray-image control ``blind=True``)
and the language model's held-out text loss (``k2lab.vision.text_loss``: mean next-token cross-entropy on
``text_eval_rows`` fixed rows of a corpus's validation split; K2.5 reports its text benchmarks did not drop
after visual RL) run before the first and after the last iteration; both go to ``summary.json``.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from k2lab.agentic.rl.trainer import settle_temperature_floor, temperature_at
from k2lab.data import load_tokenizer
from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.model_dir import check_model_directory, checkpoint_fingerprint, load_model
from k2lab.optim.grouping import OptimizerConfig
from k2lab.optim.muonclip import MuonClip
from k2lab.posttrain.base import IterativeTrainer, open_run, rounded_mean, save_policy
from k2lab.posttrain.objective import signal_groups
from k2lab.runtime.chat import IM_END
from k2lab.train.divergence import check_finite_update
from k2lab.train.persistence import derive_seed
from k2lab.train.sections import VisionDataConfig, check_task_kinds
from k2lab.vision.chat import visual_chat_prompt
from k2lab.vision.evaluate import visual_and_blind_scores
from k2lab.vision.processor import ProcessorConfig
from k2lab.vision.rewards import TASK_KINDS, visual_reward
from k2lab.vision.rl_scoring import Media, completion_logprobs, group_loss
from k2lab.vision.tasks import VisualSample, generate_tasks
from k2lab.vision.text_loss import TextRows, held_out_text, text_loss
from k2lab.vision.vlm import VisionLanguageModel

__all__ = ["VisualRLConfig", "VisualRLTrainer", "evaluation_report", "iteration_report", "run_visual_rl"]

EVAL_BEFORE = "eval_before.json"
SUMMARY = "summary.json"


class VisualRLConfig(BaseModel):
    """Hyper-parameters of ``k2lab visual-rl`` (see the module docstring for the equations)."""

    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(default=10, ge=1, description="Visual RL iterations.")
    prompts_per_iteration: int = Field(
        default=4, ge=1, description="Fresh image prompts (groups) per iteration."
    )
    group_size: int = Field(default=4, ge=2, description="K answers sampled per image prompt.")
    tasks: list[str] = Field(
        default=["counting", "ocr"],
        description=f"Task kinds drawn (of {', '.join(TASK_KINDS)}); k25-mini's pre-training learns only "
        "counting and a little OCR.",
    )
    max_new_tokens: int = Field(default=16, ge=1, description="Tokens per answer (also at evaluation).")
    temperature_start: float = Field(
        default=1.0, gt=0, allow_inf_nan=False, description="Sampling temperature T_0 (then decays)."
    )
    temperature_floor: float = Field(default=0.3, ge=0, allow_inf_nan=False, description="Temperature floor.")
    temperature_decay: float = Field(default=0.9, gt=0, le=1, description="γ in T_i = max(floor, T_0 γ^i).")
    tau: float = Field(default=0.5, gt=0, allow_inf_nan=False, description="τ of the K1.5 objective.")
    offpolicy_clip: float | None = Field(
        default=None, gt=0, description="K2.5 token-level clip δ on |log π_θ − log π_old|."
    )
    updates_per_iteration: int = Field(default=2, ge=1, description="MuonClip steps per iteration.")
    freeze_vision: bool = Field(
        default=False, description="Train the language model only (the tower and projector stay as loaded)."
    )
    # lr 2e-4, not text RL's 1e-3: a reply is scored by its summed log-ratio, and on k25-mini a zero-vision SFT
    # model's 60-96-token replies collapsed at 1e-3 (one MuonClip step moved it by tens of nats; held-out reward
    # 0.39 -> 0.01 in 16 iterations) and held at 2e-4 (docs/zero-vision.md)
    optimizer: OptimizerConfig = OptimizerConfig(lr=2e-4)
    logprob_batch: int = Field(default=16, ge=1, description="Rows per forward when scoring log π.")
    eval_samples: int = Field(
        default=40, ge=0, description="Held-out tasks scored before and after (0: no evaluation)."
    )
    text_eval_rows: int = Field(
        default=32,
        ge=0,
        description="Held-out text rows whose mean next-token cross-entropy (the language model's text loss) "
        "is measured before and after (0: none).",
    )
    text_eval_seq_len: int = Field(
        default=256,
        ge=1,
        description="Tokens per held-out text row (at most the model's max_position_embeddings).",
    )
    text_eval_data: str | None = Field(
        default=None,
        description="Corpus directory whose validation split is the held-out text (as `k2lab train --data`; "
        "give the base's pre-training corpus); unset: the embedded standard-library corpus, `k2lab train`'s "
        "default.",
    )
    checkpoint_every: int = Field(default=1, ge=1, description="Checkpoint every N iterations.")
    keep_checkpoints: int | None = Field(default=3, ge=1, description="Checkpoints kept (unset: all).")
    seed: int = Field(default=0, description="Run seed (tasks and sampling).")

    @model_validator(mode="after")
    def _check(self) -> VisualRLConfig:
        check_task_kinds("tasks", tuple(self.tasks))
        settle_temperature_floor(self)
        return self


# ------------------------------------------------------------------------------------------ the trainer


class VisualRLTrainer(IterativeTrainer):
    """Visual RL of a ``VisionLanguageModel`` with K1.5's objective; ``run()`` trains (resuming if possible).

    ``sources`` (``run_visual_rl``: the source checkpoint's fingerprint) join the settings a resumed run must
    share with its checkpoint."""

    config: VisualRLConfig

    def __init__(
        self,
        model: VisionLanguageModel,
        tokenizer: Tokenizer,
        config: VisualRLConfig,
        out_dir: str | Path,
        sources: dict[str, str | None] | None = None,
    ) -> None:
        if not isinstance(model, VisionLanguageModel):
            raise K2LabError(f"visual RL trains a vision-language model, not a {type(model).__name__}")
        self.model, self.tokenizer, self.sources = model.eval(), tokenizer, dict(sources or {})
        super().__init__(config, out_dir)
        self.model.vision.requires_grad_(not config.freeze_vision)
        self.optimizer = MuonClip(model, config.optimizer, verbose=False)
        self.processor = ProcessorConfig.from_vision_config(model.config.vision)
        self.end = tokenizer.special_tokens[IM_END]
        self.text: TextRows | None = None  # the held-out text rows, made at the first evaluation
        self.iteration = 0
        self.resume()

    # ---- persistence
    def settings(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json") | self.sources

    def state_parts(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_parts(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    # ---- the loop
    def run(
        self, iterations: int | None = None, on_iteration: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        """Evaluate (on a fresh run), train until ``iterations`` (default ``config.iterations``) are done,
        evaluate again and write ``summary.json``; returns this call's metrics lines."""
        total = iterations or self.config.iterations
        if self.completed == 0:
            atomic_write_text(self.out / EVAL_BEFORE, json.dumps(self.evaluate(), indent=2) + "\n")
        history = self.run_loop(total, on_iteration)
        before = self.out / EVAL_BEFORE
        lines = self.history()
        summary = {
            "iterations": self.completed,
            "before": json.loads(before.read_text()) if before.is_file() else None,
            "after": self.evaluate(),
            "text_eval": self.text.describe() if self.text else None,
            "mean_reward_first": lines[0]["mean_reward"] if lines else None,
            "mean_reward_last": lines[-1]["mean_reward"] if lines else None,
            "seconds_per_iteration": rounded_mean([line["seconds"] for line in lines]),
        }
        atomic_write_text(self.out / SUMMARY, json.dumps(summary, indent=2) + "\n")
        return history

    def evaluate(self) -> dict[str, Any] | None:
        """Held-out chat-format scores per task kind, with images and with gray ones (``blind``), and the
        language model's held-out ``text_loss``; None when neither is asked for."""
        config, scores = self.config, dict[str, Any]()
        if config.eval_samples > 0:
            data = VisionDataConfig(
                tasks=tuple(config.tasks),
                eval_samples=config.eval_samples,
                eval_max_new_tokens=config.max_new_tokens,
            )
            both = visual_and_blind_scores(self.model, self.tokenizer, data, seed=config.seed, chat=True)
            scores = {"chat": both["visual_scores"], "blind": both["visual_scores_blind"]}
        if config.text_eval_rows > 0:
            scores["text_loss"] = text_loss(self.model, self.held_out_text())
        return scores or None

    def held_out_text(self) -> TextRows:
        """The held-out text rows (``text_eval_*``), made once in the model's tokenizer."""
        if self.text is None:
            config = self.config
            context = self.model.language_model.config.max_position_embeddings
            seq_len = min(config.text_eval_seq_len, context)
            self.text = held_out_text(self.tokenizer, config.text_eval_rows, seq_len, config.text_eval_data)
        return self.text

    def advance(self) -> dict[str, Any]:
        """Sample, score, update ``updates_per_iteration`` times; returns (and logs) the metrics."""
        started, i, config = time.perf_counter(), self.iteration, self.config
        temperature = temperature_at(
            i, config.temperature_start, config.temperature_floor, config.temperature_decay
        )
        samples = generate_tasks(
            config.prompts_per_iteration, kinds=config.tasks, seed=derive_seed(config.seed, "tasks", i)
        )
        prompts, media, completions = self._sample(samples, temperature, i)
        rolled = time.perf_counter()
        texts = [self.tokenizer.decode(c, skip_special_tokens=True).strip() for c in completions]
        k = config.group_size
        rewards = [
            visual_reward(samples[r // k].kind, texts[r], samples[r // k].truth) for r in range(len(texts))
        ]
        losses = self._update(prompts, media, completions, rewards)
        self.iteration += 1
        metrics = self._metrics(i, temperature, samples, completions, rewards, losses)
        metrics |= {
            "seconds": round(time.perf_counter() - started, 3),
            "rollout_seconds": round(rolled - started, 3),
        }
        self.log_metrics(metrics)
        return metrics

    def _sample(
        self, samples: Sequence[VisualSample], temperature: float, iteration: int
    ) -> tuple[list[list[int]], list[Media], list[list[int]]]:
        """K answers per sample, in one batch: (prompt ids, pixel inputs, completion ids) per row."""
        k, vision = self.config.group_size, self.model.config.vision
        asked = [visual_chat_prompt(s, self.tokenizer, vision, self.processor) for s in samples]
        prompts = [ids for ids, _ in asked for _ in range(k)]
        media = [m for _, m in asked for _ in range(k)]
        seeds = [
            derive_seed(self.config.seed, "sample", iteration, s, j)
            for s in range(len(samples))
            for j in range(k)
        ]
        settings = GenerationConfig(
            max_new_tokens=self.config.max_new_tokens, temperature=temperature, eos_token_id=self.end
        )
        batch = {key: torch.cat([m[key] for m in media]) for key in media[0]}
        completions = generate(self.model, prompts, settings, media=batch, row_seeds=seeds)
        return prompts, media, completions

    def _update(
        self,
        prompts: list[list[int]],
        media: list[Media],
        completions: list[list[int]],
        rewards: list[float],
    ) -> dict[str, Any]:
        """``updates_per_iteration`` MuonClip steps on mean_groups L(θ); returns the last step's loss."""
        k, config = self.config.group_size, self.config
        groups = range(0, len(completions), k)
        reward_tensors = [torch.tensor(rewards[g : g + k], dtype=torch.float32) for g in groups]
        old: list[torch.Tensor] | None = None
        result: dict[str, Any] = {}
        for _ in range(config.updates_per_iteration):
            new = completion_logprobs(self.model, prompts, completions, media, config.logprob_batch)
            if old is None:  # the first step runs at θ = θ_old: its log-probs are π_old's
                old = [x.detach() for x in new]
            parts = [
                group_loss(r, new[g : g + k], old[g : g + k], config.tau, config.offpolicy_clip)
                for r, g in zip(reward_tensors, groups, strict=True)
            ]
            loss = torch.stack([p[0] for p in parts]).mean()
            loss.backward()
            check_finite_update(
                self.iteration, loss, self.model.parameters(), config.optimizer.lr, self.out, "iteration",
                self.checkpoints,
            )  # fmt: skip
            self.optimizer.step()
            self.optimizer.zero_grad()
            result = {"loss": round(float(loss.detach()), 6), "clipped_tokens": sum(p[1] for p in parts)}
        return result

    def _metrics(
        self,
        iteration: int,
        temperature: float,
        samples: Sequence[VisualSample],
        completions: Sequence[list[int]],
        rewards: Sequence[float],
        losses: dict[str, Any],
    ) -> dict[str, Any]:
        k = self.config.group_size
        per_task: dict[str, list[float]] = defaultdict(list)
        for r, reward in enumerate(rewards):
            per_task[samples[r // k].kind].append(reward)
        return {
            "iteration": iteration,
            "temperature": round(temperature, 6),
            "answers": len(completions),
            "groups": len(samples),
            "signal_groups": signal_groups([rewards[g : g + k] for g in range(0, len(rewards), k)]),
            "mean_reward": rounded_mean(rewards),
            "per_task": {kind: rounded_mean(v) for kind, v in sorted(per_task.items())},
            "trained_tokens": sum(len(c) for c in completions),
            "tokens_per_answer": rounded_mean([len(c) for c in completions]),
            "finished": rounded_mean([float(c[-1] == self.end) for c in completions]),
            **losses,
        }


# ------------------------------------------------------------------------------------------ entry point


def run_visual_rl(
    checkpoint: str | Path,
    out_dir: str | Path,
    config: VisualRLConfig,
    resume: bool = True,
    threads: int | None = None,
    on_iteration: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """``k2lab visual-rl``: load a vision-language ``checkpoint`` (with tokenizer.json), train, save the VLM
    to ``OUT/model`` with the tokenizer. Resumes from ``OUT/checkpoints`` (``resume`` False refuses to run over
    them); refused when the config or the source checkpoint's content differs."""
    checkpoint, out = check_model_directory(checkpoint), Path(out_dir)
    if not (checkpoint / "tokenizer.json").is_file():
        raise K2LabError(
            f"{checkpoint} has no tokenizer.json: visual RL renders chats with the model's tokenizer"
        )
    model = load_model(checkpoint)
    if not isinstance(model, VisionLanguageModel):
        raise K2LabError(
            f"{checkpoint} is a text model; visual RL trains a vision-language model (k25-*, k3-vl-* presets): "
            "use `k2lab rl` for text RL"
        )
    open_run(out, "visual-rl", [checkpoint], resume, threads, config.seed)
    tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
    sources = {"source_checkpoint_fingerprint": checkpoint_fingerprint(checkpoint)}
    history = VisualRLTrainer(model, tokenizer, config, out, sources=sources).run(on_iteration=on_iteration)
    save_policy(model, tokenizer, out)
    return history


def evaluation_report(summary: dict[str, Any]) -> str | None:
    """One console line of ``summary.json``'s held-out results before → after (None without any)."""
    before, after = summary.get("before") or {}, summary.get("after") or {}
    parts = [
        f"{label} {before[key]['mean']:.3f} → {after[key]['mean']:.3f}"
        for key, label in (("chat", "held-out visual mean"), ("blind", "gray-image mean"))
        if key in before and key in after
    ]
    if "text_loss" in before and "text_loss" in after:
        text = summary.get("text_eval") or {}
        parts.append(
            f"text loss {before['text_loss']:.4f} → {after['text_loss']:.4f} nats/token "
            f"({text.get('rows')} rows × {text.get('seq_len')} tokens of {text.get('corpus')})"
        )
    return ", ".join(parts) or None


def iteration_report(metrics: dict[str, Any], total: int) -> str:
    """One console line per iteration."""
    tasks = ", ".join(f"{kind} {value}" for kind, value in metrics["per_task"].items())
    return (
        f"iteration {metrics['iteration'] + 1}/{total}: mean reward {metrics['mean_reward']} ({tasks}), "
        f"{metrics['signal_groups']} of {metrics['groups']} groups with unequal rewards, "
        f"loss {metrics.get('loss')}, {metrics['trained_tokens']:,} tokens at T={metrics['temperature']}, "
        f"{metrics['seconds']:.1f} s"
    )
