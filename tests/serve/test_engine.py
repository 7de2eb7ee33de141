"""The serving engine's bookkeeping: ``active`` counts the requests still generating."""

from __future__ import annotations

import threading

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
