"""The settings of ``k2lab draft train`` (``k2lab.train.draft``), apart so the CLI reads them without the
training stack."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class DraftTrainConfig(BaseModel):
    """``k2lab draft train``: what to train on and how."""

    model_config = ConfigDict(extra="forbid")

    model: Path = Field(description="The target model directory (k2lab format, with its tokenizer.json).")
    out: Path | None = Field(default=None, description="Where the draft goes; None = MODEL/draft.")
    data: str | None = Field(default=None, description="Prompt corpus directory; None = embedded corpus.")
    data_max_bytes: int = Field(default=2_000_000, gt=0, description="Corpus sample read for prompts.")
    prompts: int = Field(default=256, gt=0, description="Training prompts the target continues.")
    prompt_len: int = Field(default=48, gt=1, description="Prompt tokens (a corpus window).")
    continuation: int = Field(
        default=64,
        ge=0,
        description="Tokens the target generates per prompt; 0 = none: the draft learns the target's greedy "
        "next tokens on the corpus windows themselves (teacher-forced, one forward per batch).",
    )
    eval_tokens: int = Field(default=32, gt=0, description="New tokens per held-out prompt in the check.")
    temperature: float = Field(default=0.0, ge=0, description="Continuations: 0 = the target's greedy ones.")
    steps: int = Field(default=300, gt=0, description="Optimizer steps.")
    batch_size: int = Field(default=16, gt=0, description="Sequences per step.")
    lr: float = Field(default=1e-3, gt=0, description="AdamW learning rate (cosine to 10%).")
    reg_weight: float = Field(default=1.0, ge=0, description="Weight of the feature regression (SmoothL1).")
    ce_weight: float = Field(default=0.1, ge=0, description="Weight of the CE on the target's tokens.")
    feature_noise: float = Field(default=0.0, ge=0, description="Uniform noise on input features.")
    fresh: bool = Field(default=False, description="Start from a fresh block, not the model's MTP module.")
    draft_vocab: int | None = Field(
        default=None,
        ge=1,
        description="Tokens the draft proposes among: the N most frequent of the target's own next tokens in "
        "the training pool (its head is those N rows of the lm_head); None = 1024, or the whole vocabulary if "
        "that is smaller; N = V: the whole vocabulary. N above V is an error.",
    )
    eval_prompts: int = Field(default=16, ge=0, description="Held-out prompts for the acceptance check.")
    draft_tokens: int = Field(default=4, gt=0, description="k of the acceptance check.")
    seed: int = Field(default=0, description="Prompt sampling, continuations and initialisation.")
