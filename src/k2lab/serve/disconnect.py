"""Cancelling a non-streaming request whose client has gone (a streaming one notices when its next chunk
cannot be sent): ``async with cancel_on_disconnect(http, cancel):`` around the wait for the engine polls the
client every ``DISCONNECT_POLL_S`` seconds and calls ``cancel`` once it has left, so its batch rows are freed
instead of generating to ``max_tokens`` for nobody. Chat and ``/v1/completions`` share it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Request

__all__ = ["DISCONNECT_POLL_S", "cancel_on_disconnect"]

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@asynccontextmanager
async def cancel_on_disconnect(http: Request, cancel: Callable[[], None]) -> AsyncIterator[None]:
    """Call ``cancel`` if ``http``'s client disconnects while the block runs (module doc)."""
    watch = asyncio.create_task(_watch(http, cancel))
    try:
        yield
    finally:
        watch.cancel()


async def _watch(http: Request, cancel: Callable[[], None]) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancel()
