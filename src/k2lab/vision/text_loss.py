"""Held-out text loss of a vision-language model's language model: does visual training erode text?

K2.5 reports its text benchmarks before and after visual RL (MMLU-Pro 84.7 → 86.4, GPQA-Diamond 84.3 → 86.4,
LongBench v2 56.7 → 58.9): visual optimisation did not erode text ability there. At small scale the analogue
is the language model's next-token cross-entropy on held-out text of the corpus the base was pre-trained on:

    text:   the validation split of a corpus (``k2lab.data.load_corpus``: whole files that ``k2lab train``
            holds out), its documents in order, each followed by EOS, the first ones that hold R·T + 1 ids
    rows:   R windows of T + 1 ids at stride T (``validation_batches``): input_ids = w[:-1], labels = w[1:],
            int64 [R, T], in forwards of ``ROWS_PER_FORWARD`` rows
    L_text: ``k2lab.train.validation``'s L_val of ``language_model(vlm)`` over those rows (nats/token)

Fixed rows, eval mode, no sampling: the same weights give the same loss, so L_text before and after a run
compares the weights alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k2lab.data.corpus import load_corpus
from k2lab.data.packing import Batch, tokenize_documents, validation_batches
from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import K2LabError
from k2lab.train.data import language_model
from k2lab.train.validation import validation_loss

__all__ = ["ROWS_PER_FORWARD", "TextRows", "held_out_text", "text_loss"]

ROWS_PER_FORWARD = 8


@dataclass(frozen=True)
class TextRows:
    """Held-out text rows: ``batches`` of ≤ ``ROWS_PER_FORWARD`` rows of ``seq_len`` tokens from
    ``corpus``."""

    corpus: str
    seq_len: int
    batches: list[Batch]

    @property
    def rows(self) -> int:
        return sum(len(batch.input_ids) for batch in self.batches)

    def describe(self) -> dict[str, str | int]:
        """What the text loss is measured on (for a summary)."""
        return {"corpus": self.corpus, "rows": self.rows, "seq_len": self.seq_len}


def held_out_text(tokenizer: Tokenizer, rows: int, seq_len: int, data: str | None = None) -> TextRows:
    """The first ``rows`` windows of ``seq_len`` tokens of the validation split of ``data`` (a corpus
    directory; None: the embedded standard-library corpus), fewer when the split is shorter."""
    if rows < 1 or seq_len < 1:
        raise K2LabError(f"held-out text needs rows and seq_len ≥ 1, got {rows} and {seq_len}")
    corpus = load_corpus(data)
    if not corpus.val:
        raise K2LabError(
            f"corpus {corpus.root} has no validation files (it holds {corpus.num_files}): the held-out text "
            "loss reads whole held-out files; give a corpus of two or more files"
        )
    needed, tokens, docs = rows * seq_len + 1, 0, []
    for document in corpus.val:  # only as many documents as the rows need are tokenized
        docs.append(document)
        tokens += len(tokenize_documents([document], tokenizer)[0])
        if tokens >= needed:
            break
    (window,) = validation_batches(docs, tokenizer, rows, seq_len, max_batches=1)
    batches = [
        Batch(window.input_ids[i : i + ROWS_PER_FORWARD], window.labels[i : i + ROWS_PER_FORWARD])
        for i in range(0, len(window.input_ids), ROWS_PER_FORWARD)
    ]
    return TextRows(corpus.name, seq_len, batches)


def text_loss(model: torch.nn.Module, text: TextRows) -> float:
    """L_text (nats/token) of ``model``'s language model (a ``VisionLanguageModel``'s decoder, or a
    ``CausalLM`` itself) over ``text``."""
    decoder = language_model(model)
    return validation_loss(
        decoder, text.batches, lambda batch: decoder(batch.input_ids, labels=batch.labels).loss
    )
