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
from k2lab.models.decoder import CausalLM
from k2lab.posttrain.prefix_tree import MIN_SHARED, PrefixPack, batch_packs, prefix_packs, tree_mask
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
    instead of T forwards over growing prefixes. Rows that begin alike (the K rollouts of a group share
    their prompt) are then packed with each shared prefix once (``k2lab.posttrain.prefix_tree``; MLA-only
    ``CausalLM``s): every token runs once however many rows hold it. Packs go through one right-padded
    forward per ``batch`` packs; a causal model gives each position the same log-prob whichever row or
    pack holds it (up to rounding). Models whose forward takes ``logits_mask`` (``CausalLM``) compute the
    head at the completion positions only.
    """
    rows, places = turn_rows(turns)
    shares = isinstance(model, CausalLM) and not model.config.has_kda
    packs = prefix_packs(rows, MIN_SHARED if shares else None)
    holder = {row: (p, m) for p, pack in enumerate(packs) for m, row in enumerate(pack.rows)}
    device = next(model.parameters()).device
    masked = "logits_mask" in inspect.signature(model.forward).parameters
    out: list[torch.Tensor | None] = [None] * len(turns)
    for start in range(0, len(packs), batch):
        chunk = packs[start : start + batch]
        mine = [k for k, (row, _) in enumerate(places) if start <= holder[row][0] < start + batch]
        where = []  # per turn of this chunk: (its pack's row in the chunk, packed indices predicting its tokens)
        for k in mine:
            row, begin = places[k]
            p, m = holder[row]
            where.append((p - start, packs[p].paths[m][begin - 1 : begin - 1 + len(turns[k].completion_ids)]))
        logits, wanted = _chunk_logits(model, chunk, where, device, masked)
        offset = wanted.flatten().cumsum(0).view_as(wanted) - 1  # index in the [N] rows of a wanted position
        index = torch.cat([offset[b, torch.tensor(idx, dtype=torch.long)] for b, idx in where])
        logits = logits.index_select(0, index.to(logits.device)).float()  # [Σ n_k, V], turn after turn
        begins = [0]
        for _, idx in where:
            begins.append(begins[-1] + len(idx))
        if allowed is not None:
            logits = _restrict(logits, [(allowed[k], begins[j]) for j, k in enumerate(mine)])
        logp = logits.log_softmax(-1)
        targets = torch.tensor([t for k in mine for t in turns[k].completion_ids], dtype=torch.long)
        values = logp if full else logp.gather(-1, targets.to(logp.device)[:, None]).squeeze(-1)
        for j, k in enumerate(mine):
            out[k] = values[begins[j] : begins[j + 1]]
    return out  # type: ignore[return-value]


def _chunk_logits(
    model: torch.nn.Module,
    chunk: Sequence[PrefixPack],
    where: Sequence[tuple[int, list[int]]],
    device: torch.device,
    masked: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One right-padded forward over ``chunk``: the logits [N, V] at the N ``wanted`` [B, T] positions (the
    packed indices in ``where``), row-major; ``masked``: the model takes ``logits_mask``. Packs of one row
    run with a padding mask, as plain rows; packs that share prefixes with their tree mask and positions."""
    ids, positions = batch_packs(chunk)
    wanted = torch.zeros_like(ids, dtype=torch.bool)
    for b, idx in where:
        wanted[b, idx] = True
    if all(len(pack.rows) == 1 for pack in chunk):
        lengths = torch.tensor([len(pack) for pack in chunk])
        mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        inputs = {"attention_mask": mask.to(device)}
    else:
        inputs = {"attention_mask": tree_mask(chunk).to(device), "position_ids": positions.to(device)}
    ids, wanted = ids.to(device), wanted.to(device)
    if masked:
        return model(ids, logits_mask=wanted, **inputs).logits, wanted
    return model(ids, **inputs).logits[wanted], wanted


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
