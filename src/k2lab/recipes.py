"""Recipe files: a TOML file plus ``a.b.c`` dotted overrides, validated as the pydantic config they describe.

One loader for every command and API that takes a recipe (``k2lab.cli.options`` builds on it); errors name the
file or the field, never a traceback.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from k2lab.config import format_validation_error
from k2lab.errors import K2LabError

__all__ = ["MISSING", "is_set", "load_config", "read_recipe", "set_dotted", "unset_defaults", "value_at"]

Config = TypeVar("Config", bound=BaseModel)


def read_recipe(recipe: str | Path | None) -> dict[str, Any]:
    """The TOML recipe as a dict (empty without one), with clear errors for a missing or broken file."""
    if recipe is None:
        return {}
    path = Path(recipe)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as error:
        raise K2LabError(f"recipe {path} does not exist") from error
    except tomllib.TOMLDecodeError as error:
        raise K2LabError(f"recipe {path} is not valid TOML ({error})") from error
    except UnicodeDecodeError as error:
        raise K2LabError(f"recipe {path} is not UTF-8 text, as TOML must be ({error.reason})") from error
    except OSError as error:  # a directory, no permission, …
        raise K2LabError(f"recipe {path} cannot be read: {error.strerror or error}") from error


def set_dotted(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with each ``a.b.c`` key of ``overrides`` written into its nested table (None values skipped)."""
    for key, value in overrides.items():
        if value is None:
            continue
        target = data
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return data


MISSING = object()  # what ``value_at`` returns for a key the tables do not hold


def value_at(table: Mapping[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of nested tables, or ``MISSING``."""
    node: Any = table
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def is_set(table: Mapping[str, Any], overrides: Mapping[str, Any], key: str) -> bool:
    """Whether dotted ``key`` is given by the recipe ``table`` or by a non-None override."""
    return overrides.get(key) is not None or value_at(table, key) is not MISSING


def unset_defaults(
    table: Mapping[str, Any], overrides: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The entries of a command's own ``defaults`` that neither the recipe nor an override sets: they go
    below both (e.g. SFT's learning rate over pre-training's)."""
    return {key: value for key, value in defaults.items() if not is_set(table, overrides, key)}


def load_config(
    config: type[Config], recipe: str | Path | None = None, what: str | None = None, **overrides: Any
) -> Config:
    """Recipe file (TOML) plus dotted overrides (None values ignored), validated as ``config``; errors say
    "invalid {what}: field: reason" (``what`` defaults to the class name)."""
    data = set_dotted(read_recipe(recipe), overrides)
    try:
        return config.model_validate(data)
    except ValidationError as error:
        raise K2LabError(f"invalid {what or config.__name__}: {format_validation_error(error)}") from error
