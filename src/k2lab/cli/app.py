"""The ``k2lab`` application object, its console and the options several command modules share."""

from __future__ import annotations

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
