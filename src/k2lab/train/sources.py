"""Which data a recipe trains on, decided in one place: ``build_training_data(config)``.

``[sft]`` -> agentic SFT conversations (+ PTX rows) on a checkpoint; a vision-language preset (``[vision]``)
-> the text corpus with visual rows mixed in; otherwise -> packed pre-training text. The trainer's loop
takes the result (``k2lab.train.trainer.train``) and never asks which one it got.
"""

from __future__ import annotations

from k2lab.agentic.sft import SFTData
from k2lab.train.config import TrainConfig
from k2lab.train.data import Log, TrainingData
from k2lab.train.pretraining import PretrainingData
from k2lab.vision.pretraining import VisionPretrainingData

__all__ = ["build_training_data", "source_for"]


def source_for(config: TrainConfig) -> type[TrainingData]:
    """The ``TrainingData`` class of the recipe's data."""
    if config.sft is not None:
        return SFTData
    if config.vision is not None:
        return VisionPretrainingData
    return PretrainingData


def build_training_data(config: TrainConfig, log: Log = print) -> TrainingData:
    """The recipe's data source, read and positioned at its start, with the model it trains."""
    return source_for(config).from_config(config, log)
