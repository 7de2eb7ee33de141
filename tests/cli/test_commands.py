"""Every command: it runs a config through ``runs_config`` (--recipe, --set, options derived from the config)
or it is one of the few that run none; no help text carries a copied default."""

import re

import click
import pytest
import typer

from k2lab.cli import app
from k2lab.cli.options import field_at

# commands that run no pydantic config: they print, count, draw or write a fixed thing
CONFIGLESS = {"presets", "params", "init", "plot", "mopd report"}


def _commands(group: typer.Typer, prefix: str = ""):
    for info in group.registered_commands:
        yield prefix + (info.name or info.callback.__name__.replace("_", "-")), info.callback
    for sub in group.registered_groups:
        yield from _commands(sub.typer_instance, prefix + sub.name + " ")


COMMANDS = dict(_commands(app))


def test_every_command_runs_a_config_or_is_listed_configless():
    runs_none = {name for name, callback in COMMANDS.items() if not hasattr(callback, "config_class")}
    assert runs_none == CONFIGLESS


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - CONFIGLESS))
def test_config_commands_take_recipe_and_set_and_name_real_fields(name):
    callback = COMMANDS[name]
    click_command = typer.main.get_command(app)
    for part in name.split():
        click_command = click_command.commands[part]
    flags = {flag for param in click_command.params for flag in param.opts}
    assert {"--recipe", "--set"} <= flags
    for option in callback.config_options.values():
        field_at(callback.config_class, option.path)  # KeyError if the option names no field


COPIED_DEFAULT = re.compile(r"\(default[^:]|\bdefault \d")


@pytest.mark.parametrize("name", sorted(set(COMMANDS) - CONFIGLESS))
def test_no_help_text_carries_a_copied_default(name):
    """A config command's defaults come from its config (``runs_config`` appends them); none is retyped."""
    click_command: click.Command = typer.main.get_command(app)
    for part in name.split():
        click_command = click_command.commands[part]
    for param in click_command.params:
        text = getattr(param, "help", None) or ""
        assert not COPIED_DEFAULT.search(text), f"{name} {param.opts}: {text!r}"
