"""Speculative decoding inside the serving engine: a draft proposes k tokens for every running row, the
target verifies them in one (k + 1)-token forward (``k2lab.infer.speculative.SpeculativeStep``).

Continuous batching needs three things plain ``speculative_generate`` does not:

* **per-row sampling**: each request keeps its temperature, top-p and seeded generator (``RowSettings``);
  greedy rows keep drafts while they equal the target's argmax, sampled rows follow the rejection rule, so
  every row keeps the target's distribution;
* **admission and retirement**: a new batch's target cache, draft cache, pending tokens and draft features
  are appended to the running ones (``SpeculativeStep.concat``: ``LatentCache.concat`` and
  ``Draft.concat``), and finished rows leave all of them (``select``);
* **constrained rows** (the tool-call enforcer; every chat request carries one, tools or not): the
  ``Constraint`` protocol cannot advance along a drafted path and take it back, so a greedy constrained row
  is walked forward instead (``walk``: the engine's ``Engine._walk_constrained``): at each verified position
  the engine masks the target's logits and picks the argmax as plain decoding would, advancing the
  constraint, and keeps the drafted token while it is that pick — the first other pick is the row's next
  token. Nothing is ever taken back, and the row replies exactly as plain constrained decoding. A sampled
  constrained row takes no drafts: it accepts 0 drafted tokens every step and its token is the engine's
  constrained sample from the verify forward's first position — exactly a plain decode step (``plain``
  rows). A batch of only plain rows runs the plain decode step instead;
* **sampled rows where drafts do not pay**: ``sampled_drafts`` (default: ``speculation_decision`` for
  sampled decoding — off on a CPU, where eager sampled speculative decoding measured 0.50–1.02× plain
  decoding) makes every request with a temperature > 0 a plain row too, so a batch of sampled requests
  decodes at the plain step's speed while greedy requests beside them keep drafting.

Prefill (``prefill_for_draft``): a draft of its own (``ModelDraft``, a small LM) is prefilled on the whole
prompt, cheap beside the target, while the target's prefill is the engine's usual one (prefix cache and
all). An EAGLE draft needs the target's final-normed hidden states of the prompt instead. Without a prefix
cache the whole left-padded prompt runs in one forward that returns them, and the draft is prefilled on
all of it (as ``generate`` does). With one, ``prefill`` runs each prompt but its last w tokens (w =
``tail``, at most the shortest prompt − 1) through the prefix cache — cached blocks are not recomputed —
and the last w tokens run in one more forward, whose hidden states prefill the draft: the draft's context
is then those w tokens (its own block sees the target's features, which carry the rest; cached prefixes
have no features to give it). Output is unaffected (the target verifies every token); only the acceptance
rate can differ.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k2lab.hardware import Precision
from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import CompileMode
from k2lab.infer.draft import Draft, check_draft
from k2lab.infer.generate import GenerationConfig, last_positions, left_pad, prefill
from k2lab.infer.prefix_cache import PrefixCache
from k2lab.infer.speculative import (
    DRAFT_TOKENS,
    PlainToken,
    RowSettings,
    SpeculativeStats,
    SpeculativeStep,
    speculation_decision,
)

__all__ = ["DraftForward", "Speculation", "WalkRows", "prefill_for_draft"]

#: (drafted [B, k], target logits [B, k + 1, V], accepted [B], tokens [B]) -> (accepted [B], tokens [B]): the
#: verify's result with the rows the engine decides itself (constrained greedy rows) re-decided
WalkRows = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


@dataclass
class DraftForward:
    """The prefill forward the draft starts from: ids [B, T], valid [B, T], hidden [B, T, D]."""

    ids: torch.Tensor
    valid: torch.Tensor
    hidden: torch.Tensor | None


def prefill_for_draft(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    room: int,
    prefix_cache: PrefixCache | None,
    tail: int,
    uses_hidden: bool = True,
) -> tuple[LatentCache, torch.Tensor, DraftForward]:
    """``prefill`` that also returns what a draft (``Draft.uses_hidden``: of the target's hidden states)
    is prefilled on: (cache with ``room`` free slots, last-position logits [B, V], that forward); see the
    module docstring."""
    param = next(model.parameters())
    shortest = min(len(p) for p in prompts)
    if uses_hidden and prefix_cache is not None and shortest >= 2 and tail >= 1:
        return _prefill_tail(model, prompts, room, prefix_cache, min(tail, shortest - 1))
    ids, valid = (t.to(param.device) for t in left_pad(prompts, model.config.pad_token_id or 0))
    if not uses_hidden:
        cache, logits = prefill(model, prompts, room, prefix_cache=prefix_cache)
        return cache, logits, DraftForward(ids, valid, None)
    cache = LatentCache(
        model.config, len(prompts), ids.shape[1] + room, dtype=param.dtype, device=param.device
    )
    out = model(ids, attention_mask=valid, cache=cache, logits_mask=last_positions(valid), output_hidden=True)
    return cache, out.logits, DraftForward(ids, valid, out.hidden)


def _prefill_tail(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], room: int, prefix_cache: PrefixCache, w: int
) -> tuple[LatentCache, torch.Tensor, DraftForward]:
    """All but each prompt's last w tokens through the prefix cache, then those w in one forward whose
    hidden states the draft is prefilled on."""
    param = next(model.parameters())
    cache, _ = prefill(model, [p[:-w] for p in prompts], room + w, prefix_cache=prefix_cache)
    ids = torch.tensor([list(p[-w:]) for p in prompts], device=param.device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    out = model(ids, cache=cache, logits_mask=last_positions(valid), output_hidden=True)
    return cache, out.logits, DraftForward(ids, valid, out.hidden)


class _ServingStep(SpeculativeStep):
    """A ``SpeculativeStep`` whose verify result goes through ``walk`` (the engine's constrained rows)."""

    def __init__(self, *args, walk: WalkRows, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.walk = walk

    def verify(
        self, drafted: torch.Tensor, draft_logits: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.walk(drafted, logits, *super().verify(drafted, draft_logits, logits))


def _unchanged(
    drafted: torch.Tensor, logits: torch.Tensor, accepted: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return accepted, tokens


class Speculation:
    """The engine's speculative state: ``draft`` (a prototype, copied per admitted batch), k
    (``draft_tokens``), whether sampled requests take drafts (``sampled_drafts``; None: as
    ``speculation_decision`` decides for sampled decoding on the model's device), ``walk`` (how the engine
    re-decides its constrained greedy rows after each verify; the module docstring), the running batch's
    ``SpeculativeStep`` and the acceptance counts."""

    def __init__(
        self,
        model: torch.nn.Module,
        draft: Draft,
        draft_tokens: int = DRAFT_TOKENS,
        compile: CompileMode = "auto",
        decode_weights: Precision = "auto",
        sampled_drafts: bool | None = None,
        walk: WalkRows = _unchanged,
    ) -> None:
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        check_draft(model, draft)  # once: each admitted batch's step copies this draft
        self.model, self.draft, self.k, self.walk = model, draft, draft_tokens, walk
        self.config = GenerationConfig(compile=compile, decode_weights=decode_weights)
        device = next(model.parameters()).device.type
        self.sampled_drafts, self.sampled_reason = (
            (sampled_drafts, "requested")
            if sampled_drafts is not None
            else speculation_decision(None, compile, device, sampled=True)
        )
        self.runner: SpeculativeStep | None = None
        self.stats = SpeculativeStats()

    @property
    def margin(self) -> int:
        """Cache slots beyond the new tokens: two verify windows (rejected slots are compacted away)."""
        return 2 * (self.k + 1)

    def admit(
        self,
        rows: RowSettings,
        cache: LatentCache,
        first: torch.Tensor,
        forward: DraftForward,
        capacity: int,
        room: int,
    ) -> SpeculativeStep:
        """Start the new rows (their prefilled ``cache``, first tokens [n], ``forward``) and append them to
        the running batch with ``room`` free slots after its longest row; returns the running step."""
        part = _ServingStep(self.model, copy.copy(self.draft), self.config, rows=rows, walk=self.walk)
        part.begin(cache, first, forward.ids, forward.valid, forward.hidden, capacity)
        if self.runner is None:
            self.runner = part
        else:
            self.runner.concat(part, room)
        return self.runner

    def plain_rows(self, temperatures: Sequence[float], constrained: Sequence[bool]) -> torch.Tensor:
        """Which new rows take no drafts [n] bool: sampled ones that are constrained or, unless
        ``sampled_drafts``, any sampled one (a greedy constrained row drafts, walked: the module docstring)."""
        return torch.tensor(
            [t > 0 and (c or not self.sampled_drafts) for t, c in zip(temperatures, constrained, strict=True)]
        )

    def drafting(self) -> bool:
        """Whether any running row takes drafts (else the engine runs a plain decode step)."""
        return self.runner is not None and not bool(self.runner.rows.plain.all())

    def step(
        self, cache: LatentCache, pending: torch.Tensor, plain_token: PlainToken
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One verify step from the engine's ``cache`` and pending tokens [B]: (tokens [B, k+1], counts [B])
        as ``SpeculativeStep.step``; counts the drafting rows' accepted tokens."""
        runner = self.runner
        runner.cache, runner.pending = cache, pending
        tokens, counts = runner.step(self.k, plain_token)
        drafting = ~runner.rows.plain
        rows = int(drafting.sum())
        self.stats.steps += 1
        self.stats.row_steps += rows
        self.stats.proposed += self.k * rows
        self.stats.accepted += int((counts - 1)[drafting].sum())
        return tokens, counts

    def select(self, keep: list[int]) -> None:
        """Keep only the running rows ``keep`` (none: the batch is over)."""
        if not keep:
            self.runner = None
        elif self.runner is not None:
            self.runner.select(torch.tensor(keep, device=self.runner.pending.device))

    def report(self) -> dict[str, float | int]:
        """The counters ``/health`` shows: k, verify steps, mean drafted tokens accepted per row and verify
        step, tokens per row and target forward (accepted + 1), and the acceptance rate."""
        stats = self.stats
        return {
            "draft_tokens": self.k,
            "sampled_drafts": self.sampled_drafts,
            "verify_steps": stats.steps,
            "mean_accepted": round(stats.mean_accepted, 4),
            "tokens_per_step": round(stats.tokens_per_step, 4),
            "acceptance_rate": round(stats.acceptance_rate, 4),
        }
