"""MLA latent cache: per layer and token only c_KV [kv_lora_rank] and the rotated shared k_R [qk_rope_head_dim].

Bytes per token = (kv_lora_rank + qk_rope_head_dim) × layers × element size
(K2: 576 × 61 × 2 B = 70,272 B in bf16, versus 2 × 64 heads × 192 × 61 × 2 B ≈ 3 MB for a full KV cache).
Storage is preallocated for ``max_length`` tokens; ``key_valid`` marks padding so prompts of different
lengths can share a batch (left padding).
"""

from __future__ import annotations

import torch

from k2lab.config import ModelConfig


class _LayerLatents:
    def __init__(self, cache: LatentCache, layer: int) -> None:
        self.cache = cache
        self.layer = layer

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, T, C] / [B, T, r] after the cached tokens and return all of them."""
        start, end = self.cache.length, self.cache.length + latent.shape[1]
        if end > self.cache.max_length:
            raise ValueError(f"cache is full: {end} tokens > max_length={self.cache.max_length}")
        self.cache.latent[self.layer, :, start:end] = latent
        self.cache.k_rope[self.layer, :, start:end] = k_rope
        return self.cache.latent[self.layer, :, :end], self.cache.k_rope[self.layer, :, :end]


class LatentCache:
    """Latent KV cache for a batch: ``latent`` [L, B, S, C], ``k_rope`` [L, B, S, r], ``key_valid`` [B, S]."""

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
        self.latent = torch.zeros(L, batch_size, max_length, config.kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(
            L, batch_size, max_length, config.qk_rope_head_dim, dtype=dtype, device=device
        )
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
        return self.latent.nbytes + self.k_rope.nbytes
