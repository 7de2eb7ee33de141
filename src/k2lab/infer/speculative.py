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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k2lab.infer.cache import LatentCache
from k2lab.infer.compiled import decode_step
from k2lab.infer.draft import Draft
from k2lab.infer.generate import Constraint, GenerationConfig, generate, left_pad
from k2lab.infer.rollback import CacheWindow, ensure_room

Generators = torch.Generator | list[torch.Generator]


def processed_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities: softmax(logits / T), then only the smallest set of most likely
    tokens with mass ≥ top_p keeps its (unrenormalised) mass, as ``sample_next`` draws from."""
    probs = (logits.float() / temperature).softmax(dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
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
    """Counts over (row, verify step) pairs of live rows: ``accepted`` drafted tokens of ``proposed``."""

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


class SpeculativeStep:
    """Speculative decoding of one batch: ``prefill`` once, then ``step`` until done; ``select`` drops rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        draft: Draft,
        config: GenerationConfig,
        generator: Generators,
    ) -> None:
        self.model, self.draft, self.config, self.generator = model, draft, config, generator
        self.verify_forward = decode_step(model, config.compile)  # compiled per config.compile, else model

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """A draft token per row from draft logits [B, V] (argmax when greedy, else a draw from q)."""
        if self.config.temperature == 0:
            return logits.argmax(dim=-1)
        return _multinomial(
            processed_probs(logits, self.config.temperature, self.config.top_p), self.generator
        )

    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, capacity: int) -> torch.Tensor:
        """Prefill left-padded ids [B, T] (valid [B, T]) in target and draft; return the first tokens [B].

        ``capacity`` (≥ T + new tokens + 2·(k + 1)) sizes both caches; holes from rejections are compacted."""
        param = next(self.model.parameters())
        self.cache = LatentCache(
            self.model.config, ids.shape[0], capacity, dtype=param.dtype, device=param.device
        )
        out = self.model(ids, attention_mask=valid, cache=self.cache, output_hidden=self.draft.uses_hidden)
        logits = out.logits[:, -1]
        if self.config.temperature == 0:
            self.pending = logits.argmax(dim=-1)
        else:
            probs = processed_probs(logits, self.config.temperature, self.config.top_p)
            self.pending = _multinomial(probs, self.generator)
        self.draft.prefill(ids, valid, self.pending, out.hidden, capacity)
        return self.pending

    def step(self, num_draft_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose, verify, accept: (tokens [B, k + 1], counts [B]); row b emitted tokens[b, : counts[b]]
        (its accepted drafts, then the target's token, which becomes the pending one)."""
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
        window.close(accepted + 1)
        self.draft.accept(accepted, token, out.hidden)
        self.pending = token
        emitted = torch.cat([drafted, token[:, None]], dim=1).scatter(1, accepted[:, None], token[:, None])
        return emitted, accepted + 1

    def verify(
        self, drafted: torch.Tensor, draft_logits: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """drafted [B, k], draft logits [B, k, V], target logits [B, k+1, V] -> (accepted [B], t' [B])."""
        k = drafted.shape[1]
        if self.config.temperature == 0:
            best = logits.argmax(dim=-1)  # [B, k+1]
            accepted = (drafted == best[:, :k]).long().cumprod(dim=1).sum(dim=1)
            return accepted, best.gather(1, accepted[:, None]).squeeze(1)
        temperature, top_p = self.config.temperature, self.config.top_p
        p = processed_probs(logits, temperature, top_p)  # [B, k+1, V]
        q = processed_probs(draft_logits, temperature, top_p)  # [B, k, V]
        p_x = p[:, :k].gather(2, drafted[..., None]).squeeze(-1)
        q_x = q.gather(2, drafted[..., None]).squeeze(-1)
        u = _uniform(drafted.shape[0], k, self.generator, drafted.device)
        accepted = (u * q_x < p_x).long().cumprod(dim=1).sum(dim=1)  # u < p/q, q > 0 where drafted
        rows = torch.arange(drafted.shape[0], device=drafted.device)
        residual = (p - torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)).clamp(min=0)[rows, accepted]
        mass = residual.sum(dim=-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[rows, accepted])  # p = q: p
        return accepted, _multinomial(residual, self.generator)

    def select(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order): cache, draft, pending tokens and row generators."""
        self.cache.select(index)
        self.draft.select(index)
        self.pending = self.pending[index]
        if not isinstance(self.generator, torch.Generator):
            self.generator = [self.generator[i] for i in index.tolist()]


@torch.inference_mode()
def speculative_generate(
    model: torch.nn.Module,
    draft: Draft,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    num_draft_tokens: int = 4,
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
        stats.accepted += int(counts.sum()) - len(live)
        for row, new, count in zip(live, tokens.tolist(), counts.tolist(), strict=True):
            for token in new[:count]:
                if len(outputs[row]) == budget or outputs[row][-1] == eos:
                    break
                outputs[row].append(token)
    return outputs, stats


def _drop_finished(
    runner: SpeculativeStep, live: list[int], outputs: list[list[int]], budget: int, eos: int | None
) -> list[int]:
    """The rows of ``live`` still generating; the finished ones leave the runner's batch."""
    keep = [i for i, row in enumerate(live) if len(outputs[row]) < budget and outputs[row][-1] != eos]
    if keep and len(keep) < len(live):
        runner.select(torch.tensor(keep, device=runner.pending.device))
    return [live[i] for i in keep]
