"""The ``k2lab`` application object, its console and the options several command modules share, and two
repairs of typer's rich ``--help``: flag columns that rich cut short, docstrings that broke mid-sentence."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import typer
import typer.rich_utils
from rich.columns import Columns
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

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
    """Reflow the help of every command of ``typer_app`` (and of its groups): each paragraph's line breaks
    joined, for its own ``--help`` (rich help keeps the single newlines of a docstring's later paragraphs,
    which then break mid-sentence), and the first paragraph as its ``short_help`` in a group's list."""
    for command in typer_app.registered_commands:
        command.help = _reflowed(command.help or inspect.getdoc(command.callback) or "")
        if command.short_help is None:
            command.short_help = command.help.split("\n\n")[0].removeprefix("\b\n")
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            flow_command_summaries(group.typer_instance)


def _reflowed(text: str) -> str:
    """``text`` dedented, each paragraph on one line; a paragraph that starts with click's ``\\b`` (keep my
    lines) is left as it is."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    joined = (
        part if part.startswith("\b") else " ".join(line.strip() for line in part.split("\n"))
        for part in paragraphs
    )
    return "\n\n".join(joined)


def _stacked(*cells: RenderableType) -> Text:
    """The flag spellings of ``cells`` (typer joins a cell's with commas) one per line."""
    spellings = [part for cell in cells if isinstance(cell, Text) for part in cell.split(",") if part.plain]
    return Text("\n").join(spellings)


class OptionsTable(Table):
    """typer's table of a command's options, laid out so that no flag is cut at 80 columns.

    typer fills one row per option: [required], long flags, short flags, negative long, negative short,
    type, help; a cell's spellings joined by commas (``--groups-per-iteration,--prompts``). When the table is
    wider than the terminal, rich shrinks the widest columns alike and crops words, so flags lost their ends
    (``--groups-per-it…``). Here an option's long flags (its ``--no-x`` ones too) stand one per line in one
    column, as do its short ones; flag columns never shrink, and the help folds a word too long for its
    column instead of cropping it. The tables of a group's commands (columns given beforehand) are left alone.
    """

    def add_row(self, *renderables: RenderableType | None, **kwargs: Any) -> None:
        if (not self.columns or getattr(self, "_of_options", False)) and len(renderables) in (6, 7):
            self._of_options = True  # the layout typer 0.12-0.29 gives; any other row is added as it comes
            *required, long, short, negative_long, negative_short, kind, text = renderables
            if isinstance(text, Columns):
                for item in text.renderables:
                    if isinstance(item, Text) and item.overflow is None:
                        item.overflow = "fold"
            row = [*required, _stacked(long, negative_long), _stacked(short, negative_short), kind, text]
            super().add_row(*row, **kwargs)
            for column in self.columns[:-2]:
                column.no_wrap = True
            return
        super().add_row(*renderables, **kwargs)


typer.rich_utils.Table = OptionsTable  # typer builds its options and commands tables with this name
