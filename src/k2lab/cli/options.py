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
that is not TOML is taken as a string (``--set preset=k2-nano``). A list field (``list[float]``, ...) is a
named option taking comma-separated values (``--lrs 1e-3,3e-3``), as is a ``tuple[X, ...]`` field; ``Opt(...,
sep=",")`` splits on that separator only, for text values with spaces (``--styles 'qa,a limerick'``).

A ``Profile`` is a named overlay of config values, e.g. a smoke run's smaller model and fewer steps, as
data: ``profiles={"quick": Profile(QUICK, help=...)}`` adds ``--quick``, whose overlay goes below the
recipe, ``--set`` and the named options (the command's ``load`` receives it as ``overlay=``), and
``--help`` shows each option's value under it beside the default.
"""

from __future__ import annotations

import inspect
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from copy import copy, deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from k2lab.errors import K2LabError
from k2lab.recipes import MISSING, RecipeError, load_config, read_recipe, unset_defaults, value_at

__all__ = ["Opt", "Profile", "field_at", "parse_set", "runs_config"]

Loader = Callable[..., BaseModel]


@dataclass(frozen=True)
class Opt:
    """A named option for config field ``path`` (dotted for nested sections), with extra flag spellings
    (``"-p"``; a ``"--long"`` one replaces the ``--name`` spelling), its help (default: the field's
    description), an environment variable it is read from when not given, and for a list field the
    separator its values are split on (default: commas or whitespace)."""

    path: str
    flags: tuple[str, ...] = ()
    help: str | None = None
    envvar: str | None = None
    sep: str | None = None

    def __init__(
        self,
        path: str,
        *flags: str,
        help: str | None = None,
        envvar: str | None = None,
        sep: str | None = None,
    ) -> None:
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "flags", flags)
        object.__setattr__(self, "help", help)
        object.__setattr__(self, "envvar", envvar)
        object.__setattr__(self, "sep", sep)


@dataclass(frozen=True)
class Profile:
    """A named overlay of config values (nested tables, as in a recipe) that a ``--name`` flag applies
    below the recipe, ``--set`` and the named options."""

    values: Mapping[str, Any]
    help: str


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


def default_at(config: type[BaseModel], path: str) -> Any:
    """The default of dotted ``path``, read through the section defaults (a section whose default instance
    sets ``lr=0.05`` shows 0.05, not its class's default)."""
    model: type[BaseModel] | None = config
    value: Any = PydanticUndefined
    for part in path.split("."):
        field = model.model_fields[part] if model is not None and part in model.model_fields else None
        value = getattr(value, part) if isinstance(value, BaseModel) else field_default(field)
        model = _model_of(field.annotation) if field is not None else None
    return value


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``, else the annotation itself."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _list_item(annotation: Any) -> type | None:
    """``X`` for a field of type ``list[X]`` or ``tuple[X, ...]`` (or either ``| None``) with X int, float or
    str, else None."""
    annotation = _without_none(annotation)
    item = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and len(item) == 2 and item[1] is Ellipsis:
        item = item[:1]  # tuple[X, ...]
    elif typing.get_origin(annotation) is not list:
        return None
    return item[0] if len(item) == 1 and item[0] in (int, float, str) else None


def parse_list(flag: str, text: str, item: type, sep: str | None = None) -> list[Any]:
    """``"1e-3, 3e-3"`` → ``[0.001, 0.003]``: the comma- (or space-) separated values of a list option
    (with ``sep``: the values between separators, stripped)."""
    parts = re.split(r"[\s,]+", text) if sep is None else [part.strip() for part in text.split(sep)]
    try:
        return [item(part) for part in parts if part]
    except ValueError as error:
        raise K2LabError(
            f"{flag} takes {item.__name__} values separated by commas (e.g. 1,2), got {text!r}"
        ) from error


def _option_type(annotation: Any) -> tuple[Any, str]:
    """The CLI type of a field (``X | None`` → ``X``; a ``Literal`` → ``str``; a list → comma-separated
    ``str``) and a note of its choices."""
    if _list_item(annotation) is not None:
        return str, " (comma-separated)"
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) is Literal:
        return str, " (" + ", ".join(str(choice) for choice in typing.get_args(annotation)) + ")"
    if annotation in (int, float, str, bool, Path):
        return annotation, ""
    raise TypeError(f"a field of type {annotation!r} cannot be a named option; use --set")


def _shown(value: Any) -> str:
    """A default as ``--help`` shows it (a list as the comma-separated values an option takes)."""
    return ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def option_help(
    config: type[BaseModel],
    name: str,
    option: Opt,
    defaults: Mapping[str, Any] | None = None,
    profiles: Mapping[str, Profile] | None = None,
) -> str:
    """The help of a named option: its text, the field's choices and its default (the command's own
    ``defaults`` table where it has one for the field, else the config's), and its value under each
    profile that sets it."""
    field = field_at(config, option.path)
    text = option.help or field.description
    if not text:
        raise TypeError(
            f"option --{name} ({config.__name__}.{option.path}) needs help or a field description"
        )
    _, choices = _option_type(field.annotation)
    default = (defaults or {}).get(option.path, default_at(config, option.path))
    shown = "required" if default is PydanticUndefined else f"default: {_shown(default)}"
    for profile, overlay in (profiles or {}).items():
        value = value_at(overlay.values, option.path)
        if value is not MISSING and value != default:
            shown += f"; --{profile}: {_shown(value)}"
    return f"{text.rstrip('.')}{choices}. ({shown}; recipe key: {option.path})"


def _flags(name: str, option: Opt) -> tuple[str, ...]:
    long = [flag for flag in option.flags if flag.startswith("--")]  # a spelling of its own replaces --name
    return option.flags if long else ("--" + name.replace("_", "-"), *option.flags)


def _parameter(
    config: type[BaseModel],
    name: str,
    option: Opt,
    defaults: Mapping[str, Any] | None,
    profiles: Mapping[str, Profile] | None = None,
) -> inspect.Parameter:
    kind, _ = _option_type(field_at(config, option.path).annotation)
    text = option_help(config, name, option, defaults, profiles)
    info = typer.Option(
        *_flags(name, option), help=text, show_default=False, envvar=option.envvar, path_type=str
    )
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


def _profile_parameter(name: str, profile: Profile) -> inspect.Parameter:
    flag = typer.Option("--" + name.replace("_", "-"), help=profile.help)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, flag]
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


def _default_loader(config: type[BaseModel], defaults: Mapping[str, Any]) -> Loader:
    """``load_config`` with the command's own ``defaults`` below the recipe: each applies unless the recipe
    or an override sets its key."""

    def load(recipe: str | Path | None, **overrides: Any) -> BaseModel:
        below = unset_defaults(read_recipe(recipe), overrides, defaults) if defaults else {}
        given = {path: value for path, value in overrides.items() if value is not None}
        return load_config(config, recipe, **{**below, **given})

    return load


def runs_config(
    config: type[BaseModel],
    *,
    options: Mapping[str, Opt],
    load: Loader | None = None,
    defaults: Mapping[str, Any] | None = None,
    profiles: Mapping[str, Profile] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command whose first parameter is ``config``: see the module docstring.

    ``load(recipe, **dotted_overrides)`` builds the config (default: ``k2lab.recipes.load_config``);
    ``defaults`` is the table of the command's own defaults where they differ from the config's (dotted keys,
    e.g. SFT's ``SFT_DEFAULTS``): ``load`` applies it (the default loader puts it below the recipe),
    ``--help`` shows it. With ``profiles`` (``--name`` flags, at most one per invocation) ``load`` is called
    as ``load(recipe, overlay=..., **overrides)`` with the chosen profile's values (``{}`` without one)."""
    if profiles and load is None:
        raise TypeError("profiles need a load(recipe, overlay=..., **overrides) that applies them")
    loader = load or _default_loader(config, defaults or {})
    lists = {name: _list_item(field_at(config, option.path).annotation) for name, option in options.items()}
    flag_names = {option.path: "/".join(_flags(name, option)) for name, option in options.items()}

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = list(inspect.signature(command, eval_str=True).parameters.values())
        if not own or own[0].name != "config":
            raise TypeError(f"{command.__name__}: the first parameter must be `config`")
        rest = [copy(p) for p in own[1:]]
        added = [_parameter(config, name, option, defaults, profiles) for name, option in options.items()]
        flags = [_profile_parameter(name, profile) for name, profile in (profiles or {}).items()]

        def run(**kwargs: Any) -> Any:
            overrides = dict(parse_set(text) for text in kwargs.pop("set_") or [])
            named = {options[name].path: _named_value(name, kwargs.pop(name)) for name in options}
            overrides.update({path: value for path, value in named.items() if value is not None})
            if profiles is None:
                return command(_load(kwargs.pop("recipe"), **overrides), **kwargs)
            chosen = [name for name in profiles if kwargs.pop(name)]
            if len(chosen) > 1:
                raise K2LabError(f"choose one of {', '.join('--' + name for name in chosen)}")
            overlay = deepcopy(dict(profiles[chosen[0]].values)) if chosen else {}
            return command(_load(kwargs.pop("recipe"), overlay=overlay, **overrides), **kwargs)

        def _load(recipe: Path | None, **overrides: Any) -> BaseModel:
            """``loader``'s config; a required field it lacks is named by its option (``--checkpoint/-c``)."""
            try:
                return loader(recipe, **overrides)
            except RecipeError as error:
                raise error.naming(flag_names) from error

        def _named_value(name: str, value: Any) -> Any:
            item = lists[name]
            return (
                parse_list(_flags(name, options[name])[0], value, item, options[name].sep)
                if item and value is not None
                else value
            )

        parameters = [*rest, *flags, _RECIPE, _SETS, *added]
        run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters}
        run.__name__, run.__doc__ = command.__name__, command.__doc__
        run.config_class, run.config_options = config, dict(options)  # type: ignore[attr-defined]
        return run

    return decorate
