"""Rolling a decode cache back to the first n tokens of a window of forwards (speculative decoding).

A verify forward appends T = k + 1 tokens per sequence (the pending token and k drafted ones); row b then
keeps only the first ``keep[b]`` of them. Both cache kinds are rolled back without recomputing anything:

* MLA (``LatentCache``): the rejected rows stay in storage but become invalid keys, ``key_valid[b, s] ←
  False``, and ``next_position[b]`` goes back by the number dropped, so the next token gets rotary position
  ``position(last kept) + 1``. Keys are ordered by storage index only against later queries, so holes are
  harmless; :func:`compact` squeezes them out when the storage runs out.
* KDA (``KDAState``): during the window each KDA layer sees a :class:`WindowState` instead of its state,
  which asks the layer for the state after every token (``nn.kda.StepRecorder``):
  S_t [B, T, H, K, K] and conv history [B, T, 3·H·K, W − 1]; closing the window writes back, per row,
  the state after its last kept token (index ``keep[b]``; index 0 = the state before the window).
"""

from __future__ import annotations

import torch

from k2lab.infer.cache import KDAState, LatentCache


class WindowState:
    """Stands in for one KDA layer's ``KDAState`` during a window and records each token's state."""

    record_steps = True

    def __init__(self, base: KDAState) -> None:
        self.base = base
        self.conv, self.recurrent = base.conv, base.recurrent
        self._conv = [base.conv.unsqueeze(1)]  # [B, 1, C, W−1]: the state before the window
        self._recurrent = [base.recurrent.unsqueeze(1)]  # [B, 1, H, K, K]

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """A one-token update (conv [B, C, W−1], recurrent [B, H, K, K]) recorded as a window of one."""
        self.update_steps(conv.unsqueeze(1), recurrent.unsqueeze(1))

    def update_steps(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """conv [B, T, C, W−1], recurrent [B, T, H, K, K]: the states after each of T more tokens."""
        self._conv.append(conv.to(self.base.conv.dtype))
        self._recurrent.append(recurrent.float())
        self.conv, self.recurrent = self._conv[-1][:, -1], self._recurrent[-1][:, -1]

    def settle(self, keep: torch.Tensor) -> None:
        """Write the state after ``keep[b]`` window tokens of row b (keep [B] long) into the base state."""
        rows = torch.arange(keep.shape[0], device=keep.device)
        conv = torch.cat(self._conv, dim=1)[rows, keep]
        recurrent = torch.cat(self._recurrent, dim=1)[rows, keep]
        self.base.update(conv, recurrent)


class CacheWindow:
    """The tokens appended to ``cache`` from now on (any number of forwards) until :meth:`close`.

    KDA layers need every token of the window to be a real one (``valid`` True): a pad leaves their state
    as it was (``nn.kda``), but ``WindowState.settle`` keeps the state at window position ``keep[b]``, while
    MLA counts real tokens, so a window with pads would settle on the wrong token. MLA layers accept padding
    anywhere.
    """

    def __init__(self, cache: LatentCache) -> None:
        self.cache = cache
        self.start = cache.length
        self.states = {index: WindowState(state) for index, state in cache.kda_states.items()}
        cache.kda_states = {**cache.kda_states, **self.states}

    def close(self, keep: torch.Tensor) -> None:
        """Keep the first ``keep[b]`` real tokens of the window in row b (keep [B] long), drop the rest."""
        cache = self.cache
        cache.kda_states = {**cache.kda_states, **{i: w.base for i, w in self.states.items()}}
        for state in self.states.values():
            state.settle(keep)
        window = cache.key_valid[:, self.start : cache.length]
        drop = window & (window.long().cumsum(1) > keep[:, None])
        window &= ~drop
        cache.next_position -= drop.sum(1)


def compact(cache: LatentCache) -> None:
    """Squeeze out invalid key slots: each row's valid rows move, in order, to the end of [0, L) with
    L = the largest valid count; the cache then continues at length L. Outputs are unchanged (a key's slot
    only orders it before later queries, and its rotary position was applied when it was written)."""
    valid = cache.key_valid[:, : cache.length]
    counts = valid.sum(1)
    length = int(counts.max()) if counts.numel() else 0
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid slots first, in order
    slot = torch.arange(length, device=valid.device)[None, :] - (length - counts)[:, None]  # [B, L]
    keep = slot >= 0
    source = order.gather(1, slot.clamp(min=0))  # [B, L]
    gathered = cache.rows[:, :, : cache.length].gather(
        2, source[None, :, :, None].expand(cache.rows.shape[0], -1, -1, cache.rows.shape[-1])
    )
    cache.rows[:, :, :length] = gathered
    cache.key_valid[:, :length] = keep
    cache.key_valid[:, length:] = False
    cache.length = length


def ensure_room(cache: LatentCache, tokens: int) -> None:
    """Make room for ``tokens`` more slots, compacting when the storage would overflow or fill exactly: a
    compiled step (``k2lab.infer.compiled``) builds another graph for a forward that ends at the storage's
    last slot (its slices then span the whole storage), ≈ 10 s on 2 CPU cores."""
    if cache.length + tokens < cache.max_length:
        return
    compact(cache)
    if cache.length + tokens > cache.max_length:
        raise ValueError(
            f"cache is full: {cache.length} live tokens + {tokens} > max_length={cache.max_length}"
        )
