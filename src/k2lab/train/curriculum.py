"""Context-length curriculum: training stages of growing sequence length, YaRN switched at boundaries.

The seed's schedule (K3: 8K → 64K → 256K → 1M; K2: 4K pre-training, then YaRN ×32 to 128K) scaled down.
Stage k covers steps [start_step_k, start_step_{k+1}). A stage with ``yarn_factor`` trains with
YaRN scaling of that factor over the first stage's length (the "original" context); one without uses plain
RoPE. Switching changes only the rotary frequencies and the softmax temperature (mscale²), never weights.

Recipe example::

    [[curriculum]]
    start_step = 0
    seq_len = 128

    [[curriculum]]
    start_step = 300
    seq_len = 512
    yarn_factor = 4.0
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from k2lab.config import YarnScaling


class CurriculumStage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    start_step: int = Field(ge=0)
    seq_len: int = Field(gt=1)
    yarn_factor: float | None = Field(default=None, ge=1)


def validate_stages(stages: list[CurriculumStage]) -> list[CurriculumStage]:
    """Stages must start at step 0 and be strictly increasing in start step."""
    if not stages:
        return stages
    if stages[0].start_step != 0:
        raise ValueError(f"curriculum: the first stage must start at step 0, not {stages[0].start_step}")
    for previous, stage in zip(stages, stages[1:], strict=False):
        if stage.start_step <= previous.start_step:
            raise ValueError(
                f"curriculum: stage starts must increase ({previous.start_step} then {stage.start_step})"
            )
    return stages


def stage_index(stages: list[CurriculumStage], step: int) -> int:
    """Index of the stage that 0-based ``step`` belongs to."""
    return max(i for i, stage in enumerate(stages) if stage.start_step <= step)


def rope_scaling_for(stages: list[CurriculumStage], index: int) -> YarnScaling | None:
    """The YaRN scaling of stage ``index`` (relative to the first stage's length), or None."""
    factor = stages[index].yarn_factor
    if factor is None or factor == 1:
        return None
    return YarnScaling(
        factor=factor,
        original_max_position_embeddings=stages[0].seq_len,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )


def context_error(stages: list[CurriculumStage], context: int, model: str) -> str | None:
    """Why ``stages`` cannot train ``model`` whose context is ``context`` (``max_position_embeddings``), or
    None. A sequence longer than the context trains positions the saved model then refuses (``generate``,
    the engines, RL's context limit): an SFT at 1,024 tokens on a 256-token model left every RL rollout
    failing with "context overflow" and nothing trained."""
    longest = max(stage.seq_len for stage in stages)
    if longest <= context:
        return None
    return (
        f"seq_len {longest} exceeds the context of {model} (max_position_embeddings {context}); lower seq_len, "
        "or give the model a longer context (model_overrides.max_position_embeddings, pre-training only)"
    )
