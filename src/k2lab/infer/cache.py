"""MLA latent cache: per layer and token only c_KV [kv_lora_rank] and the rotated shared k_R [qk_rope_head_dim].

Bytes per token = (kv_lora_rank + qk_rope_head_dim) × layers × element size
(K2: 576 × 61 × 2 B = 70,272 B in bf16, versus 2 × 64 heads × 192 × 61 × 2 B ≈ 3 MB for a full KV cache).
Storage is preallocated for ``max_length`` tokens as one ``rows`` tensor [L, B, S, C + r] (c_KV then k_R per
token), which is exactly the key of absorbed decode; ``latent`` and ``k_rope`` are views of it.
``key_valid`` marks padding so prompts of different lengths can share a batch (left padding).
"""

from __future__ import annotations

import torch

from k2lab.config import ModelConfig


class _LayerLatents:
    def __init__(self, cache: LatentCache, layer: int) -> None:
        self.cache = cache
        self.layer = layer

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Write latent [B, T, C] and k_rope [B, T, r] after the cached tokens; return all rows [B, S, C + r]."""
        start, end = self.cache.length, self.cache.length + latent.shape[1]
        if end > self.cache.max_length:
            raise ValueError(f"cache is full: {end} tokens > max_length={self.cache.max_length}")
        rows = self.cache.rows[self.layer, :, :end]
        rows[:, start:, : latent.shape[-1]] = latent
        rows[:, start:, latent.shape[-1] :] = k_rope
        return rows


class LatentCache:
    """Latent KV cache for a batch: ``rows`` [L, B, S, C + r] with views ``latent`` [L, B, S, C] and
    ``k_rope`` [L, B, S, r]; ``key_valid`` [B, S]."""

    def __init__(
        self,
        config: ModelConfig,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        L = config.num_hidden_layers
        self.max_length = max_length
        self.length = 0
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.rows = torch.zeros(L, batch_size, max_length, width, dtype=dtype, device=device)
        self.latent, self.k_rope = self.rows.split([config.kv_lora_rank, config.qk_rope_head_dim], dim=-1)
        self.key_valid = torch.zeros(batch_size, max_length, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)

    def layer(self, index: int) -> _LayerLatents:
        return _LayerLatents(self, index)

    def begin(self, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Register T new tokens (valid [B, T] bool); return their positions [B, T] and all key_valid [B, S']."""
        start, end = self.length, self.length + valid.shape[1]
        self.key_valid[:, start:end] = valid
        positions = self.next_position[:, None] + (valid.long().cumsum(1) - 1).clamp(min=0)
        return positions, self.key_valid[:, :end]

    def commit(self, valid: torch.Tensor) -> None:
        """Advance past the tokens registered by ``begin`` once every layer has appended them."""
        self.length += valid.shape[1]
        self.next_position += valid.long().sum(1)

    @property
    def bytes_per_token(self) -> int:
        """Cache bytes one token occupies across all layers (per sequence)."""
        per_layer = (
            self.latent.shape[-1] * self.latent.element_size()
            + self.k_rope.shape[-1] * self.k_rope.element_size()
        )
        return per_layer * self.latent.shape[0]

    def nbytes(self) -> int:
        return self.rows.nbytes
