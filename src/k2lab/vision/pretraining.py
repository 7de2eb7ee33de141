"""Joint vision-text pre-training as ``TrainingData``: the text corpus's stages (``PretrainingData``) with
visual rows mixed into every stage's batches on K2.5's injection schedule (``k2lab.vision.mixture``), a
vision-language model of the preset, and the held-out visual-task scores of the trained model.

The data state is the text one plus ``"vision"`` (the mixture's micro-batch count and visual stream); a new
curriculum stage continues the visual stream and the schedule where the last one stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from k2lab.data.corpus import Corpus
from k2lab.data.packing import Batch
from k2lab.data.tokenizer import Tokenizer
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.train import distributed
from k2lab.train.config import TrainConfig
from k2lab.train.data import Log
from k2lab.train.pretraining import PretrainingData
from k2lab.vision.evaluate import visual_and_blind_scores
from k2lab.vision.mixture import MixedBatches, VisualStream, check_samples_fit, visual_rows_total
from k2lab.vision.vlm import build_vlm

__all__ = ["VisionPretrainingData"]


class VisionPretrainingData(PretrainingData):
    """``PretrainingData`` for a vision-language preset: ``MixedBatches`` over each stage's text batches."""

    def __init__(self, config: TrainConfig, corpus: Corpus, tokenizer: Tokenizer) -> None:
        assert config.vision is not None
        self.vision = config.vision
        self.mixture: MixedBatches | None = None
        super().__init__(config, corpus, tokenizer)

    def build_model(self) -> torch.nn.Module:
        """The preset's VLM: the decoder as in text pre-training, the media token ids from the tokenizer and
        the recipe's tower overrides."""
        text_overrides = {"vocab_size": self.tokenizer.vocab_size, **self.config.model_overrides}
        special = self.tokenizer.special_tokens
        vlm_config = load_vlm_preset(
            self.config.preset, special, self.vision.vision_overrides, **text_overrides
        )
        return build_vlm(vlm_config, seed=self.config.seed)

    def enter(self, index: int) -> None:
        super().enter(index)
        config, previous = self.config, self.mixture
        stream = VisualStream(self.tokenizer, self.model.config.vision, self.vision.tasks, seed=config.seed)
        seq_len = self.stages[index].seq_len
        if self.vision.ratio > 0:
            check_samples_fit(stream, seq_len)
        self.mixture = MixedBatches(
            self.batches, stream, self.vision, config.steps, config.grad_accum, seq_len
        )
        if previous is not None:  # a new curriculum stage continues the visual stream and the schedule
            self.mixture.load_state_dict(previous.state_dict())

    def visual_rows(self) -> int:
        """The run's visual rows (``visual_rows_total`` of its schedule: what ``MixedBatches`` gives)."""
        config = self.config
        return visual_rows_total(config.steps, config.batch_size, config.grad_accum, self.vision)

    def describe(self) -> str:
        """The text side's line, then the run's visual rows (a warning when the schedule gives none)."""
        config, vision, total = self.config, self.vision, self.visual_rows()
        rows = config.steps * config.grad_accum * config.batch_size
        line = (
            f"vision: {total:,} of the run's {rows:,} rows are visual (ratio {vision.ratio:g} from step "
            f"{vision.start_step(config.steps)}; tasks {', '.join(vision.tasks)})"
        )
        if total == 0:
            line += (
                "; WARNING: no row of this run holds an image, so the vision tower is not trained: raise "
                "--steps or --batch-size, or vision.ratio"
            )
        return f"{super().describe()}\n{line}"

    def summary(self) -> dict[str, Any]:
        skipped = self.mixture.skipped if self.mixture else 0
        return {**super().summary(), "visual_rows": self.visual_rows(), "visual_samples_skipped": skipped}

    def train_batches(self) -> Iterator[Batch]:
        return distributed.local_batches(self.mixture)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "vision": self.mixture.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.mixture.load_state_dict(state["vision"])

    def evaluate(self, model: torch.nn.Module, log: Log) -> dict[str, Any]:
        """Mean reward per task on held-out samples, and on gray images (the language prior alone)."""
        if not self.vision.eval_samples:
            return {}
        return visual_and_blind_scores(model, self.tokenizer, self.vision, seed=self.config.seed, log=log)
