"""Data pipeline: corpus files -> byte-level BPE tokenizer -> packed, resumable training batches."""

from k2lab.data.corpus import Corpus, Document, load_corpus
from k2lab.data.packing import Batch, PackedBatches, tokenize_documents, unigram_baseline, validation_batches
from k2lab.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "Batch",
    "Corpus",
    "Document",
    "PackedBatches",
    "Tokenizer",
    "load_corpus",
    "load_tokenizer",
    "tokenize_documents",
    "train_tokenizer",
    "unigram_baseline",
    "validation_batches",
]
