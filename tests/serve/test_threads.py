"""One OpenMP team in a server (``k2lab.serve.threads``): the calling thread handed down to one torch thread,
and the engine's thread running with the count it was given."""

from __future__ import annotations

import threading

import torch

from k2lab import build_model, load_preset
from k2lab.serve import Engine, Request, SamplingParams
from k2lab.serve.threads import hand_threads_to_engine


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
