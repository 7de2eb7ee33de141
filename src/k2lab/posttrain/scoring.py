"""Scoring a policy's sampled turns: the log-probabilities post-training objectives are built from.

``turn_logprobs`` gives log π(y_t | prompt, y_<t) of each turn's completion tokens (at temperature 1,
optionally renormalised over the tokens the decoding enforcer allowed), folding the turns of one conversation
into one row (``turn_rows``). ``offpolicy_mask`` and ``sequence_log_ratio`` turn per-token log-probs of the
current and the sampling policy into the sequence log-ratio of K1.5's objective
(``k2lab.posttrain.objective``). RL (``k2lab.agentic.rl.trainer``), MOPD (``k2lab.agentic.distill.mopd``) and
PARL (``k2lab.swarm.parl``) score with these.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from k2lab.agentic.episodes.rollout import Turn
from k2lab.runtime.enforcer import unpack_token_mask

__all__ = ["offpolicy_mask", "sequence_log_ratio", "turn_logprobs", "turn_rows"]


def offpolicy_mask(logp_new: torch.Tensor, logp_old: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """m_t = 1[|log π_θ − log π_old| ≤ δ] per token (no gradient); all ones when δ is None."""
    if threshold is None:
        return torch.ones_like(logp_old, dtype=torch.bool)
    return (logp_new.detach() - logp_old).abs() <= threshold


def sequence_log_ratio(logp_new: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(π_θ(y|x) / π_old(y|x)) = Σ_t m_t (log π_θ(y_t) − log π_old(y_t))."""
    return ((logp_new - logp_old) * mask.to(logp_new.dtype)).sum()


def turn_logprobs(
    model: torch.nn.Module,
    turns: Sequence[Turn],
    batch: int = 8,
    allowed: Sequence[torch.Tensor | None] | None = None,
    full: bool = False,
) -> list[torch.Tensor]:
    """log π(y_t | prompt, y_<t) of each turn's completion ids (temperature 1): [len(completion)] per turn,
    or with ``full`` the whole next-token distribution log π(· | prompt, y_<t), [len(completion), V].

    With ``allowed`` (per turn: bool [len(completion), V], its packed form from ``pack_token_mask``, or None)
    the distribution at each position is renormalised over the allowed tokens (the decoding enforcer's
    policy):

        log π_A(y_t) = z_t[y_t] − log Σ_{v ∈ A_t} exp z_t[v]        (z_t: the logits at position t)

    Turns are folded into rows first (``turn_rows``): a turn whose prompt starts with the previous turn's
    prompt + completion (the next turn of the same conversation, re-rendered to the same ids) reads its
    log-probs from that conversation's row, so a T-turn episode costs one forward over its last turn
    instead of T forwards over growing prefixes. Rows go through one right-padded forward per ``batch``
    rows; a causal model gives each position the same log-prob whichever row holds it. Models whose
    forward takes ``logits_mask`` (``CausalLM``) compute the head at the completion positions only.
    """
    rows, places = turn_rows(turns)
    spans = [
        (row, begin - 1, begin - 1 + len(t.completion_ids))
        for t, (row, begin) in zip(turns, places, strict=True)
    ]
    device = next(model.parameters()).device
    masked = "logits_mask" in inspect.signature(model.forward).parameters
    out: list[torch.Tensor | None] = [None] * len(turns)
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        width = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        valid = torch.zeros(len(chunk), width, dtype=torch.bool)
        wanted = torch.zeros(len(chunk), width, dtype=torch.bool)  # positions that predict a completion token
        for i, row in enumerate(chunk):
            ids[i, : len(row)], valid[i, : len(row)] = torch.tensor(row), True
        mine = [k for k, (row, _, _) in enumerate(spans) if start <= row < start + batch]
        for k in mine:
            row, first, last = spans[k]
            wanted[row - start, first:last] = True
        ids, valid, wanted = ids.to(device), valid.to(device), wanted.to(device)
        if masked:
            logits = model(ids, attention_mask=valid, logits_mask=wanted).logits
        else:
            logits = model(ids, attention_mask=valid).logits[wanted]
        targets = ids.roll(-1, dims=1)[wanted]  # the token after each wanted position
        offset = wanted.flatten().cumsum(0).view_as(wanted) - 1  # index in the [N] rows of a wanted position
        begins = {k: int(offset[spans[k][0] - start, spans[k][1]]) for k in mine}  # turn k's first row
        logits = logits.float()
        if allowed is not None:
            logits = _restrict(logits, [(allowed[k], begins[k]) for k in mine])
        logp = logits.log_softmax(-1)  # [N, V], row-major
        values = logp if full else logp.gather(-1, targets[:, None]).squeeze(-1)
        for k in mine:
            out[k] = values[begins[k] : begins[k] + len(turns[k].completion_ids)]
    return out  # type: ignore[return-value]


def _restrict(logits: torch.Tensor, masks: Sequence[tuple[torch.Tensor | None, int]]) -> torch.Tensor:
    """``logits`` [N, V] with −inf where the enforcer ruled a token out; ``masks`` holds (bool [n, V], its
    packed uint8 [n, ⌈V/8⌉] form, or None; first row) per turn."""
    given = [(mask, begin) for mask, begin in masks if mask is not None]
    if not given:
        return logits
    bias = torch.zeros_like(logits)
    for mask, begin in given:
        if mask.dtype == torch.uint8:
            mask = unpack_token_mask(mask, logits.shape[-1])
        bias[begin : begin + len(mask)].masked_fill_(~mask.to(bias.device), float("-inf"))
    return logits + bias


def turn_rows(turns: Sequence[Turn]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """The token rows that hold every turn's prompt + completion, and per turn (row index, position of its
    first completion token). A turn extends the previous turn's row when its prompt starts with that row."""
    rows: list[list[int]] = []
    places: list[tuple[int, int]] = []
    for turn in turns:
        if not turn.prompt_ids:
            raise ValueError("a turn needs prompt ids to be scored")
        sequence = turn.prompt_ids + turn.completion_ids
        last = rows[-1] if rows else None
        if last is not None and len(turn.prompt_ids) >= len(last) and turn.prompt_ids[: len(last)] == last:
            rows[-1] = sequence
        else:
            rows.append(sequence)
        places.append((len(rows) - 1, len(turn.prompt_ids)))
    return rows, places
