"""The server's decode step compiled in a background thread, so that serving never waits for a build.

On a CPU inductor's build of the compiled decode step (``k2lab.infer.compiled``) takes ≈ 30–40 s per batch
class on 2 cores from an empty inductor cache (≈ 2–9 s from its on-disk cache), and the step then runs ≈ 3×
the eager one (k2-mini: batch 4 ≈ 3,000 against ≈ 1,100 tokens/s, docs/generation.md). A long-running server
repays the build many times over, but ``compile = "auto"`` keeps a CPU eager because a build would block the
first requests for minutes. ``k2lab serve`` therefore starts eager on a CPU and builds the compiled step here:

    thread:  for every batch size the engine can run (1 … max_batch): decode 2 tokens of a 17-token dummy
             prompt through ``generate`` with compile on (the same compiled step, cached on the model)
    engine:  at every iteration, once the thread has run them all, switch to the compiled step

Only a size whose step needs a graph of its own pays a build; the others find one and take milliseconds.
Which sizes those are depends on the model's own thresholds (dynamo guards them: one row; the decode-linear
reduction tier up to ``COMPILED_MAX_ROWS`` rows; the routed experts' tiers: rows·top-k below the expert count,
up to ``GATHERED_MAX_ROWS``;
sizes that happen to equal another dimension), so every size is run rather than a guessed list — a graph
missed here would be built by the engine mid-serving, stopping every request for tens of seconds
(measured: a list of three sizes left two builds to the engine). The engine keeps a spare cache slot so that
its steps never end at the cache's last slot, a case with a graph of its own (``Engine``). A build that
fails (no C++ compiler, say) leaves the engine eager; ``report`` says what happened (``/health``'s
``decode_step``).
The thread builds under the engine thread's intra-op thread count (``threads``), both set with
``k2lab.serve.threads.set_own_threads``: dynamo guards the count a graph was built under, and a build under
another count (the caller's one, say), or an engine thread that torch reset to one, left every graph to be
built again at the engine's first steps (measured, k2-nano, cold inductor cache: 9 recompiles; the first
burst of chats took 14.5 s against 1.3 s after). Both threads run in inference mode: grad mode, the other
guarded state that is a thread's own, is the same too.
Eager serving goes on meanwhile, slower while the build shares the cores and the GIL: in one measurement
(k2-mini, 2 threads, cold cache) 108 eager generations ran during the three builds (97 s) with the same
tokens as without them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from k2lab.hardware import CompileMode, Precision
from k2lab.infer.compiled import decode_compile_decision, decode_step
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.serve.threads import set_own_threads

__all__ = ["BackgroundCompile", "background_compiles"]

# Tokens of the dummy prompt: its cache (17 + 2 slots) must not be as long as any other size of the step, or
# dynamo's duck sizing guards that equality and the first real step builds again (a 4-token prompt's 6 slots
# met a batch of 6: measured).
DUMMY_PROMPT = 17


def background_compiles(requested: CompileMode | str, device: str) -> bool:
    """Whether a server's decode step is built in the background: ``compile = "auto"`` where it decides eager
    (a CPU); "on" compiles at the first step, "off" never, and "auto" on CUDA compiles at once."""
    return requested == "auto" and not decode_compile_decision(requested, device)[0]


class BackgroundCompile:
    """Builds ``model``'s compiled decode step (matrices per ``decode_weights``) for every batch size up to
    ``max_batch`` in a daemon thread with ``threads`` intra-op threads, the engine thread's (None: a new
    thread's default, as the engine's); ``step()`` is the compiled callable once every size ran, else None."""

    def __init__(
        self,
        model: torch.nn.Module,
        decode_weights: Precision | str,
        max_batch: int,
        threads: int | None = None,
    ) -> None:
        self.model, self.decode_weights, self.threads = model, decode_weights, threads
        self.sizes = list(range(1, max_batch + 1))
        self.state = "waiting"  # waiting -> building -> compiled | failed | stopped
        self.detail = ""
        self._built: Callable[..., object] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> BackgroundCompile:
        self._thread = threading.Thread(target=self._build, name="k2lab-compile", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """No further builds (one in progress finishes in its daemon thread)."""
        self._stop.set()

    def building(self) -> bool:
        """Whether a build is running now (its thread cannot be stopped before it ends)."""
        return self.state == "building" and self._thread is not None and self._thread.is_alive()

    def step(self) -> Callable[..., object] | None:
        """The compiled decode step once built, else None."""
        return self._built if self.state == "compiled" else None

    def report(self) -> dict[str, str]:
        """``{"mode": eager | compiled, "build": state, "detail": …}`` for ``/health``."""
        return {"mode": "compiled" if self.state == "compiled" else "eager", "build": self.state,
                "detail": self.detail}  # fmt: skip

    def _build(self) -> None:
        self.state, start = "building", time.perf_counter()
        if self.threads is not None:  # the engine's count: a graph built under another is rebuilt there
            set_own_threads(self.threads)
        config = GenerationConfig(max_new_tokens=2, compile="on", decode_weights=self.decode_weights)
        prompt = list(range(3, 3 + DUMMY_PROMPT))
        try:
            for size in self.sizes:
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                self.detail = f"building: batch size {size} of {len(self.sizes)}"
                generate(self.model, [prompt] * size, config)
        except Exception as error:  # noqa: BLE001 - any build failure leaves the server eager, said in /health
            self.state, self.detail = "failed", f"{type(error).__name__}: {error}"
            return
        self._built = decode_step(self.model, "on", self.decode_weights)
        self.detail = f"built for batch sizes 1-{len(self.sizes)} in {time.perf_counter() - start:.0f} s"
        self.state = "compiled"
