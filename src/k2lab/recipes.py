"""Recipe files: a TOML file plus ``a.b.c`` dotted overrides, validated as the pydantic config they describe.

One loader for every command and API that takes a recipe (``k2lab.cli.options`` builds on it); errors name the
file or the field, never a traceback.
"""

from __future__ import annotations

import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from k2lab.config import format_errors
from k2lab.errors import K2LabError

__all__ = [
    "MISSING",
    "RecipeError",
    "booleans_for_numbers",
    "is_set",
    "load_config",
    "read_recipe",
    "set_dotted",
    "unset_defaults",
    "validate_config",
    "value_at",
]

Config = TypeVar("Config", bound=BaseModel)


def read_recipe(recipe: str | Path | None) -> dict[str, Any]:
    """The TOML recipe as a dict (empty without one), with clear errors for a missing or broken file."""
    if recipe is None:
        return {}
    path = Path(recipe)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark is no TOML
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
        for depth, parent in enumerate(parents, 1):
            target = target.setdefault(parent, {})
            if not isinstance(target, dict):
                table = ".".join(parents[:depth])
                raise K2LabError(f"{key}: {table} is {target!r}, not a table, so it has no field {leaf!r}")
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


class RecipeError(K2LabError):
    """A recipe (file, ``--set`` and options) that does not validate as its config: "invalid {what}: field:
    reason; ...". It keeps the problems (pydantic's error dicts), so that a command can say which of its
    options a required field needs (``naming``)."""

    def __init__(
        self, what: str, problems: list[dict[str, Any]], options: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(f"invalid {what}: {format_errors(problems, options)}")
        self.what, self.problems = what, problems

    def naming(self, options: Mapping[str, str]) -> RecipeError:
        """The same error with each required field that ``options`` maps (dotted key → flags) named by it."""
        return RecipeError(self.what, self.problems, options)


def _leaves(annotation: Any) -> tuple[Any, ...]:
    """The types a field accepts: ``X | None`` → ``(X, NoneType)``, ``Annotated[X, ...]`` → ``(X,)``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaves(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return tuple(leaf for arg in typing.get_args(annotation) for leaf in _leaves(arg))
    return (annotation,)


def _items(annotation: Any, value: Any) -> list[tuple[str, Any, Any]]:
    """(key, annotation, value) of each entry of a list, tuple or dict ``value`` that ``annotation`` types."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(value, Mapping) and origin in (dict, Mapping) and len(args) == 2:
        return [(str(key), args[1], item) for key, item in value.items()]
    if not isinstance(value, list) or origin not in (list, tuple, set, frozenset) or not args:
        return []
    if origin is tuple and args[-1] is not Ellipsis:  # tuple[A, B]: one type per place
        return [(str(index), arg, item) for index, (arg, item) in enumerate(zip(args, value, strict=False))]
    return [(str(index), args[0], item) for index, item in enumerate(value)]


def _booleans_at(annotation: Any, value: Any, loc: tuple[str, ...]) -> list[dict[str, Any]]:
    """Problems (pydantic-style error dicts) where a boolean under ``loc`` would be read as a number of
    ``annotation``."""
    leaves = _leaves(annotation)
    if isinstance(value, bool):
        if not {int, float} & set(leaves) or {bool, Any, object} & set(leaves):
            return []
        wanted = "a number" if float in leaves else "an integer"
        return [{"loc": loc, "msg": f"takes {wanted}, not {str(value).lower()}", "type": "bool_number"}]
    found = []
    for leaf in leaves:
        if isinstance(leaf, type) and issubclass(leaf, BaseModel) and isinstance(value, Mapping):
            found += booleans_for_numbers(leaf, value, loc)
        for key, item_type, item in _items(leaf, value):
            found += _booleans_at(item_type, item, (*loc, key))
    return found


def booleans_for_numbers(
    config: type[BaseModel], data: Mapping[str, Any], loc: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """Where ``data`` (recipe tables) gives ``true``/``false`` to a number field of ``config``, nested
    sections and lists included (pydantic would read 1 and 0): problems as pydantic's error dicts."""
    fields = {field.alias or name: field for name, field in config.model_fields.items()}
    fields.update(config.model_fields)
    found = []
    for key, value in data.items():
        if key in fields:
            found += _booleans_at(fields[key].annotation, value, (*loc, key))
    return found


def validate_config(config: type[Config], data: Mapping[str, Any], what: str | None = None) -> Config:
    """``data`` validated as ``config``, with no boolean taken for a number; problems raise ``RecipeError``
    ("invalid {what}: field: reason", ``what`` defaulting to the class name)."""
    what = what or config.__name__
    booleans = booleans_for_numbers(config, data)
    if booleans:
        raise RecipeError(what, booleans)
    try:
        return config.model_validate(data)
    except ValidationError as error:
        raise RecipeError(what, error.errors()) from error


def load_config(
    config: type[Config], recipe: str | Path | None = None, what: str | None = None, **overrides: Any
) -> Config:
    """Recipe file (TOML) plus dotted overrides (None values ignored), validated as ``config``
    (``validate_config``); errors say "invalid {what}: field: reason" (``what`` defaults to the class name)."""
    return validate_config(config, set_dotted(read_recipe(recipe), overrides), what)
