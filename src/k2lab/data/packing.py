"""Packing documents into fixed-length training windows, resumably, plus a unigram loss baseline.

The token stream is every document's ids followed by EOS, documents in a seeded per-epoch order,
epochs one after another without end. Window ``k`` is ``stream[k*T : k*T + T + 1]`` (``T`` =
``seq_len``): ``input_ids = window[:-1]`` and ``labels = window[1:]``, so each stream token is a label
exactly once. Shapes: ``input_ids``, ``labels`` and ``segment_ids`` are int64 ``[B, T]``.

``segment_ids[b, t]`` numbers the documents inside a window from 0 (the EOS that ends a document
belongs to it), so ``segment_ids[b, i] == segment_ids[b, j]`` marks positions of the same document,
for document-boundary attention masks.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from k2lab.data.corpus import Corpus, Document, name_bytes
from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import K2LabError

STATE_VERSION = 1
_ENCODED: weakref.WeakKeyDictionary[Tokenizer, dict[str, np.ndarray]] = weakref.WeakKeyDictionary()


@dataclass
class Batch:
    """``input_ids``/``labels``/``segment_ids``: int64 ``[B, T]``; ``segment_ids`` None unless asked for.

    ``media`` (joint vision-text batches): the model's extra inputs, e.g. ``pixel_values`` and
    ``image_grid_thw`` of the images whose placeholders the rows hold (``k2lab.vision.mixture``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    segment_ids: torch.Tensor | None = None
    media: dict[str, torch.Tensor] | None = None

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        segments = None if self.segment_ids is None else self.segment_ids.to(device)
        media = None if self.media is None else {k: v.to(device) for k, v in self.media.items()}
        return Batch(self.input_ids.to(device), self.labels.to(device), segments, media)


def tokenize_documents(docs: Sequence[Document], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Each document's ids followed by EOS (int32 ``[len + 1]``), encoded once per tokenizer and text.

    Special-token strings inside documents are encoded as ordinary text.
    """
    cache = _ENCODED.setdefault(tokenizer, {})
    missing = list(dict.fromkeys(d.text for d in docs if d.text not in cache))
    for start in range(0, len(missing), 256):
        chunk = missing[start : start + 256]
        for text, ids in zip(chunk, tokenizer.encode_batch(chunk, allow_special=False), strict=True):
            cache[text] = np.array([*ids, tokenizer.eos_id], dtype=np.int32)
    return [cache[d.text] for d in docs]


def documents_digest(docs: Sequence[Document]) -> str:
    """A short digest of the documents' paths and lengths, to check a resumed state belongs to them."""
    digest = hashlib.sha256()
    for document in docs:
        digest.update(name_bytes(f"{document.path}\0{len(document.text)}\0"))
    return digest.hexdigest()[:16]


def check_resumed_state(
    what: str, current: Mapping[str, Any], saved: Mapping[str, Any], keys: Sequence[str]
) -> None:
    """Refuse a checkpoint's stream position ``saved`` that belongs to other data or settings than this run's
    ``current`` one: a ``K2LabError`` naming the first differing key and whose each value is."""
    for key in keys:
        if saved.get(key) != current[key]:
            raise K2LabError(
                f"the checkpoint's {what} has {key} {saved.get(key)!r}, this run's has {current[key]!r}; "
                "resume with the data and settings the run started with"
            )


class PackedBatches:
    """Endless, deterministic, resumable ``Batch`` iterator over packed documents.

    Document order is a permutation drawn per epoch from ``numpy.random.default_rng([seed, epoch])``
    (sorted input order when ``shuffle=False``). ``state_dict()`` after ``n`` batches, loaded into a new
    object built from the same documents, continues with exactly the batches ``n+1, n+2, ...``.
    Tokenization happens on the first batch.
    """

    def __init__(
        self,
        docs: Sequence[Document],
        tokenizer: Tokenizer,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        shuffle: bool = True,
        return_segments: bool = False,
    ):
        if not docs:
            raise K2LabError("cannot pack an empty list of documents")
        if batch_size < 1 or seq_len < 1:
            raise K2LabError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        self.docs, self.tokenizer = list(docs), tokenizer
        self.batch_size, self.seq_len, self.seed, self.shuffle = batch_size, seq_len, seed, shuffle
        self.return_segments = return_segments
        self.epoch, self.index, self.offset, self.batches = 0, 0, 0, 0
        self._units: list[np.ndarray] | None = None
        self._order_epoch, self._order = -1, np.arange(0)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        rows = [self._next_window() for _ in range(self.batch_size)]
        windows = torch.from_numpy(np.stack([w for w, _ in rows]).astype(np.int64))
        segments = torch.from_numpy(np.stack([s for _, s in rows]).astype(np.int64))
        self.batches += 1
        return Batch(windows[:, :-1], windows[:, 1:], segments if self.return_segments else None)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position: the next window starts at token ``offset`` of document ``index`` of
        epoch ``epoch``'s order; the rest identifies the stream (``batch_size`` may change on resume)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "offset": self.offset,
            "batches": self.batches,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "num_docs": len(self.docs),
            "documents": documents_digest(self.docs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a state from another stream is a ``K2LabError`` naming the mismatch."""
        keys = ("version", "seed", "shuffle", "seq_len", "num_docs", "documents")
        check_resumed_state("data stream", self.state_dict(), state, keys)
        epoch, index, offset = int(state["epoch"]), int(state["index"]), int(state["offset"])
        length = len(self._tokens()[self._document(epoch, index)]) if 0 <= index < len(self.docs) else 0
        if epoch < 0 or not 0 <= offset < length:  # a corpus or tokenizer changed under the same names
            raise K2LabError(
                f"the data state points at token {offset} of document {index}, which has {length} tokens now: "
                "the corpus or the tokenizer changed since the checkpoint; resume with the ones it was made with"
            )
        self.epoch, self.index, self.offset = epoch, index, offset
        self.batches = int(state["batches"])

    def _next_window(self) -> tuple[np.ndarray, np.ndarray]:
        """One window of ``T + 1`` ids and the ``T`` segment ids of its inputs; advances by ``T``."""
        inputs, segments = self._read(self.seq_len, advance=True)
        last, _ = self._read(1, advance=False)
        return np.concatenate([inputs, last]), segments

    def _read(self, count: int, advance: bool) -> tuple[np.ndarray, np.ndarray]:
        """The next ``count`` stream ids and their segment ids (0, 1, ... per document touched)."""
        units = self._tokens()
        epoch, index, offset = self.epoch, self.index, self.offset
        pieces, segments = [], []
        while count > 0:
            unit = units[self._document(epoch, index)]
            piece = unit[offset : offset + count]
            pieces.append(piece)
            segments.append(np.full(len(piece), len(segments)))
            count -= len(piece)
            offset += len(piece)
            if offset == len(unit):
                epoch, index, offset = (epoch + 1, 0, 0) if index + 1 == len(units) else (epoch, index + 1, 0)
        if advance:
            self.epoch, self.index, self.offset = epoch, index, offset
        return np.concatenate(pieces), np.concatenate(segments)

    def _document(self, epoch: int, index: int) -> int:
        """Which document is ``index``-th in ``epoch``'s order."""
        if not self.shuffle:
            return index
        if epoch != self._order_epoch:
            self._order_epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
        return int(self._order[index])

    def _tokens(self) -> list[np.ndarray]:
        if self._units is None:
            self._units = tokenize_documents(self.docs, self.tokenizer)
        return self._units


def validation_batches(
    docs: Sequence[Document],
    tokenizer: Tokenizer,
    batch_size: int,
    seq_len: int,
    max_batches: int | None = None,
    return_segments: bool = False,
) -> list[Batch]:
    """A fixed list of batches over one pass of ``docs`` in the given order (no shuffle, no wrap).

    Windows are cut as in ``PackedBatches`` (stride ``T``); a tail shorter than ``T + 1`` ids is dropped
    and the last batch may have fewer than ``batch_size`` rows. ``max_batches`` keeps the first ones.
    """
    units = tokenize_documents(docs, tokenizer) if docs else []
    stream = np.concatenate(units) if units else np.zeros(0, dtype=np.int32)
    document = np.repeat(np.arange(len(units)), [len(u) for u in units])
    num_windows = max(0, (len(stream) - 1) // seq_len)
    if max_batches is not None:
        num_windows = min(num_windows, max_batches * batch_size)
    if num_windows == 0:
        raise K2LabError(
            f"validation split has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}: give the corpus "
            "more or larger files (validation takes whole files) or train with a shorter --seq-len"
        )
    starts = np.arange(num_windows)[:, None] * seq_len
    windows = torch.from_numpy(stream[starts + np.arange(seq_len + 1)].astype(np.int64))
    segments = document[starts + np.arange(seq_len)]
    segments = torch.from_numpy((segments - segments[:, :1]).astype(np.int64))
    return [
        Batch(
            windows[i : i + batch_size, :-1],
            windows[i : i + batch_size, 1:],
            segments[i : i + batch_size] if return_segments else None,
        )
        for i in range(0, num_windows, batch_size)
    ]


def unigram_baseline(corpus: Corpus, tokenizer: Tokenizer) -> float:
    """Cross-entropy (nats/token) on ``corpus.val`` of a unigram model fitted on ``corpus.train``.

    ``p(v) = (count_train(v) + 1) / (N_train + V)`` (add-one smoothing over all ``V`` ids); every document
    contributes its ids and one EOS, as in the packed stream: ``-mean_{t in val} log p(t)``.
    """
    if not corpus.val:
        raise K2LabError(f"corpus {corpus.name} has no validation documents")
    vocab = tokenizer.vocab_size
    train = np.concatenate(tokenize_documents(corpus.train, tokenizer))
    val = np.concatenate(tokenize_documents(corpus.val, tokenizer))
    counts = np.bincount(train, minlength=vocab).astype(np.float64)
    log_p = np.log(counts + 1.0) - math.log(len(train) + vocab)
    return float(-log_p[val].mean())
