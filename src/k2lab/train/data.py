"""What the pre-training loop reads from its data: ``TrainingData``.

The loop (``k2lab.train.trainer.train``) knows nothing of where batches come from. A source hands it

* the run's settings, tokenizer and model (``config``, ``tokenizer``, ``model``, ``fresh_model()``), all
  made by ``from_config(config, log)``,
* batches: ``train_batches()`` (endless micro-batches of this process) and ``val_batches()``, and
  ``at_step(step)``, asked before every step, for sources whose batches change during the run (the context
  curriculum's stages),
* exact resume: ``state_dict()`` / ``load_state_dict()``, the position that decides every later batch, and
  ``fingerprints()``, what the ids rest on (the tokenizer, the text corpus), which a resume must match,
* words and figures for the log and the summary: ``describe()``, ``summary()``, ``evaluate()``,
  ``loss_report()``.

The sources: packed pre-training text (``k2lab.train.pretraining.PretrainingData``), the same with visual
rows mixed in (``k2lab.vision.pretraining.VisionPretrainingData``) and agentic SFT conversations with
optional PTX rows (``k2lab.agentic.sft.SFTData``); ``k2lab.train.sources.build_training_data`` picks one
from the recipe. The text and SFT sources share ``StagedData``: one resumable stream per stage.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from k2lab.train import distributed

if TYPE_CHECKING:
    from typing import Self

    import torch

    from k2lab.data.corpus import Corpus
    from k2lab.data.packing import Batch
    from k2lab.data.tokenizer import Tokenizer
    from k2lab.models import CausalLM
    from k2lab.train.config import TrainConfig

__all__ = ["Log", "StagedData", "TrainingData", "language_model"]

Log = Callable[[str], Any]
"""Where a source's lines for the run's log go (the trainer's console)."""


class TrainingData(ABC):
    """A training run's data source (see the module docstring).

    ``config`` is the recipe as the source settled it (the tokenizer's special ids among the model
    overrides, steps derived from SFT epochs); ``model`` is the model the run starts from, built for
    ``tokenizer`` or loaded from the checkpoint being fine-tuned.
    """

    config: TrainConfig
    tokenizer: Tokenizer
    model: torch.nn.Module
    corpus: Corpus | None = None  # the text corpus the source reads, if any (pre-training text, SFT's PTX)

    @classmethod
    @abstractmethod
    def from_config(cls, config: TrainConfig, log: Log = print) -> Self:
        """Read, tokenize and position the data of ``config`` and build (or load) its model."""

    # ---- batches --------------------------------------------------------------------------------------
    @abstractmethod
    def train_batches(self) -> Iterator[Batch]:
        """This process's training micro-batches from the current position on (endless)."""

    @abstractmethod
    def val_batches(self) -> list[Batch]:
        """This process's validation batches (the current stage's)."""

    def at_step(self, step: int) -> str | None:
        """Move to the data of optimizer step ``step``: a line for the log when that changed what
        ``train_batches`` and ``val_batches`` give (the trainer then asks for them again), else None."""
        return None

    # ---- exact resume ---------------------------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The position (JSON-able) that, loaded into a fresh source of the same recipe, gives the same
        batches from here on."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a state of other data is a ``K2LabError`` naming the mismatch."""

    def fingerprints(self) -> dict[str, str]:
        """What the run's token ids rest on, recorded in every checkpoint so that a resume on other data is
        refused (``k2lab.train.resume.check_resumed_data``): the tokenizer's fingerprint and, for a source
        reading a text corpus, the corpus' (its files' names, contents and split)."""
        prints = {"tokenizer": self.tokenizer.fingerprint}
        if self.corpus is not None:
            prints["corpus"] = self.corpus.fingerprint
        return prints

    # ---- the model around the data --------------------------------------------------------------------
    @abstractmethod
    def fresh_model(self) -> torch.nn.Module:
        """A new model of the configuration the run ends in (to gather a sharded model into)."""

    # ---- log and summary ------------------------------------------------------------------------------
    @abstractmethod
    def describe(self) -> str:
        """One line for the log at the start: what the data is and which tokenizer reads it."""

    def summary(self) -> dict[str, Any]:
        """Figures of the data for the run's ``summary.json`` (e.g. a baseline loss); none by default."""
        return {}

    def evaluate(self, model: torch.nn.Module, log: Log) -> dict[str, Any]:
        """Scores of the trained ``model`` for ``summary.json``, their lines to ``log``; none by default."""
        return {}

    @abstractmethod
    def loss_report(self, val_loss: float) -> str:
        """What the final validation loss is measured on, or against, appended to the run's last report
        line (``"validation loss L nats/token (perplexity P)"``)."""


class StagedData(TrainingData):
    """A source that serves one resumable stream per stage: ``enter(i)`` sets ``index``, ``batches`` (stage
    ``i``'s global micro-batches, with ``state_dict`` / ``load_state_dict``) and ``validation`` (this
    process's batches). The data state is ``{"stage": i, stream_key: batches.state_dict()}``."""

    stream_key: ClassVar[str] = "batches"
    index: int | None
    batches: Any
    validation: list[Batch]

    @abstractmethod
    def enter(self, index: int) -> None:
        """Stage ``index``'s training stream and validation batches (from their start)."""

    def train_batches(self) -> Iterator[Batch]:
        return distributed.local_batches(self.batches)

    def val_batches(self) -> list[Batch]:
        return self.validation

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.index, self.stream_key: self.batches.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.enter(int(state["stage"]))
        self.batches.load_state_dict(state[self.stream_key])


def language_model(model: torch.nn.Module) -> CausalLM:
    """The decoder of a ``CausalLM`` (itself) or of a ``VisionLanguageModel``."""
    return getattr(model, "language_model", model)
