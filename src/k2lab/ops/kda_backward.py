"""Hand-written backward of the chunked KDA form (``k2lab.ops.kda.chunk_kda``), chunk-parallel like its forward.

Per chunk (C tokens; q scaled; ``G`` the within-chunk cumulative log-decay; ``S`` the entering state
[K, V]; ``D = Diag(exp G_C)``; ``K̃ = exp(G_C − G) ⊙ K``), the forward is::

    M = I + Diag(β) A_kk,   T = M⁻¹ Diag(β),   W = T (exp(G)⊙K),   U = T V,   Δ = U − W S
    O = (exp(G)⊙Q) S + A_qk Δ,        S' = D S + K̃ᵀ Δ      (= P S + R, P = D − K̃ᵀ W, R = K̃ᵀ U)

and, given dO [C, V] and dS' [K, V] (the gradient reaching the next chunk's state), its backward::

    dS  = Pᵀ dS' + (exp(G)⊙Q)ᵀ dO − Wᵀ A_qkᵀ dO        (run serially over chunks, last to first)
    dΔ  = A_qkᵀ dO + K̃ dS',   dA_qk = dO Δᵀ,   d(exp(G)⊙Q) = dO Sᵀ,   dK̃ = Δ dS'ᵀ,   d exp(G_C) = Σ_v dS' ⊙ S
    Y_U = M⁻ᵀ dΔ,   Y_W = −Y_U Sᵀ (= M⁻ᵀ dW),   d(exp(G)⊙K) = Diag(β) Y_W,   dV = Diag(β) Y_U
    dM  = −Y_U Δᵀ,   dA_kk = Diag(β) dM,   dβ_i = Σ (Y_W ⊙ exp(G)⊙K + Y_U ⊙ V)_i + Σ_j dM_ij (A_kk)_ij

The scores ``A[t, j] = Σ_d a_td k_jd exp(G_td − G_jd)`` (a = q or k) depend on G only through differences,
so their part of dG is ``a ⊙ da − k ⊙ dk_col`` (row minus column gradients); they are differentiated level
by level through the same binary split (and tile level) as the forward (:class:`LevelFactors`). Each decay
factor ``e = exp(x)`` contributes ``e · de`` to dx (at the forward's decay floor the true derivative differs
by less than 1e-13 relative). Finally ``dg`` is the reverse cumulative sum of ``dG`` over each chunk.

All tensors are chunked [B, HV, N, C, ·] (``N`` chunks); see ``k2lab.ops.kda`` for the forward's helpers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from k2lab.ops.autocast import matmul_operand


class LevelFactors(NamedTuple):
    """One level of the forward's intra-chunk scores, through a reference log-decay R per block.

    A level of the binary split (blocks of b = 2h tokens, nb = C / b of them per chunk): ``e_first = exp(R −
    G_j)`` and ``e_second = exp(G_t − R)`` [..., nb, h, K], ``rows`` (q and k of the second half times
    e_second, interleaved) [..., nb, 2h, K], ``cols = e_first ⊙ k`` of the first half [..., nb, h, K].
    The tile level (``k2lab.ops.kda``'s ``TILE``-token tiles, nb = C / h of them) pairs every token of a tile
    with every other: the same fields over the whole tile, ``rows`` [..., nb, 2h, K], and ``same``
    [..., nb, h, 1, h] (1 where t and j are in one packed document) when the chunk holds document resets.
    """

    e_first: torch.Tensor
    e_second: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    same: torch.Tensor | None = None

    def whole_blocks(self, chunk: int) -> bool:
        """True for the tile level (its rows and columns are every token of a block), False for a split level."""
        nb, h = self.cols.shape[-3:-1]
        return nb * h == chunk


class ChunkSaved(NamedTuple):
    """What the forward keeps for :func:`chunk_kda_backward` (chunked, fp32 or autocast's dtype)."""

    q: torch.Tensor  # [B, HV, N, C, K], scaled
    k: torch.Tensor  # [B, HV, N, C, K]
    v: torch.Tensor  # [B, HV, N, C, V]
    beta: torch.Tensor  # [B, HV, N, C]
    decay: torch.Tensor  # exp(G) [B, HV, N, C, K]
    q_decayed: torch.Tensor  # exp(G) ⊙ q
    k_decayed: torch.Tensor  # exp(G) ⊙ k
    a_kk: torch.Tensor  # [B, HV, N, C, C]
    inverse: torch.Tensor  # M⁻¹ [B, HV, N, C, C]
    w: torch.Tensor  # [B, HV, N, C, K]
    writes: torch.Tensor  # Δ = U − W S [B, HV, N, C, V]
    a_qk: torch.Tensor  # [B, HV, N, C, C]
    states: torch.Tensor  # S entering each chunk [B, HV, N, K, V]
    transition: torch.Tensor  # P [B, HV, N, K, K]
    k_to_end: torch.Tensor  # K̃ [B, HV, N, C, K]
    to_end: torch.Tensor  # exp(G_C − G) [B, HV, N, C, K]
    last: torch.Tensor  # exp(G_C) [B, HV, N, K]


def _state_backward(
    transition: torch.Tensor, local: torch.Tensor, d_final: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dS_n = P_nᵀ dS_{n+1} + L_n`` from the last chunk to the first, ``dS_N`` = d(final state).

    Shapes: transition [B, HV, N, K, K]; local [B, HV, N, K, V]; d_final [B, HV, K, V] or None
    -> (dS_{n+1} for every chunk n [B, HV, N, K, V], d(initial state) [B, HV, K, V]).
    """
    d = local.new_zeros(local[:, :, 0].shape) if d_final is None else d_final.to(local.dtype)
    steps, sources = transition.unbind(2), local.unbind(2)
    after = [d] * len(steps)
    for n in reversed(range(len(steps))):
        after[n] = d
        d = torch.baddbmm(sources[n].flatten(0, 1), steps[n].mT.flatten(0, 1), d.flatten(0, 1)).view_as(d)
    return torch.stack(after, dim=2), d


def _outputs_backward(
    s: ChunkSaved, d_o: torch.Tensor, d_final: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """Through ``O = (exp(G)⊙Q) S + A_qk Δ`` and the state recurrence ``S' = D S + K̃ᵀ Δ``.

    Returns (d(exp(G)⊙Q) [.., C, K], dA_qk [.., C, C], dΔ [.., C, V], dK̃ [.., C, K], d exp(G_C) [.., K],
    d(initial state) [B, HV, K, V]).
    """
    states = matmul_operand(s.states)
    d_q_decayed = d_o @ states.mT
    d_a_qk = d_o @ s.writes.mT
    d_writes = s.a_qk.mT @ d_o
    local = torch.baddbmm(
        (s.q_decayed.mT @ d_o).flatten(0, 2), s.w.mT.flatten(0, 2), d_writes.flatten(0, 2), alpha=-1
    ).view_as(s.states)
    d_after, d_initial = _state_backward(s.transition, local, d_final)
    d_after_operand = matmul_operand(d_after)
    d_writes = torch.baddbmm(
        d_writes.flatten(0, 2), s.k_to_end.flatten(0, 2), d_after_operand.flatten(0, 2)
    ).view_as(s.writes)
    d_k_to_end = s.writes @ d_after_operand.mT
    d_last = (d_after * s.states).sum(-1)
    return d_q_decayed, d_a_qk, d_writes, d_k_to_end, d_last, d_initial


def _wy_backward(s: ChunkSaved, d_writes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Through ``Δ = U − W S``, ``[W | U] = M⁻¹ Diag(β) [exp(G)⊙K | V]``, ``M = I + Diag(β) A_kk``.

    With ``dW = −dΔ Sᵀ``, ``dU = dΔ`` and ``Y = M⁻ᵀ [dW | dU] = [−Y_U Sᵀ | Y_U]``, ``Y_U = M⁻ᵀ dΔ``:
    ``d[exp(G)⊙K | V] = Diag(β) Y``; ``dM = −Y [W | U]ᵀ = −Y_U Δᵀ`` (as ``Diag(β) [exp(G)⊙K | V]ᵀ M⁻ᵀ =
    [W | U]ᵀ``); ``dA_kk = Diag(β) dM``; ``dβ_i = Σ Y_i ⊙ [exp(G)⊙K | V]_i + Σ_j dM_ij (A_kk)_ij``.

    Returns (d(exp(G)⊙K) [.., C, K], dV [.., C, V], dβ [.., C], dA_kk [.., C, C]).
    """
    y_u = s.inverse.mT @ matmul_operand(d_writes)
    y_w = -(y_u @ matmul_operand(s.states).mT)
    minus_d_system = y_u @ s.writes.mT  # −dM
    d_beta = (y_w * s.k_decayed).sum(-1) + (y_u * s.v).sum(-1) - (minus_d_system * s.a_kk).sum(-1)
    beta = s.beta[..., None]
    return y_w * beta, y_u * beta, d_beta, minus_d_system * -beta


def block_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for [..., M, J] @ [..., J, N]; with J = 1, M = 1 or N = 1 (the finest level's 2 × 1 and 1 × 2
    blocks, where a batched matmul spends its time per tiny block) as a broadcast product in the inputs' dtype
    instead (the forward's scores and this backward's level gradients)."""
    if a.shape[-1] == 1:
        return a * b
    if a.shape[-2] == 1:
        return (a.unsqueeze(-1) * b.unsqueeze(-3)).sum(-2)
    if b.shape[-1] == 1:
        return (a * b.mT).sum(-1, keepdim=True)
    return a @ b


def _scores_backward(
    d_a_qk: torch.Tensor,
    d_a_kk: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    levels: list[LevelFactors],
    gather_back: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Through the intra-chunk scores: dA_qk, dA_kk [..., C, C] -> (dq, dk, dG) [..., C, K].

    ``gather_back`` maps the forward's concatenated level scores to positions in the flattened ``[2, C, C]``
    (only t ≥ j of A_qk and t > j of A_kk are read: the rest of dA never reaches an input), or to ``2·C·C``,
    a zero appended here, for the tile level's scores that no position reads (t ≤ j)."""
    *lead, C, K = q.shape
    d_flat = (x.reshape(-1, C * C) for x in (d_a_qk, d_a_kk))
    d_scores = torch.cat((*d_flat, q.new_zeros(math.prod(lead), 1)), dim=1)
    d_rows = q.new_zeros(*lead, 2, C, K)  # gradients of the score rows: q's, then k's
    d_cols = q.new_zeros(*lead, C, K)  # of the score columns (k of each token)
    start = 0
    for level in levels:
        nb, h = level.cols.shape[-3:-1]
        size = nb * level.rows.shape[-2] * h
        # gathered level by level: a contiguous block is a fast batched matmul operand, a slice is not
        d_block = d_scores.index_select(1, gather_back[start : start + size]).view(*lead, nb, -1, h)
        start += size
        if level.same is not None:
            d_block = (d_block.view(*lead, nb, h, 2, h) * level.same).view_as(d_block)
        d_block = matmul_operand(d_block) if h > 1 else d_block
        if level.whole_blocks(C):
            row_grads, col_grads = d_rows.view(*lead, 2, nb, h, K), d_cols.view(*lead, nb, h, K)
        else:
            row_grads = d_rows.view(*lead, 2, nb, 2, h, K)[..., 1, :, :]
            col_grads = d_cols.view(*lead, nb, 2, h, K)[..., 0, :, :]
        d_level_rows = block_product(d_block, level.cols).view(*lead, nb, h, 2, K).movedim(-2, -4)
        row_grads.addcmul_(d_level_rows, level.e_second.unsqueeze(-4))
        col_grads.addcmul_(block_product(d_block.mT, level.rows), level.e_first)
    d_diag = d_scores.index_select(1, gather_back[start:]).view(*lead, C, 1)
    d_q, d_k = d_rows.unbind(-3)
    d_g = torch.addcmul(q * d_q, k, d_k - d_cols)  # the diagonal q·k has no decay: no dG
    return d_q.addcmul_(d_diag, k), d_k.add_(d_cols).addcmul_(d_diag, q), d_g


def chunk_kda_backward(
    s: ChunkSaved,
    levels: list[LevelFactors],
    gather_back: torch.Tensor,
    d_o: torch.Tensor | None,
    d_final: torch.Tensor | None,
) -> tuple[torch.Tensor, ...]:
    """Gradients of the chunk form (equations in the module docstring).

    Shapes: d_o [B, HV, N, C, V] or None; d_final [B, HV, K, V] or None
    -> (dq, dk [B, HV, N, C, K], dv [B, HV, N, C, V], dg [B, HV, N, C, K], dβ [B, HV, N, C], d(initial state)
    [B, HV, K, V]), each in its input's dtype (fp32).
    """
    d_o = torch.zeros_like(s.v) if d_o is None else matmul_operand(d_o, s.v.dtype).contiguous()
    d_q_decayed, d_a_qk, d_writes, d_k_to_end, d_last, d_initial = _outputs_backward(s, d_o, d_final)
    d_k_decayed, d_v, d_beta, d_a_kk = _wy_backward(s, d_writes)
    d_q, d_k, d_gcum = _scores_backward(d_a_qk, d_a_kk, s.q, s.k, levels, gather_back)
    d_q.addcmul_(d_q_decayed, s.decay)
    d_k.addcmul_(d_k_decayed, s.decay).addcmul_(d_k_to_end, s.to_end)
    through_end = d_k_to_end * s.k_to_end
    d_gcum.addcmul_(d_q_decayed, s.q_decayed).addcmul_(d_k_decayed, s.k_decayed).sub_(through_end)
    d_gcum[..., -1, :] += through_end.sum(-2) + d_last * s.last
    d_g = d_gcum.flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g) within the chunk
    dtype = s.q.dtype
    return (d_q.to(dtype), d_k.to(dtype), d_v.to(dtype), d_g.to(dtype), d_beta.to(dtype), d_initial.to(dtype))
