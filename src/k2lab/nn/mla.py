"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2).

Per token x [D] and head h (nope width n, rope width r, value width v, latent width C):

    c_Q = RMSNorm(W_DQ x)                         (or no low-rank path when ``q_lora_rank`` is None)
    [q_C^h ; q_R^h] = W_UQ^h c_Q                  q_C^h ∈ R^n, q_R^h ∈ R^r, RoPE on q_R
    [c_KV ; k_R] = W_DKV x,  c_KV ← RMSNorm(c_KV)  c_KV ∈ R^C, k_R ∈ R^r shared by all heads, RoPE on k_R
    [k_C^h ; v^h] = W_UKV^h c_KV                  k_C^h ∈ R^n, v^h ∈ R^v
    o^h = softmax(scale · [q_C^h; q_R^h]·[k_C^h; k_R]ᵀ + mask) v^h,   y = W_O [o^1 … o^H]

Only (c_KV, k_R) are cached, side by side as one key row ``[c_KV ; k_R]`` (width C + r). Decode uses the
absorbed form: ``q̃^h = (W_UK^h)ᵀ q_C^h`` scores directly against the cached rows,
``softmax(scale·[q̃^h ; q_R^h]·[c_KV ; k_R]) c_KV`` is expanded once by W_UV^h, so past tokens are never
re-expanded. Both paths run ``F.scaled_dot_product_attention``; on CPU the values are zero-padded to the
query width, which selects the fused (flash) kernel instead of the unfused math fallback. A CPU training
forward in bf16 takes ``k2lab.ops.attention``'s blocked backward after that kernel's forward.

Variants (Kimi Linear, K3): ``mla_rope=False`` is NoPE MLA: the same projections, k_R still shared, but
nothing is rotated (position comes from the KDA layers), scale stays qk_head_dim^-0.5 = 192^-0.5.
``mla_output_gate=True`` is gated MLA (K3): ``y = W_O (o ⊙ sigmoid(W_G x))`` elementwise over H·v, no bias.

Released K3 (mlx-lm / vLLM ``kimi_k3``, checked by tests/hf/test_kimi_k3_mlx.py): MLA is NoPE with the r rope
channels kept (q_R·k_R enters the score unrotated), scale (n + r)^-0.5 with no YaRN factor, and the output gate
reads the same normed layer input as the projections. The report says only "every MLA layer uses NoPE"; the
code keeps the 64-wide shared k_R. The q/kv latent norms use ε = 1e-6 here, as DeepSeek-V3's public code and
mlx-lm's ``kimi_k3`` (hard-coded there); vLLM's K3 builds them with ``rms_norm_eps`` (1e-5). On the tiny random
model of the mlx-lm test, switching to 1e-5 moves the logits by 2.6e-5 (about the fp32 noise there).

Weight layout (matches the public checkpoints): ``q_up`` rows per head are n nope then r rope;
``kv_up`` rows per head are n key then v value; ``kv_down`` rows are C latent then r rope.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from k2lab.config import ModelConfig
from k2lab.nn.decode_linear import cpu_fp32_inference, decode_linear, widened
from k2lab.nn.norm import RMSNorm
from k2lab.nn.rope import apply_rotary
from k2lab.ops.attention import attention


@dataclass
class AttentionMask:
    """How queries may see keys. ``allowed`` [B, 1, Tq, Tk] bool, or None for plain causal (no padding)."""

    allowed: torch.Tensor | None


class LatentKV(Protocol):
    """The per-layer view of a latent cache: appends (c_KV, k_R) and returns every cached key row so far."""

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """latent [B, T, C], k_rope [B, T, r] -> cached rows [B, S, C + r] (c_KV then k_R)."""
        ...


class MultiHeadLatentAttention(nn.Module):
    """x: [B, T, D] -> [B, T, D]."""

    # Latent-space attention is cheaper than expanding keys/values when few queries see many keys.
    ABSORB_MAX_QUERIES = 8
    # Queries per block when recomputing scores for the per-head max logit (QK-Clip).
    MAX_LOGIT_BLOCK = 64

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
        self.rotate = config.mla_rope
        if config.mla_output_gate:
            self.gate_proj = nn.Linear(D, self.n_heads * self.v_dim, bias=False)
        # QK-Clip reads S_max^h here after each recorded forward (``k2lab.optim.qk_clip``).
        self.record_max_logits = False
        self.max_logits: torch.Tensor | None = None

    # ---- projections -----------------------------------------------------------------------------
    def project(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_nope [B, T, H, n], rotated q_rope [B, T, H, r], normalised c_KV [B, T, C], rotated k_R [B, T, r].

        The H query rope parts and the shared key rope part are rotated together, as H + 1 heads
        (NoPE: left as projected; cos/sin may then be None). With a few rows and no gradient (decode) the
        down/up products run as ``k2lab.nn.decode_linear`` (same products, CPU BLAS's faster operand order).
        """
        B, T, _ = x.shape
        if hasattr(self, "q_proj"):
            q = decode_linear(x, self.q_proj.weight)
        else:
            q = decode_linear(self.q_norm(decode_linear(x, self.q_down.weight)), self.q_up.weight)
        q_nope, q_rope = q.view(B, T, self.n_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = decode_linear(x, self.kv_down.weight).split([self.latent_dim, self.rope_dim], dim=-1)
        if self.rotate:
            rotated = apply_rotary(torch.cat((q_rope, k_rope.unsqueeze(2)), dim=2), cos, sin)  # [B,T,H+1,r]
            q_rope, k_rope = rotated.split([self.n_heads, 1], dim=2)
            k_rope = k_rope.squeeze(2)
        return q_nope, q_rope, self.kv_norm(latent), k_rope

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, n, C] and W_UV [H, v, C] views of ``kv_up``."""
        w = self.kv_up.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.latent_dim)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    # ---- attention --------------------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        mask: AttentionMask,
        cache: LatentKV | None = None,
    ) -> torch.Tensor:
        """x [B, T, D], cos/sin [B, T, r/2] (None for NoPE) -> [B, T, D]."""
        B, T, _ = x.shape
        q_nope, q_rope, latent, k_rope = self.project(x, cos, sin)
        if cache is None:
            out = self._expanded_attention(q_nope, q_rope, latent, k_rope, mask)
        else:
            keys = cache.append(latent, k_rope)
            if T <= self.ABSORB_MAX_QUERIES:
                out = self._absorbed_attention(q_nope, q_rope, keys, mask)
            else:
                latent, k_rope = keys.split([self.latent_dim, self.rope_dim], dim=-1)
                out = self._expanded_attention(q_nope, q_rope, latent, k_rope, mask)
        out = out.reshape(B, T, self.n_heads * self.v_dim)
        if hasattr(self, "gate_proj"):
            out = out * torch.sigmoid(decode_linear(x, self.gate_proj.weight))
        return decode_linear(out, self.out_proj.weight)

    def expanded_qkv(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head query [B, Tq, H, n+r], key [B, Tk, H, n+r] (shared k_R broadcast), value [B, Tk, H, v]."""
        B, Tk, _ = latent.shape
        kv = self.kv_up(latent).view(B, Tk, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
        key = torch.cat((k_nope, k_rope.unsqueeze(2).expand(-1, -1, self.n_heads, -1)), dim=-1)
        return torch.cat((q_nope, q_rope), dim=-1), key, value

    def _expanded_attention(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        mask: AttentionMask,
    ) -> torch.Tensor:
        """Expand keys/values per head and run SDPA. Returns [B, Tq, H, v]."""
        query, key, value = self.expanded_qkv(q_nope, q_rope, latent, k_rope)
        if self.record_max_logits:  # max over every recorded forward since QK-Clip last read it
            batch_max = self._max_logits(query, key, mask)
            previous = self.max_logits
            self.max_logits = batch_max if previous is None else torch.maximum(previous, batch_max)
        out = attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            mask.allowed,
            self.softmax_scale,
        )
        return out.transpose(1, 2)

    # ---- QK-Clip hook ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _max_logits(self, query: torch.Tensor, key: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """S_max^h = max over batch and valid (causal, unpadded) pairs of scale·q_i·k_j -> [H] fp32.

        The fused attention kernel does not expose its scores, so they are recomputed here without
        autograd, a block of queries at a time against only the keys they may see: peak extra memory is
        [B, H, block, Tk] for one block, never a [T, T] copy per head. Each block is written once by the
        product and read twice: the mask is added in place as a bias, 0 where a pair is allowed and
        −FLT_MAX where not (s − FLT_MAX rounds to −FLT_MAX for any |s| < 10³¹; ``masked_fill`` with the
        mask broadcast over heads ran 12× slower than the add), and the scale goes on the [H] maxima
        (scale > 0 and rounding is monotonic, so max fl(scale·s) = fl(scale·max s)). A head with no
        allowed pair keeps −inf. Against scaling the block and masking a copy: the same maxima bit for
        bit, 1.7× faster at T = 256 and 2.0× at T = 1,024 (k2-mini's shapes, B = 8, AVX2 Zen 3, 2 threads).
        """
        Tq, Tk = query.shape[1], key.shape[1]
        offset = Tk - Tq  # queries are the last Tq positions
        q = query.transpose(1, 2).float().contiguous()
        k = key.transpose(1, 2).float().contiguous()
        floor = torch.finfo(torch.float32).max
        best = torch.full((self.n_heads,), float("-inf"), device=query.device)
        for start in range(0, Tq, self.MAX_LOGIT_BLOCK):
            stop = min(start + self.MAX_LOGIT_BLOCK, Tq)
            visible = stop + offset
            if mask.allowed is None:
                allowed = torch.ones(stop - start, visible, dtype=torch.bool, device=query.device).tril(
                    start + offset
                )
            else:
                allowed = mask.allowed[:, :, start:stop, :visible]
            bias = allowed.float().sub_(1.0).mul_(floor)  # 0 allowed, −FLT_MAX not
            scores = (q[:, :, start:stop] @ k[:, :, :visible].mT).add_(bias)
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
        return torch.where(best <= -floor / 2, float("-inf"), best * self.softmax_scale)

    def attention_logits(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
    ) -> torch.Tensor:
        """All pre-softmax logits scale·q_i·k_j [B, H, T, T] of a forward without cache (for inspection)."""
        q_nope, q_rope, latent, k_rope = self.project(x, cos, sin)
        query, key, _ = self.expanded_qkv(q_nope, q_rope, latent, k_rope)
        return (query.transpose(1, 2) @ key.transpose(1, 2).mT) * self.softmax_scale

    def _absorbed_attention(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, keys: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Attention in latent space over the cached rows keys [B, S, C + r]. Returns [B, Tq, H, v].

        The cached rows serve as keys and, sliced to c_KV after the softmax, as values (one shared head).
        Compiled on CPU in fp32 without gradients (the compiled decode step) it runs as
        ``reduced_latent_attention``.
        """
        B, Tq, H, _ = q_nope.shape
        w_uk, w_uv = self.up_weights()
        allowed = mask.allowed
        if allowed is None:  # plain causal, queries aligned to the end of the keys
            allowed = torch.ones(Tq, keys.shape[1], dtype=torch.bool, device=keys.device).tril(
                keys.shape[1] - Tq
            )
        if torch.compiler.is_compiling() and cpu_fp32_inference(keys, w_uk):
            return reduced_latent_attention(q_nope, q_rope, keys, allowed, w_uk, w_uv, self.softmax_scale)
        w_uk, w_uv = widened(w_uk, keys), widened(w_uv, keys)  # a decode twin's bf16 copies, outside a graph
        # q̃^h = (W_UK^h)ᵀ q_C^h for all heads at once: [H, B·Tq, n] @ [H, n, C]
        q_latent = torch.bmm(q_nope.permute(2, 0, 1, 3).reshape(H, B * Tq, self.nope_dim), w_uk)
        q_latent = q_latent.view(H, B, Tq, self.latent_dim).transpose(0, 1)
        query = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)  # [B, H, Tq, C + r]
        keys = keys.unsqueeze(1)
        out = F.scaled_dot_product_attention(
            query, keys, keys, attn_mask=allowed, scale=self.softmax_scale, enable_gqa=True
        )
        # o^h = W_UV^h c̄^h: [H, B·Tq, C] @ [H, C, v]
        out_latent = out[..., : self.latent_dim].transpose(0, 1).reshape(H, B * Tq, self.latent_dim)
        out = torch.bmm(out_latent, w_uv.transpose(1, 2))
        return out.view(H, B, Tq, self.v_dim).permute(1, 2, 0, 3)


def reduced_latent_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    keys: torch.Tensor,
    allowed: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Absorbed attention written as broadcast products and sums, for inductor to fuse (decode steps).

    q_nope [B, Tq, H, n], q_rope [B, Tq, H, r], keys [B, S, C + r], allowed (bool, broadcast to [B, H, Tq, S]),
    W_UK [H, n, C], W_UV [H, v, C] -> [B, Tq, H, v]:

        q̃ = Σ_n q_C W_UK,  p = softmax(scale · [q̃ ; q_R]·keysᵀ, masked),  o = Σ_C (Σ_S p · c_KV) W_UV

    The same values as the eager form (``F.scaled_dot_product_attention`` between two ``bmm``), summed in
    another order. At decode sizes those three are fixed-cost calls (k2-mini, batch 4, profiled: the CPU
    flash kernel ≈ 57 µs for a [4, 4, 1, ~70] attention, each ``bmm`` ≈ 16 µs, six layers); as reductions
    inductor generates them into its own loops. k2-mini compiled steps, one process, alternating (two copies):
    batch 4 1.11×, batch 1 1.13×, batch 4 after a 1,024-token prompt 1.15× (docs/generation.md).
    """
    q_latent = (q_nope.unsqueeze(-1) * w_uk).sum(-2).transpose(1, 2)  # [B, H, Tq, C]
    query = torch.cat((q_latent, q_rope.transpose(1, 2)), dim=-1)  # [B, H, Tq, C + r]
    rows = keys[:, None, None]  # [B, 1, 1, S, C + r]
    scores = (query.unsqueeze(-2) * rows).sum(-1) * scale  # [B, H, Tq, S]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    latent = (probs.unsqueeze(-1) * rows[..., : w_uk.shape[-1]]).sum(-2)  # [B, H, Tq, C]
    return (latent.transpose(1, 2).unsqueeze(-2) * w_uv).sum(-1)  # [B, Tq, H, v]


@contextmanager
def max_logits_paused(model: nn.Module) -> Iterator[None]:
    """Inside the block no MLA layer of ``model`` records QK-Clip's max logits; each layer's setting is
    restored after. For forwards that are not the update's (sampling rollouts, validation): S_max is
    measured on the forwards whose gradients the optimizer step applies, and the recomputation is skipped."""
    layers = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention)]
    saved = [layer.record_max_logits for layer in layers]
    for layer in layers:
        layer.record_max_logits = False
    try:
        yield
    finally:
        for layer, setting in zip(layers, saved, strict=True):
            layer.record_max_logits = setting
