"""K2.5 chat messages with images and videos -> token ids with expanded placeholders, plus pixel inputs.

A message is ``{"role": "system" | "user" | "assistant", "content": str | list[part]}`` with parts
``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL / HWC array / CHW tensor}`` and
``{"type": "video", "video": [T frames] or [T, H, W, C]}``, the content layout of transformers'
``Kimi_K25Processor.apply_chat_template``. Rendering:

    <|im_{role}|>{role}<|im_middle|>{content}<|im_end|>   ...   <|im_assistant|>assistant<|im_middle|>

An image becomes ``<|media_begin|>image<|media_content|>`` + ``<|media_pad|>``×n + ``<|media_end|>`` with
n = (h/kh)·(w/kw) its vision tokens; a video becomes one such block per volume of ≤ 4 frames
(``<|media_begin|>video<|media_content|>`` + ``<|video_pad|>``×n + ``<|media_end|>``, n counted for one
frame: temporal pooling). The pixel inputs (``pixel_values`` / ``image_grid_thw``,
``pixel_values_videos`` / ``video_grid_thw``) list the media in the order their placeholders appear, as
``VisionLanguageModel.forward`` expects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from k2lab.data.tokenizer import IMAGE_PAD, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, VIDEO_PAD, Tokenizer
from k2lab.vision.config import VisionConfig
from k2lab.vision.moonvit import vision_token_counts
from k2lab.vision.processor import ProcessorConfig, preprocess_images, preprocess_videos

__all__ = ["ROLES", "render_multimodal_chat", "visual_chat_prompt"]

ROLES = ("system", "user", "assistant")


def _media_block(tokenizer: Tokenizer, kind: str, pad: str, count: int) -> list[int]:
    special = tokenizer.special_tokens
    return [
        special[MEDIA_BEGIN],
        *tokenizer.encode(kind, allow_special=False),
        special[MEDIA_CONTENT],
        *[special[pad]] * count,
        special[MEDIA_END],
    ]


def _parts(message: Mapping[str, Any], index: int) -> list[Mapping[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content must be a string or a list of parts")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("text", "image", "video") or kind not in part:
            raise ValueError(
                f"messages[{index}].content[{j}] must be {{'type': 'text'|'image'|'video', <type>: value}}"
            )
    return content


def render_multimodal_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    vision: VisionConfig,
    add_generation_prompt: bool = True,
    processor: ProcessorConfig | None = None,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids of the conversation and the model's pixel inputs (empty dict without media)."""
    processor = processor or ProcessorConfig.from_vision_config(vision)
    special = tokenizer.special_tokens
    ids: list[int] = []
    images: list[Any] = []
    videos: list[Any] = []
    layout: list[tuple[int, str]] = []  # (position in ids, "image" | "video") to fill once counts are known
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role not in ROLES:
            raise ValueError(f"messages[{index}].role must be one of {ROLES}, got {role!r}")
        ids += [
            special[f"<|im_{role}|>"],
            *tokenizer.encode(role, allow_special=False),
            special["<|im_middle|>"],
        ]
        for part in _parts(message, index):
            if part["type"] == "text":
                ids += tokenizer.encode(part["text"], allow_special=False)
            else:
                (images if part["type"] == "image" else videos).append(part[part["type"]])
                layout.append((len(ids), part["type"]))
        ids.append(special["<|im_end|>"])
    if add_generation_prompt:
        ids += [special["<|im_assistant|>"], *tokenizer.encode("assistant", allow_special=False)]
        ids.append(special["<|im_middle|>"])
    return _expand(tokenizer, ids, layout, images, videos, vision, processor)


def _expand(
    tokenizer: Tokenizer,
    ids: list[int],
    layout: list[tuple[int, str]],
    images: list[Any],
    videos: list[Any],
    vision: VisionConfig,
    processor: ProcessorConfig,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Insert each medium's placeholder blocks at its position; collect the pixel inputs."""
    media: dict[str, torch.Tensor] = {}
    blocks: dict[str, list[list[int]]] = {"image": [], "video": []}
    if images:
        batch = preprocess_images(images, processor)
        media |= {"pixel_values": batch.pixel_values, "image_grid_thw": batch.image_grid_thw}
        counts = vision_token_counts(batch.image_grid_thw, vision.merge_kernel_size)
        blocks["image"] = [_media_block(tokenizer, "image", IMAGE_PAD, n) for n in counts]
    if videos:
        batch = preprocess_videos(videos, processor)
        media |= {"pixel_values_videos": batch.pixel_values_videos, "video_grid_thw": batch.video_grid_thw}
        counts = iter(vision_token_counts(batch.video_grid_thw, vision.merge_kernel_size))
        for volumes in batch.volumes_per_video:
            video = [_media_block(tokenizer, "video", VIDEO_PAD, next(counts)) for _ in range(volumes)]
            blocks["video"].append([token for block in video for token in block])
    out: list[int] = []
    previous = 0
    taken = {"image": 0, "video": 0}
    for position, kind in layout:
        out += ids[previous:position] + blocks[kind][taken[kind]]
        taken[kind] += 1
        previous = position
    return out + ids[previous:], media


def visual_chat_prompt(
    sample: Any,
    tokenizer: Tokenizer,
    vision: VisionConfig,
    processor: ProcessorConfig | None = None,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A synthetic visual task (``k2lab.vision.tasks.VisualSample``) asked in chat: one user turn holding the
    image, then the question, and the assistant's generation prompt::

        <|im_user|>user<|im_middle|><|media_begin|>image<|media_content|><|media_pad|>×n<|media_end|>
        {question}<|im_end|><|im_assistant|>assistant<|im_middle|>

    Returns the ids and the image's pixel inputs (``pixel_values`` [n·kh·kw, 3, p, p], ``image_grid_thw`` [1, 3]).
    """
    content = [{"type": "image", "image": sample.image}, {"type": "text", "text": sample.prompt}]
    return render_multimodal_chat(
        tokenizer, [{"role": "user", "content": content}], vision, processor=processor
    )
