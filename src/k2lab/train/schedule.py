"""Learning-rate schedules as a multiplier of the peak lr, a pure function of the step (so resume is exact).

``wsd`` (K2 / Moonlight style warmup–stable–decay):
    f(s) = (s + 1) / W                         for s < W            (linear warmup: step 0 already trains)
         = 1                                   for W ≤ s < D        (constant)
         = m + (1 − m)·½(1 + cos(π (s − D)/(S − D)))  for s ≥ D    (cosine decay to m over the last part)
    with D = S·(1 − decay_fraction)
``cosine``: warmup, then m + (1 − m)·½(1 + cos(π (s − W)/(S − W))).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ScheduleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["wsd", "cosine", "constant"] = "wsd"
    warmup_steps: int = Field(default=20, ge=0)
    decay_fraction: float = Field(default=0.2, ge=0, le=1, description="wsd: share of steps spent decaying")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)


def lr_multiplier(step: int, total_steps: int, schedule: ScheduleConfig) -> float:
    """Multiplier of the peak lr at 0-based ``step`` of ``total_steps``."""
    warmup = min(schedule.warmup_steps, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if schedule.kind == "constant":
        return 1.0
    decay_start = (
        warmup
        if schedule.kind == "cosine"
        else max(warmup, round(total_steps * (1 - schedule.decay_fraction)))
    )
    if step < decay_start:
        return 1.0
    span = max(total_steps - decay_start, 1)
    progress = min((step - decay_start) / span, 1.0)
    floor = schedule.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
