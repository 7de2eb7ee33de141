"""The recipe's data sections, ``[sft]`` and ``[vision]``: plain settings that ``TrainConfig`` validates.

They live here, beside the recipe, rather than with the code that reads them (``k2lab.agentic.sft``,
``k2lab.vision.mixture``), so the recipe does not import the agentic or vision packages that build on it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from k2lab.vision.rewards import TASK_KINDS

__all__ = ["SFTConfig", "VisionDataConfig", "check_task_kinds"]


def check_task_kinds(name: str, tasks: tuple[str, ...]) -> None:
    """``ValueError`` unless ``tasks`` is a non-empty subset of the visual task kinds."""
    unknown = [t for t in tasks if t not in TASK_KINDS]
    if unknown or not tasks:
        raise ValueError(f"{name} {list(tasks)} must be a non-empty subset of {list(TASK_KINDS)}")


class SFTConfig(BaseModel):
    """The recipe's ``[sft]`` table: fine-tune ``init_checkpoint`` on the conversations of ``data``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    init_checkpoint: str = Field(description="A k2lab model directory holding tokenizer.json (runs/X/model).")
    data: str = Field(description="JSONL of {'messages': [...], 'tools': [...]?} conversations.")
    ptx_ratio: float = Field(default=0.0, ge=0, lt=1, description="Fraction of rows from TrainConfig.data.")
    val_fraction: float = Field(default=0.05, ge=0, lt=1, description="Share of lines held out (by hash).")
    epochs: float | None = Field(
        default=None, gt=0, description="When set, the run's steps are derived from it (over SFT rows)."
    )
    overlong: Literal["truncate", "skip"] = "truncate"
    tool_format: Literal["typescript", "json"] = "typescript"
    visual_ratio: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Fraction of rows that are visual trajectories (synthetic tasks asked in chat, hand-designed "
        "visual chain of thought, the answer): K2.5's text-vision SFT arm; a vision-language checkpoint only.",
    )
    visual_tasks: tuple[str, ...] = Field(
        default=TASK_KINDS, description="Visual task kinds of the visual rows and of the final evaluation."
    )
    visual_eval_samples: int = Field(
        default=60,
        ge=0,
        description="Held-out visual samples scored in chat at the end (vision-language only).",
    )
    visual_eval_max_new_tokens: int = Field(
        default=384, gt=0, description="Longest answer of that evaluation (room for a program before it)."
    )

    def model_post_init(self, _context: object) -> None:
        check_task_kinds("sft.visual_tasks", self.visual_tasks)
        if self.ptx_ratio + self.visual_ratio >= 1:
            raise ValueError(
                f"sft.ptx_ratio {self.ptx_ratio:g} + sft.visual_ratio {self.visual_ratio:g} must stay below 1: "
                "the rest of the rows are the conversations"
            )

    def visual_eval(self) -> VisionDataConfig:
        """The visual evaluation's settings, in the form ``k2lab.vision.evaluate`` reads."""
        return VisionDataConfig(
            tasks=self.visual_tasks,
            eval_samples=self.visual_eval_samples,
            eval_max_new_tokens=self.visual_eval_max_new_tokens,
        )


class VisionDataConfig(BaseModel):
    """The recipe's ``[vision]`` table: which tasks, and when and how much vision enters the batches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: float = Field(default=0.0, ge=0, lt=1, description="Fraction of the steps before vision starts.")
    ratio: float = Field(default=0.1, ge=0, le=1, description="Fraction of batch rows that are visual after.")
    tasks: tuple[str, ...] = TASK_KINDS
    eval_samples: int = Field(default=60, ge=0, description="Held-out visual samples scored at the end.")
    eval_max_new_tokens: int = Field(default=24, gt=0)
    vision_overrides: dict = Field(default_factory=dict, description="VisionConfig fields over the preset's.")

    def model_post_init(self, _context: object) -> None:
        check_task_kinds("vision.tasks", self.tasks)

    def start_step(self, steps: int) -> int:
        return int(self.start * steps)
