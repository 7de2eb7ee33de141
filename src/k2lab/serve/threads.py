"""Torch's intra-op threads in a server whose engine decodes in a thread of its own.

PyTorch's CPU wheels parallelise with GNU OpenMP (libgomp). Every thread that runs a parallel region gets a
team of its own, and libgomp keeps a team's idle workers spinning for a while (≈ 300,000 iterations) so that
the next region starts without waking them through the kernel — unless the process has more OpenMP threads
than CPUs, when they spin only 100–1,000 iterations ("throttled") and nearly every region pays a futex wake.
The serving engine decodes in its own thread, beside the team the main thread made while loading the model:
two teams, more threads than CPUs, and each of a decode step's hundreds of small ops pays the wake. Measured on
a 2-core Zen 5 (AMD EPYC family 26): a SiLU over [8, 64, 256] took 56–84 µs in such a thread against 17–23 µs
in the main thread; eager serving of the k2-mini demo model, 8 concurrent chats × 48 tokens, 363–405 tokens/s,
and 849–968 with a single team (docs/generation.md).

So ``k2lab serve`` keeps one team: ``hand_threads_to_engine`` makes the calling (main) thread single-threaded
before it touches a tensor — it only loads the model and handles HTTP — and the engine's thread takes the
process's threads (``Engine(threads=…)``); scoring requests (``logprobs``) run single-threaded in their
worker thread too. A thread that exits takes its team with it (a background build's thread, say).

A thread's count is set with ``set_own_threads``, not ``torch.set_num_threads`` alone: torch initialises a
thread's count lazily, at its first parallel op, to the count that some thread set last, process-wide, and
that undid a count set before it. The engine's thread set its count and waited for work; the first chat
rendered in a worker thread set one; the engine's first step then initialised it to one. It decoded on one
thread, and dynamo built every graph of the background build (made under the engine's count) again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["hand_threads_to_engine", "in_worker_thread", "set_own_threads"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


def hand_threads_to_engine() -> int:
    """Torch's intra-op thread count, returned for the engine's thread, with the calling thread left at one
    (module docstring). Call it before the calling thread runs any tensor work."""
    threads = torch.get_num_threads()
    set_own_threads(1)
    return threads


def set_own_threads(threads: int) -> None:
    """The calling thread's intra-op thread count, set for good: torch's lazy initialisation of the thread's
    count, which would overwrite it with the count some thread set last (module docstring), is run first."""
    torch.get_num_threads()  # initialises this thread's count now, so that nothing resets the one set next
    torch.set_num_threads(threads)


async def in_worker_thread(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``fn(*args, **kwargs)`` in a worker thread that keeps one intra-op thread: no OpenMP team beside the
    engine's (module docstring). For a request's tensor work off the event loop (scoring, a chat's rendering)."""
    return await asyncio.to_thread(_single_threaded, fn, *args, **kwargs)


def _single_threaded(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    set_own_threads(1)
    return fn(*args, **kwargs)
