"""K2.5's text-vision SFT arm: a synthetic visual task asked in chat, answered with a hand-designed visual
chain of thought and the final answer.

One trajectory (``k2lab.vision.chat.visual_chat_prompt`` for the user turn)::

    <|im_user|>user<|im_middle|>{image placeholders}{question}<|im_end|>
    <|im_assistant|>assistant<|im_middle|>{chain of thought}\\nAnswer: {answer}<|im_end|>

The loss covers the assistant's body and its ``<|im_end|>`` only (as in text SFT); the answer line is
``k2lab.vision.answers.final_answer``, so ``visual_reward`` of the whole reply is 1.0.
K2.5 found this arm (hand-designed visual CoT) generalised worse than zero-vision SFT on text trajectories
(``k2lab.vision.text_trajectories``); it is the comparison.
"""

from __future__ import annotations

from k2lab.data.tokenizer import Tokenizer
from k2lab.runtime.chat import IM_END
from k2lab.vision.answers import final_answer, sample_answer_value
from k2lab.vision.chat import visual_chat_prompt
from k2lab.vision.config import VisionConfig
from k2lab.vision.mixture import EncodedSample
from k2lab.vision.processor import ProcessorConfig
from k2lab.vision.tasks import VisualSample

__all__ = ["encode_visual_chat", "visual_chain_of_thought", "visual_reply"]


def _targets_phrase(sample: VisualSample) -> str:
    meta = sample.meta
    return f"{meta['colour']} {meta['shape']}"


def visual_chain_of_thought(sample: VisualSample) -> str:
    """A short description of how the image is looked at, from the task's drawing metadata."""
    kind, meta = sample.kind, sample.meta
    if kind == "counting":
        subject = " ".join(w for w in (meta["colour"], meta["shape"]) if w) or "shape"
        return (
            f"I look at every shape in the image: {len(meta['shapes'])} in all, "
            f"and {sample.truth} of them match ({subject})."
        )
    if kind == "grounding_box":
        return (
            f"I find each {_targets_phrase(sample)} ({len(sample.truth)} in the image) and read off the first and "
            "last pixel column and row it covers."
        )
    if kind == "grounding_point":
        return (
            f"I find each {_targets_phrase(sample)} ({len(sample.truth)} in the image) and take its centre."
        )
    if kind == "segmentation":
        vertices = len(sample_answer_value(sample))
        return f"I trace the {_targets_phrase(sample)}'s outline corner by corner: {vertices} vertices."
    if kind == "ocr":
        return f"I read the characters from left to right: {' '.join(sample.truth)}."
    bars = ", ".join(f"{b['label']} {b['value']}" for b in meta["bars"])
    return f"I measure each bar against the grid lines: {bars}."


def visual_reply(sample: VisualSample) -> str:
    """The assistant's reply: the chain of thought, then the answer line."""
    return visual_chain_of_thought(sample) + "\n" + final_answer(sample.kind, sample_answer_value(sample))


def encode_visual_chat(
    sample: VisualSample, tokenizer: Tokenizer, processor: ProcessorConfig, vision: VisionConfig
) -> EncodedSample:
    """The trajectory as tokens: the chat prompt with the image, the reply and ``<|im_end|>``; targets
    are the reply and ``<|im_end|>`` (a ``k2lab.vision.mixture.Encoder``, for ``VisualStream``)."""
    prompt, media = visual_chat_prompt(sample, tokenizer, vision, processor)
    reply = [*tokenizer.encode(visual_reply(sample), allow_special=False), tokenizer.special_tokens[IM_END]]
    return EncodedSample(
        ids=prompt + reply,
        targets=[False] * len(prompt) + [True] * len(reply),
        pixel_values=media["pixel_values"],
        grid_thw=media["image_grid_thw"],
        prompt_length=len(prompt),
        sample=sample,
    )
