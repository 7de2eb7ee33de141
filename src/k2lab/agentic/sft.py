"""Agentic supervised fine-tuning: chat trajectories (OpenAI format, tool calls and results) in the model
family's chat format, loss on the assistant's tokens only, optionally mixed with pre-training rows (PTX).

**Data.** A JSONL file, one conversation a line: ``{"messages": [...], "tools": [...]}`` (``tools``
optional), as the data factory writes them. Each line is validated (JSON object, messages the chat module
renders, at least one assistant message; ``SFTDataError`` names the line) and encoded in the model's chat
format (``k2lab.runtime.chat_format.chat_format_of(model, tokenizer=...).encode_chat``: K2's ``encode_chat``,
or K3's XTML for a K3-family model whose tokenizer has the XTML tokens, as its rollouts render; tool
declarations first when ``tools`` is present). About ``val_fraction`` of the lines, chosen by a hash of the
line's text, are held out for ``val_loss``.

**Labels.** Only assistant tokens are targets: every assistant turn's body (thinking, content, tool-call
section) and its closing ``<|im_end|>`` (K3: everything after the assistant generation prompt through
``<|end_of_msg|>``; ``ChatEncoding.assistant_mask``); headers, system / user / tool turns and the tool
declarations get label −100.

**Packing.** Whole conversations are packed greedily into rows of ``seq_len + 1`` tokens (``input_ids =
row[:-1]``, ``labels = row[1:]``), in a seeded order drawn per epoch (``numpy.random.default_rng([seed,
epoch])``), epochs one after another without end. A conversation that does not fit the rest of a row
starts the next one; the rest of the row is padding, a segment of its own with label −100. Each
conversation is its own document (``segment_ids``), so attention stays inside it. A conversation longer
than a row is cut to its first ``seq_len + 1`` tokens (``overlong = "truncate"``, the default: the early
turns are still learnt; one left with no assistant token is dropped) or dropped (``"skip"``).

**PTX.** With ``ptx_ratio`` r > 0, micro-batch m holds ``vision_rows_at(m, B, r, 0)`` rows of the
pre-training corpus (``TrainConfig.data``, plain next-token loss on every token) after its SFT rows, so
over the run exactly ⌊m·B·r⌋ of the rows are PTX. The loss is the mean over all target tokens of the
micro-batch, so a PTX row (all tokens targets) weighs more than an SFT row.

**Vision-language checkpoints (K2.5).** ``init_checkpoint`` may be a vision-language model directory
(``k2lab train --preset k25-mini``'s ``runs/X/model``): the conversations train its language model (chat
format and context checks read the language model's config); the vision tower is kept and, on text rows,
gets no gradient, so MuonClip leaves it as it is (a parameter without a gradient is skipped). This is
K2.5's *zero-vision SFT* (text trajectories only, e.g. ``k2lab.vision.text_trajectories``). With
``visual_ratio`` v > 0 (the text-vision arm) micro-batch m also holds ``vision_rows_at(m, B, v, 0)`` rows
of visual trajectories (``k2lab.vision.visual_trajectories``: a synthetic task asked in chat with its image,
a hand-designed visual chain of thought and the answer; loss on the assistant's tokens), packed by
``VisualStream.pack`` and placed after the SFT rows, before the PTX rows (at most B − PTX rows). The run
saves a vision-language model directory and scores held-out visual tasks asked in chat, with their images
and on gray images (``evaluate_visual_tasks(..., chat=True)``), into the summary.

Everything is resumable: ``SFTBatches.state_dict()`` (epoch, position, micro-batch count, the PTX and visual
streams' own states) continues with exactly the same batches, so ``k2lab sft --resume`` after a kill
reproduces the uninterrupted losses.

The recipe's ``[sft]`` table is ``k2lab.train.sections.SFTConfig``; ``SFTData`` is what the trainer reads
(``k2lab.train.data.TrainingData``), ``k2lab.train.config.load_sft_config`` the command line's recipe.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from k2lab.data.corpus import load_corpus
from k2lab.data.packing import Batch, PackedBatches, check_resumed_state
from k2lab.data.tokenizer import Tokenizer, load_tokenizer
from k2lab.errors import K2LabError
from k2lab.model_dir import check_model_directory, load_model
from k2lab.models import CausalLM, build_model
from k2lab.ops.linear_cross_entropy import IGNORE_INDEX
from k2lab.runtime.chat import normalize_messages
from k2lab.runtime.chat_format import ChatFormat, K2ChatFormat, chat_format_of
from k2lab.train import distributed
from k2lab.train.config import TrainConfig
from k2lab.train.curriculum import context_error
from k2lab.train.data import Log, StagedData, language_model
from k2lab.train.family_settings import resolve_family_settings
from k2lab.vision.evaluate import visual_and_blind_scores
from k2lab.vision.mixture import VisualStream, check_samples_fit, vision_rows_at
from k2lab.vision.visual_trajectories import encode_visual_chat
from k2lab.vision.vlm import VisionLanguageModel, build_vlm

__all__ = [
    "ConversationRows",
    "EncodedConversation",
    "SFTBatches",
    "SFTData",
    "SFTDataError",
    "assistant_loss",
    "encode_conversations",
    "load_conversations",
    "load_sft_checkpoint",
]

IGNORE = IGNORE_INDEX  # label of a position the loss skips (the prompt's tokens)
STATE_VERSION = 1


class SFTDataError(K2LabError):
    """A trajectories file that cannot be used: unreadable, a malformed line, no conversation left."""


# ---- reading and encoding -----------------------------------------------------------------------------
@dataclass
class Conversation:
    """One JSONL line: its 1-based ``line`` number, messages, tools and a hash of its text."""

    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    digest: str

    @property
    def held_out(self) -> float:
        """A number in [0, 1) from the line's hash: lines below ``val_fraction`` are validation."""
        return int(self.digest[:8], 16) / 2**32


@dataclass
class EncodedConversation:
    """Token ids of a conversation and which of them are loss targets (assistant tokens)."""

    ids: np.ndarray  # int64 [n]
    targets: np.ndarray  # bool [n]
    line: int


def load_conversations(path: str | Path) -> list[Conversation]:
    """Every non-blank line of ``path`` as a ``Conversation``; ``SFTDataError`` names the first bad line."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise SFTDataError(f"cannot read trajectories file {path} ({error})") from error
    conversations = [_parse_line(path, number, text) for number, text in enumerate(lines, 1) if text.strip()]
    if not conversations:
        raise SFTDataError(f"trajectories file {path} holds no conversations")
    return conversations


def _parse_line(path: Path, number: int, text: str) -> Conversation:
    where = f"{path} line {number}"
    try:
        record = json.loads(text)
    except ValueError as error:
        raise SFTDataError(f"{where} is not valid JSON ({error})") from error
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        raise SFTDataError(f'{where} must be a JSON object {{"messages": [...], "tools": [...]?}}')
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise SFTDataError(f"{where}: tools must be a list, got {type(tools).__name__}")
    try:
        messages = normalize_messages(record["messages"])
    except K2LabError as error:
        raise SFTDataError(f"{where}: {error}") from error
    if not any(message["role"] == "assistant" for message in messages):
        raise SFTDataError(f"{where} has no assistant message, so nothing to learn from")
    digest = hashlib.sha256(text.strip().encode()).hexdigest()
    return Conversation(number, record["messages"], tools or None, digest)


def split_conversations(
    conversations: Sequence[Conversation], val_fraction: float
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, validation) by line hash; at least one validation conversation when there are two or more,
    and with a single conversation it serves both."""
    val = [c for c in conversations if c.held_out < val_fraction]
    if not val and len(conversations) > 1 and val_fraction > 0:
        val = [min(conversations, key=lambda c: c.held_out)]
    train = [c for c in conversations if c not in val]
    return (train, val) if train else (list(conversations), list(conversations))


def encode_conversations(
    conversations: Sequence[Conversation],
    tokenizer: Tokenizer,
    seq_len: int,
    overlong: str = "truncate",
    tool_format: str = "typescript",
    chat_format: ChatFormat | None = None,
) -> list[EncodedConversation]:
    """Each conversation's ids and assistant-token targets in ``chat_format`` (default K2's with
    ``tool_format``), cut to one row (``seq_len + 1``) or dropped per ``overlong``; conversations left
    without a target are dropped."""
    chat_format = chat_format or K2ChatFormat(tool_format)
    encoded = []
    for conversation in conversations:
        try:
            chat = chat_format.encode_chat(tokenizer, conversation.messages, conversation.tools)
        except K2LabError as error:
            raise SFTDataError(f"line {conversation.line}: {error}") from error
        ids, targets = np.array(chat.ids, dtype=np.int64), np.array(chat.assistant_mask, dtype=bool)
        if len(ids) > seq_len + 1:
            if overlong == "skip":
                continue
            ids, targets = ids[: seq_len + 1], targets[: seq_len + 1]
        if targets[1:].any():  # the first token is never predicted
            encoded.append(EncodedConversation(ids, targets, conversation.line))
    return encoded


def conversations_digest(conversations: Sequence[Conversation]) -> str:
    """A short digest of the conversations' texts, to check a resumed state belongs to them."""
    digest = hashlib.sha256()
    for conversation in conversations:
        digest.update(conversation.digest.encode())
    return digest.hexdigest()[:16]


# ---- packing ------------------------------------------------------------------------------------------
def rows_to_batch(ids: np.ndarray, targets: np.ndarray, segments: np.ndarray) -> Batch:
    """``[n, T + 1]`` rows -> a shifted ``Batch``; labels only where the next token is a target of the same
    conversation."""
    ids_t, segments_t = torch.from_numpy(ids), torch.from_numpy(segments)
    keep = torch.from_numpy(targets[:, 1:]) & (segments_t[:, 1:] == segments_t[:, :-1])
    labels = torch.where(keep, ids_t[:, 1:], IGNORE)
    return Batch(ids_t[:, :-1].contiguous(), labels, segments_t[:, :-1].contiguous())


class ConversationRows:
    """Endless, deterministic, resumable rows of whole conversations (see the module docstring); with
    ``endless=False`` one pass in order, rows after it all padding.

    ``take(n)`` returns the next ``n`` rows; ``state_dict()`` after it, loaded into a new object built from
    the same conversations, continues with exactly the rows that would have followed.
    """

    def __init__(
        self,
        units: Sequence[EncodedConversation],
        seq_len: int,
        pad_id: int,
        seed: int = 0,
        shuffle: bool = True,
        digest: str = "",
        endless: bool = True,
    ) -> None:
        if not units:
            raise SFTDataError("no conversation fits the training rows (all too long or without targets)")
        self.units, self.seq_len, self.pad_id, self.digest = list(units), seq_len, pad_id, digest
        self.seed, self.shuffle, self.endless = seed, shuffle, endless
        self.epoch, self.index, self.rows = 0, 0, 0
        self._order_epoch, self._order = -1, np.arange(0)

    def take(self, n: int) -> Batch:
        """The next ``n`` packed rows as a batch."""
        width = self.seq_len + 1
        ids = np.full((n, width), self.pad_id, dtype=np.int64)
        targets = np.zeros((n, width), dtype=bool)
        segments = np.zeros((n, width), dtype=np.int64)
        for row in range(n):
            used, segment = 0, 0
            while (self.endless or self.epoch == 0) and used + len((unit := self._peek()).ids) <= width:
                ids[row, used : used + len(unit.ids)] = unit.ids
                targets[row, used : used + len(unit.ids)] = unit.targets
                segments[row, used : used + len(unit.ids)] = segment
                used, segment = used + len(unit.ids), segment + 1
                self._advance()
            segments[row, used:] = segment  # the padding is a document of its own
        self.rows += n
        return rows_to_batch(ids, targets, segments)

    def rows_per_epoch(self) -> int:
        """How many rows one pass over the conversations fills (in epoch 0's order)."""
        width, rows, used = self.seq_len + 1, 1, 0
        for index in range(len(self.units)):
            size = len(self.units[self._unit_at(0, index)].ids)
            rows, used = (rows + 1, size) if used + size > width else (rows, used + size)
        return rows

    def _peek(self) -> EncodedConversation:
        return self.units[self._unit_at(self.epoch, self.index)]

    def _advance(self) -> None:
        self.index += 1
        if self.index == len(self.units):
            self.epoch, self.index = self.epoch + 1, 0

    def _unit_at(self, epoch: int, index: int) -> int:
        """Which conversation is ``index``-th in ``epoch``'s order."""
        if not self.shuffle:
            return index
        if epoch != self._order_epoch:
            self._order_epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.units))
        return int(self._order[index])

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "rows": self.rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.seq_len,
            "num_conversations": len(self.units),
            "conversations": self.digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; a state of other conversations or settings is a ``K2LabError``."""
        keys = ("version", "seed", "shuffle", "seq_len", "num_conversations", "conversations")
        check_resumed_state("SFT data stream", self.state_dict(), state, keys)
        self.epoch, self.index, self.rows = int(state["epoch"]), int(state["index"]), int(state["rows"])


def validation_rows(
    units: Sequence[EncodedConversation], seq_len: int, pad_id: int, batch_size: int, max_batches: int
) -> list[Batch]:
    """Held-out conversations packed once in file order: at most ``max_batches`` batches."""
    rows = ConversationRows(units, seq_len, pad_id, shuffle=False, endless=False)
    total = min(rows.rows_per_epoch(), batch_size * max_batches)
    return [rows.take(min(batch_size, total - start)) for start in range(0, total, batch_size)]


class SFTBatches:
    """Micro-batches of ``batch_size`` rows: SFT rows, then ``vision_rows_at(m, B, visual_ratio, 0)`` rows of
    visual trajectories (with their images in ``media``; at most B − PTX rows), then
    ``vision_rows_at(m, B, ptx_ratio, 0)`` PTX rows (pre-training text, every token a target) in micro-batch
    ``m``."""

    def __init__(
        self,
        rows: ConversationRows,
        batch_size: int,
        ptx: PackedBatches | None = None,
        ptx_ratio: float = 0.0,
        visual: VisualStream | None = None,
        visual_ratio: float = 0.0,
    ) -> None:
        if ptx_ratio > 0 and ptx is None:
            raise K2LabError("ptx_ratio > 0 needs a pre-training stream")
        if visual_ratio > 0 and visual is None:
            raise K2LabError("visual_ratio > 0 needs a stream of visual trajectories")
        self.rows, self.ptx, self.batch_size, self.ptx_ratio = rows, ptx, batch_size, ptx_ratio
        self.visual, self.visual_ratio = visual, visual_ratio
        self.micro = 0
        self.skipped = 0  # visual trajectories longer than a row, skipped

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        n = vision_rows_at(self.micro, self.batch_size, self.ptx_ratio, 0) if self.ptx_ratio > 0 else 0
        v = vision_rows_at(self.micro, self.batch_size, self.visual_ratio, 0) if self.visual_ratio > 0 else 0
        v = min(v, self.batch_size - n)
        self.micro += 1
        parts = [self.rows.take(self.batch_size - n - v)] if n + v < self.batch_size else []
        media = None
        if v:
            visual, media, skipped = self.visual.pack(v, self.rows.seq_len)
            self.skipped += skipped
            parts.append(visual)
        parts += [self._ptx_row() for _ in range(n)]
        names = ("input_ids", "labels", "segment_ids")
        return Batch(*(torch.cat([getattr(p, name) for p in parts]) for name in names), media=media)

    def _ptx_row(self) -> Batch:
        batch = next(self.ptx)
        segments = batch.segment_ids if batch.segment_ids is not None else torch.zeros_like(batch.input_ids)
        return Batch(batch.input_ids, batch.labels, segments)

    def state_dict(self) -> dict[str, Any]:
        state = {
            "micro": self.micro,
            "ptx_ratio": self.ptx_ratio,
            "rows": self.rows.state_dict(),
            "ptx": None if self.ptx is None else self.ptx.state_dict(),
        }
        if self.visual_ratio > 0:  # a text run's state stays as it was
            visual = {
                "visual_ratio": self.visual_ratio,
                "tasks": list(self.visual.tasks),
                "skipped": self.skipped,
            }
            state["visual"] = {**visual, "stream": self.visual.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_resumed_state("SFT batch mix", self.state_dict(), state, ("ptx_ratio",))
        current = self.state_dict().get("visual") or {"visual_ratio": 0.0}
        check_resumed_state(
            "SFT batch mix", current, state.get("visual") or {"visual_ratio": 0.0}, ("visual_ratio",)
        )
        self.micro = int(state["micro"])
        self.rows.load_state_dict(state["rows"])
        if self.ptx is not None:
            self.ptx.load_state_dict(state["ptx"])
        if self.visual is not None:
            check_resumed_state("SFT visual stream", current, state["visual"], ("tasks",))
            self.skipped = int(state["visual"]["skipped"])
            self.visual.load_state_dict(state["visual"]["stream"])


# ---- the trainer's data source ------------------------------------------------------------------------
class SFTData(StagedData):
    """``TrainingData`` of agentic SFT: the checkpoint's tokenizer and model (a text or a vision-language
    one), ``SFTBatches`` for training (one stage at ``seq_len``), held-out conversations for validation; the
    data state is ``{"stage": 0, "sft": SFTBatches.state_dict()}``."""

    stream_key = "sft"

    def __init__(
        self, config: TrainConfig, tokenizer: Tokenizer, model: CausalLM | VisionLanguageModel
    ) -> None:
        sft = config.sft
        assert sft is not None
        self.config, self.tokenizer, self.model = config, tokenizer, model
        self.vision_language = isinstance(model, VisionLanguageModel)
        self.index: int | None = None
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        conversations = load_conversations(sft.data)
        train, val = split_conversations(conversations, sft.val_fraction)
        self.train, self.val, self.digest = train, val, conversations_digest(train)
        self.chat_format = chat_format_of(model, sft.tool_format, tokenizer)  # K2's, or K3's XTML
        encode = dict(seq_len=config.seq_len, overlong=sft.overlong, chat_format=self.chat_format)
        self.train_units = encode_conversations(train, tokenizer, **encode)
        # held-out conversations that all fail to fit a row leave the training ones to validate on
        self.val_units = encode_conversations(val, tokenizer, **encode) or self.train_units
        self.corpus = load_corpus(config.data, max_bytes=config.data_max_bytes) if sft.ptx_ratio > 0 else None
        if sft.visual_ratio > 0:
            check_samples_fit(self._visual_stream(), config.seq_len)
        self.enter(0)

    @classmethod
    def from_config(cls, config: TrainConfig, log: Log = print) -> SFTData:
        """The checkpoint's tokenizer and model and the SFT data of ``config.sft``; ``config`` gets the
        family settings of the checkpoint's model (``k2lab.train.family_settings``) and ``steps`` derived
        from ``sft.epochs`` when that is set."""
        sft = config.sft
        assert sft is not None
        tokenizer, model = load_sft_checkpoint(Path(sft.init_checkpoint).expanduser())
        check_visual_rows(model, sft.visual_ratio, sft.init_checkpoint)
        text = language_model(model).config
        error = context_error(config.stages(), text.max_position_embeddings, sft.init_checkpoint)
        if error is not None:
            raise SFTDataError(error)
        config = config.model_copy()  # the bias rule and Per-Head Muon of the checkpoint's family
        resolve_family_settings(config, text, f"checkpoint {sft.init_checkpoint}")
        data = cls(config, tokenizer, model)
        if sft.epochs is not None:
            data.config = config.model_copy(update={"steps": data.steps_for(sft.epochs)})
        return data

    def enter(self, index: int) -> None:
        config, sft = self.config, self.config.sft
        self.index = index
        rows = ConversationRows(
            self.train_units, config.seq_len, self.pad_id, config.seed, digest=self.digest
        )
        visual = self._visual_stream() if sft.visual_ratio > 0 else None
        self.batches = SFTBatches(
            rows, config.batch_size, self._ptx_stream(), sft.ptx_ratio, visual, sft.visual_ratio
        )
        val = validation_rows(
            self.val_units, config.seq_len, self.pad_id, config.batch_size, config.eval_batches
        )
        self.validation = [distributed.local_batch(batch) for batch in val]

    def _ptx_stream(self) -> PackedBatches | None:
        if self.corpus is None:
            return None
        config = self.config
        masking = config.document_masking
        return PackedBatches(
            self.corpus.train, self.tokenizer, 1, config.seq_len, config.seed, return_segments=masking
        )

    def _visual_stream(self) -> VisualStream:
        """Visual trajectories in chat (the text-vision arm), from the run's seed."""
        sft, vision = self.config.sft, self.model.config.vision
        return VisualStream(
            self.tokenizer, vision, sft.visual_tasks, self.config.seed, encode=encode_visual_chat
        )

    def steps_for(self, epochs: float) -> int:
        """Optimizer steps that show the SFT rows ``epochs`` times (PTX and visual rows come on top)."""
        config = self.config
        shares = 1 - config.sft.ptx_ratio - config.sft.visual_ratio
        sft_rows = config.batch_size * config.grad_accum * shares
        return max(1, math.ceil(epochs * self.batches.rows.rows_per_epoch() / max(sft_rows, 1e-9)))

    def fresh_model(self) -> CausalLM | VisionLanguageModel:
        """A new model of the checkpoint's config (to gather a sharded model into)."""
        return build_vlm(self.model.config) if self.vision_language else build_model(self.model.config)

    def describe(self) -> str:
        """The checkpoint (and its kind), conversations, held-out ones, rows per epoch, steps, the PTX and
        visual shares."""
        sft = self.config.sft
        rows = self.batches.rows.rows_per_epoch()
        ptx = f", PTX {sft.ptx_ratio:.0%} of rows" if self.corpus is not None else ""
        if self.vision_language:
            ptx += (
                f", visual trajectories {sft.visual_ratio:.0%} of rows ({', '.join(sft.visual_tasks)})"
                if sft.visual_ratio > 0
                else ", text rows only (zero-vision: the vision tower gets no gradient)"
            )
        kind = " (vision-language)" if self.vision_language else ""
        return (
            f"SFT of {sft.init_checkpoint}{kind}: {len(self.train_units)} train / {len(self.val_units)} "
            f"held-out conversations, {rows} rows of {self.config.seq_len + 1} tokens per epoch, "
            f"{self.config.steps} steps{ptx}; tokenizer: {self.tokenizer}"
        )

    def summary(self) -> dict[str, Any]:
        """A vision-language run's visual rows skipped as longer than a row (none for a text run)."""
        if not self.vision_language or self.config.sft.visual_ratio == 0:
            return {}
        return {"visual_samples_skipped": self.batches.skipped}

    def evaluate(self, model: torch.nn.Module, log: Log) -> dict[str, Any]:
        """A vision-language model's mean reward per held-out visual task asked in chat, with its images
        and on gray images (the language prior alone); nothing for a text model."""
        settings = self.config.sft.visual_eval()
        if not isinstance(model, VisionLanguageModel) or not settings.eval_samples:
            return {}
        return visual_and_blind_scores(
            model, self.tokenizer, settings, seed=self.config.seed, chat=True, log=log
        )

    def loss_report(self, val_loss: float) -> str:
        return " on held-out assistant tokens"


def load_sft_checkpoint(directory: Path) -> tuple[Tokenizer, CausalLM | VisionLanguageModel]:
    """The tokenizer and model (text, or vision-language) of the k2lab model directory SFT starts from,
    checked to fit."""
    check_model_directory(directory)
    if not (directory / "tokenizer.json").is_file():
        raise K2LabError(
            f"checkpoint {directory} has no tokenizer.json; SFT needs a k2lab model directory with its "
            "tokenizer (k2lab train writes one in runs/NAME/model)"
        )
    tokenizer = load_tokenizer(directory / "tokenizer.json")
    model = load_model(directory)
    tokenizer.check_fits(language_model(model).config.vocab_size)
    return tokenizer, model


def check_visual_rows(model: torch.nn.Module, visual_ratio: float, checkpoint: str) -> None:
    """``SFTDataError`` for ``visual_ratio`` > 0 on a text model (no tower to see the images); a
    vision-language model under a launcher of several processes is refused too (its batches are not split
    across ranks yet)."""
    if not isinstance(model, VisionLanguageModel):
        if visual_ratio > 0:
            raise SFTDataError(
                f"sft.visual_ratio {visual_ratio:g} needs a vision-language checkpoint, and {checkpoint} is a "
                "text model: set visual_ratio = 0, or start from a k25 run's model (k2lab train --preset k25-mini)"
            )
        return
    distributed.check_text_only(True)


# ---- evaluation -----------------------------------------------------------------------------------------
@torch.no_grad()
def assistant_loss(model: CausalLM, batches: Sequence[Batch]) -> float:
    """Mean cross-entropy (nats/token) over every target token of ``batches`` (token-weighted)."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        logits = model(batch.input_ids, segment_ids=batch.segment_ids).logits.float()
        labels = batch.labels.reshape(-1)
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="sum"))
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)
