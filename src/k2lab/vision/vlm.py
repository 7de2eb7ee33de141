"""The vision-language model of Kimi K2.5: a vision tower whose tokens replace placeholders in the text.

For ``input_ids`` [B, T] holding ``n_img`` image placeholders (``image_token_id``) and ``n_vid`` video
placeholders (``video_token_id``):

    e = Embed(input_ids with placeholders -> 0)                              [B, T, D]
    e[input_ids == image_token_id] = Vision(pixel_values, image_grid_thw)     [n_img, D]  (in order)
    e[input_ids == video_token_id] = Vision(pixel_values_videos, video_grid_thw)  [n_vid, D]
    logits = LM(inputs_embeds = e)                                            [B, T, V]

The vision features fill the placeholders in reading order (row-major over [B, T]), exactly as
transformers' ``Kimi_K25Model`` does (``masked_scatter``), so its processors feed this model directly. The
language side is any k2lab decoder: K2's MLA MoE as in K2.5, or a K3-style KDA hybrid.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from k2lab.config import ModelConfig
from k2lab.data.tokenizer import IMAGE_PAD, MEDIA_BEGIN, MEDIA_END, VIDEO_PAD
from k2lab.infer.cache import LatentCache
from k2lab.models import CausalLM
from k2lab.models.decoder import CausalLMOutput
from k2lab.models.init import constructing_on, init_weights
from k2lab.vision.config import VisionConfig
from k2lab.vision.moonvit import MoonViT3D, vision_token_counts

__all__ = ["VLMConfig", "VisionLanguageModel", "build_vlm"]


class VLMConfig(BaseModel):
    """Text decoder + vision tower + the ids of the media tokens (HF ``Kimi_K25Config`` field names).

    Defaults are Kimi K2.5's ids; models with k2lab's own tokenizer use ``VLMConfig.for_tokenizer``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int = Field(default=163605, ge=0)
    video_token_id: int = Field(default=163840, ge=0)
    vision_start_token_id: int = Field(default=163602, ge=0)
    vision_end_token_id: int = Field(default=163604, ge=0)

    @model_validator(mode="after")
    def _check(self) -> VLMConfig:
        if self.vision.text_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"vision.text_hidden_size={self.vision.text_hidden_size} must equal the language model's "
                f"hidden_size={self.text.hidden_size}: the projector writes into its embedding space"
            )
        # placeholders are replaced before the embedding (K2.5's video id 163840 lies past K2's vocabulary);
        # the media begin / end markers are embedded like any token
        for field in ("vision_start_token_id", "vision_end_token_id"):
            if getattr(self, field) >= self.text.vocab_size:
                raise ValueError(
                    f"{field}={getattr(self, field)} is outside the vocabulary (vocab_size={self.text.vocab_size})"
                )
        if self.image_token_id == self.video_token_id:
            raise ValueError("image_token_id and video_token_id must differ")
        return self

    @classmethod
    def for_tokenizer(
        cls, text: ModelConfig, vision: VisionConfig, special_tokens: dict[str, int]
    ) -> VLMConfig:
        """Media ids from a k2lab tokenizer's special tokens (``k2lab.data.tokenizer.MEDIA_TOKENS``)."""
        missing = [t for t in (IMAGE_PAD, VIDEO_PAD, MEDIA_BEGIN, MEDIA_END) if t not in special_tokens]
        if missing:
            raise ValueError(f"the tokenizer lacks the media tokens {missing}")
        return cls(
            text=text,
            vision=vision.model_copy(update={"text_hidden_size": text.hidden_size}),
            image_token_id=special_tokens[IMAGE_PAD],
            video_token_id=special_tokens[VIDEO_PAD],
            vision_start_token_id=special_tokens[MEDIA_BEGIN],
            vision_end_token_id=special_tokens[MEDIA_END],
        )


class VisionLanguageModel(nn.Module):
    """``model(input_ids, pixel_values=..., image_grid_thw=...).logits`` -> [B, T, V].

    Submodules: ``language_model`` (a ``CausalLM``) and ``vision`` (``MoonViT3D``: tower + projector).
    ``attention_mask``, ``cache`` and ``segment_ids`` pass through to the language model; on incremental
    decoding steps the new tokens are text, so no pixels are passed.
    """

    def __init__(self, config: VLMConfig) -> None:
        super().__init__()
        self.config = config
        self.language_model = CausalLM(config.text)
        self.vision = MoonViT3D(config.vision)

    def embed(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token embeddings with the image and video features spliced into their placeholders. [B, T, D]."""
        image, video = self.config.image_token_id, self.config.video_token_id
        media = (input_ids == image) | (input_ids == video)
        embeds = self.language_model.embed(input_ids.masked_fill(media, 0))
        for token, pixels, grid, what in (
            (image, pixel_values, image_grid_thw, "image"),
            (video, pixel_values_videos, video_grid_thw, "video"),
        ):
            slots = input_ids == token
            if pixels is None:
                if bool(slots.any()):
                    raise ValueError(
                        f"input_ids has {int(slots.sum())} {what} placeholders but no {what} pixels"
                    )
                continue
            if grid is None:
                raise ValueError(f"{what} pixels need their grid ({what}_grid_thw)")
            features = self.vision(pixels, grid).features.to(embeds.dtype)
            if int(slots.sum()) != features.shape[0]:
                raise ValueError(
                    f"input_ids has {int(slots.sum())} {what} placeholders but the {what}s give "
                    f"{features.shape[0]} vision tokens (per entry {vision_token_counts(grid, self.config.vision.merge_kernel_size)})"
                )
            embeds = embeds.masked_scatter(slots.unsqueeze(-1), features)
        return embeds

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: LatentCache | None = None,
        segment_ids: torch.Tensor | None = None,
        logits_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        embeds = self.embed(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return self.language_model(
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            segment_ids=segment_ids,
            inputs_embeds=embeds,
            logits_mask=logits_mask,
            labels=labels,
        )


def build_vlm(
    config: VLMConfig, device: torch.device | str = "cpu", seed: int | None = 0
) -> VisionLanguageModel:
    """Construct and initialise (language model as ``build_model``, vision tower truncated normal)."""
    with constructing_on(device):
        model = VisionLanguageModel(config)
    if torch.device(device).type != "meta":
        init_weights(model.language_model, seed=seed)
        if seed is not None:
            torch.manual_seed(seed + 1)
        model.vision.reset_parameters()
    return model
