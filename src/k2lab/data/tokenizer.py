"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``) with K2's special tokens at fixed low ids.

``train_tokenizer(corpus)`` trains a byte-level BPE (GPT-2 style ``ByteLevel`` pre-tokenizer and
decoder, all 256 byte symbols in the initial alphabet, so any text encodes without an unknown token)
on the corpus' train split and caches it as ``<cache_dir>/<fingerprint>-<vocab_size>.json``; the next
call with the same corpus and vocabulary size loads that file instead of training.

``family`` says which chat format the tokenizer is for: ``"k2"`` (the default) has ``SPECIAL_TOKENS`` at ids
0 .. 17; ``"k3"`` (a K3-family model, ``k2lab.runtime.chat_format.is_k3_family``) also has K3's four XTML
markup tokens (``XTML_TOKENS``) at ids 18 .. 21, the BPE learning four merges fewer so the total is still
``vocab_size``, and is cached as ``<fingerprint>-<vocab_size>-k3.json`` (neither family's file is ever
taken for the other's). The cache directory
is ``cache_dir`` if given, else ``$K2LAB_CACHE_DIR/tokenizers``, else ``~/.cache/k2lab/tokenizers``.

Training reads at most ``max_train_bytes`` (64 MB by default) of train documents, taken in sorted path
order, so a large corpus trains on a deterministic prefix; the whole embedded standard-library corpus
(~11 MB) fits and trains in a few seconds on two cores. A run of more than ``MAX_TRAIN_WORD_CHARS`` characters
without white space trains as several words (``bounded_words``), so a long unbroken line costs linear time.

``load_tokenizer(path)`` wraps any local ``tokenizer.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from k2lab.data.corpus import Corpus, refuse_surrogates
from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# K2 chat and tool-call tokens (MoonshotAI/Kimi-K2 docs/tool_call_guidance.md).
CHAT_TOKENS = (
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
# K2.5 media tokens: an image is <|media_begin|>image<|media_content|><|media_pad|>×n<|media_end|> with n
# the number of vision tokens (transformers' Kimi_K25Processor); a video volume uses <|video_pad|>.
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"
IMAGE_PAD, VIDEO_PAD = "<|media_pad|>", "<|video_pad|>"
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, IMAGE_PAD, VIDEO_PAD)
SPECIAL_TOKENS = (PAD, BOS, EOS, *CHAT_TOKENS, *MEDIA_TOKENS)  # ids 0, 1, 2, ... in this order
DEFAULT_VOCAB_SIZE = 8192  # k2-mini's vocabulary
DEFAULT_MAX_TRAIN_BYTES = 64 * 2**20
MAX_TRAIN_WORD_CHARS = 4096  # longer runs without white space train as several words (bounded_words)
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens (K2 family)
# K3's XTML chat markup tokens (k2lab.runtime.chat_k3): tokenizers trained for K3-family models carry them.
XTML_TOKENS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
FAMILY_TOKENS = {"k2": (), "k3": XTML_TOKENS}  # the chat tokens a family adds after SPECIAL_TOKENS
# Names other tokenizer.json files use for the same roles, tried in order by load_tokenizer.
ROLE_NAMES = {
    "pad": (PAD, "<pad>", "[PAD]", "<|endoftext|>"),
    "bos": (BOS, "<s>", "<bos>", "<|begin_of_text|>", "[BOS]", "[CLS]"),
    "eos": (EOS, "</s>", "<eos>", "<|endoftext|>", "<|end_of_text|>", "[EOS]", "[SEP]"),
}


class Tokenizer:
    """A thin wrapper over ``tokenizers.Tokenizer``: ids in, ids out, no special tokens added implicitly.

    Special-token strings in the text (``"<|im_end|>"``) encode to their single ids unless
    ``allow_special=False``, which encodes them as ordinary text.
    """

    def __init__(self, backend: tokenizers.Tokenizer, path: Path | None = None, from_cache: bool = False):
        self.backend = backend
        self.path = path
        self.from_cache = from_cache
        self._literal: tokenizers.Tokenizer | None = None  # made on first use: _literal_backend
        ids = {role: find_token(backend, names) for role, names in ROLE_NAMES.items()}
        if ids["eos"] is None:
            raise K2LabError(
                f"tokenizer {path or ''} has no end-of-sequence token (tried {', '.join(ROLE_NAMES['eos'])})"
            )
        self.eos_id: int = ids["eos"]
        self.bos_id: int | None = ids["bos"]
        self.pad_id: int | None = ids["pad"]

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id, in id order."""
        added = self.backend.get_added_tokens_decoder()
        return {token.content: i for i, token in sorted(added.items()) if token.special}

    @cached_property
    def fingerprint(self) -> str:
        """A SHA-256 hex digest of what gives the ids their meaning: the model type, every token with its id,
        the merges (in rank order, as pairs whichever way the JSON writes them), the normalizer and the
        pre-tokenizer. Equal for the same tokenizer saved and loaded again; checkpoints record it, so a run
        resumed with another tokenizer is refused (``k2lab.train.resume.check_resumed_data``)."""
        spec = json.loads(self.backend.to_str())
        model = spec.get("model") or {}
        merges = [m.split(" ", 1) if isinstance(m, str) else m for m in model.get("merges") or []]
        vocab = sorted(self.backend.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
        meaning = [model.get("type"), vocab, merges, spec.get("normalizer"), spec.get("pre_tokenizer")]
        return hashlib.sha256(json.dumps(meaning, sort_keys=True).encode()).hexdigest()

    def check_fits(self, vocab_size: int) -> None:
        """``K2LabError`` unless every id fits a model of ``vocab_size`` ids: a tokenizer with more would encode
        some text (or a chat's markup) to ids the model has no embedding for."""
        if self.vocab_size > vocab_size:
            raise K2LabError(
                f"tokenizer {self.path or '(in memory)'} has {self.vocab_size} ids but the model's vocabulary is "
                f"{vocab_size}: give the model the tokenizer it was trained with"
            )

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self.encode_batch([text], allow_special)[0]

    def encode_batch(self, texts: Sequence[str], allow_special: bool = True) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust backend. ``K2LabError`` for a text that is
        no Unicode text (a lone UTF-16 surrogate, as ``json.loads('"\\ud800"')`` or undecodable bytes in
        ``sys.argv`` give), which the backend would refuse with a bare ``TypeError``."""
        texts = list(texts)
        backend = self.backend if allow_special else self._literal_backend()
        try:
            return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
        except TypeError:  # the backend's answer to a lone surrogate: name it (checked only then)
            for i, text in enumerate(texts):
                if isinstance(text, str):  # anything else: the backend's TypeError stands
                    refuse_surrogates(text, f"text {i}" if len(texts) > 1 else "the text")
            raise

    def _literal_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token strings as ordinary text, made on first use.

        A copy, not ``backend.encode_special_tokens`` toggled around each call: the flag is the shared
        backend's, and the Rust encoder runs outside the GIL, so a server rendering chats in worker threads
        would let one request's toggle decide whether another's user text turns ``"<|im_end|>"`` into the
        role marker. Two threads making the copy at once each make an equal one; either is kept."""
        if self._literal is None:
            literal = tokenizers.Tokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``; ``decode(encode(text)) == text`` for any text."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a standard ``tokenizer.json`` (atomically) that ``load_tokenizer`` reads back."""
        atomic_write_text(Path(path), self.backend.to_str())

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, path={str(self.path) if self.path else None!r})"


def find_token(backend: tokenizers.Tokenizer, names: Sequence[str]) -> int | None:
    """Id of the first of ``names`` in the vocabulary, or None."""
    for name in names:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load any local ``tokenizer.json`` (a directory holding one also works)."""
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise K2LabError(f"tokenizer file {path} does not exist")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises plain Exception for any parse error
        raise K2LabError(f"{path} is not a valid tokenizer.json ({str(error).splitlines()[0]})") from error
    return Tokenizer(backend, path)


def default_cache_dir() -> Path:
    """``$K2LAB_CACHE_DIR/tokenizers`` or ``~/.cache/k2lab/tokenizers``."""
    base = os.environ.get("K2LAB_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "k2lab") / "tokenizers"


def special_tokens_for(family: str = "k2") -> tuple[str, ...]:
    """The special tokens of a tokenizer for ``family`` in id order: ``SPECIAL_TOKENS``, then the family's
    chat tokens (none for ``k2``, ``XTML_TOKENS`` for ``k3``)."""
    if family not in FAMILY_TOKENS:
        raise K2LabError(f"unknown tokenizer family {family!r}; one of {', '.join(FAMILY_TOKENS)}")
    return (*SPECIAL_TOKENS, *FAMILY_TOKENS[family])


def min_vocab_size(family: str = "k2") -> int:
    """256 bytes + the family's special tokens (``MIN_VOCAB_SIZE`` for ``k2``)."""
    return 256 + len(special_tokens_for(family))


def cache_path(
    corpus: Corpus, vocab_size: int, cache_dir: Path, max_train_bytes: int, family: str = "k2"
) -> Path:
    """``<cache_dir>/<fingerprint>-<vocab_size>.json``; a ``k3`` tokenizer adds ``-k3``, a non-default
    training cap ``-max<bytes>``."""
    suffix = "" if family == "k2" else f"-{family}"
    suffix += "" if max_train_bytes == DEFAULT_MAX_TRAIN_BYTES else f"-max{max_train_bytes}"
    return cache_dir / f"{corpus.fingerprint}-{vocab_size}{suffix}.json"


def train_tokenizer(
    corpus: Corpus,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
    max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
    use_cache: bool = True,
    family: str = "k2",
) -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` ids trained on ``corpus.train``, loaded from the cache if there.

    ``family``: ``k2`` or ``k3`` (the special tokens, module doc). The result's ``from_cache`` says whether
    it was loaded; ``path`` is its cache file (None when ``use_cache=False`` or the cache directory is not
    writable, which only warns).
    """
    special = special_tokens_for(family)
    if vocab_size < min_vocab_size(family):
        raise K2LabError(
            f"vocab_size must be at least {min_vocab_size(family)} (256 bytes + special tokens), got {vocab_size}"
        )
    if not corpus.train:
        raise K2LabError(f"corpus {corpus.name} has no training documents to train a tokenizer on")
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    path = cache_path(corpus, vocab_size, folder, max_train_bytes, family)
    if use_cache and path.is_file():
        cached = load_cached(path, vocab_size, special)
        if cached is not None:
            return cached
    backend = train_bpe(training_sample(corpus, max_train_bytes), vocab_size, special)
    tokenizer = Tokenizer(backend)
    if use_cache:
        try:
            tokenizer.save(path)
            tokenizer.path = path
        except OSError as error:
            warnings.warn(f"could not cache the tokenizer at {path}: {error}", stacklevel=2)
    return tokenizer


def load_cached(path: Path, vocab_size: int, special: Sequence[str] = SPECIAL_TOKENS) -> Tokenizer | None:
    """The cached tokenizer at ``path``, or None if unreadable or not what we would train: other special
    tokens than ``special`` at ids 0.., or more than ``vocab_size`` ids (a tiny corpus may give fewer)."""
    try:
        tokenizer = load_tokenizer(path)
    except K2LabError:
        return None
    expected = {token: i for i, token in enumerate(special)}
    if tokenizer.vocab_size > vocab_size or tokenizer.special_tokens != expected:
        return None
    tokenizer.from_cache = True
    return tokenizer


def training_sample(corpus: Corpus, max_train_bytes: int) -> Iterator[str]:
    """Train documents in sorted path order until ``max_train_bytes`` of UTF-8 are reached (>= 1 doc)."""
    total = 0
    for document in corpus.train:
        size = len(document.text.encode("utf-8"))
        if total and total + size > max_train_bytes:
            return
        total += size
        yield document.text


def train_bpe(
    texts: Iterable[str], vocab_size: int, special: Sequence[str] = SPECIAL_TOKENS
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids in all; the special tokens come first, so they take ids
    0 .. len(special) - 1 (each one more special token is one merge fewer)."""
    backend = tokenizers.Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([bounded_words(), byte_level])  # for training only
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    backend.pre_tokenizer = byte_level
    return backend


def bounded_words(bound: int = MAX_TRAIN_WORD_CHARS) -> pre_tokenizers.Split:
    """A pre-tokenizer that cuts every run of ``bound`` non-space characters off as a word of its own, so no
    pre-token is longer: the BPE trainer's time grows with the square of its longest one (a 300 KB line
    without a space took a minute, 3 MB did not finish). Far above any natural word, so no other text is
    split differently and the BPE trained is the same."""
    return pre_tokenizers.Split(tokenizers.Regex(rf"\S{{{bound}}}"), behavior="isolated")
