"""Score a vision-language model on held-out synthetic visual tasks with K2.5's visual rewards.

For each sample: prompt = image placeholders + question (``k2lab.vision.mixture.encode_sample``, the raw
layout joint pre-training trains on) or, with ``chat=True``, K2.5's chat with the image and the question in
the user turn (``k2lab.vision.chat.visual_chat_prompt``, what a chat-tuned model answers: SFT and visual RL),
greedy decoding up to ``eval_max_new_tokens`` (in chat: up to the turn's ``<|im_end|>``), reward =
``visual_reward(kind, answer, truth)`` in [0, 1] (soft IoU, point F1, mask IoU, 1 − normalised edit distance,
count and chart rewards; malformed answers score 0).
Samples come from seeds the training stream never draws (``HELD_OUT_SEED``).

``blind=True`` is the control: the same prompts with every image replaced by a uniform gray one (all
normalised pixels 0), which measures what the language prior alone scores (e.g. always answering "3" to
a counting question earns partial count reward).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from k2lab.data.tokenizer import Tokenizer
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.runtime.chat import IM_END
from k2lab.train.sections import VisionDataConfig
from k2lab.vision.chat import visual_chat_prompt
from k2lab.vision.config import VisionConfig
from k2lab.vision.mixture import HELD_OUT_SEED, encode_sample
from k2lab.vision.processor import ProcessorConfig
from k2lab.vision.rewards import visual_reward
from k2lab.vision.tasks import generate_tasks
from k2lab.vision.vlm import VisionLanguageModel

__all__ = ["answer_visual_samples", "evaluate_visual_tasks", "visual_and_blind_scores", "visual_prompts"]


def visual_prompts(
    samples: list, tokenizer: Tokenizer, vision: VisionConfig, chat: bool = False
) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Prompt ids per ``VisualSample`` (raw layout, or ``chat``) and their pixel inputs, concatenated in order."""
    processor = ProcessorConfig.from_vision_config(vision)
    if chat:
        rendered = [visual_chat_prompt(s, tokenizer, vision, processor) for s in samples]
        prompts, media = [ids for ids, _ in rendered], [m for _, m in rendered]
        pixels, grids = [m["pixel_values"] for m in media], [m["image_grid_thw"] for m in media]
    else:
        encoded = [encode_sample(s, tokenizer, processor, vision) for s in samples]
        prompts = [e.ids[: e.prompt_length] for e in encoded]
        pixels, grids = [e.pixel_values for e in encoded], [e.grid_thw for e in encoded]
    return prompts, {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}


def answer_visual_samples(
    model: VisionLanguageModel,
    tokenizer: Tokenizer,
    samples: list,
    max_new_tokens: int,
    batch_size: int = 16,
    blind: bool = False,
    chat: bool = False,
) -> list[str]:
    """Greedy answers (decoded text, special tokens dropped) to each ``VisualSample`` (``blind``: gray images;
    ``chat``: asked in K2.5's chat format, the answer ending with the turn)."""
    vision = model.config.vision
    eos = tokenizer.special_tokens[IM_END] if chat else tokenizer.eos_id
    settings = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_id=eos)
    answers: list[str] = []
    model.eval()
    for start in range(0, len(samples), batch_size):
        prompts, media = visual_prompts(samples[start : start + batch_size], tokenizer, vision, chat)
        media["pixel_values"] = media["pixel_values"] * (0.0 if blind else 1.0)
        for new in generate(model, prompts, settings, media=media):
            answers.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    return answers


def evaluate_visual_tasks(
    model: VisionLanguageModel,
    tokenizer: Tokenizer,
    config: VisionDataConfig,
    seed: int = 0,
    blind: bool = False,
    chat: bool = False,
) -> dict[str, float]:
    """Mean reward per task kind and overall (``"mean"``) on ``config.eval_samples`` held-out samples
    (``chat``: asked in K2.5's chat format)."""
    samples = generate_tasks(config.eval_samples, kinds=config.tasks, seed=HELD_OUT_SEED + seed)
    answers = answer_visual_samples(
        model, tokenizer, samples, config.eval_max_new_tokens, blind=blind, chat=chat
    )
    rewards: dict[str, list[float]] = defaultdict(list)
    for sample, answer in zip(samples, answers, strict=True):
        rewards[sample.kind].append(visual_reward(sample.kind, answer, sample.truth))
    scores = {kind: sum(values) / len(values) for kind, values in sorted(rewards.items())}
    scores["mean"] = sum(sum(v) for v in rewards.values()) / max(sum(len(v) for v in rewards.values()), 1)
    return scores


def visual_and_blind_scores(
    model: VisionLanguageModel,
    tokenizer: Tokenizer,
    config: VisionDataConfig,
    seed: int = 0,
    chat: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict[str, float]]:
    """``{"visual_scores": ..., "visual_scores_blind": ...}``: ``evaluate_visual_tasks`` with the images and
    on gray images (the language prior alone), the summary entries of a vision-language run; ``log`` gets
    one line each."""
    scores = {}
    for key, blind in (("visual_scores", False), ("visual_scores_blind", True)):
        scores[key] = evaluate_visual_tasks(model, tokenizer, config, seed=seed, blind=blind, chat=chat)
        if log is not None:
            held_out = "held-out, asked in chat, mean reward" if chat else "held-out, mean reward"
            what = "gray images (language prior)" if blind else held_out
            log(f"visual tasks ({what}): " + ", ".join(f"{k} {v:.3f}" for k, v in scores[key].items()))
    return scores
