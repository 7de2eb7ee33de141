"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a draft proposes k tokens, the target
verifies all k + 1 positions in one forward over its latent cache, and the output keeps the target's
distribution exactly.

One step, per row, with the pending token x (sampled from the target, not yet fed) and drafted d_1 … d_k
drawn from the draft's distributions q_1 … q_k:

    p_1 … p_{k+1} = target([x, d_1, …, d_k])                       one forward, T = k + 1
    accept d_j while u_j < p_j(d_j) / q_j(d_j), u_j ~ U(0, 1)        (greedy: while d_j = argmax p_j)
    first rejection at j: t' ~ norm(max(0, p_j − q_j));  all k accepted: t' ~ p_{k+1}

so a step emits a + 1 tokens (a accepted, then t', the next pending token). p and q are the *processed*
distributions: softmax(logits / temperature) restricted to the top-p nucleus, the same function for both
(``processed_probs``, as ``generate.sample_next`` samples). Greedy decoding is the one-hot special case and
reproduces plain greedy ``generate`` token for token (up to the rounding of a k+1-token forward versus
one-token forwards). The caches keep the a + 1 tokens [x, d_1 … d_a] per row (``k2lab.infer.rollback``);
the draft is told the same (``k2lab.infer.draft``).

``SpeculativeStep`` is one batch's state (prefill, then ``step``), so a serving engine can interleave steps
with other work; ``speculative_generate`` is the ``generate`` counterpart. Constraints (tool-call grammars)
are not speculated: the ``Constraint`` protocol has no way to advance along a drafted path and take it back,
so a call with any constraint falls back to plain ``generate`` (its stats then count no speculative steps).

A serving engine's rows differ: ``RowSettings`` gives each row its own temperature, top-p and generator
(temperature 0: that row is greedy), and ``plain`` rows take no drafts at all — every step they accept 0
drafted tokens and their token comes from the engine's own sampler (e.g. under a tool-call constraint) on
the verify forward's first position, which is exactly one plain decode step. ``begin`` starts a step from a
cache the caller prefilled and ``concat`` appends another batch's rows (continuous batching).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import CompileMode, decode_compile_decision, decode_step
from k2lab.infer.draft import Draft, check_draft
from k2lab.infer.generate import (
    Constraint,
    GenerationConfig,
    check_prompts,
    generate,
    last_positions,
    left_pad,
    outside_nucleus,
    tempered_softmax,
)
from k2lab.infer.rollback import CacheWindow, ensure_room

#: k, the tokens the draft proposes per step: the default of ``generate --draft-tokens`` and ``k2lab serve``.
DRAFT_TOKENS = 4


def speculation_decision(
    requested: bool | None, compile: CompileMode | str, device: str, sampled: bool = False
) -> tuple[bool, str]:
    """Whether ``generate`` / ``serve`` decode speculatively when a draft is found, and why: as ``requested``
    (``--speculative/--no-speculative``), else on unless, on a CPU,

    - the decode step runs compiled (``decode_compile_decision``): there plain compiled decoding beat
      speculative decoding in every measured case (k2-mini with an MTP draft, batch 1 and 4, greedy and
      sampled: 0.24–0.84×, the draft compiled too; docs/generation.md);
    - or the decoding is ``sampled`` (``generate`` with a temperature; ``serve`` learns its temperatures per
      request, so its engine asks with ``sampled=True`` for the sampled requests alone and lets only its
      greedy ones draft: ``k2lab.serve.speculation.Speculation``): eager sampled speculative decoding ran at 0.50–1.02× plain decoding over
      the measured drafts, batches and CPUs (docs/generation.md), against 0.84–1.67× greedy at batch 1, since
      sampling accepts fewer drafted tokens (1.7–3.4 tokens per forward against 3.6–4.7).
    """
    if requested is not None:
        return requested, "requested"
    if device == "cpu" and decode_compile_decision(compile, device)[0]:
        return (
            False,
            "compiled decoding on CPU is faster than speculative decoding (--speculative to force it)",
        )
    if device == "cpu" and sampled:
        return (
            False,
            "sampled speculative decoding on CPU measured 0.50-1.02x plain decoding (--speculative to force it)",
        )
    return True, "a draft was found"


Generators = torch.Generator | list[torch.Generator]
Setting = float | torch.Tensor  # one value for every row, or one per row [B]
PlainToken = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [n], logits [n, V]) -> tokens [n]


def _per_row(value: Setting, logits: torch.Tensor) -> Setting:
    """A per-row setting [B] shaped to broadcast over logits [B, ..., V]; a float stays a float."""
    if isinstance(value, torch.Tensor):
        return value.to(device=logits.device, dtype=torch.float32).reshape(-1, *[1] * (logits.dim() - 1))
    return value


def processed_probs(logits: torch.Tensor, temperature: Setting, top_p: Setting) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities: softmax(logits / T), then only the smallest set of most likely
    tokens with mass ≥ top_p keeps its (unrenormalised) mass, as ``sample_next`` draws from. T and top_p
    are floats, or per-row tensors [B] for logits [B, ..., V]."""
    temperature, top_p = _per_row(temperature, logits), _per_row(top_p, logits)
    probs = tempered_softmax(logits, temperature)
    nucleus = top_p < 1  # a bool, or [B, 1 …] per row (rows at 1 keep every token, as sample_next)
    if nucleus if isinstance(nucleus, bool) else nucleus.any():
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(outside_nucleus(sorted_probs, top_p) & nucleus, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


def _multinomial(probs: torch.Tensor, generator: Generators) -> torch.Tensor:
    """One draw per row of probs [B, V] -> [B]; with a list, row b draws from generator b."""
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return torch.cat(
        [torch.multinomial(probs[b : b + 1], 1, generator=g)[0] for b, g in enumerate(generator)]
    )


def _uniform(rows: int, width: int, generator: Generators, device: torch.device) -> torch.Tensor:
    if isinstance(generator, torch.Generator):
        return torch.rand(rows, width, generator=generator, device=device)
    return torch.stack([torch.rand(width, generator=g, device=device) for g in generator])


@dataclass
class SpeculativeStats:
    """Counts over (row, verify step) pairs of live rows: ``accepted`` drafted tokens of ``proposed``.

    ``speculative_generate`` counts what a row kept: at ``max_new_tokens`` or after an EOS the rest of a
    step's tokens are dropped and not counted (a step that keeps only drafted tokens counts one of them as
    its own), so ``accepted + row_steps`` is exactly the tokens emitted after the prefill's."""

    steps: int = 0  # verify forwards
    row_steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per row and step."""
        return self.accepted / max(self.row_steps, 1)

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per row and target forward (accepted + the target's own: EAGLE's τ)."""
        return (self.accepted + self.row_steps) / max(self.row_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)


@dataclass
class RowSettings:
    """Each row's own sampling (a serving batch): temperature [B] (0: greedy), top_p [B], a generator per
    row, and ``plain`` [B] bool: rows that take no drafts (their token comes from the caller's sampler)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    generators: list[torch.Generator]
    plain: torch.Tensor

    def select(self, index: torch.Tensor) -> RowSettings:
        """The rows ``index`` [n] (long), in that order."""
        index = index.to(self.temperature.device)
        rows = index.tolist()
        return RowSettings(
            self.temperature[index], self.top_p[index], [self.generators[i] for i in rows], self.plain[index]
        )

    def concat(self, other: RowSettings) -> RowSettings:
        """These rows, then ``other``'s."""
        return RowSettings(
            torch.cat([self.temperature, other.temperature]),
            torch.cat([self.top_p, other.top_p]),
            self.generators + other.generators,
            torch.cat([self.plain, other.plain]),
        )


class SpeculativeStep:
    """Speculative decoding of one batch: ``prefill`` (or ``begin``) once, then ``step`` until done;
    ``select`` drops rows and ``concat`` appends another batch's.

    Sampling follows ``config`` and ``generator`` (one for the batch or one per row), or, with ``rows``,
    each row's own ``RowSettings`` (``config`` then only chooses whether the verify and the draft's forwards
    compile)."""

    def __init__(
        self,
        model: torch.nn.Module,
        draft: Draft,
        config: GenerationConfig,
        generator: Generators | None = None,
        rows: RowSettings | None = None,
    ) -> None:
        if (generator is None) == (rows is None):
            raise ValueError("pass exactly one of generator (one config for all rows) and rows (per row)")
        self.model, self.draft, self.config, self.generator, self.rows = model, draft, config, generator, rows
        # compiled per config.compile (matrices per config.decode_weights), else the model
        self.verify_forward = decode_step(model, config.compile, config.decode_weights)
        draft.compile(config.compile, config.decode_weights)  # the draft's proposing forwards likewise

    def _sampled(self, device: torch.device) -> torch.Tensor | None:
        """The rows that sample (index [n]); None when every row does (the others take the argmax)."""
        if self.rows is None:
            return None if self.config.temperature > 0 else torch.zeros(0, dtype=torch.long, device=device)
        sampled = (self.rows.temperature > 0).to(device) & ~self.rows.plain.to(device)
        return None if bool(sampled.all()) else sampled.nonzero().squeeze(1)

    def _settings(self, index: torch.Tensor | None) -> tuple[Setting, Setting, Generators]:
        """(temperature, top-p, generators) of every row (index None) or of the rows ``index``."""
        if self.rows is None:
            return self.config.temperature, self.config.top_p, self.generator
        rows = self.rows if index is None else self.rows.select(index)
        return rows.temperature, rows.top_p, rows.generators

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """A token per row from logits [B, V] (argmax when greedy, else a draw from the processed
        distribution): the draft's proposals (q) and the target's first token after a prefill (p)."""
        sampled = self._sampled(logits.device)
        if sampled is None:
            temperature, top_p, generator = self._settings(None)
            return _multinomial(processed_probs(logits, temperature, top_p), generator)
        tokens = logits.argmax(dim=-1)
        if len(sampled):
            temperature, top_p, generator = self._settings(sampled)
            probs = processed_probs(logits[sampled], temperature, top_p)
            tokens[sampled] = _multinomial(probs, generator)
        return tokens

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        """Prefill left-padded ids [B, T] (valid [B, T]) in target and draft; return the first tokens [B].

        ``capacity`` (≥ T + new tokens + 2·(k + 1)) sizes both caches; holes from rejections are compacted."""
        param = next(self.model.parameters())
        cache = LatentCache(self.model.config, ids.shape[0], capacity, dtype=param.dtype, device=param.device)
        out = self.model(
            ids,
            attention_mask=valid,
            cache=cache,
            logits_mask=last_positions(valid),
            output_hidden=self.draft.uses_hidden,
        )
        self.begin(cache, self.pick(out.logits), ids, valid, out.hidden, capacity)
        return self.pending

    def begin(
        self,
        cache: LatentCache,
        pending: torch.Tensor,
        ids: torch.Tensor,
        valid: torch.Tensor,
        hidden: torch.Tensor | None,
        capacity: int,
    ) -> None:
        """Start from a target ``cache`` the caller prefilled, whose last forward took ids [B, T] (valid
        [B, T]; hidden [B, T, D] its final-normed states), and the tokens ``pending`` [B] sampled after it:
        the draft is prefilled on that forward (``capacity`` bounds its cache, as in ``prefill``)."""
        self.cache, self.pending = cache, pending
        self.draft.prefill(ids, valid, pending, hidden, capacity)

    def step(
        self, num_draft_tokens: int, plain_token: PlainToken | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose, verify, accept: (tokens [B, k + 1], counts [B]); row b emitted tokens[b, : counts[b]]
        (its accepted drafts, then the target's token, which becomes the pending one). ``plain`` rows
        (``RowSettings``) accept nothing and take ``plain_token(rows, logits [n, V])`` of the first
        position: one plain decode step."""
        k = num_draft_tokens
        drafted, draft_logits = self.draft.propose(k, self.pick)
        ensure_room(self.cache, k + 1)
        window = CacheWindow(self.cache)
        out = self.verify_forward(
            torch.cat([self.pending[:, None], drafted], dim=1),
            cache=self.cache,
            output_hidden=self.draft.uses_hidden,
        )
        accepted, token = self.verify(drafted, draft_logits, out.logits)
        if self.rows is not None and bool(self.rows.plain.any()):
            if plain_token is None:
                raise ValueError("plain rows need plain_token to choose their tokens")
            plain = self.rows.plain.nonzero().squeeze(1)
            accepted[plain] = 0
            token[plain] = plain_token(plain, out.logits[plain, 0]).to(token)
        window.close(accepted + 1)
        self.draft.accept(accepted, token, out.hidden)
        self.pending = token
        emitted = torch.cat([drafted, token[:, None]], dim=1).scatter(1, accepted[:, None], token[:, None])
        return emitted, accepted + 1

    def verify(
        self, drafted: torch.Tensor, draft_logits: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """drafted [B, k], draft logits [B, k, V], target logits [B, k+1, V] -> (accepted [B], t' [B]):
        greedy rows keep drafts while they equal the argmax, sampled rows follow the rejection rule."""
        sampled = self._sampled(logits.device)
        if sampled is None:
            return self._reject(drafted, draft_logits, logits, *self._settings(None))
        k = drafted.shape[1]
        best = logits.argmax(dim=-1)  # [B, k+1]
        accepted = (drafted == best[:, :k]).long().cumprod(dim=1).sum(dim=1)
        token = best.gather(1, accepted[:, None]).squeeze(1)
        if len(sampled):
            accepted[sampled], token[sampled] = self._reject(
                drafted[sampled], draft_logits[sampled], logits[sampled], *self._settings(sampled)
            )
        return accepted, token

    @staticmethod
    def _reject(
        drafted: torch.Tensor,
        draft_logits: torch.Tensor,
        logits: torch.Tensor,
        temperature: Setting,
        top_p: Setting,
        generator: Generators,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rejection rule on sampled rows (shapes as ``verify``): accept d_j while u_j·q_j < p_j, then
        t' ~ norm(max(0, p − q)) at the first rejection (p_{k+1} when all k are accepted)."""
        k = drafted.shape[1]
        p = processed_probs(logits, temperature, top_p)  # [B, k+1, V]
        q = processed_probs(draft_logits, temperature, top_p)  # [B, k, V]
        p_x = p[:, :k].gather(2, drafted[..., None]).squeeze(-1)
        q_x = q.gather(2, drafted[..., None]).squeeze(-1)
        u = _uniform(drafted.shape[0], k, generator, drafted.device)
        accepted = (u * q_x < p_x).long().cumprod(dim=1).sum(dim=1)  # u < p/q, q > 0 where drafted
        rows = torch.arange(drafted.shape[0], device=drafted.device)
        residual = (p - torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)).clamp(min=0)[rows, accepted]
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[rows, accepted])  # p = q: p
        return accepted, _multinomial(residual, generator)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order): cache, draft, pending tokens and row generators."""
        self.cache.select(index)
        self.draft.select(index)
        self.pending = self.pending[index]
        if self.rows is not None:
            self.rows = self.rows.select(index)
        elif not isinstance(self.generator, torch.Generator):
            self.generator = [self.generator[i] for i in index.tolist()]

    def concat(self, other: SpeculativeStep, room: int) -> None:
        """Append ``other``'s rows (both per-row ``RowSettings``) after these: the target caches merge by
        ``LatentCache.concat`` with ``room`` free slots after the longest, the drafts by ``Draft.concat``."""
        if self.rows is None or other.rows is None:
            raise ValueError("only steps with per-row settings (rows=...) can be concatenated")
        length = max(self.cache.length, other.cache.length)
        self.cache = LatentCache.concat([self.cache, other.cache], length + room)
        self.draft.concat(other.draft)
        self.pending = torch.cat([self.pending, other.pending])
        self.rows = self.rows.concat(other.rows)


@torch.inference_mode()
def speculative_generate(
    model: torch.nn.Module,
    draft: Draft,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    num_draft_tokens: int = DRAFT_TOKENS,
    constraints: Sequence[Constraint | None] | None = None,
    row_seeds: Sequence[int] | None = None,
) -> tuple[list[list[int]], SpeculativeStats]:
    """``generate`` with a draft: the new tokens per prompt (up to and including EOS, at most
    ``max_new_tokens``) and the acceptance counts. ``model`` is a ``CausalLM``. With any constraint the call
    is plain ``generate`` (see the module docstring). Finished rows leave the batch (``select``)."""
    config = config or GenerationConfig()
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if constraints is not None and any(c is not None for c in constraints):
        return generate(
            model, prompts, config, constraints=constraints, row_seeds=row_seeds
        ), SpeculativeStats()
    check_prompts(model, prompts, config.eos_token_id)
    check_draft(model, draft)
    param = next(model.parameters())
    ids, valid = left_pad(prompts, model.config.pad_token_id or 0)
    ids, valid = ids.to(param.device), valid.to(param.device)
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
    generator: Generators = (
        torch.Generator(device=param.device).manual_seed(config.seed)
        if row_seeds is None
        else [torch.Generator(device=param.device).manual_seed(int(s)) for s in row_seeds]
    )
    runner = SpeculativeStep(model, draft, config, generator)
    budget, eos = config.max_new_tokens, config.eos_token_id
    first = runner.prefill(ids, valid, ids.shape[1] + budget + 2 * (num_draft_tokens + 1))
    outputs = [[token] for token in first.tolist()]
    live = list(range(len(outputs)))
    stats = SpeculativeStats()
    while live := _drop_finished(runner, live, outputs, budget, eos):
        k = max(1, min(num_draft_tokens, max(budget - len(outputs[row]) for row in live) - 1))
        tokens, counts = runner.step(k)
        stats.steps += 1
        stats.row_steps += len(live)
        stats.proposed += k * len(live)
        for row, new, count in zip(live, tokens.tolist(), counts.tolist(), strict=True):
            stats.accepted += _append(outputs[row], new[:count], budget, eos) - 1
    return outputs, stats


def _append(output: list[int], tokens: list[int], budget: int, eos: int | None) -> int:
    """Append ``tokens`` to a live row's ``output`` until it holds ``budget`` tokens or ends with ``eos``;
    how many were appended (at least one: the row was live)."""
    before = len(output)
    for token in tokens:
        if len(output) == budget or output[-1] == eos:
            break
        output.append(token)
    return len(output) - before


def _drop_finished(
    runner: SpeculativeStep, live: list[int], outputs: list[list[int]], budget: int, eos: int | None
) -> list[int]:
    """The rows of ``live`` still generating; the finished ones leave the runner's batch."""
    keep = [i for i, row in enumerate(live) if len(outputs[row]) < budget and outputs[row][-1] != eos]
    if keep and len(keep) < len(live):
        runner.select(torch.tensor(keep, device=runner.pending.device))
    return [live[i] for i in keep]
