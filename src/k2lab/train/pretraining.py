"""Pre-training text as ``TrainingData``: the corpus packed per context-curriculum stage, its tokenizer
(trained or loaded), a fresh model of the preset and the unigram baseline the validation loss is judged by.

A run that trains its BPE trains it for the model's family (``run_tokenizer``): a K3-family model's
(``k2lab.runtime.chat_format.is_k3_family`` of the preset's language model with the recipe's overrides)
carries K3's XTML chat tokens, so the checkpoint speaks K3's chat format; every other model's is K2's.
``k2lab export`` re-derives the same tokenizer through ``run_tokenizer``.

Stage ``i`` of ``TrainConfig.stages()`` has its own ``PackedBatches`` (seeded ``seed + i``), its own
validation batches and its YaRN scaling on the model; the data state is ``{"stage": i, "batches": ...}``.
``k2lab.vision.pretraining`` mixes visual rows into these batches.
"""

from __future__ import annotations

from typing import Any

import torch

from k2lab.data.corpus import Corpus, load_corpus
from k2lab.data.packing import PackedBatches, unigram_baseline, validation_batches
from k2lab.data.tokenizer import Tokenizer, load_tokenizer, min_vocab_size, train_tokenizer
from k2lab.errors import K2LabError
from k2lab.models import CausalLM, build_model
from k2lab.params import check_fits_in_memory
from k2lab.presets import language_model_config, load_preset
from k2lab.runtime.chat_format import is_k3_family
from k2lab.train import distributed
from k2lab.train.config import TrainConfig
from k2lab.train.curriculum import rope_scaling_for, stage_index
from k2lab.train.data import Log, StagedData, language_model

__all__ = ["PretrainingData", "run_tokenizer", "tokenizer_family_for", "tokenizer_vocab_for"]


def tokenizer_family_for(preset: str, overrides: dict[str, Any] | None = None) -> str:
    """``"k3"`` when the language model of ``preset`` (with the recipe's model ``overrides``) is K3-family,
    else ``"k2"``: the special tokens of the BPE a run of it trains (``k2lab.data.tokenizer``)."""
    return "k3" if is_k3_family(language_model_config(preset, **(overrides or {}))) else "k2"


def tokenizer_vocab_for(preset: str, log: Log = print, family: str | None = None) -> int:
    """The BPE vocabulary a run of ``preset`` trains when the recipe names none: the preset's own, or the
    byte-level minimum (256 bytes + the ``family``'s special tokens; default: the preset's family) where the
    preset's is smaller (the nano presets' 128)."""
    own = language_model_config(preset).vocab_size
    least = min_vocab_size(family or tokenizer_family_for(preset))
    if own < least:
        log(
            f"{preset}'s vocabulary ({own}) is below the byte-level BPE's minimum; training a "
            f"{least}-token tokenizer (the model's vocabulary follows it)"
        )
        return least
    return own


def run_tokenizer(config: TrainConfig, corpus: Corpus, log: Log = print) -> Tokenizer:
    """The BPE a run that names no tokenizer trains (cached): ``config.vocab_size`` ids in all (default
    ``tokenizer_vocab_for``), with the model family's special tokens (``tokenizer_family_for``)."""
    family = tokenizer_family_for(config.preset, config.model_overrides)
    vocab = config.vocab_size or tokenizer_vocab_for(config.preset, log, family)
    return train_tokenizer(corpus, vocab, family=family)


class PretrainingData(StagedData):
    """Batches of the current context-curriculum stage over a text corpus (see the module docstring)."""

    def __init__(self, config: TrainConfig, corpus: Corpus, tokenizer: Tokenizer) -> None:
        self.config, self.corpus, self.tokenizer = config, corpus, tokenizer
        self.model = self.build_model()
        self.decoder: CausalLM = language_model(self.model)
        self.stages = config.stages()
        self.index: int | None = None
        self.enter(0)
        self.baseline = unigram_baseline(corpus, tokenizer)

    @classmethod
    def from_config(cls, config: TrainConfig, log: Log = print) -> PretrainingData:
        """Corpus, tokenizer (trained or loaded), a fresh model and stage 0's batches; the config gets the
        tokenizer's special ids among its model overrides."""
        # before the corpus and the tokenizer: a full-size preset cannot be built on this machine
        language = language_model_config(config.preset, **config.model_overrides)  # a VLM's decoder
        check_fits_in_memory(language, "training", copies=3, name=config.preset)
        corpus = load_corpus(config.data, max_bytes=config.data_max_bytes)
        if not corpus.val:  # before the tokenizer is trained: validation would find no text
            raise K2LabError(
                f"corpus {corpus.root} has no validation text: whole files go to validation, and it holds "
                f"{corpus.num_files} file{'s' if corpus.num_files != 1 else ''}; give it at least two (a JSON-lines "
                "corpus can be split into several .jsonl files)"
            )
        with distributed.main_first():  # rank 0 fills the tokenizer cache, the others read it
            tokenizer = (
                load_tokenizer(config.tokenizer) if config.tokenizer else run_tokenizer(config, corpus, log)
            )
        overrides = {
            "pad_token_id": tokenizer.pad_id,
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id,
        }
        config = config.model_copy(update={"model_overrides": {**overrides, **config.model_overrides}})
        return cls(config, corpus, tokenizer)

    def build_model(self) -> torch.nn.Module:
        """The preset with the tokenizer's vocabulary and the recipe's overrides, seeded by the recipe."""
        overrides = {"vocab_size": self.tokenizer.vocab_size, **self.config.model_overrides}
        return build_model(load_preset(self.config.preset, **overrides), seed=self.config.seed)

    # ---- stages ---------------------------------------------------------------------------------------
    def enter(self, index: int) -> None:
        """Stage ``index``'s training stream, validation batches and rope scaling."""
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
        self.validation = [distributed.local_batch(batch) for batch in val]
        if self.config.curriculum:  # without a curriculum the preset's own rope scaling stays
            self.decoder.set_rope_scaling(rope_scaling_for(self.stages, index))

    def at_step(self, step: int) -> str | None:
        stage = stage_index(self.stages, step)
        if stage == self.index:
            return None
        self.enter(stage)
        scaling = self.decoder.config.rope_scaling
        yarn = f", YaRN ×{scaling.factor:g}" if scaling else ""
        return f"curriculum stage {stage} (seq_len {self.stages[stage].seq_len}{yarn})"

    # ---- model, log and summary -----------------------------------------------------------------------
    def fresh_model(self) -> torch.nn.Module:
        """A new build of the model with the rope scaling the run ended in."""
        model = self.build_model()
        if self.config.curriculum:
            language_model(model).set_rope_scaling(rope_scaling_for(self.stages, self.index))
        return model

    def describe(self) -> str:
        return f"corpus: {self.corpus}; tokenizer: {self.tokenizer}"

    def summary(self) -> dict[str, Any]:
        return {"unigram_baseline": self.baseline}

    def loss_report(self, val_loss: float) -> str:
        baseline = self.baseline
        verdict = "below" if val_loss < baseline else "[red]NOT below[/]"
        return f": {abs(baseline - val_loss):.2f} nats {verdict} the unigram baseline {baseline:.3f}"
