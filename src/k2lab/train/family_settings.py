"""The training choices that follow the model family: K3's where the model is K3-family, K2's otherwise.

K3 changed two of K2's training rules (report, Design 6): the router bias moves by **Quantile Balancing**
instead of the DeepSeek-V3 sign rule, and Muon orthogonalises the Q/K/V projections **per head block**
instead of as one matrix ("Per-Head Muon is a K3 change and must not be written backward into K2's
recipe"). A setting the recipe, ``--set`` or a flag gives (the nested section's ``model_fields_set``) is
kept as given; an unset one becomes:

    setting                  K3-family model (k2lab.family.is_k3_family)   any other model
    balance.bias_rule        "quantile"                                    "deepseek" (the field default)
    optimizer.per_head_muon  true                                          false (the field default)

``resolve_family_settings`` decides once, in ``TrainConfig``'s validation from the preset (with its
``model_overrides``), or for SFT from the checkpoint's model (``k2lab.agentic.sft``); the config records
each value's reason (``family_reasons``), which ``k2lab train`` prints beside the precision choices and
writes to ``summary.json``. The checkpoints save the resolved values, and a resumed run keeps the values it
trained with where they were decided automatically (``keep_saved_choices``): a run started before a rule
changed does not switch rules halfway.

(``document_masking`` is not a family choice: the spec says nothing of K3's; ``recipes/k3-mini.toml``
sets it.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from k2lab.config import ModelConfig
from k2lab.family import is_k3_family

if TYPE_CHECKING:
    from k2lab.train.config import TrainConfig

__all__ = [
    "FAMILY_SETTINGS",
    "RESUMED",
    "chosen_values",
    "describe_choices",
    "family_reasons",
    "keep_saved_choices",
    "resolve_family_settings",
]


RESUMED = "resumed: the run's checkpoint trained with it"


@dataclass(frozen=True)
class FamilySetting:
    """One setting of ``TrainConfig`` (``path``: section.field) with K3's value and what each value is."""

    path: str
    label: str  # as ``k2lab train`` prints it
    k3: Any
    k3_rule: str
    k2_rule: str
    help: str  # the default as ``--help`` shows it

    @property
    def section(self) -> str:
        return self.path.split(".")[0]

    @property
    def field(self) -> str:
        return self.path.split(".")[1]

    def value(self, config: TrainConfig) -> Any:
        return getattr(getattr(config, self.section), self.field)


FAMILY_SETTINGS = (
    FamilySetting(
        "balance.bias_rule",
        "router bias rule",
        "quantile",
        "K3's Quantile Balancing",
        "the DeepSeek-V3 sign rule",
        "auto: quantile for K3-family presets, deepseek otherwise",
    ),
    FamilySetting(
        "optimizer.per_head_muon",
        "per-head Muon",
        True,
        "K3's Per-Head Muon",
        "K2's whole-matrix Muon",
        "auto: on for K3-family presets, off otherwise",
    ),
)


def _set_quietly(config: TrainConfig, setting: FamilySetting, value: Any) -> None:
    """``config``'s setting = ``value`` in a copy of its section, which keeps the setting out of the section's
    ``model_fields_set`` (it stays "not given", so an SFT checkpoint can still decide it) and leaves a
    section object the caller passed in untouched."""
    if setting.value(config) != value:
        section: BaseModel = getattr(config, setting.section).model_copy()
        object.__setattr__(section, setting.field, value)
        object.__setattr__(config, setting.section, section)


def resolve_family_settings(config: TrainConfig, model: ModelConfig, source: str) -> None:
    """Give each unset ``FAMILY_SETTINGS`` entry of ``config`` (in place) the value of ``model``'s family
    (``source`` names where the model comes from, e.g. "preset 'k3-mini'") and record why."""
    k3 = is_k3_family(model)
    reasons = {}
    for setting in FAMILY_SETTINGS:
        section = getattr(config, setting.section)
        if setting.field in section.model_fields_set:
            reasons[setting.path] = "requested"
            continue
        default = type(section).model_fields[setting.field].default
        _set_quietly(config, setting, setting.k3 if k3 else default)
        family, rule = ("K3", setting.k3_rule) if k3 else ("not K3", setting.k2_rule)
        reasons[setting.path] = f"auto: {source} is {family}-family: {rule}"
    config._family_reasons = reasons


def family_reasons(config: TrainConfig) -> dict[str, str]:
    """``{path: reason}`` of the family settings as ``resolve_family_settings`` decided them (empty where it
    has not run: an SFT config before its checkpoint is read)."""
    return dict(config._family_reasons)


def describe_choices(config: TrainConfig) -> list[str]:
    """One line per family setting, as ``k2lab train`` prints it: "router bias rule: quantile (reason)"."""
    lines = []
    for setting in FAMILY_SETTINGS:
        value = setting.value(config)
        shown = ("on" if value else "off") if isinstance(value, bool) else str(value)
        reason = config._family_reasons.get(setting.path, "default")
        lines.append(f"{setting.label}: {shown} ({reason})")
    return lines


def chosen_values(config: TrainConfig) -> dict[str, Any]:
    """``{path: value}`` of the family settings (recorded in the run's summary)."""
    return {setting.path: setting.value(config) for setting in FAMILY_SETTINGS}


def keep_saved_choices(config: TrainConfig, saved: dict[str, Any] | None) -> TrainConfig:
    """``config`` for resuming a run whose checkpoint saved the recipe ``saved``: each family setting decided
    automatically takes the saved value (a run started before K3's rules became its family's defaults resumes
    with the rules it trained with); a requested one is left for the resume check to compare."""
    config = config.model_copy()
    reasons = dict(config._family_reasons)
    for setting in FAMILY_SETTINGS:
        value = (saved or {}).get(setting.section, {}).get(setting.field)
        automatic = reasons.get(setting.path, "").startswith("auto")
        if automatic and value is not None and value != setting.value(config):
            _set_quietly(config, setting, value)
            reasons[setting.path] = RESUMED
    config._family_reasons = reasons
    return config
