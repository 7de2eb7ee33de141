"""The ``k2lab`` command (also ``python -m k2lab``, which torchrun needs): one module per area.

| module | commands |
|---|---|
| ``models`` | ``presets``, ``params``, ``init``, ``export`` |
| ``infer`` | ``generate``, ``serve``, ``draft train`` |
| ``train`` | ``train``, ``sft``, ``stability``, ``plot`` |
| ``ablate`` | ``ablate optimizer / balancing / vision-injection / rephrase / parl`` |
| ``data`` | ``data rephrase`` |
| ``runtime`` | ``tools harvest``, ``sandbox run`` |
| ``agentic`` | ``rl``, ``factory generate``, ``recipe agentic-mini``, ``mopd experts / distill / report`` |

Every user error (unknown preset, bad checkpoint, invalid value) is reported as one paragraph on stderr with
exit code 2, never a traceback.
"""

from __future__ import annotations

import sys

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from k2lab.allocator import keep_freed_memory
from k2lab.cli.app import app, flow_command_summaries
from k2lab.config import format_validation_error
from k2lab.errors import K2LabError

# the command modules register themselves on ``app`` when imported, in this (the --help) order
# isort: off
from k2lab.cli import models, infer, train, ablate, data, runtime, agentic  # noqa: E402, F401

# isort: on
flow_command_summaries(app)

__all__ = ["app", "main"]


DATA_PARALLEL_COMMANDS = ("train", "sft")  # the commands torchrun scales out (k2lab.train.distributed)


def refuse_under_torchrun(argv: list[str]) -> None:
    """``K2LabError`` for a command other than ``DATA_PARALLEL_COMMANDS`` launched in several processes: each
    would run the whole job (``rl`` N times into one run directory, ``serve`` N servers on one port)."""
    from k2lab.train.distributed import launched_world_size

    world = launched_world_size()
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if world > 1 and command is not None and command not in DATA_PARALLEL_COMMANDS:
        raise K2LabError(
            f"`k2lab {command}` runs in one process: under torchrun (WORLD_SIZE={world}) every process would "
            "run the whole job; only `k2lab train` and `k2lab sft` are data-parallel. Run it without torchrun."
        )


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the app, turning user errors into one paragraph and exit code 2."""
    err = Console(stderr=True)
    keep_freed_memory()  # freed tensors stay mapped for the next step (k2lab.allocator)
    try:
        refuse_under_torchrun(sys.argv[1:] if argv is None else argv)
        app(args=argv)  # click reports usage errors itself (exit code 2)
    except K2LabError as error:
        err.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except ValidationError as error:
        err.print(
            f"[bold red]invalid value:[/] {escape(format_validation_error(error))}",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
