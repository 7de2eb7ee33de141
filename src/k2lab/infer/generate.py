"""Autoregressive generation over the latent cache: greedy, temperature and nucleus (top-p) sampling.

Prompts of different lengths are left-padded into one batch; the prompt is prefilled in one forward, then
each step feeds one token per sequence and attends in latent space (absorbed MLA decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from k2lab.infer.cache import LatentCache


class GenerationConfig(BaseModel):
    """``temperature == 0`` is greedy decoding; ``top_p < 1`` keeps the smallest set of tokens with that mass."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(default=16, gt=0)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    eos_token_id: int | None = None
    seed: int = 0


class Constraint(Protocol):
    """Per-sequence decoding constraint (e.g. ``k2lab.runtime.enforcer.ToolCallConstraint``)."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [V] of tokens that may not come next to −inf, in place."""

    def advance(self, token: int) -> None:
        """Record the token that was sampled."""


def sample_next(
    logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | Sequence[torch.Generator]
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]; with one generator per row, row b draws from its own generator."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = (logits.float() / config.temperature).softmax(dim=-1)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= config.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.cat(
        [torch.multinomial(probs[b : b + 1], 1, generator=g)[0] for b, g in enumerate(generator)]
    )


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and validity mask [B, T] with each prompt right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, width - len(prompt) :] = True
    return ids, valid


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    media: dict[str, torch.Tensor] | None = None,
    constraints: Sequence[Constraint | None] | None = None,
    row_seeds: Sequence[int] | None = None,
) -> list[list[int]]:
    """Continue each prompt; returns the new tokens per prompt (up to and including EOS).

    ``row_seeds`` gives every prompt its own sampling generator (instead of one for the batch seeded with
    ``config.seed``): row b then samples exactly what it would sample alone with ``seed = row_seeds[b]``,
    up to the batched forward's rounding.

    ``constraints`` (one per prompt, or None) mask each step's logits before sampling and see the
    sampled token after it (e.g. the tool-call decoding enforcer).

    ``model`` is a ``CausalLM`` or a ``VisionLanguageModel``; ``media`` (``pixel_values``,
    ``image_grid_thw`` ...) goes to the prefill, whose placeholders it fills in reading order.

    Tokens stay on the model's device until the end (one transfer, no per-step sync) unless an
    ``eos_token_id`` needs checking after each step.
    """
    config = config or GenerationConfig()
    param = next(model.parameters())
    decoder_config = getattr(model, "language_model", model).config
    ids, valid = left_pad(prompts, decoder_config.pad_token_id or 0)
    ids, valid = ids.to(param.device), valid.to(param.device)
    cache = LatentCache(
        decoder_config,
        len(prompts),
        ids.shape[1] + config.max_new_tokens,
        dtype=param.dtype,
        device=param.device,
    )
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
    generator: torch.Generator | list[torch.Generator] = (
        torch.Generator(device=param.device).manual_seed(config.seed)
        if row_seeds is None
        else [torch.Generator(device=param.device).manual_seed(int(s)) for s in row_seeds]
    )

    media = {k: v.to(param.device) for k, v in (media or {}).items()}
    logits = model(ids, attention_mask=valid, cache=cache, **media).logits[:, -1]
    tokens: list[torch.Tensor] = []
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=param.device)
    for step in range(config.max_new_tokens):
        if constraints is not None:
            logits = logits.float().clone()
            for row, constraint in enumerate(constraints):
                if constraint is not None and not bool(finished[row]):
                    constraint.mask(logits[row])
        token = sample_next(logits, config, generator)
        tokens.append(token)
        if constraints is not None:
            for row, constraint in enumerate(constraints):
                if constraint is not None and not bool(finished[row]):
                    constraint.advance(int(token[row]))
        if config.eos_token_id is not None:
            finished |= token == config.eos_token_id
            if bool(finished.all()):
                break
        if step < config.max_new_tokens - 1:
            logits = model(token[:, None], cache=cache).logits[:, -1]
    return [_until_eos(row, config.eos_token_id) for row in torch.stack(tokens, 1).tolist()]


def _until_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """The tokens up to and including the first EOS."""
    if eos_token_id is None or eos_token_id not in tokens:
        return tokens
    return tokens[: tokens.index(eos_token_id) + 1]
