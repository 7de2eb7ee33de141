"""K2.5 multimodal chat rendering: placeholders expand to each image's / video volume's token count, in the
order the model splices features, and the vision-language model accepts the result."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k2lab.data.tokenizer import IMAGE_PAD, MEDIA_BEGIN, VIDEO_PAD
from k2lab.presets.vision_language import load_vlm_preset
from k2lab.vision.chat import render_multimodal_chat
from k2lab.vision.processor import num_image_tokens
from k2lab.vision.tasks import make_task
from k2lab.vision.vlm import build_vlm


@pytest.fixture
def tokenizer(small_tokenizer):
    return small_tokenizer


def test_placeholders_match_media_and_the_model_accepts_them(tokenizer):
    config = load_vlm_preset("k25-nano", tokenizer.special_tokens, vocab_size=300)
    wide = make_task("ocr", 0).image  # 112 × 56
    square = make_task("counting", 1).image  # 112 × 112
    video = np.random.default_rng(0).integers(0, 256, (6, 56, 84, 3), dtype=np.uint8)  # 6 frames: 4 + 2
    messages = [
        {"role": "system", "content": "You are Kimi."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": wide},
                {"type": "text", "text": "and"},
                {"type": "video", "video": video},
                {"type": "image", "image": square},
                {"type": "text", "text": "describe"},
            ],
        },
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]
    ids, media = render_multimodal_chat(tokenizer, messages, config.vision)
    special = tokenizer.special_tokens
    image_tokens = [num_image_tokens(im.height, im.width, config.vision) for im in (wide, square)]
    assert image_tokens == [8, 16]
    assert ids.count(special[IMAGE_PAD]) == sum(image_tokens)
    assert media["video_grid_thw"].tolist() == [[4, 4, 6], [2, 4, 6]]
    assert ids.count(special[VIDEO_PAD]) == 2 * (2 * 3)  # two volumes, one frame's worth each
    assert ids.count(special[MEDIA_BEGIN]) == 4  # two images + two video volumes
    # reading order: wide image, the video's volumes, then the square image
    pads = [t for t in ids if t in (special[IMAGE_PAD], special[VIDEO_PAD])]
    assert pads == [special[IMAGE_PAD]] * 8 + [special[VIDEO_PAD]] * 12 + [special[IMAGE_PAD]] * 16
    text = tokenizer.decode(ids)
    assert text.startswith(
        "<|im_system|>system<|im_middle|>You are Kimi.<|im_end|><|im_user|>user<|im_middle|>"
    )
    assert text.endswith("<|im_user|>user<|im_middle|>more<|im_end|><|im_assistant|>assistant<|im_middle|>")
    model = build_vlm(config).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **media).logits
    assert logits.shape == (1, len(ids), 300) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "robot", "content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": "user", "content": [{"type": "audio", "audio": b""}]}],
        [{"role": "user", "content": [{"type": "image"}]}],
    ],
)
def test_malformed_messages_are_clear_errors(tokenizer, messages):
    config = load_vlm_preset("k25-nano", tokenizer.special_tokens, vocab_size=300)
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        render_multimodal_chat(tokenizer, messages, config.vision)


def test_visual_chat_prompt_is_k2_chat_with_the_image_block_before_the_question(tokenizer):
    """A visual task asked in chat is K2's rendering of the same user turn (``K2ChatFormat``) with the image's
    ``<|media_begin|>image<|media_content|><|media_pad|>×n<|media_end|>`` where the content starts; the
    chat-mode evaluation answers it up to the turn's end."""
    from k2lab.runtime.chat_format import K2ChatFormat
    from k2lab.vision.chat import visual_chat_prompt
    from k2lab.vision.evaluate import answer_visual_samples
    from k2lab.vision.mixture import image_prompt_ids

    config = load_vlm_preset("k25-nano", tokenizer.special_tokens, vocab_size=300)
    sample = make_task("counting", 3)
    ids, media = visual_chat_prompt(sample, tokenizer, config.vision)
    text = (
        K2ChatFormat()
        .encode_chat(tokenizer, [{"role": "user", "content": sample.prompt}], add_generation_prompt=True)
        .ids
    )
    head = list(text).index(tokenizer.special_tokens["<|im_middle|>"]) + 1
    n = num_image_tokens(sample.image.height, sample.image.width, config.vision)
    assert ids == list(text[:head]) + image_prompt_ids(tokenizer, n) + list(text[head:])
    assert media["image_grid_thw"].shape == (1, 3) and ids.count(tokenizer.special_tokens[IMAGE_PAD]) == n
    model = build_vlm(config)
    answers = answer_visual_samples(model, tokenizer, [sample, make_task("ocr", 4)], 3, chat=True)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)
