"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2).

Per token x [D] and head h (nope width n, rope width r, value width v, latent width C):

    c_Q = RMSNorm(W_DQ x)                         (or no low-rank path when ``q_lora_rank`` is None)
    [q_C^h ; q_R^h] = W_UQ^h c_Q                  q_C^h ∈ R^n, q_R^h ∈ R^r, RoPE on q_R
    [c_KV ; k_R] = W_DKV x,  c_KV ← RMSNorm(c_KV)  c_KV ∈ R^C, k_R ∈ R^r shared by all heads, RoPE on k_R
    [k_C^h ; v^h] = W_UKV^h c_KV                  k_C^h ∈ R^n, v^h ∈ R^v
    o^h = softmax(scale · [q_C^h; q_R^h]·[k_C^h; k_R]ᵀ + mask) v^h,   y = W_O [o^1 … o^H]

Only (c_KV, k_R) are cached. Decode uses the absorbed form: ``q̃^h = (W_UK^h)ᵀ q_C^h`` scores directly
against the cached latents, ``softmax(scale·(q̃^h·c_KV + q_R^h·k_R)) c_KV`` is expanded once by W_UV^h, so
past tokens are never re-expanded.

Weight layout (matches the public checkpoints): ``q_up`` rows per head are n nope then r rope;
``kv_up`` rows per head are n key then v value; ``kv_down`` rows are C latent then r rope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from k2lab.config import ModelConfig
from k2lab.nn.norm import RMSNorm
from k2lab.nn.rope import apply_rotary


@dataclass
class AttentionMask:
    """How queries may see keys. ``allowed`` [B, 1, Tq, Tk] bool, or None for plain causal (no padding)."""

    allowed: torch.Tensor | None


class LatentKV(Protocol):
    """The per-layer view of a latent cache: appends (c_KV, k_R) and returns everything cached so far."""

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class MultiHeadLatentAttention(nn.Module):
    """x: [B, T, D] -> [B, T, D]."""

    # Latent-space attention is cheaper than expanding keys/values when few queries see many keys.
    ABSORB_MAX_QUERIES = 8

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.latent_dim = config.kv_lora_rank
        self.softmax_scale = config.softmax_scale
        qk_dim = config.qk_head_dim
        D = config.hidden_size

        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, self.n_heads * qk_dim, bias=False)
        else:
            self.q_down = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(config.q_lora_rank)  # eps 1e-6 as in the public model code
            self.q_up = nn.Linear(config.q_lora_rank, self.n_heads * qk_dim, bias=False)
        self.kv_down = nn.Linear(D, self.latent_dim + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.latent_dim)
        self.kv_up = nn.Linear(self.latent_dim, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.out_proj = nn.Linear(self.n_heads * self.v_dim, D, bias=False)

    # ---- projections -----------------------------------------------------------------------------
    def queries(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [B, T, H, n], rotated q_rope [B, T, H, r]."""
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_up(self.q_norm(self.q_down(x)))
        q = q.view(*x.shape[:2], self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        return q_nope, apply_rotary(q_rope, cos, sin)

    def latents(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised c_KV [B, T, C] and rotated shared k_R [B, T, r]: exactly what the cache stores."""
        latent, k_rope = self.kv_down(x).split([self.latent_dim, self.rope_dim], dim=-1)
        k_rope = apply_rotary(k_rope.unsqueeze(2), cos, sin).squeeze(2)
        return self.kv_norm(latent), k_rope

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, n, C] and W_UV [H, v, C] views of ``kv_up``."""
        w = self.kv_up.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    # ---- attention --------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        cache: LatentKV | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x, cos, sin)
        latent, k_rope = self.latents(x, cos, sin)
        if cache is not None:
            latent, k_rope = cache.append(latent, k_rope)
        if cache is not None and T <= self.ABSORB_MAX_QUERIES:
            out = self._absorbed_attention(q_nope, q_rope, latent, k_rope, mask)
        else:
            out = self._expanded_attention(q_nope, q_rope, latent, k_rope, mask)
        return self.out_proj(out.reshape(B, T, self.n_heads * self.v_dim))

    def _expanded_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Expand keys/values per head and run SDPA. Returns [B, Tq, H, v]."""
        B, Tk, _ = latent.shape
        kv = self.kv_up(latent).view(B, Tk, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
        key = torch.cat((k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.n_heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_rope), dim=-1)
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=mask.allowed,
            is_causal=mask.allowed is None,
            scale=self.softmax_scale,
        )
        return out.transpose(1, 2)

    def _absorbed_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Attention in latent space over cached (c_KV, k_R). Returns [B, Tq, H, v]."""
        w_uk, w_uv = self.up_weights()
        q_latent = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)
        scores = torch.einsum("bhtc,bsc->bhts", q_latent, latent)
        scores = scores + torch.einsum("bthr,bsr->bhts", q_rope, k_rope)
        scores = scores.float() * self.softmax_scale
        if mask.allowed is not None:
            scores = scores.masked_fill(~mask.allowed, float("-inf"))
        else:
            Tq, Tk = scores.shape[-2:]
            causal = torch.ones(Tq, Tk, dtype=torch.bool, device=scores.device).tril(Tk - Tq)
            scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(dim=-1).to(latent.dtype)
        out_latent = torch.einsum("bhts,bsc->bthc", probs, latent)
        return torch.einsum("bthc,hvc->bthv", out_latent, w_uv)
