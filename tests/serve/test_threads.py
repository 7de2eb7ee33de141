"""One OpenMP team in a server (``k2lab.serve.threads``): the calling thread handed down to one torch thread,
and the engine's thread running with the count it was given."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.serve import Engine, Request, SamplingParams
from k2lab.serve.threads import hand_threads_to_engine, in_worker_thread


def test_hand_threads_to_engine_leaves_the_caller_one():
    before = torch.get_num_threads()
    try:
        assert hand_threads_to_engine() == before and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def engine_thread_count(threads: int | None) -> int:
    """torch.get_num_threads() as seen in the engine's thread (on_token runs there)."""
    seen, done = [], threading.Event()
    engine = Engine(build_model(load_preset("k2-nano")), 1, 0, compile="off", threads=threads).start()
    request = Request([5, 6, 7], SamplingParams(2, 0.0), lambda _: seen.append(torch.get_num_threads()))
    request.on_finish = lambda _: done.set()
    engine.submit(request)
    assert done.wait(60)
    engine.shutdown()
    return seen[0]


def test_the_engine_thread_runs_with_the_threads_it_was_given():
    before = torch.get_num_threads()
    try:
        assert engine_thread_count(1) == 1 and engine_thread_count(2) == 2
        assert torch.get_num_threads() == before  # the caller's own setting is untouched
    finally:
        torch.set_num_threads(before)  # torch's count for threads yet to start is process-wide


def test_the_engine_keeps_its_threads_when_a_worker_sets_one_before_its_first_step():
    """Torch gives a thread the count some thread set last, process-wide, at its first parallel op: the
    engine's thread set two and waited, the first chat rendered in a worker thread set one, and the engine
    then decoded on one thread (and rebuilt every graph the background build made under two)."""
    before = torch.get_num_threads()
    seen, done = [], threading.Event()
    try:
        engine = Engine(build_model(load_preset("k2-nano")), 1, 0, compile="off", threads=2).start()
        deadline = time.monotonic() + 30
        while not engine._wake._waiters and time.monotonic() < deadline:  # waiting: its count is set
            time.sleep(0.01)
        assert asyncio.run(in_worker_thread(torch.get_num_threads)) == 1  # a worker sets one meanwhile
        request = Request([5, 6, 7], SamplingParams(2, 0.0), lambda _: seen.append(torch.get_num_threads()))
        request.on_finish = lambda _: done.set()
        engine.submit(request)
        assert done.wait(60)
        engine.shutdown()
        assert seen[0] == 2
    finally:
        torch.set_num_threads(before)


def test_in_worker_thread_runs_with_one_thread_and_passes_arguments_and_errors():
    def work(a: int, *, b: int) -> tuple[int, int, str]:
        return a + b, torch.get_num_threads(), threading.current_thread().name

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        total, threads, name = asyncio.run(in_worker_thread(work, 1, b=2))
        assert (total, threads) == (3, 1) and name != threading.current_thread().name
        assert torch.get_num_threads() == 2  # the caller keeps its own count

        def fail() -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            asyncio.run(in_worker_thread(fail))
    finally:
        torch.set_num_threads(before)
