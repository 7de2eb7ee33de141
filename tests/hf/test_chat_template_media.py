"""Image parts through the exported chat templates: a kimi_k25 export's template, rendered by transformers
(``AutoTokenizer`` on the export) and widened as ``Kimi_K25Processor`` widens it (each ``<|media_pad|>`` to
the image's ``grid.prod() // merge_size²`` pads, ``merge_size`` read from the export's processor file), gives
the ids of k2lab's ``render_multimodal_chat``, images in any role, position and number, as ``image`` or
OpenAI ``image_url`` parts. The template used to drop them (no ``<|media_pad|>``, so the processor's count
check failed). Video parts raise in both templates (their blocks depend on the frames). K3's template renders
an image as the same block in place.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jinja2.exceptions import TemplateError

from k2lab.data.tokenizer import IMAGE_PAD, MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, Tokenizer
from k2lab.hf.chat_template import chat_template, chat_template_k3
from k2lab.hf.processor_files import IMAGE_PROCESSOR_FILE
from k2lab.runtime.chat_k3 import with_k3_tokens
from k2lab.vision.chat import render_multimodal_chat
from tests.hf.conftest import k25_config

transformers = pytest.importorskip("transformers")

BLOCK = f"{MEDIA_BEGIN}image{MEDIA_CONTENT}{IMAGE_PAD}{MEDIA_END}"  # one image before the processor widens it


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


WIDE, SQUARE, SMALL = _image(56, 112, 0), _image(112, 112, 1), _image(30, 20, 2)


def image(pixels: np.ndarray) -> dict[str, Any]:
    return {"type": "image", "image": pixels}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


CONVERSATIONS = {
    "image first": [{"role": "user", "content": [image(WIDE), text("What is this?")]}],
    "image last": [{"role": "user", "content": [text("Describe"), image(SQUARE)]}],
    "images only": [{"role": "user", "content": [image(WIDE), image(SMALL), image(SQUARE)]}],
    "across turns and roles": [
        {"role": "system", "content": [text("You see "), image(SMALL), text(".")]},
        {"role": "user", "content": [text("a"), image(SQUARE), text("b"), image(WIDE), text("c")]},
        {"role": "assistant", "content": [text("Here:"), image(SMALL)]},
        {"role": "user", "content": "and now?"},
    ],
    "text only": [{"role": "system", "content": "s"}, {"role": "user", "content": [text("hi")]}],
}


def map_parts(messages: list[dict[str, Any]], change: Callable[[dict[str, Any]], dict[str, Any]]) -> list:
    """The conversation with ``change`` applied to every non-text part of a list content."""

    def part(p: dict[str, Any]) -> dict[str, Any]:
        return p if p["type"] == "text" else change(p)

    return [m if isinstance(m["content"], str) else {**m, "content": [part(p) for p in m["content"]]}
            for m in messages]  # fmt: skip


def as_image_url(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with its images as OpenAI ``image_url`` parts (what a chat client sends)."""
    return map_parts(
        messages, lambda p: {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    )


@pytest.fixture(scope="module")
def hf_tokenizer(k25_export: Path):
    return transformers.AutoTokenizer.from_pretrained(str(k25_export))


def widened(prompt: str, grids: list[list[int]], merge_size: int) -> str:
    """``prompt`` with its i-th ``<|media_pad|>`` repeated as ``Kimi_K25Processor.replace_image_token`` does."""
    pieces = prompt.split(IMAGE_PAD)
    assert len(pieces) == len(grids) + 1, "one <|media_pad|> per image (the processor's count check)"
    pads = [IMAGE_PAD * (int(np.prod(grid)) // merge_size**2) for grid in grids]
    return pieces[0] + "".join(pad + piece for pad, piece in zip(pads, pieces[1:], strict=True))


@pytest.mark.parametrize("prompt", [True, False])
@pytest.mark.parametrize("parts", ["image", "image_url"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_k25_export_renders_images_as_render_multimodal_chat(
    hf_tokenizer, tokenizer: Tokenizer, k25_export: Path, name: str, parts: str, prompt: bool
):
    messages = CONVERSATIONS[name]
    ours, media = render_multimodal_chat(
        tokenizer, messages, k25_config(tokenizer).vision, add_generation_prompt=prompt
    )
    sent = messages if parts == "image" else as_image_url(messages)
    rendered = hf_tokenizer.apply_chat_template(sent, tokenize=False, add_generation_prompt=prompt)
    merge_size = json.loads((k25_export / IMAGE_PROCESSOR_FILE).read_text())["merge_size"]
    grids = media["image_grid_thw"].tolist() if media else []
    theirs = hf_tokenizer(widened(rendered, grids, merge_size), add_special_tokens=False)["input_ids"]
    assert theirs == ours


def test_kimi_k25_processor_counts_and_widens_the_images(k25_export: Path, tokenizer: Tokenizer):
    """End to end through ``AutoProcessor`` (its image processor needs torchvision)."""
    pytest.importorskip("torchvision")
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(str(k25_export))
    messages = CONVERSATIONS["across turns and roles"]
    ours, _ = render_multimodal_chat(tokenizer, messages, k25_config(tokenizer).vision)
    with_pil = map_parts(messages, lambda p: {**p, "image": Image.fromarray(p["image"])})
    out = processor.apply_chat_template(with_pil, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert list(out["input_ids"][0]) == ours


@pytest.mark.parametrize("kind", ["video", "video_url"])
@pytest.mark.parametrize("template", [chat_template, chat_template_k3])
def test_video_parts_raise_instead_of_vanishing(template, kind: str):
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": [{"type": kind, kind: "v.mp4"}, text("what happens?")]}]
    with pytest.raises(
        TemplateError, match=f"a {kind} part: this chat template renders text and images only"
    ):
        render_jinja_template([messages], chat_template=template())


def test_the_k3_template_renders_an_image_as_the_block_in_place(small_tokenizer):
    """K3's engines widen the same block (its ``<|media_pad|>`` is ``media_placeholder_token_id``)."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=with_k3_tokens(small_tokenizer).backend, chat_template=chat_template_k3()
    )
    for name, messages in CONVERSATIONS.items():
        for sent in (messages, as_image_url(messages)):
            placed = map_parts(sent, lambda p: text(BLOCK))
            theirs = hf.apply_chat_template(sent, tokenize=False, add_generation_prompt=True)
            assert theirs == hf.apply_chat_template(placed, tokenize=False, add_generation_prompt=True), name
