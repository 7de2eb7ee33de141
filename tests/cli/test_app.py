"""Every command's ``--help``: flags and recipe keys whole at 80 columns, docstring paragraphs reflowed."""

import inspect
import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from rich.text import Text
from typer.testing import CliRunner

from k2lab.cli import app


def _commands(group: typer.Typer, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(words of the command line, callback) of every command of ``group`` and its groups."""
    for info in group.registered_commands:
        yield (*prefix, info.name or info.callback.__name__.replace("_", "-")), info.callback
    for sub in group.registered_groups:
        yield from _commands(sub.typer_instance, (*prefix, sub.name))


COMMANDS = list(_commands(app))
IDS = [" ".join(words) for words, _ in COMMANDS]


def _help(words: tuple[str, ...], columns: int) -> str:
    result = CliRunner().invoke(
        app, [*words, "--help"], terminal_width=columns, env={"COLUMNS": str(columns)}
    )
    assert result.exit_code == 0, result.output
    return result.output


def _click_command(words: tuple[str, ...]) -> Any:
    command = typer.main.get_command(app)
    for word in words:
        command = command.commands[word]
    return command


@pytest.mark.parametrize(("words", "callback"), COMMANDS, ids=IDS)
def test_flags_and_recipe_keys_are_whole_at_80_columns(words, callback):
    """rich shrank the flag column of `k2lab rl --help` to `--group-size,--…` and `--groups-per-it…`."""
    output = _help(words, 80)
    flags = [
        flag
        for parameter in _click_command(words).params
        if not getattr(parameter, "hidden", False)
        for flag in (*parameter.opts, *parameter.secondary_opts)
    ]
    cut = [flag for flag in flags if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", output)]
    assert not cut, f"flags cut in `k2lab {' '.join(words)} --help`: {cut}"
    keys = [option.path for option in getattr(callback, "config_options", {}).values()]
    text = output.replace("│", " ")  # the panel's border between wrapped lines
    cut = [key for key in keys if not re.search(rf"recipe\s+key:\s+{re.escape(key)}\)", text)]
    assert not cut, f"recipe keys cut in `k2lab {' '.join(words)} --help`: {cut}"


@pytest.mark.parametrize(("words", "callback"), COMMANDS, ids=IDS)
def test_each_docstring_paragraph_reflows(words, callback):
    """`ablate optimizer --help` broke "split over / several processes" where the docstring's line ended."""
    lines = [line.strip() for line in _help(words, 1000).splitlines()]
    for paragraph in inspect.cleandoc(callback.__doc__ or "").split("\n\n"):
        assert Text.from_markup(" ".join(paragraph.split())).plain in lines


def test_a_default_the_study_derives_is_shown_as_derived():
    """`ablate zero-vision --help` showed `--seq-len (default: 256)`, the base recipe's, which the study never
    uses unless given: it sizes rows to the longest trajectory."""
    text = " ".join(_help(("ablate", "zero-vision"), 1000).replace("│", " ").split())
    assert "(default: the longest trajectory's length rounded up to 64; recipe key: base.seq_len)" in text
    assert "default: 256" not in text
