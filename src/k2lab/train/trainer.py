"""The pre-training loop: packed batches -> K2 model -> MuonClip, with telemetry, checkpoints and resume.

One optimizer step:

    for each of grad_accum micro-batches: loss = CE(model(x), y)/grad_accum (+ balance loss); backward
    clip the global gradient norm; lr ← peak · schedule(step)
    MuonClip.step()  -> Muon/AdamW update, then per-head QK-Clip on the step's max logits
    router bias ← DeepSeek-V3 sign rule on the step's expert loads
    log metrics; validate every ``eval_every``; checkpoint every ``save_every``

Everything that decides the next step (weights, optimizer, data position, RNG) is in the checkpoint, so a
run killed at any moment and resumed continues with exactly the losses it would have had.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

from k2lab.data.packing import Batch
from k2lab.data.tokenizer import Tokenizer
from k2lab.hardware import Choice, choose
from k2lab.models import CausalLM, build_model
from k2lab.nn.balancing import all_reduce_loads, deepseek_bias_update, quantile_balance
from k2lab.optim.muonclip import MuonClip
from k2lab.presets import language_model_config, load_preset, load_vlm_preset
from k2lab.train import distributed
from k2lab.train.compile import compile_decision, compiled
from k2lab.train.config import TrainConfig
from k2lab.train.curriculum import rope_scaling_for, stage_index
from k2lab.train.schedule import lr_multiplier
from k2lab.vision.vlm import VisionLanguageModel, build_vlm

console = Console()


def precision_choices(config: TrainConfig, device: str = "cpu") -> dict[str, Choice]:
    """The run's compute dtypes (``k2lab.hardware``): the model step under autocast and Newton–Schulz."""
    return {
        "autocast": choose("autocast", config.precision, device),
        "newton_schulz": choose("newton_schulz", config.optimizer.ns_precision, device),
    }


@dataclass
class StepResult:
    loss: float
    aux_loss: float
    grad_norm: float
    tokens: int


class Trainer:
    """Owns the model, optimizer, data and run directory of one training run."""

    def __init__(
        self, config: TrainConfig, model: CausalLM, batches, val_batches: list, run_dir: Path
    ) -> None:
        self.config = config
        self.model = model
        self.batches = batches
        self.val_batches = val_batches
        self.run_dir = run_dir
        self.muonclip = MuonClip(model, config.optimizer, verbose=distributed.is_main())
        self.device = next(model.parameters()).device.type
        self.precision = precision_choices(config, self.device)
        self.compiled, self.compile_reason = compile_decision(config.compile, self.device)
        self.train_forward = compiled(model) if self.compiled else model
        self.lm: CausalLM = language_model(model)
        for moe in self.lm.moe_layers():
            moe.balance_alpha = config.balance.sequence_loss_alpha
            moe.record_scores = config.balance.bias_rule == "quantile"
        self.step = 0

    # ---- one step -------------------------------------------------------------------------------------
    def autocast(self):
        """Autocast to the dtype ``k2lab.hardware`` chose for the model step (none when that is fp32)."""
        dtype = self.precision["autocast"].dtype
        return torch.autocast(self.device, dtype=dtype) if dtype != torch.float32 else nullcontext()

    def loss_of(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token cross-entropy of ``batch`` and the summed MoE balance loss (the compiled forward
        in training when ``compile`` is on; validation stays eager)."""
        labels = batch.labels
        forward = self.train_forward if self.model.training else self.model
        with self.autocast():
            logits = forward(batch.input_ids, segment_ids=batch.segment_ids, **(batch.media or {})).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        aux = sum((moe.aux_loss for moe in self.lm.moe_layers() if moe.aux_loss is not None), torch.zeros(()))
        return loss, aux

    def train_step(self) -> tuple[StepResult, list[torch.Tensor]]:
        config = self.config
        self.model.train()
        loads = [torch.zeros(moe.experts.n_experts) for moe in self.lm.moe_layers()]
        total_loss, total_aux, tokens = 0.0, 0.0, 0
        for _ in range(config.grad_accum):
            batch = next(self.batches)
            labels = batch.labels
            loss, aux = self.loss_of(batch)
            ((loss + aux) / config.grad_accum).backward()
            total_loss += loss.item() / config.grad_accum
            total_aux += float(aux) / config.grad_accum
            tokens += labels.numel()
            for load, moe in zip(loads, self.lm.moe_layers(), strict=True):
                load += moe.last_expert_counts.float().cpu()
        grad_norm = self._clip_gradients()
        for group in self.muonclip.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier(self.step, config.steps, config.schedule)
        loss, aux = distributed.all_reduce_mean([total_loss, total_aux])  # identity in one process
        return StepResult(loss, aux, grad_norm, tokens * distributed.world_size()), all_reduce_loads(loads)

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        return float(distributed.full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm)))

    def update(self, loads: list[torch.Tensor]) -> dict[str, float]:
        stats = self.muonclip.step()
        self.muonclip.zero_grad()
        rule = self.config.balance.bias_rule
        for moe, load in zip(self.lm.moe_layers(), loads, strict=True):
            if rule == "deepseek":
                deepseek_bias_update(moe.router, load, self.config.balance.gamma)
            elif rule == "quantile":  # the scores of this step's batch set the bias for the next
                quantile_balance(moe)
        return stats

    # ---- evaluation -----------------------------------------------------------------------------------
    @torch.no_grad()
    def validation_loss(self) -> float:
        self.model.eval()
        self.muonclip.qk_clip.record(False)
        losses = [self.loss_of(batch)[0].item() for batch in self.val_batches]
        self.muonclip.qk_clip.record(True)
        return distributed.all_reduce_mean(sum(losses) / max(len(losses), 1))

    def metrics(
        self, result: StepResult, stats: dict[str, float], loads: list[torch.Tensor], seconds: float
    ) -> dict:
        values: dict[str, float | list[float]] = {
            "loss": result.loss,
            "lr": self.muonclip.param_groups[0]["lr"],
            "tokens_per_s": result.tokens / max(seconds, 1e-9),
            "grad_norm": result.grad_norm,
            **stats,
        }
        if self.config.balance.sequence_loss_alpha > 0:
            values["balance_loss"] = result.aux_loss
        first = self.lm.config.first_k_dense_replace
        for index, load in enumerate(loads):
            values[f"expert_load/layer{index + first}"] = load.tolist()
            values[f"expert_imbalance/layer{index + first}"] = float(load.max() / load.mean().clamp(min=1e-9))
        return values


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def tokenizer_vocab_for(preset: str) -> int:
    """The BPE vocabulary a run of ``preset`` trains when the recipe names none: the preset's own, or the
    byte-level minimum (256 bytes + special tokens) where the preset's is smaller (the nano presets' 128)."""
    from k2lab.data.tokenizer import MIN_VOCAB_SIZE

    own = language_model_config(preset).vocab_size
    if own < MIN_VOCAB_SIZE:
        console.print(
            f"{preset}'s vocabulary ({own}) is below the byte-level BPE's minimum; training a "
            f"{MIN_VOCAB_SIZE}-token tokenizer (the model's vocabulary follows it)"
        )
        return MIN_VOCAB_SIZE
    return own


def language_model(model: torch.nn.Module) -> CausalLM:
    """The decoder of a ``CausalLM`` (itself) or of a ``VisionLanguageModel``."""
    return getattr(model, "language_model", model)


def build_trainer_model(
    config: TrainConfig, vocab_size: int, special_tokens: dict[str, int] | None = None
) -> CausalLM | VisionLanguageModel:
    """The preset with the tokenizer's vocabulary and the recipe's overrides (a VLM for k25-style presets,
    its media token ids from ``special_tokens``)."""
    text_overrides = {"vocab_size": vocab_size, **config.model_overrides}
    if config.vision is not None:
        vlm_config = load_vlm_preset(
            config.preset, special_tokens, config.vision.vision_overrides, **text_overrides
        )
        return build_vlm(vlm_config, seed=config.seed)
    return build_model(load_preset(config.preset, **text_overrides), seed=config.seed)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


# ---- the whole run ---------------------------------------------------------------------------------------
def training_state(trainer: Trainer, data: StageData) -> dict:
    """Everything the next step depends on (checkpoint payload)."""
    from k2lab.train.persistence import capture_rng_state

    return {
        "step": trainer.step,
        "model": distributed.full_state_dict(trainer.model, rank0_only=True),
        "optimizer": distributed.full_optimizer_state_dict(trainer.muonclip, rank0_only=True),
        "data": data.state_dict(),
        "rng": capture_rng_state(),
        "train_config": trainer.config.model_dump(mode="json"),
        "model_config": trainer.model.config.model_dump(mode="json"),
    }


def restore_training_state(trainer: Trainer, data: StageData, state: dict) -> None:
    from k2lab.train.persistence import restore_rng_state

    distributed.load_full_state_dict(trainer.model, state["model"])
    distributed.load_full_optimizer_state_dict(trainer.muonclip, state["optimizer"])
    data.load_state_dict(state["data"])
    restore_rng_state(state["rng"])
    trainer.step = int(state["step"])


def sample_text(model: CausalLM, tokenizer, prompt: str, tokens: int, seed: int) -> str:
    """A short greedy-ish continuation (temperature 0.8, top-p 0.95) of ``prompt`` (``prompt`` alone when
    ``tokens`` is 0)."""
    from k2lab.infer import GenerationConfig, generate

    if tokens == 0:
        return prompt
    ids = tokenizer.encode(prompt) or [tokenizer.bos_id]
    settings = GenerationConfig(
        max_new_tokens=tokens, temperature=0.8, top_p=0.95, seed=seed, eos_token_id=tokenizer.eos_id
    )
    model.eval()
    return prompt + tokenizer.decode(generate(model, [ids], settings)[0], skip_special_tokens=True)


def run_training(config: TrainConfig, resume: bool = False) -> dict[str, Any]:
    """Train per ``config``; writes the run directory and returns the final summary.

    Under ``torchrun`` every process runs this: data-parallel FSDP2 over the global ``batch_size``
    (see ``k2lab.train.distributed``); rank 0 prints and writes the run directory.
    """
    with distributed.session():
        console.quiet = not distributed.is_main()
        return _run_training(config, resume)


def _run_training(config: TrainConfig, resume: bool) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from k2lab.checkpoint import save_model
    from k2lab.errors import K2LabError
    from k2lab.train.checkpoint import list_checkpoints, load_latest_checkpoint, save_training_checkpoint
    from k2lab.train.dashboard import plot_dashboard
    from k2lab.train.metrics import MetricsLogger

    run_dir = Path(config.out)
    if list_checkpoints(run_dir) and not resume:
        raise K2LabError(
            f"{run_dir} already holds checkpoints; pass --resume to continue it or choose a new --out"
        )
    distributed.check_batch_size(config.batch_size)
    torch.manual_seed(config.seed)
    if config.sft is not None:  # fine-tune a checkpoint on chat trajectories (k2lab.agentic.sft)
        from k2lab.agentic.sft import prepare_sft

        config, tokenizer, model, data = prepare_sft(config)
        console.print(f"SFT of {config.sft.init_checkpoint}: {data.summary()}; tokenizer: {tokenizer}")
        baseline = float("nan")
        fresh_model = data.fresh_model
    else:
        config, tokenizer, model, data, baseline = prepare_pretraining(config)

        def fresh_model() -> CausalLM | VisionLanguageModel:
            return data.final_model(
                build_trainer_model(config, tokenizer.vocab_size, tokenizer.special_tokens)
            )

    model = distributed.shard_model(model)
    trainer = Trainer(config, model, data.train_batches(), data.val_batches, run_dir)

    if resume:
        loaded = load_latest_checkpoint(
            run_dir, on_skip=lambda line: console.print(line, style="yellow", markup=False)
        )
        if loaded is not None:
            restore_training_state(trainer, data, loaded[1])
            trainer.batches, trainer.val_batches = data.train_batches(), data.val_batches
            console.print(f"resumed {run_dir} at step {trainer.step}")
    metrics = distributed.on_main(lambda: MetricsLogger(run_dir, resume_step=trainer.step))
    for path, choice in trainer.precision.items():
        console.print(f"precision of {path.replace('_', '-')}: {choice.describe()}", markup=False)
    console.print(f"compiled training step: {'on' if trainer.compiled else 'off'} ({trainer.compile_reason})")
    tau = config.optimizer.qk_clip_tau
    progress = Progress(
        TextColumn("[bold]train[/] {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn(
            "loss {task.fields[loss]:.3f}  {task.fields[tps]:,.0f} tok/s  max logit {task.fields[logit]:.1f}"
        ),
        TextColumn("clipped {task.fields[clipped]:.0f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not distributed.is_main(),
    )
    val_loss = float("nan")
    with progress, metrics:
        task = progress.add_task(
            "train", total=config.steps, completed=trainer.step, loss=0.0, tps=0.0, logit=0.0, clipped=0
        )
        while trainer.step < config.steps:
            stage = stage_index(data.stages, trainer.step)
            if stage != data.index:
                data.enter(stage)
                trainer.batches, trainer.val_batches = data.train_batches(), data.val_batches
                console.print(f"step {trainer.step}: curriculum stage {stage} {data.describe()}")
            start = time.perf_counter()
            result, loads = trainer.train_step()
            stats = trainer.update(loads)
            seconds = time.perf_counter() - start
            trainer.step += 1
            values = trainer.metrics(result, stats, loads, seconds)
            if trainer.step % config.eval_every == 0 or trainer.step == config.steps:
                val_loss = trainer.validation_loss()
                values["val_loss"] = val_loss
            metrics.log(trainer.step, values)
            progress.update(
                task,
                completed=trainer.step,
                loss=result.loss,
                tps=values["tokens_per_s"],
                logit=stats["max_logit"],
                clipped=stats["qk_clipped_heads"],
            )
            if trainer.step % config.save_every == 0 or trainer.step == config.steps:
                state = training_state(trainer, data)  # a collective under FSDP2
                if distributed.is_main():
                    save_training_checkpoint(run_dir, trainer.step, state, config.keep_last)

    summary: dict = {"val_loss": val_loss, "steps": trainer.step}
    summary["precision"] = {path: choice.name for path, choice in trainer.precision.items()}
    summary["precision_reason"] = {path: choice.reason for path, choice in trainer.precision.items()}
    summary["compiled"] = trainer.compiled
    if not math.isnan(baseline):
        summary["unigram_baseline"] = baseline
    model = distributed.gather_model(model, fresh_model)
    if model is None:  # not rank 0: it took part in the gather; rank 0 writes the rest
        return summary
    save_model(model, run_dir / "model")
    tokenizer.save(run_dir / "model" / "tokenizer.json")
    if config.vision is not None and config.vision.eval_samples:
        from k2lab.vision.evaluate import evaluate_visual_tasks

        for key, blind in (("visual_scores", False), ("visual_scores_blind", True)):
            scores = evaluate_visual_tasks(model, tokenizer, config.vision, seed=config.seed, blind=blind)
            summary[key] = scores
            what = "gray images (language prior)" if blind else "held-out, mean reward"
            console.print(f"visual tasks ({what}): " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    sample = sample_text(
        language_model(model), tokenizer, config.sample_prompt, config.sample_tokens, config.seed
    )
    (run_dir / "sample.txt").write_text(sample + "\n")
    dashboard = plot_dashboard(run_dir, tau=tau)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"[bold]sample:[/]\n{sample}")
    report = f"validation loss {val_loss:.3f} nats/token (perplexity {perplexity(val_loss):.1f})"
    if config.sft is not None:
        console.print(f"{report} on held-out assistant tokens")
    else:
        verdict = "below" if val_loss < baseline else "[red]NOT below[/]"
        console.print(
            f"{report}: {abs(baseline - val_loss):.2f} nats {verdict} the unigram baseline {baseline:.3f}"
        )
    console.print(
        f"run directory {run_dir}: checkpoints/, metrics.jsonl, tensorboard/, {dashboard.name}, sample.txt, model/"
    )
    return summary


def prepare_pretraining(
    config: TrainConfig,
) -> tuple[TrainConfig, Tokenizer, CausalLM | VisionLanguageModel, StageData, float]:
    """Corpus, tokenizer (trained or loaded), a fresh model, the stage data and the unigram baseline; the
    config comes back with the tokenizer's special ids among its model overrides."""
    from k2lab.data import load_corpus, load_tokenizer, train_tokenizer, unigram_baseline

    corpus = load_corpus(config.data, max_bytes=config.data_max_bytes)
    vocab = config.vocab_size or tokenizer_vocab_for(config.preset)
    with distributed.main_first():  # rank 0 fills the tokenizer cache, the others read it
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else train_tokenizer(corpus, vocab)
    console.print(f"corpus: {corpus}; tokenizer: {tokenizer}")
    overrides = {
        "pad_token_id": tokenizer.pad_id,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
    }
    config = config.model_copy(update={"model_overrides": {**overrides, **config.model_overrides}})
    model = build_trainer_model(config, tokenizer.vocab_size, tokenizer.special_tokens)
    data = StageData(config, corpus, tokenizer, model)
    data.enter(0)
    return config, tokenizer, model, data, unigram_baseline(corpus, tokenizer)


class StageData:
    """Batches of the current context-curriculum stage (``TrainConfig.stages()``): one ``PackedBatches``
    per stage (seeded by stage), that stage's validation batches, and its YaRN scaling on the model."""

    def __init__(self, config: TrainConfig, corpus, tokenizer, model: CausalLM | VisionLanguageModel) -> None:
        self.config, self.corpus, self.tokenizer = config, corpus, tokenizer
        self.model = language_model(model)
        self.stages = config.stages()
        self.index: int | None = None
        self.vision_config = getattr(model, "config", None) if config.vision is not None else None
        self.mixture = None

    def enter(self, index: int) -> None:
        from k2lab.data import PackedBatches, validation_batches

        config, stage = self.config, self.stages[index]
        self.index = index
        masking = config.document_masking
        self.batches = PackedBatches(
            self.corpus.train,
            self.tokenizer,
            config.batch_size,
            stage.seq_len,
            seed=config.seed + index,
            return_segments=masking,
        )
        val = validation_batches(
            self.corpus.val,
            self.tokenizer,
            config.batch_size,
            stage.seq_len,
            max_batches=config.eval_batches,
            return_segments=masking,
        )
        self.val_batches = [distributed.local_batch(batch) for batch in val]
        if self.vision_config is not None:
            self.mixture = self._mixture(stage.seq_len)
        if self.config.curriculum:  # without a curriculum the preset's own rope scaling stays
            self.model.set_rope_scaling(rope_scaling_for(self.stages, index))

    def _mixture(self, seq_len: int):
        """Joint vision-text batches over this stage's text batches (``k2lab.vision.mixture``)."""
        from k2lab.vision.mixture import MixedBatches, VisualStream

        config, previous = self.config, self.mixture
        stream = VisualStream(
            self.tokenizer, self.vision_config.vision, config.vision.tasks, seed=config.seed
        )
        mixture = MixedBatches(self.batches, stream, config.vision, config.steps, config.grad_accum, seq_len)
        if previous is not None:  # a new curriculum stage continues the visual stream and the schedule
            mixture.load_state_dict(previous.state_dict())
        return mixture

    def final_model(self, model: CausalLM | VisionLanguageModel) -> CausalLM | VisionLanguageModel:
        """``model`` (a fresh build) with the rope scaling the run ended in."""
        if self.config.curriculum:
            language_model(model).set_rope_scaling(rope_scaling_for(self.stages, self.index))
        return model

    def describe(self) -> str:
        scaling = self.model.config.rope_scaling
        yarn = f", YaRN ×{scaling.factor:g}" if scaling else ""
        return f"(seq_len {self.stages[self.index].seq_len}{yarn})"

    def train_batches(self) -> Iterator[Batch]:
        return distributed.local_batches(self.mixture if self.mixture is not None else self.batches)

    def state_dict(self) -> dict:
        state = {"stage": self.index, "batches": self.batches.state_dict()}
        if self.mixture is not None:
            state["vision"] = self.mixture.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.enter(int(state["stage"]))
        self.batches.load_state_dict(state["batches"])
        if self.mixture is not None:
            self.mixture.load_state_dict(state["vision"])
