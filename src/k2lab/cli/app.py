"""The ``k2lab`` application object, its console and the options several command modules share."""

from __future__ import annotations

import inspect
from typing import Annotated

import typer
from rich.console import Console

app = typer.Typer(
    name="k2lab",
    help="The Kimi K2 model family (K2, K2.5, K3): build, inspect, convert and run models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
PresetOption = Annotated[str, typer.Option("--preset", "-p", help="Preset name; `k2lab presets` lists them.")]


def flow_command_summaries(typer_app: typer.Typer) -> None:
    """Give every command of ``typer_app`` (and of its groups) a ``short_help``: the first paragraph of its
    help with its line breaks joined. Rich help keeps a docstring's single newlines in a group's command list,
    which then breaks mid-sentence; a command's own ``--help`` reflows its text already."""
    for command in typer_app.registered_commands:
        if command.short_help is None:
            command.short_help = _first_paragraph(command.help or inspect.getdoc(command.callback) or "")
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            flow_command_summaries(group.typer_instance)


def _first_paragraph(text: str) -> str:
    return " ".join(inspect.cleandoc(text).split("\n\n")[0].split())
