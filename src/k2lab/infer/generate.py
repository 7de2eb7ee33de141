"""Autoregressive generation over the latent cache: greedy, temperature and nucleus (top-p) sampling.

Prompts of different lengths are left-padded into one batch; the prompt is prefilled in one forward, then
each step feeds one token per sequence and attends in latent space (absorbed MLA decode).

Prefix reuse (``prefill``): a row may start from cached contents instead of an empty cache — a
``GenerationCache`` left by an earlier call (a multi-turn episode extends its own cache) or the longest
match in a ``PrefixCache`` (blocks shared across requests) — and only its uncached suffix runs. Rows
with different cached lengths combine like ``LatentCache.concat`` does (masked slots, positions carry on) and
prefill together, left-padded: pads after cached tokens leave KDA states as they were (``nn.kda``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from k2lab.errors import K2LabError
from k2lab.hardware import Precision
from k2lab.infer.cache import KDAState, LatentCache, RowState
from k2lab.infer.compiled import CompileMode, decode_step
from k2lab.infer.decode_weights import decode_weights_field
from k2lab.infer.prefix_cache import PrefixCache


class GenerationConfig(BaseModel):
    """``temperature == 0`` is greedy decoding; ``top_p < 1`` keeps the smallest set of tokens with that mass.
    Numbers are finite (a temperature of inf was accepted and sampled uniformly)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(default=16, gt=0)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    eos_token_id: int | None = None
    seed: int = 0
    compile: CompileMode = Field(
        default="auto",
        description="torch.compile the decode step (k2lab.infer.compiled): auto = on for CUDA, off on CPU "
        "(a build of minutes); on = compile (one build per model, reused by later calls); off = eager.",
    )
    decode_weights: Precision = decode_weights_field()
    drop_finished: bool = Field(
        default=False,
        description="A row that samples eos_token_id leaves the batch: later steps compute the live rows only "
        "(same tokens up to the rounding of a smaller batch; sampling needs row_seeds).",
    )


class Constraint(Protocol):
    """Per-sequence decoding constraint (e.g. ``k2lab.runtime.enforcer.ToolCallConstraint``)."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [V] of tokens that may not come next to −inf, in place."""

    def advance(self, token: int) -> None:
        """Record the token that was sampled."""


@dataclass
class GenerationCache:
    """What ``generate(..., cache=...)`` leaves for the next call: per row the ids its cache holds
    (the prompt and every generated token but the last, which was never fed) and their ``RowState``.

    Pass the same object again with prompts that extend those ids (e.g. the conversation so far and the
    next user turn): only the new tokens are prefilled. An empty one (the default) starts fresh."""

    ids: list[list[int]] = field(default_factory=list)
    rows: list[RowState] = field(default_factory=list)

    def starts(self, prompts: Sequence[Sequence[int]]) -> list[RowState | None]:
        """The cached contents each prompt continues from (checks that it extends them)."""
        if not self.ids:
            return [None] * len(prompts)
        if len(prompts) != len(self.ids):
            raise ValueError(f"{len(prompts)} prompts continue a cache of {len(self.ids)} sequences")
        for row, (prompt, held) in enumerate(zip(prompts, self.ids, strict=True)):
            if len(prompt) <= len(held) or list(prompt[: len(held)]) != held:
                same = next((i for i, (a, b) in enumerate(zip(prompt, held, strict=False)) if a != b), None)
                where = "is not longer" if same is None else f"differs at token {same}"
                raise ValueError(
                    f"prompt {row} does not extend its cached tokens: {len(prompt)} tokens against "
                    f"{len(held)} cached, {where} (the new prompt must start with the cached ids)"
                )
        return list(self.rows)


def sample_next(
    logits: torch.Tensor, config: GenerationConfig, generator: torch.Generator | Sequence[torch.Generator]
) -> torch.Tensor:
    """logits [B, V] -> token ids [B]; with one generator per row, row b draws from its own generator."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, config)
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return _exponential_race(probs, generator)


def media_placeholders(model: torch.nn.Module, vocab_size: int) -> list[int]:
    """The image and video placeholder ids of a vision-language ``model`` inside its vocabulary (none for a
    text model): ``generate`` never samples them, since only a prompt's media can fill a placeholder."""
    config = getattr(model, "config", None)
    if not hasattr(model, "language_model") or config is None:
        return []
    ids = (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
    return [i for i in ids if i is not None and 0 <= i < vocab_size]


def sampling_probs(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T) [B, V], cut to the top-p nucleus (unnormalised)."""
    probs = tempered_softmax(logits, config.temperature)
    if config.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(outside_nucleus(sorted_probs, config.top_p), 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def tempered_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """softmax(z / T) of logits z [..., V] in fp32, taken as softmax((z − max z) / T): for a tiny T (an API
    allows any T > 0, say 1e-45) z / T overflows to ±inf and the softmax to NaN, where (z − max z) / T only
    runs to −inf below the maximum, the greedy limit. At the maximum the gap is 0 whatever T: a T below fp32's
    smallest number (1e-46, 5e-324) is 0 there, and 0 / 0 made the softmax NaN (HTTP 500 in ``k2lab serve``).
    ``temperature`` broadcasts (a float, or per row)."""
    z = logits.float()
    gap = z - z.amax(dim=-1, keepdim=True)
    return torch.where(gap == 0, 0.0, gap / temperature).softmax(dim=-1)


def outside_nucleus(sorted_probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Where probabilities sorted in descending order [..., V] fall outside the top-p nucleus: the mass before
    them is ≥ top_p. The most likely token always stays (a top_p below fp32's smallest number, 1e-300 say,
    compares as 0 with the mass before it, which is 0, and would leave nothing to sample)."""
    outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
    outside[..., 0] = False
    return outside


def _exponential_race(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row from probs [B, V], row b from ``generators[b]``: argmax_v p_v / q_v, q_v ~ Exp(1).

    The same draws as ``torch.multinomial(probs[b : b + 1], 1, generator=generators[b])`` row by row (that is
    how torch samples one token; tests/infer hold it to bit-equality), with only the exponential variates
    drawn per row and the division and argmax batched (16 rows of 8192: 3.2 -> 2.8 ms a step).
    """
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):  # multinomial's check and words
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")
    race = torch.empty_like(probs)
    for row, generator in zip(race, generators, strict=True):
        row.exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and validity mask [B, T] with each prompt right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    return _pad(prompts, pad_id)


def check_prompts(model: torch.nn.Module, prompts: Sequence[Sequence[int]], eos_token_id: int | None) -> None:
    """``K2LabError`` (one line) for a prompt id or ``eos_token_id`` outside ``model``'s vocabulary (the
    embedding's IndexError; an EOS that can never be sampled) or a prompt longer than its context
    (``max_position_embeddings``: positions it was never trained on). New tokens may still run past the
    context: ``k2lab generate``, agentic rollouts and ``k2lab serve`` refuse that themselves, while a training
    run's closing sample and serve's background compile decode a fixed number of tokens whatever it is."""
    config = getattr(model, "language_model", model).config
    vocab, context = config.vocab_size, config.max_position_embeddings
    if eos_token_id is not None and not 0 <= eos_token_id < vocab:
        raise K2LabError(
            f"eos_token_id {eos_token_id} is outside the model's vocabulary [0, {vocab}): it could never end "
            "a sequence"
        )
    for row, prompt in enumerate(prompts):
        if len(prompt) > context:
            raise K2LabError(
                f"prompt {row} has {len(prompt)} tokens, more than the model's context of {context} "
                "(max_position_embeddings)"
            )
        low, high = (min(prompt), max(prompt)) if len(prompt) else (0, 0)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise K2LabError(f"prompt {row}: token id {bad} is outside the model's vocabulary [0, {vocab})")


def last_positions(valid: torch.Tensor) -> torch.Tensor:
    """The ``logits_mask`` [B, T] of a left-padded batch's last positions (the only logits a prefill needs:
    the head over a whole prompt, [B·T, V], was ≈ 23 % of a k2-mini prefill)."""
    last = torch.zeros_like(valid, dtype=torch.bool)
    last[:, -1] = True
    return last


def _pad(segments: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``left_pad`` that allows empty segments (rows with nothing to add in this forward)."""
    width = max(map(len, segments))
    ids = torch.full((len(segments), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(segments), width, dtype=torch.bool)
    for row, segment in enumerate(segments):
        if segment:
            ids[row, width - len(segment) :] = torch.tensor(list(segment), dtype=torch.long)
            valid[row, width - len(segment) :] = True
    return ids, valid


@torch.inference_mode()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    media: dict[str, torch.Tensor] | None = None,
    constraints: Sequence[Constraint | None] | None = None,
    row_seeds: Sequence[int] | None = None,
    cache: GenerationCache | None = None,
    prefix_cache: PrefixCache | None = None,
) -> list[list[int]]:
    """Continue each prompt; returns the new tokens per prompt (up to and including EOS).

    ``row_seeds`` gives every prompt its own sampling generator (instead of one for the batch seeded with
    ``config.seed``): row b then samples exactly what it would sample alone with ``seed = row_seeds[b]``,
    up to the batched forward's rounding.

    ``constraints`` (one per prompt, or None) mask each step's logits before sampling and see the
    sampled token after it (e.g. the tool-call decoding enforcer).

    ``model`` is a ``CausalLM`` or a ``VisionLanguageModel``; ``media`` (``pixel_values``,
    ``image_grid_thw`` ...) goes to the prefill, whose placeholders it fills in reading order.

    ``cache`` (a ``GenerationCache``): continue from what an earlier call with it left (each prompt must
    extend the ids it holds; only the new tokens are prefilled), and leave this call's state in it.
    ``prefix_cache``: prefill only what its blocks do not already hold, and store the new blocks
    (``prefill``). Outputs equal those without reuse up to the rounding of a differently split prefill.

    Tokens stay on the model's device until the end (one transfer, no per-step sync) unless an
    ``eos_token_id`` needs checking after each step.
    """
    config = config or GenerationConfig()
    check_prompts(model, prompts, config.eos_token_id)
    param = next(model.parameters())
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts)} prompts")
    if media and (cache is not None or prefix_cache is not None):
        raise ValueError("prefix reuse is for text prompts: media placeholders are not named by their ids")
    generator: torch.Generator | list[torch.Generator] = (
        torch.Generator(device=param.device).manual_seed(config.seed)
        if row_seeds is None
        else [torch.Generator(device=param.device).manual_seed(int(s)) for s in row_seeds]
    )
    starts = None if cache is None else cache.starts(prompts)
    media = {k: v.to(param.device) for k, v in (media or {}).items()}
    latents, logits = prefill(model, prompts, config.max_new_tokens, starts, prefix_cache, media)
    keep_states = cache is not None and bool(latents.kda_states)
    step_model = decode_step(model, config.compile, config.decode_weights)
    ended: dict[int, dict[int, KDAState]] = {}  # row -> its KDA states when it sampled EOS
    tokens: list[torch.Tensor] = []
    finished = torch.zeros(len(prompts), dtype=torch.bool, device=param.device)
    batch = _LiveRows(
        len(prompts), constraints, generator, config, cache is not None or prefix_cache is not None
    )
    placeholders = media_placeholders(model, logits.shape[-1])
    unsampled = torch.tensor(placeholders, device=logits.device) if placeholders else None
    for step in range(config.max_new_tokens):
        if unsampled is not None:  # a sampled placeholder has no pixels to fill it: the next step would fail
            logits = logits.float().index_fill(-1, unsampled, -torch.inf)
        if constraints is not None:
            logits = logits.float().clone()
            for row, constraint in enumerate(batch.constraints):
                if constraint is not None and not bool(finished[row]):
                    constraint.mask(logits[row])
        token = sample_next(logits, config, batch.generator)
        tokens.append(batch.place(token))
        if constraints is not None:
            for row, constraint in enumerate(batch.constraints):
                if constraint is not None and not bool(finished[row]):
                    constraint.advance(int(token[row]))
        if config.eos_token_id is not None:
            newly = (token == config.eos_token_id) & ~finished
            if keep_states:
                ended.update({batch.rows[r]: latents.kda_row(r) for r in newly.nonzero()[:, 0].tolist()})
            finished |= newly
            if bool(finished.all()):
                break
            if batch.compact and bool(newly.any()):
                token, finished = batch.drop(latents, token, finished)
        if step < config.max_new_tokens - 1:
            logits = step_model(token[:, None], cache=latents).logits[:, -1]
    outputs = [_until_eos(row, config.eos_token_id) for row in torch.stack(tokens, 1).tolist()]
    if cache is not None or prefix_cache is not None:
        _keep(latents, prompts, outputs, ended, cache, prefix_cache, batch)
    return outputs


class _LiveRows:
    """The rows still in the running batch (``GenerationConfig.drop_finished``): ``rows[i]`` is the prompt
    batch row i continues, with its constraint and generator; a dropped row's cache contents are kept in
    ``dropped`` (for ``_keep``). Without ``drop_finished`` every row stays and nothing is copied."""

    def __init__(
        self,
        size: int,
        constraints: Sequence[Constraint | None] | None,
        generator: torch.Generator | list[torch.Generator],
        config: GenerationConfig,
        keep: bool,
    ) -> None:
        self.compact = config.drop_finished and config.eos_token_id is not None
        if self.compact and config.temperature > 0 and isinstance(generator, torch.Generator):
            raise ValueError("drop_finished with sampling needs row_seeds (one generator per row)")
        self.size, self.rows, self.keep = size, list(range(size)), keep
        self.constraints = list(constraints) if constraints is not None else [None] * size
        self.generator = generator
        self.dropped: dict[int, RowState] = {}
        self.index: torch.Tensor | None = None  # rows as a tensor once some were dropped

    def place(self, token: torch.Tensor) -> torch.Tensor:
        """This step's tokens [live] as a full row [size] (-1 for the rows that left: past their EOS)."""
        if self.index is None:
            return token
        full = token.new_full((self.size,), -1)
        return full.index_copy_(0, self.index, token)

    def drop(
        self, latents: LatentCache, token: torch.Tensor, finished: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the finished rows from the batch (the cache in place); the live rows' tokens and flags."""
        live = (~finished).nonzero()[:, 0].tolist()
        if self.keep:
            for i in finished.nonzero()[:, 0].tolist():
                self.dropped[self.rows[i]] = latents.row(i)
        latents.select(live)
        self.rows = [self.rows[i] for i in live]
        self.constraints = [self.constraints[i] for i in live]
        if not isinstance(self.generator, torch.Generator):
            self.generator = [self.generator[i] for i in live]
        self.index = torch.tensor(self.rows, device=token.device)
        return token[live], finished[live]

    def state(self, latents: LatentCache, row: int) -> RowState:
        """Prompt row ``row``'s cache contents: kept when it was dropped, else read from ``latents``."""
        if row in self.dropped:
            return self.dropped[row]
        return latents.row(self.rows.index(row))


def _keep(
    latents: LatentCache,
    prompts: Sequence[Sequence[int]],
    outputs: list[list[int]],
    ended: dict[int, dict[int, KDAState]],
    cache: GenerationCache | None,
    prefix_cache: PrefixCache | None,
    batch: _LiveRows,
) -> None:
    """Per row, the prompt and all generated tokens but the last (what was fed before it was sampled):
    into ``cache`` for a continuation, and (MLA-only models) their full blocks into ``prefix_cache``."""
    held = [list(p) + out[:-1] for p, out in zip(prompts, outputs, strict=True)]
    rows = []
    for row, ids in enumerate(held):
        state = batch.state(latents, row)
        rows.append(RowState(state.rows[:, : len(ids)], ended.get(row, state.kda)))
    if cache is not None:
        cache.ids, cache.rows = held, rows
    if prefix_cache is not None and not latents.kda_states:
        for ids, state in zip(held, rows, strict=True):
            prefix_cache.insert(ids, state)


def prefill(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    room: int,
    starts: Sequence[RowState | None] | None = None,
    prefix_cache: PrefixCache | None = None,
    media: dict[str, torch.Tensor] | None = None,
) -> tuple[LatentCache, torch.Tensor]:
    """Run the prompts into a new cache with ``room`` free slots after them; returns it and the last
    position's logits [B, V].

    Row b starts from ``starts[b]`` (its first n tokens' contents, e.g. a continuation) or else the longest
    match in ``prefix_cache``, and only ``prompts[b][n:]`` runs; the blocks it computes go into
    ``prefix_cache`` (on hybrid models, the state at its last full block before the final token is
    captured by splitting the suffix there). Without either, one left-padded forward as always.
    """
    param = next(model.parameters())
    decoder = getattr(model, "language_model", model)
    config = decoder.config
    if starts is None and prefix_cache is None:
        ids, valid = left_pad(prompts, config.pad_token_id or 0)
        ids, valid = ids.to(param.device), valid.to(param.device)
        cache = LatentCache(config, len(prompts), ids.shape[1] + room, dtype=param.dtype, device=param.device)
        return cache, model(
            ids, attention_mask=valid, cache=cache, logits_mask=last_positions(valid), **(media or {})
        ).logits
    left_pad(prompts)  # every prompt has a token
    starts = list(starts or [None] * len(prompts))
    if prefix_cache is not None:
        prefix_cache.check(model)
        shared = prefix_cache.shared_prefixes([p for p, s in zip(prompts, starts, strict=True) if s is None])
        if shared:  # what several rows share runs once, first (recursively: shared among those too)
            prefill(model, shared, 0, prefix_cache=prefix_cache)
        starts = [s if s is not None else prefix_cache.match(p) for s, p in zip(starts, prompts, strict=True)]
    hybrid = "kda" in config.layer_types
    offsets = [0 if s is None else s.length for s in starts]
    splits = [_split(len(p), o, prefix_cache, hybrid) for p, o in zip(prompts, offsets, strict=True)]
    cache, logits = _prefill_rows(decoder, prompts, starts, splits, prefix_cache, room)
    if prefix_cache is not None and not hybrid:
        for row, prompt in enumerate(prompts):
            prefix_cache.insert(prompt, cache.row(row))
    return cache, logits


def _split(length: int, offset: int, prefix_cache: PrefixCache | None, hybrid: bool) -> int | None:
    """Where a hybrid model's prefill pauses to capture KDA states for the prefix cache: the last block
    boundary before the final token, when it lies past the cached ``offset``."""
    if prefix_cache is None or not hybrid:
        return None
    split = (length - 1) // prefix_cache.block_size * prefix_cache.block_size
    return split if split > offset else None


def _prefill_rows(
    decoder: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    starts: list[RowState | None],
    splits: list[int | None],
    prefix_cache: PrefixCache | None,
    room: int,
) -> tuple[LatentCache, torch.Tensor]:
    """The rows from their starts in one batch: the segment up to each split (its state stored), then the
    rest; each left-padded (a row without a split sits out the first forward as pads)."""
    param = next(decoder.parameters())
    offsets = [0 if s is None else s.length for s in starts]
    firsts = [p[o : s or o] for p, o, s in zip(prompts, offsets, splits, strict=True)]
    seconds = [p[max(o, s or 0) :] for p, o, s in zip(prompts, offsets, splits, strict=True)]
    width = max(map(len, firsts)) + max(map(len, seconds))
    singles = [LatentCache.from_row(decoder.config, s, param.dtype, param.device) for s in starts]
    cache = LatentCache.concat(singles, max(offsets) + width + room)
    if any(firsts):
        ids, valid = (t.to(param.device) for t in _pad(firsts, decoder.config.pad_token_id or 0))
        decoder(ids, attention_mask=valid, cache=cache, logits_mask=torch.zeros_like(valid))
        for row, (prompt, split) in enumerate(zip(prompts, splits, strict=True)):
            if split is not None and prefix_cache is not None:
                prefix_cache.insert(prompt[:split], cache.row(row))
    ids, valid = (t.to(param.device) for t in _pad(seconds, decoder.config.pad_token_id or 0))
    return cache, decoder(ids, attention_mask=valid, cache=cache, logits_mask=last_positions(valid)).logits


def _until_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    """The tokens up to and including the first EOS."""
    if eos_token_id is None or eos_token_id not in tokens:
        return tokens
    return tokens[: tokens.index(eos_token_id) + 1]
