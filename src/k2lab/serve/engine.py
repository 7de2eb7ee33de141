"""The serving engine: continuous batching of token-level requests over one model, in a background thread.

Every iteration of the loop:

1. **admit** waiting requests (up to ``max_batch`` running): prefill them together (left-padded) into a
   cache of their own, sample each one's first token, and merge that cache into the running one
   (``LatentCache.concat``: shorter histories are left-aligned with masked slots, positions carry on).
   With a prefix cache (``k2lab.infer.prefix_cache``; on by default) only what its blocks do not hold is
   prefilled — shared system prompts and tool declarations run once — and a retiring sequence's prompt
   and reply go into it (MLA-only models), so the next turn of a conversation reuses them;
2. **decode** one token for every running sequence in a single forward pass;
3. **retire** sequences that stopped (a stop token, ``max_tokens``, or a cancelled request — a client
   that went away) with ``LatentCache.select``, so later steps compute only live rows.

With a draft (``MODEL/draft/`` or an MTP layer; ``k2lab.serve.speculation``) step 2 is speculative: the
draft proposes ``draft_tokens`` tokens per row and one (k + 1)-token forward verifies them, so a row emits
1 … k + 1 tokens per step — greedy rows exactly what plain decoding gives, sampled rows the target's
distribution (rejection sampling with the request's own generator). A greedy row with a constraint drafts
too: after each verify the engine walks its drafted tokens through the constraint, keeping each while it is
the constrained argmax (``_walk``), so it replies as plain constrained decoding. Sampled rows with a
constraint take no drafts, nor do sampled rows where sampled drafts do not pay (``sampled_drafts``: by
default not on a CPU), and a batch of such rows runs plain decode steps.
Admission appends the new rows' draft cache and features, retirement selects them.

Each request has its own sampling settings and generator (temperature, top-p, seed) and may carry a
decoding constraint (the tool-call enforcer). Tokens are delivered through a thread-safe callback as
they are sampled; ``Request.cancel()`` frees the request's row at the next iteration.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from k2lab.hardware import Precision
from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import CompileMode, decode_step
from k2lab.infer.draft import Draft
from k2lab.infer.generate import Constraint, GenerationConfig, prefill, sample_next
from k2lab.infer.prefix_cache import PrefixCache
from k2lab.infer.speculative import DRAFT_TOKENS, RowSettings
from k2lab.serve.background_compile import BackgroundCompile, background_compiles
from k2lab.serve.speculation import Speculation, prefill_for_draft
from k2lab.serve.threads import set_own_threads

__all__ = ["PREFIX_CACHE_BYTES", "Engine", "Request", "SamplingParams"]

#: The engine's default prefix-cache cap.
PREFIX_CACHE_BYTES = 256 << 20
#: Cache slots kept beyond the longest request's budget: a decode step then never ends at the cache
#: storage's last slot, which a compiled step (dynamo guards ``1 + length == storage``) would need a graph of
#: its own for, built mid-serving.
SPARE_SLOTS = 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(eq=False)
class Request:
    """One generation: prompt ids in, sampled ids out through ``on_token(id)`` then ``on_finish(reason)``.

    ``finish_reason``: "stop" (a stop token, which is not delivered), "length" (``max_tokens``),
    "cancelled", or "error: …".
    """

    prompt: list[int]
    params: SamplingParams
    on_token: Callable[[int], None] = lambda token: None
    on_finish: Callable[[str], None] = lambda reason: None
    constraint: Constraint | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    id: int = field(default_factory=itertools.count().__next__)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _generator: torch.Generator | None = None

    def cancel(self) -> None:
        """Stop generating for this request; its batch row is freed at the engine's next iteration."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class Engine:
    """Continuous batching over ``model`` (a ``CausalLM``; ``max_batch`` sequences decode together), with
    an automatic prefix cache of ``prefix_cache_bytes`` (0: none) in blocks of ``block_size`` tokens and
    decode steps compiled per ``compile`` (``k2lab.infer.compiled.decode_step``, the compiled step's matrices
    in the dtype of ``decode_weights``); with ``draft``,
    speculative steps of ``draft_tokens`` drafted tokens (``speculation``; None: plain decoding), sampled
    requests drafting per ``sampled_drafts`` (``Speculation``). ``background_compile``: where ``compile``
    decides eager, decode eagerly while a thread builds the compiled step, then switch to it
    (``k2lab.serve.background_compile``; ``k2lab serve`` asks for it on a CPU). ``threads``: torch's intra-op
    threads in the engine's thread (None: the process default; ``k2lab.serve.threads`` for why a server
    gives them all to it and runs its other threads single-threaded)."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_batch: int = 16,
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        block_size: int = 16,
        compile: CompileMode = "auto",
        draft: Draft | None = None,
        draft_tokens: int = DRAFT_TOKENS,
        decode_weights: Precision = "auto",
        sampled_drafts: bool | None = None,
        background_compile: bool = False,
        threads: int | None = None,
    ) -> None:
        self.model = model.eval()
        self.threads = threads
        self.speculation = (
            None
            if draft is None
            else Speculation(
                self.model,
                draft,
                draft_tokens,
                compile,
                decode_weights,
                sampled_drafts,
                self._walk_constrained,
            )
        )
        # the decode forward: compiled (its matrices per decode_weights) or the model
        self._step = decode_step(self.model, compile, decode_weights)
        device = next(self.model.parameters()).device.type
        self.background = (
            BackgroundCompile(self.model, decode_weights, max_batch, threads)
            if background_compile and background_compiles(compile, device)
            else None
        )
        self.prefix_cache = (
            PrefixCache.for_model(model, prefix_cache_bytes, block_size) if prefix_cache_bytes else None
        )
        self.config = model.config
        self.max_batch = max_batch
        self.pad_id = self.config.pad_token_id or 0
        self._waiting: list[Request] = []
        self._admitting: list[Request] = []  # taken from the queue, being prefilled
        self._running: list[Request] = []
        self._cache: LatentCache | None = None
        self._last: torch.Tensor | None = None  # [B] last sampled token of each running sequence
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode forward passes run
        self.max_seen_batch = 0
        self.finished: dict[str, int] = {}  # finish reason -> requests

    # ---- public --------------------------------------------------------------------------------------
    def start(self) -> Engine:
        self._thread = threading.Thread(target=self._loop, name="k2lab-engine", daemon=True)
        self._thread.start()
        if self.background is not None:
            self.background.start()
        return self

    def shutdown(self) -> None:
        if self.background is not None:
            self.background.stop()
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def submit(self, request: Request) -> Request:
        with self._wake:
            self._waiting.append(request)
            self._wake.notify()
        return request

    @property
    def active(self) -> int:
        """Requests waiting or running; a finished one not counted while its row waits to be retired (its
        client may already hold the response)."""
        with self._wake:
            running = sum(1 for request in self._running if request.finish_reason is None)
            return len(self._waiting) + len(self._admitting) + running

    # ---- loop ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.threads is not None:
            set_own_threads(self.threads)  # this thread's own OpenMP setting
        while True:
            with self._wake:
                while not self._stop and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stop:
                    break
                room = self.max_batch - len(self._running)
                admitted, self._waiting = self._waiting[:room], self._waiting[room:]
                self._admitting = admitted
            try:
                with torch.inference_mode():
                    self._iterate(admitted)
            except Exception as error:  # a failed step fails its requests, never the server
                for request in [*self._running, *admitted]:
                    if request.finish_reason is None:
                        self._finish(request, f"error: {type(error).__name__}: {error}")
                with self._wake:
                    self._running, self._cache, self._last = [], None, None
                if self.speculation is not None:
                    self.speculation.select([])
            with self._wake:
                self._admitting = []
        for request in [*self._waiting, *self._running]:
            self._finish(request, "cancelled")

    def decode_report(self) -> dict[str, str]:
        """How decode steps run, for ``/health``: ``{"mode": eager | compiled, …}`` (with a background build,
        its state and detail)."""
        if self.background is not None:
            return self.background.report()
        return {"mode": "eager" if self._step is self.model else "compiled"}

    def _iterate(self, admitted: list[Request]) -> None:
        if self.background is not None and self._step is self.model and self.background.step() is not None:
            self._step = self.background.step()  # built in the background: every later step runs it
        admitted = [r for r in admitted if not self._drop_if_cancelled(r)]
        if admitted:
            self._admit(admitted)
        if self._running and self.speculation is not None and self.speculation.drafting():
            tokens, counts = self.speculation.step(self._cache, self._last, self._plain_tokens)
            self.steps += 1
            self._last = self.speculation.runner.pending
            for request, row, count in zip(self._running, tokens.tolist(), counts.tolist(), strict=True):
                for token in row[:count]:
                    if request.finish_reason is None:
                        self._deliver(request, token)
        elif self._running:
            logits = self._step(self._last[:, None], cache=self._cache).logits[:, -1]
            self.steps += 1
            self._sample_all(logits)
            if self.speculation is not None:  # every row is plain: the draft rows wait, unused
                self.speculation.runner.pending = self._last
        self._retire()

    def _drop_if_cancelled(self, request: Request) -> bool:
        if request.cancelled:
            self._finish(request, "cancelled")
        return request.cancelled

    def _admit(self, requests: list[Request]) -> None:
        spec = self.speculation
        budget = (
            max(r.params.max_tokens for r in requests) + (0 if spec is None else spec.margin) + SPARE_SLOTS
        )
        prompts = [r.prompt for r in requests]
        if spec is None:
            cache, logits = prefill(self.model, prompts, budget, prefix_cache=self.prefix_cache)
        else:
            block = self.prefix_cache.block_size if self.prefix_cache is not None else 0
            cache, logits, forward = prefill_for_draft(
                self.model, prompts, budget, self.prefix_cache, block, spec.draft.uses_hidden
            )
        for r in requests:  # any integer seed: torch takes 0 … 2⁶⁴ − 1 (2⁶⁴ itself failed the whole batch)
            r._generator = torch.Generator().manual_seed(r.params.seed % 2**64)
        first = self._sample(requests, logits)
        room = max(r.params.max_tokens - len(r.tokens) for r in [*self._running, *requests]) + SPARE_SLOTS
        if spec is not None:
            rows = self._row_settings(requests, spec)
            runner = spec.admit(rows, cache, first, forward, cache.max_length, room + spec.margin)
            self._cache, self._last = runner.cache, runner.pending
        elif self._cache is None:
            self._cache, self._last = cache, first
        else:
            caches = [self._cache, cache]
            self._cache = LatentCache.concat(caches, max(c.length for c in caches) + room)
            self._last = torch.cat([self._last, first])
        with self._wake:
            self._running += requests
            self._admitting = []
        self.max_seen_batch = max(self.max_seen_batch, len(self._running))

    def _sample_all(self, logits: torch.Tensor) -> None:
        self._last = self._sample(self._running, logits)

    def _sample(self, requests: Sequence[Request], logits: torch.Tensor) -> torch.Tensor:
        """One token per request (its own settings and generator); delivers it or finishes the request."""
        tokens = []
        for row, request in enumerate(requests):
            token = None if request.finish_reason is not None else self._choose_or_fail(request, logits[row])
            tokens.append(self.pad_id if token is None else token)
            if token is not None:
                self._deliver(request, token)
        return torch.tensor(tokens, dtype=torch.long)

    def _choose_or_fail(self, request: Request, logits: torch.Tensor) -> int | None:
        """``_choose``; where that raises (its constraint, its sampling settings), the request alone finishes
        with the error and None comes back: the other rows of the batch go on."""
        try:
            return self._choose(request, logits)
        except Exception as error:  # noqa: BLE001 - one request's failure, reported to it
            self._finish(request, f"error: {type(error).__name__}: {error}")
            return None

    @staticmethod
    def _choose(request: Request, logits: torch.Tensor) -> int:
        """The request's next token from logits [V]: under its constraint, with its settings and generator."""
        row_logits = logits.float().clone()
        if request.constraint is not None:
            request.constraint.mask(row_logits)
        p = request.params
        settings = GenerationConfig(max_new_tokens=1, temperature=p.temperature, top_p=p.top_p)
        token = int(sample_next(row_logits[None], settings, request._generator)[0])
        if request.constraint is not None:
            request.constraint.advance(token)
        return token

    def _plain_tokens(self, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Tokens [n] of the running rows ``rows`` [n] that take no drafts, from their logits [n, V]."""
        chosen = [self._choose_or_fail(self._running[r], logits[i]) for i, r in enumerate(rows.tolist())]
        return torch.tensor([self.pad_id if c is None else c for c in chosen], dtype=torch.long)

    def _walk_constrained(
        self, drafted: torch.Tensor, logits: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify's (accepted [B], tokens [B]) with each drafting row under a constraint re-decided by
        ``_walk`` from its drafted [k] tokens and target logits [k + 1, V] (``Speculation``'s ``walk``)."""
        plain = self.speculation.runner.rows.plain.tolist()
        for row, request in enumerate(self._running):
            if request.constraint is not None and not plain[row] and request.finish_reason is None:
                accepted[row], tokens[row] = self._walk(request, drafted[row].tolist(), logits[row])
        return accepted, tokens

    def _walk(self, request: Request, drafted: list[int], logits: torch.Tensor) -> tuple[int, int]:
        """(accepted drafts, next token) of a greedy row under a constraint, chosen as plain decoding chooses:
        at each position ``_choose`` masks the verify forward's logits, takes the argmax and advances the
        constraint; a drafted token stays while it is that choice. The walk also ends at a stop token and at
        ``max_tokens``, so the constraint is never fed a token plain decoding would not have fed it."""
        left = request.params.max_tokens - len(request.tokens)
        for position, draft_token in enumerate([*drafted, None]):
            choice = self._choose_or_fail(request, logits[position])
            if choice is None:
                return position, self.pad_id
            if choice != draft_token or choice in request.params.stop_token_ids or position + 1 >= left:
                return position, choice
        raise AssertionError("unreachable: the position after the last draft always ends the walk")

    @staticmethod
    def _row_settings(requests: Sequence[Request], spec: Speculation) -> RowSettings:
        """The speculative rows' sampling: each request's own; which take no drafts: ``spec.plain_rows``."""
        temperatures = [r.params.temperature for r in requests]
        return RowSettings(
            temperature=torch.tensor(temperatures, dtype=torch.float32),
            top_p=torch.tensor([r.params.top_p for r in requests], dtype=torch.float32),
            generators=[r._generator for r in requests],
            plain=spec.plain_rows(temperatures, [r.constraint is not None for r in requests]),
        )

    def _deliver(self, request: Request, token: int) -> None:
        if token in request.params.stop_token_ids:
            self._finish(request, "stop")
            return
        request.tokens.append(token)
        request.on_token(token)
        if len(request.tokens) >= request.params.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        if request.finish_reason is None:
            request.finish_reason = reason
            key = reason.split(":", 1)[0]
            self.finished[key] = self.finished.get(key, 0) + 1
            request.on_finish(reason)

    def _retire(self) -> None:
        for request in self._running:
            if request.cancelled:
                self._finish(request, "cancelled")
        keep = [i for i, r in enumerate(self._running) if r.finish_reason is None]
        if len(keep) == len(self._running):
            return
        self._remember([i for i, r in enumerate(self._running) if r.finish_reason is not None])
        with self._wake:
            self._running = [self._running[i] for i in keep]
        if self.speculation is not None:
            self.speculation.select(keep)
        if not keep:
            self._cache, self._last = None, None
            return
        if self.speculation is not None:  # the runner selected the same cache and pending tokens
            self._cache, self._last = self.speculation.runner.cache, self.speculation.runner.pending
            return
        self._cache.select(keep)
        self._last = self._last[keep]

    def _remember(self, rows: list[int]) -> None:
        """Put retiring rows' prompt and reply (all that was fed) into the prefix cache (MLA-only models:
        a KDA state is only kept at block boundaries, which a reply rarely ends on). A speculative row can
        hold drafted tokens past its stop token or ``max_tokens``: only the delivered ones go in."""
        if self.prefix_cache is None or self._cache is None or self._cache.kda_states:
            return
        for i in rows:
            state = self._cache.row(i)
            request = self._running[i]
            ids = (request.prompt + request.tokens)[: state.length]
            self.prefix_cache.insert(ids, state.prefix(len(ids)))
