"""The pre-training loop: batches of a ``TrainingData`` -> K2 model -> MuonClip, with telemetry,
checkpoints and resume.

``run_training(config)`` builds the recipe's data (``k2lab.train.sources``: packed text, text with visual
rows, or SFT conversations) and runs ``train(data)``, which reads only the ``k2lab.train.data`` interface.

One optimizer step:

    for each of grad_accum micro-batches: loss = CE(model(x), y)/grad_accum (+ balance loss)
                                          (+ λ · MTP loss with MTP modules, k2lab.train.mtp_loss); backward
        (data-parallel ranks backpropagate their token-weighted share of the micro-batch's mean,
        k2lab.train.token_mean, so the averaged gradient is one process's)
    clip the global gradient norm; lr ← peak · schedule(step)
    MuonClip.step()  -> Muon/AdamW update, then per-head QK-Clip on the step's max logits
    router bias ← the bias rule on the step's expert loads (DeepSeek-V3 sign rule, or K3's Quantile
                  Balancing on the step's scores: the default for K3-family models, k2lab.train.family_settings)
    log metrics; validate every ``eval_every`` (with the MoE layers' activation maxima on the validation
    batches, k2lab.train.moe_telemetry); checkpoint every ``save_every``

Everything that decides the next step (weights, optimizer, data position, RNG) is in the checkpoint, so a
run killed at any moment and resumed continues with exactly the losses it would have had.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from k2lab.data.packing import Batch
from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import CheckpointError, K2LabError
from k2lab.fsutil import atomic_write_text
from k2lab.hardware import Choice, choose
from k2lab.infer import GenerationConfig, generate
from k2lab.interrupt import last_checkpoint, reports_interrupt
from k2lab.model_dir import save_model
from k2lab.models import CausalLM
from k2lab.nn.balancing import all_reduce_loads, deepseek_bias_update, quantile_balance
from k2lab.optim.muonclip import MuonClip
from k2lab.train import distributed
from k2lab.train.compile import compile_decision, compiled
from k2lab.train.config import TrainConfig
from k2lab.train.dashboard import plot_dashboard
from k2lab.train.data import TrainingData, language_model
from k2lab.train.divergence import check_finite_step
from k2lab.train.family_settings import chosen_values, describe_choices, family_reasons, keep_saved_choices
from k2lab.train.metrics import MetricsLogger
from k2lab.train.moe_telemetry import moe_activation_maxima
from k2lab.train.mtp_loss import MTPLoss, fused_mtp_loss
from k2lab.train.persistence import capture_rng_state, restore_rng_state
from k2lab.train.resume import (
    SUMMARY_FILE,
    check_no_orphan_results,
    check_resumed_data,
    check_resumed_settings,
    recorded_settings,
    results_written,
)
from k2lab.train.run_checkpoints import CheckpointWriter, list_checkpoints, load_latest_checkpoint
from k2lab.train.run_directory import claim_run_directory
from k2lab.train.schedule import lr_multiplier
from k2lab.train.token_mean import global_token_means
from k2lab.train.validation import validation_loss

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
    mtp_loss: float | None = None  # mean over depths, without λ (only with MTP modules)
    mtp_top1: float | None = None

    @property
    def finite(self) -> bool:
        """Whether the loss and the gradient norm are finite (``k2lab.train.divergence``)."""
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class Trainer:
    """One training run's model, optimizer and step: ``train_step`` + ``update`` over ``batches`` (an
    iterator of micro-batches), ``validation_loss`` over ``val_batches``; ``train`` drives it.
    ``val_activations`` holds the MoE activation maxima of the last validation (``moe_activation_maxima``)."""

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
        self.mtp = len(self.lm.mtp) > 0
        if self.mtp and self.lm is not model:
            raise K2LabError("multi-token prediction trains a text model; this model wraps its decoder")
        for moe in self.lm.moe_layers():
            moe.balance_alpha = config.balance.sequence_loss_alpha
            moe.record_scores = config.balance.bias_rule == "quantile"
        self.step = 0
        self.val_activations: dict[str, float] = {}

    # ---- one step -------------------------------------------------------------------------------------
    def autocast(self):
        """Autocast to the dtype ``k2lab.hardware`` chose for the model step (none when that is fp32)."""
        dtype = self.precision["autocast"].dtype
        return torch.autocast(self.device, dtype=dtype) if dtype != torch.float32 else nullcontext()

    def loss_of(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, MTPLoss | None]:
        """Mean next-token cross-entropy of ``batch``, the summed MoE balance loss and, for a model with MTP
        modules in training, their loss (the compiled forward in training when ``compile`` is on;
        validation stays eager and runs the main model only)."""
        labels = batch.labels
        forward = self.train_forward if self.model.training else self.model
        run_mtp = self.mtp and self.model.training
        extra = {"output_hidden": True} if run_mtp else {}
        with self.autocast():
            out = forward(
                batch.input_ids, segment_ids=batch.segment_ids, labels=labels, **(batch.media or {}), **extra
            )
            depths = self.lm.mtp_hidden(batch.input_ids, out.hidden, batch.segment_ids) if run_mtp else None
            mtp = None if depths is None else fused_mtp_loss(depths, self.lm.lm_head.weight, labels)
        aux = sum((moe.aux_loss for moe in self.lm.moe_layers() if moe.aux_loss is not None), torch.zeros(()))
        return out.loss, aux, mtp

    def train_step(self) -> tuple[StepResult, list[torch.Tensor]]:
        config = self.config
        self.model.train()
        loads = [torch.zeros(moe.experts.n_experts) for moe in self.lm.moe_layers()]
        total_loss, total_aux, tokens = 0.0, 0.0, 0
        total_mtp = [0.0, 0.0]  # MTP loss, depth-1 top-1
        for _ in range(config.grad_accum):
            batch = next(self.batches)
            labels = batch.labels
            loss, aux, mtp = self.loss_of(batch)
            loss, mtp = global_token_means(loss, mtp, labels)  # ranks' token-weighted shares; alone as is
            objective = loss + aux if mtp is None else loss + aux + config.mtp_loss_weight * mtp.loss
            (objective / config.grad_accum).backward()
            total_loss += loss.item() / config.grad_accum
            total_aux += float(aux) / config.grad_accum
            if mtp is not None:
                total_mtp[0] += mtp.loss.item() / config.grad_accum
                total_mtp[1] += mtp.top1.item() / config.grad_accum
            tokens += labels.numel()
            for load, moe in zip(loads, self.lm.moe_layers(), strict=True):
                load += moe.last_expert_counts.float().cpu()
        grad_norm = self._clip_gradients()
        for group in self.muonclip.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier(self.step, config.steps, config.schedule)
        loss, aux, *mtp = distributed.all_reduce_mean([total_loss, total_aux, *total_mtp])  # identity in one
        result = StepResult(loss, aux, grad_norm, tokens * distributed.world_size())
        if self.mtp:
            result.mtp_loss, result.mtp_top1 = mtp
        return result, all_reduce_loads(loads)

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
    def validation_loss(self) -> float:
        """``k2lab.train.validation``'s L_val over ``val_batches`` (main model only, under the run's
        autocast); the MoE layers' activation maxima on those batches go to ``val_activations``."""
        with moe_activation_maxima(self.lm) as maxima:
            loss = validation_loss(self.model, self.val_batches, lambda batch: self.loss_of(batch)[0])
        self.val_activations = distributed.all_reduce_max(maxima)
        return loss

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
        if result.mtp_loss is not None:
            values["mtp_loss"], values["mtp_top1"] = result.mtp_loss, result.mtp_top1
        first = self.lm.config.first_k_dense_replace
        for index, load in enumerate(loads):
            values[f"expert_load/layer{index + first}"] = load.tolist()
            values[f"expert_imbalance/layer{index + first}"] = float(load.max() / load.mean().clamp(min=1e-9))
        return values


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


# ---- the whole run ---------------------------------------------------------------------------------------
def training_state(trainer: Trainer, data: TrainingData) -> dict:
    """Everything the next step depends on (checkpoint payload)."""
    return {
        "step": trainer.step,
        "model": distributed.full_state_dict(trainer.model, rank0_only=True),
        "optimizer": distributed.full_optimizer_state_dict(trainer.muonclip, rank0_only=True),
        "data": data.state_dict(),
        "fingerprints": data.fingerprints(),  # the corpus and tokenizer a resume must match
        "rng": capture_rng_state(),
        "train_config": recorded_settings(trainer.config.model_dump(mode="json")),  # paths resolved
        "model_config": trainer.model.config.model_dump(mode="json"),
    }


def restore_training_state(trainer: Trainer, data: TrainingData, state: dict) -> None:
    """Load a ``training_state`` into the trainer and the data; the trainer reads the data's batches anew.
    A checkpoint of another model or optimizer (a run resumed with another preset or ``--optimizer``) is a
    ``CheckpointError`` naming the mismatch, not torch's traceback."""
    with _fitting("model", state):
        distributed.load_full_state_dict(trainer.model, state["model"])
    with _fitting("optimizer", state):
        distributed.load_full_optimizer_state_dict(trainer.muonclip, state["optimizer"])
    data.load_state_dict(state["data"])
    restore_rng_state(state["rng"])
    trainer.step = int(state["step"])
    trainer.batches, trainer.val_batches = data.train_batches(), data.val_batches()


@contextmanager
def _fitting(what: str, state: dict) -> Iterator[None]:
    """Loading ``what`` of a training ``state``: torch's refusal of a different shape or layout becomes a
    ``CheckpointError`` naming its first mismatch."""
    try:
        yield
    except (RuntimeError, ValueError, KeyError) as error:
        lines = str(error).strip().splitlines()
        detail = next((line.strip() for line in lines if "mismatch" in line), lines[0] if lines else "")
        raise CheckpointError(
            f"the checkpoint at step {state.get('step')} does not fit this run's {what} ({detail}): resume "
            "with the preset, model settings and optimizer the run was started with (and the k2lab version that "
            "wrote it, if a newer one groups the parameters differently)"
        ) from error


def sample_text(model: CausalLM, tokenizer: Tokenizer, prompt: str, tokens: int, seed: int) -> str:
    """A short greedy-ish continuation (temperature 0.8, top-p 0.95) of ``prompt`` (``prompt`` alone when
    ``tokens`` is 0)."""
    if tokens == 0:
        return prompt
    ids = tokenizer.encode(prompt) or [tokenizer.bos_id]
    settings = GenerationConfig(
        max_new_tokens=tokens, temperature=0.8, top_p=0.95, seed=seed, eos_token_id=tokenizer.eos_id
    )
    model.eval()
    return prompt + tokenizer.decode(generate(model, [ids], settings)[0], skip_special_tokens=True)


RESUME_HINT = "run the same command with --resume to continue"  # k2lab train / sft: what Ctrl-C says to do


def run_training(config: TrainConfig, resume: bool = False, resume_hint: str = RESUME_HINT) -> dict[str, Any]:
    """Train per ``config``; writes the run directory and returns the final summary. ``resume_hint``: what
    an interrupted run's message tells the user to do (a caller without ``--resume`` says its own way).

    Under ``torchrun`` every process runs this: data-parallel FSDP2 over the global ``batch_size``
    (see ``k2lab.train.distributed``); rank 0 prints and writes the run directory.
    """
    # the one place that picks the data; imported here because it sits above the loop (it imports the
    # agentic and vision packages, which build on this one)
    from k2lab.train.sources import build_training_data  # lazy: a layer above the trainer

    distributed.check_text_only(config.vision is not None)  # before a process group or the run directory
    with distributed.session(config.device):
        console.quiet = not distributed.is_main()
        # before the corpus and the model: a run directory that cannot be made, or not without loss, fails first
        reads = [config.sft.init_checkpoint if config.sft is not None else None]
        run_dir = claim_run_directory(
            config.out, "sft" if config.sft else "train", reads, distributed.is_main(), distributed.barrier
        )
        if list_checkpoints(run_dir) and not resume:
            raise K2LabError(
                f"{run_dir} already holds checkpoints; pass --resume to continue it or choose a new --out"
            )
        distributed.check_batch_size(config.batch_size)
        torch.manual_seed(config.seed)
        kept = last_checkpoint(run_dir, "step")
        with reports_interrupt(run_dir, kept, resume_hint, show=distributed.is_main()):  # Ctrl-C: exit 130
            return train(build_training_data(config, log=console.print), resume)


def train(data: TrainingData, resume: bool = False) -> dict[str, Any]:
    """Train ``data.model`` on ``data`` per ``data.config`` (from its latest checkpoint when ``resume``);
    writes the run directory ``config.out`` and returns the summary. ``run_training`` is the entry that
    checks the run directory, seeds and builds the data first."""
    run_dir = Path(data.config.out)
    console.print(data.describe())
    loaded = None
    if resume:
        loaded = load_latest_checkpoint(
            run_dir, on_skip=lambda line: console.print(line, style="yellow", markup=False)
        )
    if loaded is None:
        check_no_orphan_results(run_dir)
        if resume:
            console.print(f"no checkpoint in {run_dir} yet: starting at step 0", markup=False)
    else:  # before the optimizer is built: Per-Head Muon groups its parameters differently
        data.config = keep_saved_choices(data.config, loaded[1].get("train_config"))
        check_resumed_settings(loaded[1].get("train_config"), data.config.model_dump(mode="json"), run_dir)
        check_resumed_data(loaded[1].get("fingerprints"), data.fingerprints(), run_dir)
        if "fingerprints" not in loaded[1]:
            console.print(
                "the checkpoint predates recorded corpus and tokenizer fingerprints: resuming without checking "
                "that they are the ones it was trained on",
                style="yellow",
                markup=False,
            )
    config = data.config
    model = distributed.shard_model(data.model)
    trainer = Trainer(config, model, data.train_batches(), data.val_batches(), run_dir)
    if loaded is not None:
        restore_training_state(trainer, data, loaded[1])
        console.print(f"resumed {run_dir} at step {trainer.step}")
    if trainer.step > config.steps:
        raise K2LabError(
            f"{run_dir}'s newest checkpoint is at step {trainer.step}, past steps = {config.steps}: resume it "
            f"with --steps {trainer.step} or more"
        )
    if trainer.step == config.steps:
        if results_written(run_dir):  # finishing again would validate nothing and overwrite its summary
            raise K2LabError(
                f"{run_dir} is already complete at step {trainer.step} (steps = {config.steps}); raise --steps "
                "to train it further"
            )
        console.print(f"step {trainer.step} is the last: writing the results the run did not finish writing")
        return finish_run(trainer, data, trainer.validation_loss())  # of the final checkpoint's weights
    metrics = distributed.on_main(lambda: MetricsLogger(run_dir, resume_step=trainer.step))
    for path, choice in trainer.precision.items():
        console.print(f"precision of {path.replace('_', '-')}: {choice.describe()}", markup=False)
    for line in describe_choices(config):
        console.print(line, markup=False)
    console.print(f"device: {distributed.device()} (device = {config.device!r})")
    console.print(f"compiled training step: {'on' if trainer.compiled else 'off'} ({trainer.compile_reason})")
    return finish_run(trainer, data, train_loop(trainer, data, metrics))


def progress_bar() -> Progress:
    """The live line: steps, loss, throughput, the largest attention logit and the QK-clipped heads."""
    return Progress(
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


def train_loop(trainer: Trainer, data: TrainingData, metrics: MetricsLogger) -> float:
    """Steps from ``trainer.step`` to ``config.steps``: log, validate, checkpoint; the last validation loss.
    Closes ``metrics``."""
    config, run_dir = trainer.config, trainer.run_dir
    val_loss = float("nan")
    checkpoints = CheckpointWriter()  # written while the next steps run; durable when the loop ends
    with (progress := progress_bar()), metrics, checkpoints:
        task = progress.add_task(
            "train", total=config.steps, completed=trainer.step, loss=0.0, tps=0.0, logit=0.0, clipped=0
        )
        while trainer.step < config.steps:
            if (change := data.at_step(trainer.step)) is not None:
                trainer.batches, trainer.val_batches = data.train_batches(), data.val_batches()
                console.print(f"step {trainer.step}: {change}")
            start = time.perf_counter()
            result, loads = trainer.train_step()
            if not result.finite:
                stop_diverged(trainer, result, loads, metrics, checkpoints, time.perf_counter() - start)
            stats = trainer.update(loads)
            seconds = time.perf_counter() - start
            trainer.step += 1
            values = trainer.metrics(result, stats, loads, seconds)
            if trainer.step % config.eval_every == 0 or trainer.step == config.steps:
                val_loss = trainer.validation_loss()
                values["val_loss"] = val_loss
                values.update(trainer.val_activations)
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
                    checkpoints.save(run_dir, trainer.step, state, config.keep_last)
    return val_loss


def stop_diverged(
    trainer: Trainer,
    result: StepResult,
    loads: list[torch.Tensor],
    metrics: MetricsLogger,
    checkpoints: CheckpointWriter,
    seconds: float,
) -> None:
    """Raise ``TrainingDiverged`` for the step of ``result`` before its update, once the step's loss,
    gradient norm and expert loads are logged and the checkpoint in flight is durable (the error names the
    newest one)."""
    step, lr = trainer.step + 1, trainer.config.optimizer.lr
    metrics.log(step, trainer.metrics(result, {}, loads, seconds))
    check_finite_step(step, result.loss, result.grad_norm, lr, trainer.run_dir, pending=checkpoints)


def finish_run(trainer: Trainer, data: TrainingData, val_loss: float) -> dict[str, Any]:
    """The summary; on rank 0 also the model with its tokenizer, the data's scores, a sample, the dashboard
    and ``summary.json`` in the run directory, and the closing report."""
    config, run_dir, tokenizer = trainer.config, trainer.run_dir, data.tokenizer
    summary: dict = {"val_loss": val_loss, "steps": trainer.step}
    summary["precision"] = {path: choice.name for path, choice in trainer.precision.items()}
    summary["precision_reason"] = {path: choice.reason for path, choice in trainer.precision.items()}
    summary["family_settings"] = chosen_values(config)
    summary["family_settings_reason"] = family_reasons(config)
    summary["compiled"] = trainer.compiled
    summary.update(data.summary())
    model = distributed.gather_model(trainer.model, data.fresh_model)
    if model is None:  # not rank 0: it took part in the gather; rank 0 writes the rest
        return summary
    save_model(model, run_dir / "model")
    tokenizer.save(run_dir / "model" / "tokenizer.json")
    summary.update(data.evaluate(model, console.print))
    sample = sample_text(
        language_model(model), tokenizer, config.sample_prompt, config.sample_tokens, config.seed
    )
    (run_dir / "sample.txt").write_text(sample + "\n")
    summary["qk_clip_tau"] = config.optimizer.qk_clip_tau  # the dashboard's τ line (`k2lab plot` redraws it)
    dashboard = plot_dashboard(run_dir, tau=config.optimizer.qk_clip_tau)
    atomic_write_text(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")  # written last
    console.print(f"[bold]sample:[/]\n{sample}")
    report = f"validation loss {val_loss:.3f} nats/token (perplexity {perplexity(val_loss):.1f})"
    console.print(report + data.loss_report(val_loss))
    console.print(
        f"run directory {run_dir}: checkpoints/, metrics.jsonl, tensorboard/, {dashboard.name}, sample.txt, model/"
    )
    return summary
