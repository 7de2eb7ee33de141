"""Decode cache: the MLA latent rows of every MLA layer and the recurrent state of every KDA layer.

MLA layers keep per token only c_KV [kv_lora_rank] and the (rotated) shared k_R [qk_rope_head_dim]:
bytes per token = (kv_lora_rank + qk_rope_head_dim) × MLA layers × element size
(K2: 576 × 61 × 2 B = 70,272 B in bf16, versus 2 × 64 heads × 192 × 61 × 2 B ≈ 3 MB for a full KV cache).
Storage is preallocated for ``max_length`` tokens as one ``rows`` tensor [L_mla, B, S, C + r] (c_KV then k_R
per token), which is exactly the key of absorbed decode; ``latent`` and ``k_rope`` are views of it.
``key_valid`` marks padding so prompts of different lengths can share a batch (left padding).

KDA layers (Kimi Linear, K3) keep a fixed-size state per sequence, whatever the context length: the
recurrent S [H, K, K] in fp32 and the short-convolution history [3·H·K, kernel − 1].

A sequence's contents can be taken out (``row``: its tokens' rows in order, masked slots dropped, and its
KDA states, a ``RowState``) and put back as a cache of its own (``from_row``), which ``concat`` merges
with others: the prefix cache (``k2lab.infer.prefix_cache``) and continued generation build on this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k2lab.config import ModelConfig
from k2lab.ops.latent_write import write_rows, write_rows_indexed


class _LayerLatents:
    def __init__(self, cache: LatentCache, slot: int) -> None:
        self.cache = cache
        self.slot = slot

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Write latent [B, T, C] and k_rope [B, T, r] after the cached tokens; return all rows [B, S, C + r].

        Capacity was checked when the tokens were registered (``LatentCache.begin``). Under ``torch.compile``
        without gradients the write is one ``index_put_`` on the storage, which the compiled graph performs
        in place (``k2lab.ops.latent_write``); otherwise, the slice assignment."""
        start, end = self.cache.length, self.cache.length + latent.shape[1]
        in_place = torch.compiler.is_compiling() and not torch.is_grad_enabled()
        write = write_rows_indexed if in_place else write_rows
        write(self.cache.rows, self.slot, start, latent, k_rope)
        return self.cache.rows[self.slot, :, :end]


@dataclass
class KDAState:
    """One KDA layer's decode state: conv [B, 3·H·K, kernel − 1], recurrent [B, H, K, K] fp32."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)

    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes


@dataclass
class RowState:
    """One sequence's cached contents: ``rows`` [L_mla, n, C + r] of its n tokens in order (positions
    0 … n − 1) and ``kda`` {layer: KDAState with batch 1} (the state after token n − 1; empty for MLA-only
    models)."""

    rows: torch.Tensor
    kda: dict[int, KDAState]

    @property
    def length(self) -> int:
        return self.rows.shape[1]

    def prefix(self, n: int) -> RowState:
        """The first n tokens' rows (KDA states only describe the whole row, so only without KDA layers)."""
        if n != self.length and self.kda:
            raise ValueError("a KDA state holds its whole row: it cannot be cut to a shorter prefix")
        return RowState(self.rows[:, :n], self.kda)

    def nbytes(self) -> int:
        return self.rows.nbytes + sum(state.nbytes() for state in self.kda.values())


class LatentCache:
    """Decode cache for a batch: ``rows`` [L_mla, B, S, C + r] with views ``latent`` [L_mla, B, S, C] and
    ``k_rope`` [L_mla, B, S, r]; ``key_valid`` [B, S]; ``kda_states`` {layer index: KDAState}."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        kinds = config.layer_types
        mla_layers = [i for i, kind in enumerate(kinds) if kind == "mla"]
        self.slot_of = {layer: slot for slot, layer in enumerate(mla_layers)}
        self.max_length = max_length
        self.length = 0
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.rows = torch.zeros(len(mla_layers), batch_size, max_length, width, dtype=dtype, device=device)
        self.latent, self.k_rope = self.rows.split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        self.key_valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        H, K = config.linear_num_heads, config.linear_head_dim
        conv_shape = (batch_size, 3 * H * K, config.linear_conv_kernel_dim - 1)
        self.kda_states = {
            i: KDAState(
                torch.zeros(conv_shape, dtype=dtype, device=device),
                torch.zeros(batch_size, H, K, K, dtype=torch.float32, device=device),
            )
            for i, kind in enumerate(kinds)
            if kind == "kda"
        }

    def layer(self, index: int) -> _LayerLatents | KDAState:
        """The view layer ``index`` reads and writes: latent rows (MLA) or its recurrent state (KDA)."""
        if index in self.kda_states:
            return self.kda_states[index]
        return _LayerLatents(self, self.slot_of[index])

    def begin(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register T new tokens (valid [B, T] bool); return their positions [B, T] and all key_valid [B, S']."""
        start, end = self.length, self.length + valid.shape[1]
        if end > self.max_length:
            raise ValueError(f"cache is full: {end} tokens > max_length={self.max_length}")
        self.key_valid[:, start:end] = valid
        positions = self.next_position[:, None] + (valid.long().cumsum(1) - 1).clamp(min=0)
        return positions, self.key_valid[:, :end]

    def commit(self, valid: torch.Tensor | None, num_tokens: int) -> None:
        """Advance past the ``num_tokens`` tokens registered by ``begin`` once every layer has appended them
        (valid [B, num_tokens] bool, None when all are real)."""
        self.length += num_tokens
        self.next_position += num_tokens if valid is None else valid.long().sum(1)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token adds across all MLA layers (per sequence)."""
        return self.rows.shape[0] * self.rows.shape[-1] * self.rows.element_size()

    @property
    def state_bytes(self) -> int:
        """Fixed bytes per sequence held by the KDA layers, independent of context length."""
        batch = self.rows.shape[1]
        return sum(state.nbytes() for state in self.kda_states.values()) // max(batch, 1)

    def bytes_per_sequence(self, context: int) -> int:
        """Cache bytes one sequence of ``context`` tokens needs: latent rows plus the KDA states."""
        return context * self.bytes_per_token + self.state_bytes

    def nbytes(self) -> int:
        return self.rows.nbytes + sum(state.nbytes() for state in self.kda_states.values())

    @property
    def batch_size(self) -> int:
        return self.key_valid.shape[0]

    def _set_rows(self, rows: torch.Tensor, key_valid: torch.Tensor) -> None:
        self.rows, self.key_valid = rows, key_valid
        self.max_length = rows.shape[2]
        width = self.latent.shape[-1]
        self.latent, self.k_rope = rows.split([width, rows.shape[-1] - width], dim=-1)

    def select(self, index: torch.Tensor | list[int]) -> LatentCache:
        """Keep only the sequences ``index`` (in that order), in place; returns self.

        A server drops finished or cancelled sequences this way, so later steps compute only live rows.
        """
        index = torch.as_tensor(index, dtype=torch.long, device=self.key_valid.device)
        self._set_rows(self.rows.index_select(1, index), self.key_valid.index_select(0, index))
        self.next_position = self.next_position.index_select(0, index)
        for state in self.kda_states.values():
            state.conv = state.conv.index_select(0, index)
            state.recurrent = state.recurrent.index_select(0, index)
        return self

    def row(self, index: int) -> RowState:
        """A copy of sequence ``index``'s contents: its valid rows in order and its KDA states."""
        valid = self.key_valid[index, : self.length]
        rows = self.rows[:, index, : self.length][:, valid]
        return RowState(rows, self.kda_row(index))

    def kda_row(self, index: int) -> dict[int, KDAState]:
        """A copy of sequence ``index``'s KDA states (batch 1)."""
        return {
            layer: KDAState(s.conv[index : index + 1].clone(), s.recurrent[index : index + 1].clone())
            for layer, s in self.kda_states.items()
        }

    def set_kda_row(self, index: int, states: dict[int, KDAState]) -> None:
        """Overwrite sequence ``index``'s KDA states with ``states`` (from ``kda_row``)."""
        for layer, state in states.items():
            self.kda_states[layer].conv[index] = state.conv[0]
            self.kda_states[layer].recurrent[index] = state.recurrent[0]

    @classmethod
    def from_row(
        cls,
        config: ModelConfig,
        state: RowState | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> LatentCache:
        """A one-sequence cache holding ``state`` (empty for None), full (``concat`` it to make room)."""
        length = 0 if state is None else state.length
        cache = cls(config, 1, length, dtype=dtype, device=device)
        if state is not None:
            cache.rows[:, 0] = state.rows
            cache.key_valid[:] = True
            cache.length = length
            cache.next_position[:] = length
            cache.set_kda_row(0, state.kda)
        return cache

    @classmethod
    def concat(cls, caches: list[LatentCache], max_length: int) -> LatentCache:
        """One cache holding every sequence of ``caches`` (batch order kept), room for ``max_length`` tokens.

        Shorter caches are left-aligned to the longest with invalid (masked) key slots: a key's storage
        index only orders it before later queries, and its rotary position was applied when it was
        written (``next_position`` carries on per sequence), so the sequences continue exactly.
        """
        length = max(cache.length for cache in caches)
        if max_length < length:
            raise ValueError(f"max_length={max_length} is below the longest cached sequence ({length})")
        first = caches[0]
        layers, _, _, width = first.rows.shape
        batch = sum(cache.batch_size for cache in caches)
        rows = first.rows.new_zeros(layers, batch, max_length, width)
        key_valid = first.key_valid.new_zeros(batch, max_length)
        row = 0
        for cache in caches:
            b, shift = cache.batch_size, length - cache.length
            rows[:, row : row + b, shift:length] = cache.rows[:, :, : cache.length]
            key_valid[row : row + b, shift:length] = cache.key_valid[:, : cache.length]
            row += b
        merged = object.__new__(cls)
        merged.slot_of, merged.length = dict(first.slot_of), length
        merged.latent = first.latent  # replaced by _set_rows (keeps the latent width)
        merged._set_rows(rows, key_valid)
        merged.next_position = torch.cat([cache.next_position for cache in caches])
        merged.kda_states = {
            layer: KDAState(
                torch.cat([cache.kda_states[layer].conv for cache in caches]),
                torch.cat([cache.kda_states[layer].recurrent for cache in caches]),
            )
            for layer in first.kda_states
        }
        return merged
