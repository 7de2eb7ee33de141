"""Every command: it runs a config through ``runs_config`` (--recipe, --set, options derived from the config)
or it is one of the few that run none; no help text carries a copied default."""

import inspect
import re

import click
import pytest
import typer
from typer.testing import CliRunner

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


def _listing(args: list[str]) -> str:
    result = CliRunner().invoke(app, args, terminal_width=400, env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("group", ["", "draft", "ablate", "mopd"])
def test_command_lists_show_each_summary_unbroken(group):
    """A group's command list shows each command's first help paragraph unbroken at a wide terminal (rich help
    kept a docstring's line breaks there, so ``export`` and ``draft train`` broke mid-sentence)."""
    output = _listing([*group.split(), "--help"])
    click_group = typer.main.get_command(app)
    for part in group.split():
        click_group = click_group.commands[part]
    for name, command in click_group.commands.items():
        # 160 characters reach past a docstring's first line break (they are ~110 wide)
        first = " ".join(inspect.cleandoc(command.help or "").split("\n\n")[0].split())[:160]
        assert any(first in line for line in output.splitlines()), f"{name}: {first!r} is not on one line"
