"""The training recipe: one validated object, read from a TOML file and overridden from the command line.

Example ``recipe.toml``::

    preset = "k2-mini"
    steps = 300
    batch_size = 8
    seq_len = 256

    [optimizer]
    name = "muonclip"
    lr = 2e-3
    qk_clip_tau = 100.0

    [schedule]
    kind = "wsd"
    warmup_steps = 20
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from k2lab.config import ConfigError, ModelConfig
from k2lab.hardware import CompileMode, DeviceChoice, Precision
from k2lab.optim.grouping import OptimizerConfig
from k2lab.presets import available_presets, get_preset, language_model_config
from k2lab.recipes import is_set, load_config, read_recipe, unset_defaults
from k2lab.train.curriculum import CurriculumStage, context_error, validate_stages
from k2lab.train.family_settings import resolve_family_settings
from k2lab.train.schedule import ScheduleConfig
from k2lab.train.sections import SFTConfig, VisionDataConfig


class BalanceConfig(BaseModel):
    """Router load balancing: the bias rule (DeepSeek-V3 sign steps of γ, K3 Quantile Balancing, or none)
    and an optional sequence-wise loss (α)."""

    model_config = ConfigDict(extra="forbid")

    bias_rule: Literal["deepseek", "quantile", "none"] = Field(
        default="deepseek",
        description="Router-bias balancing rule (in a TrainConfig, unset: by the model family, "
        "k2lab.train.family_settings).",
    )
    gamma: float = Field(default=1e-3, ge=0)
    sequence_loss_alpha: float = Field(default=0.0, ge=0)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    preset: str = "k2-mini"
    model_overrides: dict[str, Any] = Field(default_factory=dict)
    data: str | None = Field(
        default=None, description="Directory of .txt/.md/.jsonl; None = embedded corpus."
    )
    data_max_bytes: int | None = Field(default=None, gt=0)
    tokenizer: str | None = Field(default=None, description="A local tokenizer.json; None = train BPE.")
    vocab_size: int | None = Field(default=None, gt=0, description="BPE vocabulary; None = the preset's.")
    steps: int = Field(default=300, gt=0, description="Optimizer steps.")
    batch_size: int = Field(default=8, gt=0, description="Sequences (rows) per micro-batch.")
    seq_len: int = Field(default=256, gt=1, description="Tokens per sequence (row).")
    document_masking: bool = Field(
        default=False, description="Confine attention (and KDA state) to each packed document."
    )
    grad_accum: int = Field(default=1, gt=0)
    grad_clip: float = Field(default=1.0, ge=0, description="0 disables clipping.")
    precision: Precision = Field(
        default="auto",
        description="Model-step precision: auto = bf16 autocast where the hardware runs it natively "
        "(k2lab.hardware), else fp32.",
    )
    compile: CompileMode = Field(
        default="auto",
        description="torch.compile the training forward+backward: auto = on for CUDA, off on CPU "
        "(k2lab.train.compile).",
    )
    device: DeviceChoice = Field(
        default="auto",
        description="Where a one-process run trains: auto = the GPU where torch sees one, else the CPU "
        "(under torchrun each rank takes its local GPU; k2lab.train.distributed).",
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    mtp_loss_weight: float = Field(
        default=0.3,
        ge=0,
        description="λ of the multi-token-prediction loss (models with num_nextn_predict_layers > 0): "
        "loss + λ · mean over depths of their CE. 0.3 is DeepSeek-V3's weight for its first 10T tokens "
        "(0.1 after; report §4.2).",
    )
    curriculum: list[CurriculumStage] = Field(
        default_factory=list, description="Context-length stages; empty = one stage of seq_len."
    )
    eval_every: int = Field(default=50, gt=0)
    eval_batches: int = Field(default=8, gt=0)
    save_every: int = Field(default=100, gt=0, description="Checkpoint every K steps.")
    keep_last: int = Field(default=3, gt=0)
    log_every: int = Field(default=1, gt=0)
    seed: int = 0
    sample_prompt: str = "def "
    sample_tokens: int = Field(default=64, ge=0)
    out: str = Field(default="runs/k2-mini", description="Run directory.")
    vision: VisionDataConfig | None = Field(
        default=None,
        description="Joint vision-text training (``[vision]``: injection start, ratio, tasks); set by default "
        "for vision-language presets such as k25-mini.",
    )
    sft: SFTConfig | None = Field(
        default=None,
        description="Agentic SFT (``[sft]``): start from a checkpoint (its model and tokenizer; ``preset``, "
        "``tokenizer`` and ``vocab_size`` unused) and train on chat trajectories, ``data`` the PTX corpus.",
    )
    _family_reasons: dict[str, str] = PrivateAttr(default_factory=dict)  # k2lab.train.family_settings

    @model_validator(mode="after")
    def _family_settings(self) -> TrainConfig:
        """K3's bias rule and Per-Head Muon for a K3-family preset where the recipe leaves them unset
        (``k2lab.train.family_settings``); SFT's come from its checkpoint, decided when that is loaded."""
        if self.sft is None:
            try:  # the model the run builds; overrides that do not validate are reported where it is built
                model = language_model_config(self.preset, **self.model_overrides)
            except ConfigError:
                model = language_model_config(self.preset)
            resolve_family_settings(self, model, f"preset {self.preset!r}")
        return self

    @model_validator(mode="after")
    def _vision_defaults(self) -> TrainConfig:
        vision_language = get_preset(self.preset).is_vision_language
        if vision_language and self.vision is None:
            object.__setattr__(self, "vision", VisionDataConfig())
        if self.vision is not None and not vision_language:
            names = ", ".join(available_presets("vision-language"))
            raise ValueError(f"[vision] needs a vision-language preset ({names}), not {self.preset!r}")
        return self

    @model_validator(mode="after")
    def _sft_alone(self) -> TrainConfig:
        if self.sft is not None and (self.vision is not None or self.curriculum):
            raise ValueError(
                "[sft] fine-tunes a checkpoint at one seq_len: no [vision] (a vision-language checkpoint's visual "
                "rows are sft.visual_ratio), no curriculum"
            )
        return self

    @model_validator(mode="after")
    def _within_the_context(self) -> TrainConfig:
        if self.sft is None:  # SFT's model comes from its checkpoint: checked when it is loaded
            language = get_preset(get_preset(self.preset).language_model).data
            default = ModelConfig.model_fields["max_position_embeddings"].default
            context = self.model_overrides.get(
                "max_position_embeddings", language.get("max_position_embeddings", default)
            )
            error = context_error(self.stages(), int(context), f"preset {self.preset!r}")
            if error is not None:
                raise ValueError(error)
        return self

    @field_validator("curriculum")
    @classmethod
    def _stages_in_order(cls, stages: list[CurriculumStage]) -> list[CurriculumStage]:
        return validate_stages(stages)

    def stages(self) -> list[CurriculumStage]:
        """The curriculum, or a single stage of ``seq_len`` when none is given."""
        return self.curriculum or [CurriculumStage(start_step=0, seq_len=self.seq_len)]


def load_train_config(recipe: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Recipe file (TOML) plus overrides (None values ignored; ``optimizer.lr`` style keys for nesting)."""
    return load_config(TrainConfig, recipe, what="training recipe", **overrides)


SFT_DEFAULTS: dict[str, Any] = {  # ``k2lab sft``'s own defaults, below its recipe and flags
    "optimizer.lr": 5e-4,  # a quarter of pre-training's: adapt the checkpoint, do not overwrite it
    "schedule.warmup_steps": 10,
    "batch_size": 4,
    "seq_len": 1024,  # agentic conversations with tool declarations run to hundreds of tokens
    "eval_every": 25,
    "save_every": 50,
    "out": "runs/sft",
    "sample_prompt": "<|im_user|>user<|im_middle|>Hello!<|im_end|><|im_assistant|>assistant<|im_middle|>",
    "sft.epochs": 3.0,  # only when neither the recipe nor a flag sets steps or epochs
}


def load_sft_config(recipe: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """``load_train_config`` for SFT: the recipe, then the overrides (``None`` = unset), and ``SFT_DEFAULTS``
    for whatever neither sets (``sft.epochs`` only when neither gives ``steps``)."""
    table = read_recipe(recipe)
    below = unset_defaults(table, overrides, SFT_DEFAULTS)
    if is_set(table, overrides, "steps"):
        below.pop("sft.epochs", None)
    return load_train_config(recipe, **{**overrides, **below})
