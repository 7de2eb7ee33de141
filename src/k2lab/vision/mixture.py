"""Joint vision-text pre-training data: synthetic visual tasks packed into rows, mixed into text batches
on K2.5's vision injection schedule.

**Schedule.** With S total steps, batch B and ``ratio`` r, vision starts at step s₀ = ⌊start·S⌋ and from then
on takes a fraction r of the batch rows: step s gets

    n(s) = ⌊(s − s₀ + 1)·B·r⌋ − ⌊(s − s₀)·B·r⌋   vision rows   (0 before s₀),

so over the run exactly ⌊(S − s₀)·B·r⌋ rows are visual (``visual_rows_total``) and every step holds B·T
tokens. K2.5's ablation
(early 10:90 from step 0, mid 20:80 from 50 %, late 50:50 from 80 %) spends the same 10 % of the total
budget on vision in all three arms.

**Rows.** A visual sample is ``<|media_begin|>image<|media_content|>`` + ``<|media_pad|>``×n +
``<|media_end|>`` + prompt + " " + answer + ``<|eos|>`` with n the image's vision tokens. Whole samples are
packed into rows of T + 1 tokens (a sample never straddles two rows, the remainder is padding); each
sample is its own document (``segment_ids``). A run whose first ``PROBE_SAMPLES`` samples do not all fit in
T + 1 tokens is refused before it starts (``check_samples_fit``); a rarer longer sample later is skipped and
counted (``MixedBatches.skipped``), never cut. The loss covers the prompt, the answer and EOS, never the
media markup. The images of a batch go to the tower in reading order (row-major), as the placeholders
appear, so ``VisionLanguageModel`` splices each feature into its own slot.

The recipe's ``[vision]`` table is ``k2lab.train.sections.VisionDataConfig``; ``k2lab.vision.pretraining``
hands these batches to the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from k2lab.data.packing import Batch
from k2lab.data.tokenizer import IMAGE_PAD, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, Tokenizer
from k2lab.errors import K2LabError
from k2lab.ops.linear_cross_entropy import IGNORE_INDEX
from k2lab.train.sections import VisionDataConfig
from k2lab.vision.config import VisionConfig
from k2lab.vision.moonvit import vision_token_counts
from k2lab.vision.processor import ProcessorConfig, preprocess_images
from k2lab.vision.tasks import VisualSample, make_task

__all__ = [
    "EncodedSample",
    "Encoder",
    "MixedBatches",
    "VisualStream",
    "check_samples_fit",
    "encode_sample",
    "image_prompt_ids",
    "image_prompts",
    "pack_visual_rows",
    "vision_rows_at",
    "visual_rows_total",
]

IGNORE = IGNORE_INDEX  # label of a position the loss skips
HELD_OUT_SEED = 1_000_003  # evaluation samples come from seeds the training stream never draws
PROBE_SAMPLES = 64  # samples a run's start measures against seq_len


def vision_rows_at(step: int, batch_size: int, ratio: float, start_step: int) -> int:
    """n(s) = ⌊(s − s₀ + 1)·B·r⌋ − ⌊(s − s₀)·B·r⌋ for s ≥ s₀, else 0 (exact long-run ratio r)."""
    if step < start_step:
        return 0
    s = step - start_step
    return int(np.floor((s + 1) * batch_size * ratio + 1e-9) - np.floor(s * batch_size * ratio + 1e-9))


def visual_rows_total(steps: int, batch_size: int, grad_accum: int, config: VisionDataConfig) -> int:
    """Σ n(m) over the run's S·A micro-batches of ``batch_size`` rows = ⌊(S − s₀)·A·B·r⌋ (telescoping)."""
    micro = (steps - config.start_step(steps)) * grad_accum
    return int(np.floor(micro * batch_size * config.ratio + 1e-9))


def image_prompt_ids(tokenizer: Tokenizer, num_image_tokens: int) -> list[int]:
    """``<|media_begin|>image<|media_content|><|media_pad|>×n<|media_end|>`` as ids."""
    special = tokenizer.special_tokens
    return [
        special[MEDIA_BEGIN],
        *tokenizer.encode("image", allow_special=False),
        special[MEDIA_CONTENT],
        *[special[IMAGE_PAD]] * num_image_tokens,
        special[MEDIA_END],
    ]


def image_prompts(
    tokenizer: Tokenizer,
    vision: VisionConfig,
    images: Sequence[object],
    texts: Sequence[str],
    processor: ProcessorConfig | None = None,
) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Prompt i = image i's placeholders (``image_prompt_ids``) + ``texts[i]``; and the model's pixel inputs.

    Images are PIL images, HWC uint8 arrays or CHW tensors at any resolution (``preprocess_images``).
    """
    batch = preprocess_images(list(images), processor or ProcessorConfig.from_vision_config(vision))
    counts = vision_token_counts(batch.image_grid_thw, vision.merge_kernel_size)
    prompts = [
        image_prompt_ids(tokenizer, n) + tokenizer.encode(text, allow_special=False)
        for n, text in zip(counts, texts, strict=True)
    ]
    return prompts, {"pixel_values": batch.pixel_values, "image_grid_thw": batch.image_grid_thw}


@dataclass
class EncodedSample:
    """One visual sample as tokens: ``ids``, which of them are loss targets, and its image's patches."""

    ids: list[int]
    targets: list[bool]
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor  # [1, 3]
    prompt_length: int  # tokens up to and including the prompt (what generation is conditioned on)
    sample: VisualSample | None = field(default=None, repr=False)


def encode_sample(
    sample: VisualSample, tokenizer: Tokenizer, processor: ProcessorConfig, vision: VisionConfig
) -> EncodedSample:
    (prompt,), media = image_prompts(tokenizer, vision, [sample.image], [sample.prompt + " "], processor)
    answer = [*tokenizer.encode(sample.answer, allow_special=False), tokenizer.eos_id]
    markup = prompt.index(tokenizer.special_tokens[MEDIA_END]) + 1
    return EncodedSample(
        ids=prompt + answer,
        targets=[False] * markup + [True] * (len(prompt) - markup + len(answer)),
        pixel_values=media["pixel_values"],
        grid_thw=media["image_grid_thw"],
        prompt_length=len(prompt),
        sample=sample,
    )


def pack_visual_rows(
    samples: Iterator[EncodedSample], rows: int, seq_len: int, pad_id: int
) -> tuple[Batch, dict[str, torch.Tensor], int]:
    """``rows`` rows of whole samples (each T + 1 tokens before the shift) and their images, in order.

    Returns the batch (input_ids, labels with −100 off-target, segment_ids), ``pixel_values`` /
    ``image_grid_thw`` of every image it holds, and how many samples longer than T + 1 tokens it skipped
    (drawn, never cut).
    """
    ids = torch.full((rows, seq_len + 1), pad_id, dtype=torch.long)
    targets = torch.zeros(rows, seq_len + 1, dtype=torch.bool)
    segments = torch.zeros(rows, seq_len + 1, dtype=torch.long)
    pixels, grids = [], []
    pending: EncodedSample | None = None
    skipped = 0
    for row in range(rows):
        used, segment = 0, 0
        while True:
            item = pending if pending is not None else next(samples)
            pending = None
            if len(item.ids) > seq_len + 1:
                skipped += 1
                continue
            if used + len(item.ids) > seq_len + 1:
                pending = item
                break
            span = slice(used, used + len(item.ids))
            ids[row, span] = torch.tensor(item.ids)
            targets[row, span] = torch.tensor(item.targets)
            segments[row, span] = segment
            pixels.append(item.pixel_values)
            grids.append(item.grid_thw)
            used, segment = used + len(item.ids), segment + 1
        segments[row, used:] = segment  # the padding is a document of its own
    labels = torch.where(targets[:, 1:], ids[:, 1:], IGNORE)
    batch = Batch(ids[:, :-1].contiguous(), labels, segments[:, :-1].contiguous())
    return batch, {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}, skipped


Encoder = Callable[[VisualSample, Tokenizer, ProcessorConfig, VisionConfig], EncodedSample]
"""How a stream turns a sample into tokens: ``encode_sample`` (pre-training's raw layout) or a chat layout."""


class VisualStream:
    """An endless, resumable stream of encoded training samples (sample i from seed ``seed``·10⁶ + i),
    encoded by ``encode`` (default ``encode_sample``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vision: VisionConfig,
        tasks: Sequence[str],
        seed: int,
        processor: ProcessorConfig | None = None,
        encode: Encoder = encode_sample,
    ) -> None:
        self.tokenizer, self.vision, self.tasks, self.seed = tokenizer, vision, tuple(tasks), seed
        self.processor = processor or ProcessorConfig.from_vision_config(vision)
        self.encode = encode
        self.index = 0  # samples drawn so far

    def draw(self, index: int) -> EncodedSample:
        kind = self.tasks[index % len(self.tasks)]
        return self.encode(
            make_task(kind, self.seed * 1_000_000 + index), self.tokenizer, self.processor, self.vision
        )

    def pack(self, rows: int, seq_len: int) -> tuple[Batch, dict[str, torch.Tensor], int]:
        """``pack_visual_rows`` of the next samples; the stream moves past exactly the samples packed (and
        skipped), so the one that did not fit the last row starts the next call."""
        consumed = 0

        def counting() -> Iterator[EncodedSample]:
            nonlocal consumed
            while True:
                yield self.draw(self.index + consumed)
                consumed += 1

        batch, media, skipped = pack_visual_rows(counting(), rows, seq_len, self.tokenizer.pad_id)
        self.index += consumed
        return batch, media, skipped

    def __iter__(self) -> Iterator[EncodedSample]:
        return self

    def __next__(self) -> EncodedSample:
        sample = self.draw(self.index)
        self.index += 1
        return sample

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])


def check_samples_fit(stream: VisualStream, seq_len: int, count: int = PROBE_SAMPLES) -> None:
    """``K2LabError`` unless the stream's first ``count`` samples each fit a row of ``seq_len`` + 1 tokens
    (a visual sample is never cut, so a row too short for them trains on text only)."""
    lengths = [(len(sample.ids), sample.sample.kind) for sample in map(stream.draw, range(count))]
    longest, kind = max(lengths)
    if longest > seq_len + 1:
        over = sum(length > seq_len + 1 for length, _ in lengths)
        raise K2LabError(
            f"seq_len {seq_len} is too short for the visual samples: {over} of the first {count} need more "
            f"than {seq_len + 1} tokens (the longest, a {kind} sample, {longest}); a sample is never cut, so "
            f"give --seq-len {longest - 1} or more"
        )


class MixedBatches:
    """Text batches with the first n(s) rows of step s replaced by packed visual rows (``vision_rows_at``).

    A row that is cut short by the next sample is padded, and the sample starts the next row: the stream
    does not consume it (``VisualStream.pack``), so resuming from ``state_dict`` reproduces the same batches.
    """

    def __init__(
        self,
        text: Iterator[Batch],
        stream: VisualStream,
        config: VisionDataConfig,
        steps: int,
        grad_accum: int,
        seq_len: int,
    ) -> None:
        self.text, self.stream, self.config = text, stream, config
        self.start_step = config.start_step(steps)
        self.grad_accum, self.seq_len = grad_accum, seq_len
        self.micro = 0  # micro-batches produced
        self.skipped = 0  # samples longer than a row, skipped

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = next(self.text)
        rows = batch.input_ids.shape[0]
        # the schedule counted in micro-batches, so accumulation spreads a step's visual rows over them
        n = vision_rows_at(self.micro, rows, self.config.ratio, self.start_step * self.grad_accum)
        self.micro += 1
        if n == 0:
            return batch
        visual, media, skipped = self.stream.pack(n, self.seq_len)
        self.skipped += skipped
        segments = batch.segment_ids if batch.segment_ids is not None else torch.zeros_like(batch.input_ids)
        return Batch(
            torch.cat([visual.input_ids, batch.input_ids[n:]]),
            torch.cat([visual.labels, batch.labels[n:]]),
            torch.cat([visual.segment_ids, segments[n:]]),
            media=media,
        )

    def state_dict(self) -> dict:
        return {"micro": self.micro, "skipped": self.skipped, "stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.micro = int(state["micro"])
        self.skipped = int(state.get("skipped", 0))  # 0: states from before it was counted
        self.stream.load_state_dict(state["stream"])
