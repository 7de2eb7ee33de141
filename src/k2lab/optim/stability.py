"""A short high-learning-rate run that shows what QK-Clip is for (K2 report, "Failed Baselines").

The model memorises one fixed random batch with a large learning rate, which drives attention logits up
quickly. With plain Muon the per-head maximum runs past τ; with MuonClip each head is pulled back to τ
after every update, so the next step's maximum sits near τ (the telemetry's clipped maximum, min(S_max, τ) on
the weights the batch was measured on, never exceeds it; the update applied in the same step moves it a little).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator

from k2lab.config import ModelConfig
from k2lab.models import build_model
from k2lab.optim.grouping import OptimizerConfig
from k2lab.optim.muonclip import MuonClip
from k2lab.params import check_fits_in_memory

_OPTIMIZER_DEFAULTS = {"lr": 0.05, "qk_clip_tau": 5.0}  # high on purpose: logits grow within 30 steps


class StabilityConfig(BaseModel):
    """``k2lab stability``: which preset, how many steps, and the (deliberately high-lr) optimizer."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field(default="k2-nano", description="Text model preset (`k2lab presets`).")
    steps: int = Field(default=30, gt=0, description="Training steps.")
    optimizer: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(**_OPTIMIZER_DEFAULTS))

    @model_validator(mode="before")
    @classmethod
    def _optimizer_defaults(cls, data: object) -> object:
        """A given ``[optimizer]`` table keeps this run's high-lr defaults for the fields it leaves out."""
        if isinstance(data, dict) and isinstance(data.get("optimizer"), dict):
            return {**data, "optimizer": {**_OPTIMIZER_DEFAULTS, **data["optimizer"]}}
        return data


def stability_run(
    config: ModelConfig,
    optimizer: OptimizerConfig,
    steps: int = 30,
    batch: int = 8,
    seq: int = 32,
    seed: int = 0,
    weight_scale: float = 1.0,
) -> list[dict[str, float]]:
    """Train ``steps`` steps on one random batch; returns MuonClip's telemetry per step (plus ``loss``)."""
    check_fits_in_memory(config, "a stability run", copies=3)
    torch.manual_seed(seed)
    model = build_model(config, seed=seed)
    if weight_scale != 1.0:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(weight_scale)
    muonclip = MuonClip(model, optimizer, verbose=False)
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=generator)
    history = []
    for _ in range(steps):
        logits = model(data[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), data[:, 1:].reshape(-1))
        loss.backward()
        stats = muonclip.step()
        muonclip.zero_grad()
        history.append({"loss": loss.item(), **stats})
    return history
