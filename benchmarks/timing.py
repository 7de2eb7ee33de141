"""Shared timing for the side-by-side benchmarks: interleaved calls, median wall time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternating_medians(fns: list[Callable[[], object]], repeats: int, warmup: int = 1) -> list[float]:
    """Median wall time of each ``fn()`` over ``repeats`` calls, after ``warmup`` untimed calls each.

    Calls are interleaved (a, b, a, b, ...) so that load from other processes hits every side alike.
    """
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, fn_times in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [statistics.median(fn_times) for fn_times in times]
