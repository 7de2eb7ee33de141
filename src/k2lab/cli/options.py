"""Command options derived from the pydantic config a command runs, so each default lives in one place.

A command names the config fields it exposes; ``runs_config`` builds the typer options from the config
class (type from the field's annotation, help from the option or the field's description, the default read
from the config and shown in ``--help``) and adds ``--recipe FILE.toml`` and repeatable
``--set key.path=value``. The command body receives the validated config::

    @app.command()
    @runs_config(TrainConfig, load=load_train_config, options={
        "preset": Opt("preset", "-p", help="Model preset."),
        "lr": Opt("optimizer.lr", help="Peak learning rate."),
    })
    def train(config: TrainConfig, resume: Annotated[bool, typer.Option("--resume")] = False) -> None: ...

Precedence, lowest first: the config's defaults, the recipe, ``--set`` in order, the named options.
``--set`` values are read as TOML values (``--set optimizer.lr=3e-3``, ``--set 'curriculum=[]'``); a value
that is not TOML is taken as a string (``--set preset=k2-nano``).
"""

from __future__ import annotations

import inspect
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from copy import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from k2lab.errors import K2LabError
from k2lab.recipes import load_config

__all__ = ["Opt", "field_at", "parse_set", "runs_config"]

Loader = Callable[..., BaseModel]


@dataclass(frozen=True)
class Opt:
    """A named option for config field ``path`` (dotted for nested sections), with extra flag spellings
    (``"-p"``; a ``"--long"`` one replaces the ``--name`` spelling) and its help (default: the field's
    description)."""

    path: str
    flags: tuple[str, ...] = ()
    help: str | None = None

    def __init__(self, path: str, *flags: str, help: str | None = None) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "flags", flags)
        object.__setattr__(self, "help", help)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel inside ``Section`` or ``Section | None``."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def field_at(config: type[BaseModel], path: str) -> FieldInfo:
    """The pydantic field at dotted ``path`` (``KeyError`` naming the missing part)."""
    model: type[BaseModel] | None = config
    *parents, leaf = path.split(".")
    for part in parents:
        if model is None or part not in model.model_fields:
            raise KeyError(f"{config.__name__} has no section {part!r} (in {path!r})")
        model = _model_of(model.model_fields[part].annotation)
    if model is None or leaf not in model.model_fields:
        raise KeyError(f"{config.__name__} has no field {path!r}")
    return model.model_fields[leaf]


def field_default(field: FieldInfo) -> Any:
    """The field's default (its factory called), or ``PydanticUndefined`` for a required field."""
    if field.default_factory is not None:
        return field.default_factory()
    return field.default


def _option_type(annotation: Any) -> tuple[Any, str]:
    """The CLI type of a field (``X | None`` → ``X``; a ``Literal`` → ``str``) and a note of its choices."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        return str, " (" + ", ".join(str(choice) for choice in typing.get_args(annotation)) + ")"
    if annotation in (int, float, str, bool, Path):
        return annotation, ""
    raise TypeError(f"a field of type {annotation!r} cannot be a named option; use --set")


def option_help(config: type[BaseModel], name: str, option: Opt) -> str:
    """The help of a named option: its text, the field's choices and the config's default."""
    field = field_at(config, option.path)
    text = option.help or field.description
    if not text:
        raise TypeError(
            f"option --{name} ({config.__name__}.{option.path}) needs help or a field description"
        )
    _, choices = _option_type(field.annotation)
    default = field_default(field)
    shown = "required" if default is PydanticUndefined else f"default: {default}"
    return f"{text.rstrip('.')}{choices}. ({shown}; recipe key: {option.path})"


def _parameter(config: type[BaseModel], name: str, option: Opt) -> inspect.Parameter:
    kind, _ = _option_type(field_at(config, option.path).annotation)
    long = [flag for flag in option.flags if flag.startswith("--")]  # a spelling of its own replaces --name
    flags = option.flags if long else ("--" + name.replace("_", "-"), *option.flags)
    info = typer.Option(*flags, help=option_help(config, name, option), show_default=False)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, info]
    )


_RECIPE = inspect.Parameter(
    "recipe",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[
        Path | None, typer.Option(help="TOML recipe of this command's config; options override it.")
    ],
)
_SETS = inspect.Parameter(
    "set_",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[
        list[str] | None,
        typer.Option(
            "--set", help="Override any config field: --set key.path=value (TOML value); repeatable."
        ),
    ],
)


def parse_set(text: str) -> tuple[str, Any]:
    """``"optimizer.lr=3e-3"`` → ``("optimizer.lr", 0.003)``; a value that is not TOML stays a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise K2LabError(f"--set takes key.path=value, got {text!r}")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return key.strip(), parsed


def runs_config(
    config: type[BaseModel], *, options: Mapping[str, Opt], load: Loader | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose first parameter is ``config``: see the module docstring."""
    loader = load or (lambda recipe, **overrides: load_config(config, recipe, **overrides))

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        if not own or own[0].name != "config":
            raise TypeError(f"{command.__name__}: the first parameter must be `config`")
        rest = [copy(p) for p in own[1:]]
        added = [_parameter(config, name, option) for name, option in options.items()]

        def run(**kwargs: Any) -> Any:
            overrides = dict(parse_set(text) for text in kwargs.pop("set_") or [])
            named = {options[name].path: kwargs.pop(name) for name in options}
            overrides.update({path: value for path, value in named.items() if value is not None})
            return command(loader(kwargs.pop("recipe"), **overrides), **kwargs)

        parameters = [*rest, _RECIPE, _SETS, *added]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        run.__name__, run.__doc__ = command.__name__, command.__doc__
        run.config_class, run.config_options = config, dict(options)  # type: ignore[attr-defined]
        return run

    return decorate
