"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel (diagonal) forget gate.

Per value head, with a state ``S`` of shape [K, V] and per-token ``q_t, k_t`` [K], ``v_t`` [V],
log-decay ``g_t`` [K] and ``β_t`` (a scalar)::

    S ← Diag(exp g_t) · S                       (decay the K rows of the state)
    S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ             (delta-rule write)
    o_t = Sᵀ (scale · q_t)                      (read)

Shapes (the convention of flash-linear-attention's ``fla/ops/kda``): ``q, k`` [B, T, H, K];
``v`` [B, T, HV, V]; ``g`` [B, T, HV, K]; ``beta`` [B, T, HV]; state [B, HV, K, V]. ``HV`` is a multiple of
``H`` and value head ``h`` reads query/key head ``h // (HV // H)``. ``scale`` defaults to ``K ** -0.5``.
``q`` and ``k`` are used as given (the layer L2-normalises them). Everything is computed in fp32; the
output is cast to ``v``'s dtype and the final state is fp32.

Three entry points:

* :func:`recurrent_kda` — the recurrence token by token (decode, and the reference);
  :func:`recurrent_kda_states` also returns the state after every token (speculative verify windows).
* :func:`chunk_kda` — the chunk-parallel WY / UT-transform form: within a chunk every token's
  contribution is solved at once with a unit-lower-triangular system; the state crosses chunk
  boundaries with one [K, K] @ [K, V] product per chunk. Any ``T`` (padded internally).
* :func:`kda` — dispatch: flash-linear-attention's kernels on CUDA when importable, ours otherwise;
  a single token with a state uses the recurrent form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from k2lab.ops.autocast import matmul_operand
from k2lab.ops.kda_backward import ChunkSaved, LevelFactors, block_product, chunk_kda_backward

# Decays below exp(-DECAY_FLOOR) ≈ 1e-13 are held there (see _decay).
DECAY_FLOOR = 30.0

# Tokens of a tile whose scores come from one reference log-decay (see _tile_factors), and the largest
# |G_t − R| a tile may hold for it. K3's gate keeps every log-decay above −5 (nn/kda_gate.py), so a 16-token
# tile with R after its 8th token holds |G_t − R| < 8 · 5 = 40; 44 leaves room for fp32 rounding of the
# cumulative sums. Factors exp(±44) ≈ 1.3e19 / 7.8e-20 stay far inside the range of fp32 and bf16.
TILE = 16
TILE_EXPONENT_LIMIT = 44.0

# Tokens per chunk of chunk_kda: a split level of 32 and the tile level. On CPU (AVX512-BF16 Zen 5, 2 threads,
# H = 4, K = V = 64) 32 ran 1.13–1.27× faster than 64 forward + backward at B = 8, T = 256 and forward at B = 4,
# T = 1,024, 1.04–1.12× at B = 1, T = 1,024 / 4,096 (alternating medians of 15); 16 was slower than 32 in
# every case. fla's kernels keep their own default, 64.
CHUNK_SIZE = 32
FLA_CHUNK_SIZE = 64

Backend = Literal["auto", "chunk", "recurrent", "fla"]


# ----------------------------------------------------------------------------------------------- helpers


def _check_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate the fla shape convention and return ``(B, T, H, K, HV, V)``."""
    if q.ndim != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of query/key heads H={H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K] = {[B, T, HV, K]}, got {list(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {[B, T, HV]}, got {list(beta.shape)}")
    if initial_state is not None and initial_state.shape != (B, HV, K, V):
        raise ValueError(
            f"initial_state must be [B, HV, K, V] = {[B, HV, K, V]}, got {list(initial_state.shape)}"
        )
    return B, T, H, K, HV, V


def _to_value_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """fp32 copies with q/k repeated to the ``HV`` value heads and q multiplied by ``scale``."""
    groups = v.shape[2] // q.shape[2]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    return q * scale, k, v, g, beta


def _initial_state(
    initial_state: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(shape)
    return initial_state.float()


# -------------------------------------------------------------------------------------------- recurrent


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA by the recurrence, one token at a time (for decode and as the reference).

    For each token: ``S ← Diag(exp g_t) S``; ``S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ``; ``o_t = Sᵀ (scale·q_t)``.

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V]. g: [B, T, HV, K] log-decay. beta: [B, T, HV].
        scale: defaults to ``K ** -0.5``.
        initial_state: [B, HV, K, V] or ``None`` (zeros).
        output_final_state: also return the state after the last token.

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] in ``v``'s dtype; final_state [B, HV, K, V] fp32 or ``None``.
    """
    o, states = _recurrence(q, k, v, g, beta, scale, initial_state, keep_states=False)
    return o, (states[-1] if output_final_state else None)


def recurrent_kda_states(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`recurrent_kda` that also returns the state after every token (for a short window).

    Speculative decoding verifies T drafted tokens in one forward and then keeps only the first n of them
    per sequence: the state to continue from is ``S_n``, which the chunked form never materialises.

    Returns ``(o [B, T, HV, V], states [B, T, HV, K, V] fp32)`` with ``states[:, t]`` = S after token t.
    """
    o, states = _recurrence(q, k, v, g, beta, scale, initial_state, keep_states=True)
    if not states:
        B, _, _, K = q.shape
        return o, v.new_zeros(B, 0, v.shape[2], K, v.shape[3], dtype=torch.float32)
    return o, torch.stack(states, dim=1)


def _recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    keep_states: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The token loop of :func:`recurrent_kda`: o [B, T, HV, V] and the states after each token (only the
    last one, or the initial state when T = 0, unless ``keep_states``)."""
    B, T, H, K, HV, V = _check_shapes(q, k, v, g, beta, initial_state)
    dtype = v.dtype
    q, k, v, g, beta = _to_value_heads(q, k, v, g, beta, K**-0.5 if scale is None else scale)
    state = _initial_state(initial_state, (B, HV, K, V), v)
    per_token = (
        q.unsqueeze(-2),  # [B, T, HV, 1, K]
        k.unsqueeze(-2),
        v.unsqueeze(-2),  # [B, T, HV, 1, V]
        g.exp().unsqueeze(-1),  # [B, T, HV, K, 1]
        (beta[..., None] * k).unsqueeze(-1),
    )
    # unbind rather than index by t: backward then has one node per input, not T full-size zero gradients
    steps = (x.unbind(1) for x in per_token)
    outputs, states = [], []
    for q_t, k_t, v_t, decay_t, write_t in zip(*steps, strict=True):
        state = state * decay_t  # S ← Diag(exp g_t) S
        state = state + write_t * (v_t - k_t @ state)  # S ← S + β_t k_t (v_t − Sᵀ k_t)ᵀ
        outputs.append(q_t @ state)  # o_t = Sᵀ q_t (q already scaled)
        if keep_states:
            states.append(state)
    o = torch.cat(outputs, dim=2).transpose(1, 2).contiguous() if outputs else v.new_zeros(B, 0, HV, V)
    return o.to(dtype), (states if keep_states else [state])


# ---------------------------------------------------------------------------------------------- chunked


def _chunked(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, T, HV, *rest] -> [B, HV, N, chunk, *rest], zero-padded at the end of T to N·chunk."""
    x = x.transpose(1, 2)
    pad = -x.shape[2] % chunk
    if pad:
        x = F.pad(x, (0, 0) * (x.ndim - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


def _levels(chunk: int, tiled: bool = False) -> list[int]:
    """Block sizes of the binary split of a chunk: chunk, chunk/2, ..., 2 (``tiled``: only those above
    ``TILE``, the tile level taking the rest)."""
    return [chunk >> i for i in range(chunk.bit_length() - 1) if not tiled or chunk >> i > TILE]


def _score_index(chunk: int, device: torch.device, tiled: bool) -> torch.Tensor:
    """:func:`_build_score_index`, cached (a plain function, so that torch.compile can take it as a constant:
    see :func:`mark_compile_constants`)."""
    return _build_score_index(chunk, device, tiled)


def mark_compile_constants() -> None:
    """Tell torch.compile that :func:`_score_index` is a constant, so a compiled step calls it once instead of
    tracing its C² index writes. The mark (set on the function in place) imports ``torch._dynamo``, 3–4 s, so
    ``k2lab.train.compile`` makes it before compiling rather than every import of this module."""
    torch.compiler.assume_constant_result(_score_index)
    torch.compiler.assume_constant_result(_score_gather_back)


def _score_gather_back(chunk: int, device: torch.device, tiled: bool) -> torch.Tensor:
    """:func:`_build_score_gather_back`, cached (a plain function for torch.compile, as :func:`_score_index`)."""
    return _build_score_gather_back(chunk, device, tiled)


@functools.lru_cache(maxsize=32)
@torch.inference_mode(False)
def _build_score_gather_back(chunk: int, device: torch.device, tiled: bool) -> torch.Tensor:
    """The inverse of :func:`_build_score_index`: for each level score and diagonal value (every entry of the
    concatenation but the final zero), its position in the flattened ``[2, C, C]`` (the backward's gather),
    or ``2·C·C`` (a zero the backward appends) for the tile level's scores that no position reads."""
    index = _build_score_index(chunk, device, tiled)
    inverse = torch.full((int(index.max()) + 1,), 2 * chunk * chunk, dtype=torch.long, device=device)
    inverse[index] = torch.arange(index.numel(), device=device)  # several positions share only the zero
    return inverse[:-1]


@functools.lru_cache(maxsize=32)
@torch.inference_mode(False)  # cached across calls: must not be an inference tensor, which autograd refuses
def _build_score_index(chunk: int, device: torch.device, tiled: bool) -> torch.Tensor:
    """Gather map from the concatenated level scores of :func:`_intra_chunk_scores` to ``[2, C, C]``.

    Level ``b`` stores, for each of its ``C/b`` blocks, rows ``t`` of the second half (q then k per row)
    against columns ``j`` of the first half: ``C·b/2`` values. ``tiled``: levels of ``TILE`` tokens and less
    are replaced by the tile level, every row of a tile (q then k) against every column: ``2·C·TILE`` values.
    Then ``C`` diagonal q·k values and one zero, which every entry above the diagonal (and the diagonal of
    A_kk) points to.
    """
    levels = _levels(chunk, tiled)
    sizes = [chunk * b // 2 for b in levels]
    offset = {b: sum(sizes[:i]) for i, b in enumerate(levels)}
    tile_offset = sum(sizes)
    diag = tile_offset + (2 * chunk * TILE if tiled else 0)
    index = torch.full((2, chunk, chunk), diag + chunk, dtype=torch.long)
    for t in range(chunk):
        index[0, t, t] = diag + t
        for j in range(t):
            b = 2 << ((t ^ j).bit_length() - 1)  # the smallest block holding both: t, j in different halves
            if tiled and b <= TILE:  # q_t·k_j at row 2·(t mod TILE) of its tile; k_t·k_j the next row
                entry = tile_offset + (t // TILE) * 2 * TILE * TILE + (t % TILE) * 2 * TILE + j % TILE
                index[0, t, j], index[1, t, j] = entry, entry + TILE
                continue
            h = b // 2
            entry = offset[b] + (t // b) * 2 * h * h + (t % b - h) * 2 * h + j % b  # q_t·k_j; k_t·k_j is h on
            index[0, t, j], index[1, t, j] = entry, entry + h
    return index.flatten().to(device)


def _decay(exponent: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """``exp(exponent)`` for exponents ≤ 0, the decay held at ``exp(-DECAY_FLOOR)`` from below.

    Below the floor a decay is numerically nothing next to fp32 rounding of O(1) outputs, and keeping every
    factor (and the product of two of them) a normal float avoids denormal arithmetic, which is tens of times
    slower on CPUs. ``scratch=True`` lets it overwrite ``exponent`` when no gradient is recorded.
    """
    if _may_overwrite(exponent, scratch):
        return exponent.clamp_(min=-DECAY_FLOOR).exp_()
    return exponent.clamp(min=-DECAY_FLOOR).exp()


def _may_overwrite(x: torch.Tensor, scratch: bool) -> bool:
    return scratch and not (torch.is_grad_enabled() and x.requires_grad)


def _tile_factors(g: torch.Tensor, gcum: torch.Tensor) -> LevelFactors | None:
    """Exponential factors of the tile level, or ``None`` where a tile's log-decays span too much for them.

    Inside each ``TILE``-token tile, ``exp(G_t − G_j) = exp(G_t − R) · exp(R − G_j)`` with one reference ``R``
    (after the tile's ``TILE/2``-th token) for every pair: one exponential and its reciprocal instead of two
    exponentials per level for the four finest levels of the binary split. It needs
    ``|G_t − R| ≤ TILE_EXPONENT_LIMIT`` (K3's bounded gate guarantees it, Kimi Linear's unbounded one may
    not), checked here. A packed document's reset token (a
    log-decay ≤ −DECAY_FLOOR in every channel, as ``nn.kda`` writes it) is taken out of the cumulative sums
    and the pairs it separates are masked: their true decay is below exp(−DECAY_FLOOR) ≈ 1e-13, which the
    split levels hold there and this level rounds to zero.

    Shapes: g, gcum [..., C, K] -> ``LevelFactors(e_first = exp(R − G_j), e_second = exp(G_t − R)``
    [..., C / TILE, TILE, K], ``rows``, ``cols`` left empty, ``same`` [..., C / TILE, TILE, 1, TILE] or None).
    """
    *lead, C, K = gcum.shape
    if C < TILE or torch.compiler.is_compiling():  # the checks below are data-dependent: no graph of them
        return None
    exponent, same = _tile_exponents(gcum), None
    if not _fits_tile(exponent):  # a reset at a tile's first token fits: its decay is between tiles
        resets = g.amax(-1) <= -DECAY_FLOOR  # [..., C]
        if not bool(resets.any()):
            return None
        exponent = _tile_exponents(gcum - (g * resets.unsqueeze(-1)).cumsum(-2))
        if not _fits_tile(exponent):
            return None
        segment = resets.cumsum(-1).view(*lead, C // TILE, TILE)
        same = (segment.unsqueeze(-1) == segment.unsqueeze(-2)).unsqueeze(-2).to(gcum.dtype)
    e_second = exponent.exp_() if _may_overwrite(exponent, True) else exponent.exp()
    empty = gcum.new_empty(0)
    return LevelFactors(e_second.reciprocal(), e_second, empty, empty, same)


def _tile_exponents(gcum: torch.Tensor) -> torch.Tensor:
    """[..., C, K] -> ``G_t − R`` [..., C / TILE, TILE, K], R the log-decay after each tile's TILE/2-th token."""
    tiles = gcum.view(*gcum.shape[:-2], -1, TILE, gcum.shape[-1])
    return tiles - tiles[..., TILE // 2 - 1 : TILE // 2, :]


def _fits_tile(exponent: torch.Tensor) -> bool:
    low, high = torch.aminmax(exponent)
    return max(-low.item(), high.item()) <= TILE_EXPONENT_LIMIT


def _intra_chunk_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    gcum: torch.Tensor,
    keep: list[LevelFactors] | None = None,
    tile: LevelFactors | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted scores inside each chunk.

    ``A_qk[t, j] = Σ_d q_td k_jd exp(G_td − G_jd)`` for t ≥ j and ``A_kk[t, j]`` likewise with ``k_t`` for
    t > j (zero elsewhere), where ``G`` is the within-chunk cumulative log-decay. The chunk is split in halves
    recursively; a row t in the second half of a block meets a column j in its first half through the
    cumulative decay ``R`` at the end of the first half: ``exp(G_t − G_j) = exp(G_t − R)·exp(R − G_j)``, two
    factors ≤ 1 (for g ≤ 0), so strong decays never overflow and every block pair is one batched matmul.

    With ``tile`` (:func:`_tile_factors`), blocks of ``TILE`` tokens and less are one level instead: every
    pair inside a tile through the tile's reference.

    Shapes: q, k, gcum [..., C, K] (C a power of two) -> (A_qk, A_kk) [..., C, C]. ``keep`` (a list) receives
    each level's :class:`LevelFactors` for the hand-written backward.
    """
    *lead, C, K = q.shape
    qk = torch.stack((q, k), dim=-2)  # [..., C, 2, K]: a block's rows are q and k of each token
    parts = []
    for b in _levels(C, tiled=tile is not None):
        h, nb = b // 2, C // b
        g_first, g_second = gcum.view(*lead, nb, 2, h, K).unbind(-3)
        qk_first, qk_second = qk.view(*lead, nb, 2, h, 2, K).unbind(-4)
        ref = g_first[..., h - 1 : h, :]  # [..., nb, 1, K]
        e_second = _decay(g_second - ref, scratch=True)  # exp(G_t − R) [..., nb, h, K]
        e_first = _decay(ref - g_first, scratch=True)  # exp(R − G_j)
        rows = (qk_second * e_second.unsqueeze(-2)).view(*lead, nb, 2 * h, K)
        cols = e_first * qk_first[..., 1, :]  # [..., nb, h, K]
        parts.append(block_product(rows, cols.transpose(-1, -2)).flatten(-3))  # [..., nb, 2h, h]
        if keep is not None:
            keep.append(LevelFactors(e_first, e_second, rows, cols))
    if tile is not None:
        nt = C // TILE
        rows = (qk.view(*lead, nt, TILE, 2, K) * tile.e_second.unsqueeze(-2)).view(*lead, nt, 2 * TILE, K)
        cols = tile.e_first * k.view(*lead, nt, TILE, K)
        block = block_product(rows, cols.transpose(-1, -2))  # [..., nt, 2·TILE, TILE]
        if tile.same is not None:
            block = (block.view(*lead, nt, TILE, 2, TILE) * tile.same).view_as(block)
        parts.append(block.flatten(-3))
        if keep is not None:
            keep.append(tile._replace(rows=rows, cols=cols))
    parts.append((q * k).sum(-1))
    parts.append(q.new_zeros(()).expand(*lead, 1))
    flat = torch.cat(parts, dim=-1)
    scores = flat.view(-1, flat.shape[-1]).index_select(1, _score_index(C, q.device, tile is not None))
    a_qk, a_kk = scores.view(*lead, 2, C, C).unbind(-3)
    return a_qk, a_kk


def _batched(x: torch.Tensor) -> torch.Tensor:
    """[..., M, N] -> [batch, M, N] (a view) for ``torch.baddbmm``."""
    return x.flatten(0, -3)


def _wy_transform(
    a_kk: torch.Tensor, k_decayed: torch.Tensor, v: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Solve the intra-chunk delta rule: ``W = T (exp(G)⊙K)``, ``U = T V``, ``T = (I + Diag(β) A_kk)⁻¹ Diag(β)``.

    The chunk's effective writes are then ``U − W S₀`` for the state ``S₀`` entering the chunk.
    Shapes: a_kk [..., C, C]; k_decayed [..., C, K]; v [..., C, V]; beta [..., C]
    -> w [..., C, K], u [..., C, V] and the inverse ``(I + Diag(β) A_kk)⁻¹`` [..., C, C].
    """
    eye = torch.eye(a_kk.shape[-1], dtype=a_kk.dtype, device=a_kk.device)
    system = torch.addcmul(eye, beta[..., None], a_kk)
    inverse = torch.linalg.solve_triangular(system, eye.expand_as(system), upper=False, unitriangular=True)
    transform = matmul_operand(inverse * beta[..., None, :])  # cast once for its two products
    return transform @ k_decayed, transform @ v, inverse


def _chunk_transitions(
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, gcum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each chunk's state map ``S ↦ P S + R``: ``P = Diag(exp G_last) − K̃ᵀ W`` [K, K], ``R = K̃ᵀ U`` [K, V],
    ``K̃ = exp(G_last − G) ⊙ K``.

    Shapes: w, k, gcum [B, HV, N, C, K]; u [B, HV, N, C, V] -> (P, R, K̃ [.., C, K], exp(G_last − G)
    [.., C, K], exp(G_last) [.., K]).
    """
    last = gcum[..., -1:, :]
    to_end = _decay(last - gcum, scratch=True)
    k_to_end = to_end * k
    keep = _decay(last.squeeze(-2))
    k_to_end_t = matmul_operand(k_to_end.transpose(-1, -2))  # [B, HV, N, K, C]; cast once for two products
    transition = torch.baddbmm(
        _batched(torch.diag_embed(keep)), _batched(k_to_end_t), _batched(w), alpha=-1
    ).view(*keep.shape, keep.shape[-1])
    return transition, k_to_end_t @ u, k_to_end, to_end, keep


def _propagate_states(
    transition: torch.Tensor, write: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering every chunk, serially over chunks: ``S_{n+1} = P_n S_n + R_n``.

    Shapes: transition [B, HV, N, K, K]; write [B, HV, N, K, V]; state [B, HV, K, V]
    -> (states [B, HV, N, K, V] at the start of each chunk, final state [B, HV, K, V]).
    """
    states = []
    for step, source in zip(transition.unbind(2), write.unbind(2), strict=True):  # unbind: one backward node
        states.append(state)
        state = torch.baddbmm(_batched(source), _batched(step), _batched(state)).view_as(state)
    return torch.stack(states, dim=2), state


def _chunk_outputs(
    q_decayed: torch.Tensor, a_qk: torch.Tensor, w: torch.Tensor, u: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``O = (exp(G)⊙Q) S₀ + A_qk (U − W S₀)`` per chunk: (O [B, HV, N, C, V], the writes ``U − W S₀``)."""
    states = matmul_operand(states)  # cast once for its two products
    writes = torch.baddbmm(_batched(u), _batched(w), _batched(states), alpha=-1)
    o = torch.baddbmm(_batched(q_decayed) @ _batched(states), _batched(a_qk), writes)
    return o.view_as(u), writes.view_as(u)


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep: list[LevelFactors] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, ChunkSaved | None]:
    """The chunk form on chunked fp32 inputs (q scaled, value heads): q, k, g [B, HV, N, C, K],
    v [B, HV, N, C, V], beta [B, HV, N, C], state [B, HV, K, V] -> (o [B, HV, N, C, V], final state, and
    with ``keep`` (a list for the level factors) the tensors :func:`chunk_kda_backward` reads)."""
    gcum = g.cumsum(dim=-2)
    a_qk, a_kk = _intra_chunk_scores(q, k, gcum, keep, _tile_factors(g, gcum))
    decay = _decay(gcum)
    q_decayed, k_decayed = q * decay, k * decay
    w, u, inverse = _wy_transform(a_kk, k_decayed, v, beta)
    w_operand = matmul_operand(w)  # cast once for its two products
    transition, write, k_to_end, to_end, last = _chunk_transitions(w_operand, u, k, gcum)
    states, final = _propagate_states(transition, write, state)
    o, writes = _chunk_outputs(q_decayed, a_qk, w_operand, u, states)
    if keep is None:
        return o, final, None
    saved = ChunkSaved(
        q, k, v, beta, decay, q_decayed, k_decayed, a_kk, inverse, w, writes, a_qk,
        states, transition, k_to_end, to_end, last,
    )  # fmt: skip
    return o, final, saved


class _ChunkKDA(torch.autograd.Function):
    """:func:`_chunk_forward` with :func:`chunk_kda_backward` as its backward (instead of autograd through
    the chunk form's many small ops). Runs its backward under the autocast state of its forward."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, chunk):  # noqa: ANN001, ANN205 - autograd.Function protocol
        ctx.set_materialize_grads(False)
        device = q.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.has_state = state is not None
        initial = state if state is not None else v.new_zeros(*v.shape[:2], k.shape[-1], v.shape[-1])
        levels: list[LevelFactors] = []
        o, final, saved = _chunk_forward(q, k, v, g, beta, initial, levels)
        ctx.n_levels = len(levels)
        ctx.save_for_backward(*saved, *(t for level in levels for t in level))
        tiled = any(level.whole_blocks(chunk) for level in levels)
        ctx.gather_back = _score_gather_back(chunk, q.device, tiled)
        return o, final

    @staticmethod
    @once_differentiable  # a second derivative through it would be silently wrong: an error instead
    def backward(ctx, d_o, d_final):  # noqa: ANN001, ANN205 - autograd.Function protocol
        tensors = ctx.saved_tensors
        saved = ChunkSaved(*tensors[: len(ChunkSaved._fields)])
        flat = tensors[len(ChunkSaved._fields) :]
        n = len(LevelFactors._fields)
        levels = [LevelFactors(*flat[n * i : n * i + n]) for i in range(ctx.n_levels)]
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            dq, dk, dv, dg, dbeta, d_state = chunk_kda_backward(saved, levels, ctx.gather_back, d_o, d_final)
        return dq, dk, dv, dg, dbeta, (d_state if ctx.has_state else None), None


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK_SIZE,
    backward: Literal["manual", "autograd"] = "manual",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA in chunk-parallel (WY / UT-transform) form; same results as :func:`recurrent_kda`.

    Within a chunk with cumulative log-decay ``G_t = Σ_{s≤t} g_s`` and entering state ``S₀``:

        (I + Diag(β) A_kk) [W | U] = Diag(β) [exp(G)⊙K | V]          (unit lower-triangular solve)
        O = (exp(G)⊙Q) S₀ + A_qk (U − W S₀)
        S_C = Diag(exp G_C) S₀ + (exp(G_C − G)⊙K)ᵀ (U − W S₀)

    with ``A_kk[t, j] = Σ_d k_td k_jd exp(G_td − G_jd)`` (t > j) and ``A_qk`` likewise with ``scale·q_t``
    (t ≥ j). All chunks are formed at once; only the state update runs serially over chunks.

    Numerics: every exponential is of a log-decay summed over the span between two tokens (≤ 0 for g ≤ 0),
    so strong decays underflow rather than overflow; decays below ``exp(-DECAY_FLOOR)`` ≈ 1e-13 are held
    there. Spans are differences of fp32 cumulative sums within a chunk, so a decay carries a relative error
    of about 1e-7·|Σ_chunk g| (as in fla's chunk kernels); a smaller ``chunk_size`` tightens it. Pairs inside
    a ``TILE``-token tile go through one reference decay per tile where the tile's log-decays allow it (K3's
    bounded gate always does): factors up to exp(±TILE_EXPONENT_LIMIT), their products ≤ 1 as before.

    Args:
        q, k: [B, T, H, K]. v: [B, T, HV, V]. g: [B, T, HV, K] log-decay. beta: [B, T, HV].
        scale: defaults to ``K ** -0.5``.
        initial_state: [B, HV, K, V] or ``None`` (zeros).
        output_final_state: also return the state after the last token.
        chunk_size: tokens per chunk (any T works; the tail chunk is padded with no-op tokens).
        backward: ``"manual"`` — the hand-written chunk-parallel backward of :mod:`k2lab.ops.kda_backward`
            (one autograd node); ``"autograd"`` — autograd through the forward's ops (the reference tier).

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] in ``v``'s dtype; final_state [B, HV, K, V] fp32 or ``None``.
    """
    B, T, H, K, HV, V = _check_shapes(q, k, v, g, beta, initial_state)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if backward not in ("manual", "autograd"):
        raise ValueError(f"backward must be 'manual' or 'autograd', got {backward!r}")
    if T == 0:
        return recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)
    dtype = v.dtype
    chunk = min(chunk_size, 1 << (T - 1).bit_length())  # a short sequence gets a short chunk
    q, k, v, g, beta = _to_value_heads(q, k, v, g, beta, K**-0.5 if scale is None else scale)
    q, k, v, g, beta = (_chunked(x, chunk) for x in (q, k, v, g, beta))
    v = v.contiguous()  # a right-hand side of batched matmuls: copied once here rather than by each of them
    state = None if initial_state is None else initial_state.float()
    if backward == "manual" and _needs_grad(q, k, v, g, beta, state):
        o, final = _ChunkKDA.apply(q, k, v, g, beta, state, chunk)
    else:
        o, final, _ = _chunk_forward(q, k, v, g, beta, _initial_state(state, (B, HV, K, V), v))
    o = o.view(B, HV, -1, V)[:, :, :T].transpose(1, 2).contiguous()
    return o.to(dtype), (final if output_final_state else None)


# --------------------------------------------------------------------------------------------- dispatch


@functools.cache
def _fla_kernels() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """flash-linear-attention's ``(chunk_kda, fused_recurrent_kda)`` kernels, or ``None`` where they don't import.

    Importing ``fla.ops.kda`` needs triton and a GPU runtime; anything it raises means "not available".
    """
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda  # lazy: optional dependency fla
        from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda  # lazy: optional fla
    except Exception:  # noqa: BLE001 - ImportError, or triton/driver errors raised while importing
        return None
    return fla_chunk_kda, fla_fused_recurrent_kda


def _fla_usable(q: torch.Tensor) -> bool:
    """fla's kernels run on CUDA tensors with key width ≤ 256, when they import."""
    return q.is_cuda and q.shape[-1] <= 256 and _fla_kernels() is not None


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fla_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's kernels with our conventions: q, k used as given (no in-kernel L2 norm), g already the
    log-decay, beta already a probability, fp32 state, output in ``v``'s dtype. The fused recurrent kernel
    has no backward, so it serves only single-token steps that need no gradient."""
    chunk, fused_recurrent = _fla_kernels()
    state = None if initial_state is None else initial_state.float()
    kwargs = dict(scale=scale, initial_state=state, output_final_state=output_final_state)
    if q.shape[1] == 1 and not _needs_grad(q, k, v, g, beta, initial_state):
        o, final = fused_recurrent(q=q, k=k, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=False, **kwargs)
    else:
        o, final = chunk(
            q=q,
            k=k,
            v=v,
            g=g,
            beta=beta,
            use_qk_l2norm_in_kernel=False,
            use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False,
            chunk_size=chunk_size if chunk_size in (32, 64) else FLA_CHUNK_SIZE,
            **kwargs,
        )
    return o.to(v.dtype), (final if output_final_state else None)


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA with the best available implementation; arguments and results as :func:`chunk_kda`
    (``chunk_size`` None: ``CHUNK_SIZE`` for ours, ``FLA_CHUNK_SIZE`` for fla's).

    ``backend="auto"``: flash-linear-attention's kernels for CUDA tensors when ``fla.ops.kda`` imports
    (``fused_recurrent_kda`` for a single token without gradients, ``chunk_kda`` otherwise); elsewhere
    :func:`recurrent_kda` for a single token (decode) and :func:`chunk_kda` for longer inputs.
    ``"chunk"``, ``"recurrent"`` and ``"fla"`` force one; ``"fla"`` raises where fla's kernels are unusable.
    """
    if backend == "auto":
        backend = "fla" if _fla_usable(q) else ("recurrent" if q.shape[1] == 1 else "chunk")
    args = (q, k, v, g, beta, scale, initial_state, output_final_state)
    if backend == "fla":
        if not _fla_usable(q):
            raise RuntimeError("backend='fla' needs CUDA tensors, K <= 256 and an importable fla.ops.kda")
        _check_shapes(q, k, v, g, beta, initial_state)
        return _fla_kda(*args, chunk_size or FLA_CHUNK_SIZE)
    if backend == "recurrent":
        return recurrent_kda(*args)
    if backend == "chunk":
        return chunk_kda(*args, chunk_size=chunk_size or CHUNK_SIZE)
    raise ValueError(f"backend must be one of auto, chunk, recurrent, fla; got {backend!r}")
