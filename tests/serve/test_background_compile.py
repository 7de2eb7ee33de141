"""The server's decode step built in the background (``k2lab.serve.background_compile``): the batch classes,
when it applies, an engine that serves eagerly while the thread builds and then switches to the compiled
step with the same greedy replies, and a failed build that leaves the engine eager and says why."""

from __future__ import annotations

import time

import pytest
import torch

from k2lab import build_model, load_preset
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.serve import Engine
from k2lab.serve.background_compile import background_compiles
from tests.conftest import randomize
from tests.serve.test_engine_speculative import replies, serve

WAVES = [[([7, 8, 9], 6), (list(range(10, 22)), 5)], [([99, 98], 4)]]


@pytest.fixture(scope="module")
def nano():
    return randomize(build_model(load_preset("k2-nano")))


def test_when_the_build_runs_in_the_background():
    assert background_compiles("auto", "cpu")
    assert not background_compiles("on", "cpu") and not background_compiles("off", "cpu")
    assert not background_compiles("auto", "cuda")  # "auto" compiles there at once


def wait_for(engine: Engine, build: str, timeout: float = 600.0) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while engine.decode_report()["build"] in ("waiting", "building") and time.monotonic() < deadline:
        time.sleep(0.2)
    report = engine.decode_report()
    assert report["build"] == build, report
    return report


def test_the_engine_switches_to_the_compiled_step_once_built(nano):
    """max_batch 2 (two sizes, two graphs): replies during and after the build equal the eager engine's;
    after the switch the engine runs the compiled step and builds nothing more (a warm-up of size 1 alone
    left the batch of 2 to be built mid-serving: this count caught it)."""
    eager = replies(serve(Engine(nano, 2, 0, compile="off").start(), WAVES))
    engine = Engine(nano, 2, 0, background_compile=True).start()
    assert engine.decode_report()["mode"] == "eager"
    assert replies(serve(engine, WAVES, keep=True)) == eager  # while (or after) it builds
    report = wait_for(engine, "compiled")
    assert report["mode"] == "compiled" and "built for batch sizes 1-2" in report["detail"]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert replies(serve(engine, WAVES)) == eager
    assert engine._step is not engine.model and not engine.background.building()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing built mid-serving


def test_a_failed_build_leaves_the_engine_eager(nano, monkeypatch):
    def no_compiler(*_args, **_kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr("k2lab.serve.background_compile.generate", no_compiler)
    eager = replies(serve(Engine(nano, 2, 0, compile="off").start(), WAVES))
    engine = Engine(nano, 2, 0, background_compile=True).start()
    report = wait_for(engine, "failed")
    assert report["mode"] == "eager" and "RuntimeError: no C++ compiler" in report["detail"]
    assert not engine.background.building()
    assert replies(serve(engine, WAVES)) == eager and engine._step is engine.model


def test_no_background_build_where_compile_decides(nano):
    for compile in ("off", "on"):
        engine = Engine(nano, 1, 0, compile=compile, background_compile=True)
        assert engine.background is None
    assert Engine(nano, 1, 0, compile="off").decode_report() == {"mode": "eager"}


def test_the_build_runs_under_the_engine_threads_so_nothing_is_rebuilt():
    """The caller at one thread (as ``hand_threads_to_engine`` leaves it), the engine's at two: a build thread
    that starts before the engine's sets its two took the caller's one, and dynamo, which guards the count,
    built every graph again at the engine's first steps. The build runs alone here, so that order is certain;
    then the compiled step runs as in the engine's thread (its two threads, inference mode). A model of its
    own: another test's graphs, built under the default count, would hide a rebuild."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        model = randomize(build_model(load_preset("k2-nano")))
        engine = Engine(model, 1, 0, background_compile=True, threads=2)
        engine.background.start()
        wait_for(engine, "compiled")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        torch.set_num_threads(engine.threads)
        generate(model, [[5, 6, 7]], GenerationConfig(max_new_tokens=3, compile="on"))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing built again
    finally:
        torch.set_num_threads(before)
