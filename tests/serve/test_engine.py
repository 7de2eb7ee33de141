"""The serving engine's bookkeeping: ``active`` counts the requests still generating."""

from __future__ import annotations

import threading

import torch

from k2lab import build_model, load_preset
from k2lab.serve import Engine, Request, SamplingParams


def test_a_finished_request_is_not_active_when_its_client_hears_of_it():
    """Was: ``active`` 1 in the request's own on_finish (its row retired only after), so /health showed a
    request in flight for a moment after every client had its response."""
    engine = Engine(build_model(load_preset("k2-nano", vocab_size=300)), max_batch=2, prefix_cache_bytes=0)
    seen, done = [], threading.Event()

    def on_finish(reason: str) -> None:
        seen.append((reason, engine.active))
        done.set()

    params = SamplingParams(max_tokens=3, temperature=0.0, seed=0, stop_token_ids=())
    engine.start()
    try:
        engine.submit(Request([1, 2, 3], params, on_finish=on_finish))
        assert done.wait(timeout=60)
    finally:
        engine.shutdown()
    assert seen == [("length", 0)]


def test_a_stop_token_ends_the_request_and_is_not_delivered():
    """``finish_reason`` "stop": the stop token is neither passed to ``on_token`` nor kept in ``tokens``.
    Greedy tokens from full forwards (argmax of the last position, no cache) are the reference."""
    model = build_model(load_preset("k2-nano", vocab_size=300))
    ids, greedy = [1, 2, 3], []
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(model(torch.tensor([ids + greedy])).logits[0, -1].argmax()))
    stop = next(k for k in range(1, 6) if greedy[k] not in greedy[:k])  # a token not sampled before
    engine = Engine(model, max_batch=2, prefix_cache_bytes=0)
    delivered, done = [], threading.Event()
    params = SamplingParams(max_tokens=8, temperature=0.0, seed=0, stop_token_ids=(greedy[stop],))
    request = Request(ids, params, on_token=delivered.append, on_finish=lambda reason: done.set())
    engine.start()
    try:
        engine.submit(request)
        assert done.wait(timeout=60)
    finally:
        engine.shutdown()
    assert request.finish_reason == "stop"
    assert delivered == greedy[:stop] and request.tokens == greedy[:stop]
