"""Ctrl-C in a long command: one line saying where the run stands, exit code 130, no traceback.

A run wraps its work in ``reports_interrupt(run_dir, kept, hint)``; a ``KeyboardInterrupt`` inside becomes a
``RunInterrupted`` (a ``KeyboardInterrupt``, so typer still exits with 130 and prints nothing) and the
outermost such block prints, on stderr::

    interrupted: RUN_DIR keeps its last checkpoint, step N (later steps were not saved); HINT
    interrupted: RUN_DIR keeps no checkpoint yet; HINT

``kept`` says what the directory holds at that moment (``last_checkpoint(run_dir, counter)`` for a run that
checkpoints; a command may say its own, e.g. the documents done). Blocks nest: a study wraps each of its
runs, a run wraps its loop. The innermost block names the run directory and what it keeps (it knows which
run stopped); the outermost block that gives a ``hint`` says how to go on (a study knows that its runs
start afresh when it is run again, which the run inside it does not).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

from k2lab.train.run_checkpoints import list_checkpoints

__all__ = ["RERUN_TO_CONTINUE", "RunInterrupted", "last_checkpoint", "reports_interrupt"]

# what a run that resumes when started again with the same arguments says
RERUN_TO_CONTINUE = "run the same command again to continue"

_DEPTH: ContextVar[int] = ContextVar("k2lab_interrupt_depth", default=0)


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C inside ``reports_interrupt``: which run stopped, what it keeps and how to go on."""

    def __init__(self, run_dir: Path, kept: str, hint: str | None) -> None:
        super().__init__(f"{run_dir} keeps {kept}")
        self.run_dir, self.kept, self.hint = run_dir, kept, hint

    def line(self) -> str:
        """The one line the user sees."""
        return f"interrupted: {self.run_dir} keeps {self.kept}" + (f"; {self.hint}" if self.hint else "")


def last_checkpoint(run_dir: str | Path, counter: str = "step") -> Callable[[], str]:
    """What a checkpointing run keeps: "its last checkpoint, COUNTER N (later COUNTERs were not saved)" or
    "no checkpoint yet" (read when the interrupt comes)."""

    def kept() -> str:
        saved = list_checkpoints(Path(run_dir))
        if not saved:
            return "no checkpoint yet"
        return f"its last checkpoint, {counter} {saved[0][0]} (later {counter}s were not saved)"

    return kept


@contextmanager
def reports_interrupt(
    run_dir: str | Path, kept: Callable[[], str], hint: str | None = None, show: bool = True
) -> Iterator[None]:
    """Turn Ctrl-C inside the block into ``RunInterrupted(run_dir, kept(), hint)``; the outermost block
    prints its line on stderr (when ``show``: rank 0 of a data-parallel run) and re-raises it (exit 130).
    An inner block's ``RunInterrupted`` keeps its run and what it keeps; an outer ``hint`` replaces its."""
    depth = _DEPTH.set(_DEPTH.get() + 1)
    try:
        yield
    except RunInterrupted as stopped:
        _finish(stopped if hint is None else RunInterrupted(stopped.run_dir, stopped.kept, hint), show)
    except KeyboardInterrupt:
        _finish(RunInterrupted(Path(run_dir), kept(), hint), show)
    finally:
        _DEPTH.reset(depth)


def _finish(stopped: RunInterrupted, show: bool) -> None:
    """Print ``stopped`` when this is the outermost block, and raise it without the traceback's chain."""
    if _DEPTH.get() == 1 and show:
        print(f"\n{stopped.line()}", file=sys.stderr, flush=True)
    raise stopped from None
