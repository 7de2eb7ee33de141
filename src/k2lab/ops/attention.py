"""Causal softmax attention for training on CPU: torch's fused flash forward, a blocked hand-written backward.

For one head with queries q_i, keys k_j, values v_j (j allowed for i: causal, or a causal mask) and scale s:

    P_ij = exp(s·q_i·k_j − lse_i),   O_i = Σ_j P_ij v_j                          (forward; lse_i from it)
    Δ_i = dO_i · O_i,   dS_ij = P_ij (dO_i · v_j − Δ_i)
    dQ_i = s Σ_j dS_ij k_j,   dK_j = s Σ_i dS_ij q_i,   dV_j = Σ_i P_ij dO_i               (backward)

The forward is ``aten::_scaled_dot_product_flash_attention_for_cpu`` (what ``F.scaled_dot_product_attention``
runs on CPU), which also returns lse. Its backward kernel takes ≈ 2.5× the forward at k2-mini's shapes
(queries of 64 against 256 keys, head width 48); the backward here recomputes P a block of ``BLOCK`` queries
at a time, each block against only the keys it may see (a causal mask: keys up to the block's last query),
with batched products:

* P by one fp32 product ``[s·q_i ; −lse_i] · [k_j ; 1]``: the exponent s·q·k − lse comes out of one
  accumulation at fp32 precision, as inside the flash kernel. (A bf16 product would round the exponent to
  8 bits, |s·q·k − lse|·2⁻⁹: twice the kernel's error in dQ and dK, measured.)
* dP − Δ by one product in the operands' dtype ``[dO_i ; −Δ_i] · [v_j ; 1]`` (Δ split into a high and a
  low part in that dtype), so the subtraction happens in the product's fp32 accumulation, not after its
  rounding.
* Exponents are floored at −``EXP_FLOOR`` before ``exp`` (below e⁻⁸⁷ fp32 turns denormal, and ``exp`` into
  denormals runs ≈ 15× slower on these CPUs); a P that small is nothing next to O(1) rows.

Shapes: query, key [B, H, T, Dq]; value [B, H, T, Dv] (Dv ≤ Dq, zero-padded to Dq for the forward kernel,
which wants equal widths); ``allowed`` [B, 1, T, T] bool or None (causal) -> [B, H, T, Dv].

Everything else (CUDA, no gradient, torch.compile, queries that do not line up with the keys, a mask that
is not causal) goes to ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from k2lab.ops.autocast import matmul_dtype, matmul_operand

BLOCK = 64  # queries per block of the backward
MAX_BLOCKED_KEYS = 512  # longer sequences keep the flash kernel's backward (see takes_blocked_backward)
EXP_FLOOR = 80.0  # exponents below −EXP_FLOOR are held there: e⁻⁸⁰ ≈ 1.8e-35, still a normal fp32


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """softmax(scale·Q Kᵀ, masked) V per head (shapes in the module docstring): :func:`blocked_attention` where
    it pays (:func:`takes_blocked_backward`), ``F.scaled_dot_product_attention`` otherwise."""
    if takes_blocked_backward(query, key, value, allowed):
        return blocked_attention(query, key, value, allowed, scale)
    width = value.shape[-1]
    if query.device.type == "cpu":
        value = _padded_to_query_width(value, query)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, is_causal=allowed is None, scale=scale
    )
    return out[..., :width]


def _padded_to_query_width(value: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """value [..., Dv] zero-padded to [..., Dq]: the CPU flash kernel needs equal q/k/v widths (otherwise SDPA
    takes its unfused math path); zero value columns add zero output columns."""
    width = query.shape[-1]
    return F.pad(value, (0, width - value.shape[-1])) if value.shape[-1] < width else value


def blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """The flash forward with :func:`attention_backward` as its backward (CPU, T queries against the same T
    keys, a causal ``allowed`` or None). Operands go to autocast's dtype where it is on, else to their common
    dtype."""
    common = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    query, key, value = (matmul_operand(x, common) for x in (query, key, value))
    return _Attention.apply(query, key, value, allowed, scale)


def takes_blocked_backward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None
) -> bool:
    """Whether :func:`attention` takes :func:`blocked_attention`: a CPU forward that records gradients
    (eager), in bf16 or fp16 (autocast's or the operands'), T = T_keys ≤ ``MAX_BLOCKED_KEYS``, V no wider than
    Q, and a causal mask. Measured on an AVX512-BF16 Zen 5 (2 threads, H = 4, widths 48 / 32): in bf16 the
    whole attention 1.3× faster at T = 256 and 512, 2.1× at 128, even at 1,024 (0.96–1.0×: there the flash
    kernel takes 256-query blocks); in fp32 0.97–1.18×, so fp32 keeps the kernel's backward."""
    tensors = (query, key, value)
    return (
        query.device.type == "cpu"
        and matmul_dtype(query) in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and any(x.requires_grad for x in tensors)
        and not torch.compiler.is_compiling()
        and query.shape[-2] == key.shape[-2] <= MAX_BLOCKED_KEYS
        and value.shape[-1] <= query.shape[-1]
        and (allowed is None or not bool(allowed.triu(1).any()))
    )


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, allowed, scale):  # noqa: ANN001, ANN205 - autograd.Function protocol
        width = value.shape[-1]
        padded = _padded_to_query_width(value, query)
        bias = None
        if allowed is not None:  # the kernel takes an additive mask in the queries' dtype
            bias = torch.zeros(allowed.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(~allowed, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, padded, 0.0, allowed is None, attn_mask=bias, scale=scale
        )
        out = out[..., :width]
        ctx.save_for_backward(query, key, value, out, lse, allowed)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable  # a second derivative through it would be silently wrong: an error instead
    def backward(ctx, d_out):  # noqa: ANN001, ANN205 - autograd.Function protocol
        query, key, value, out, lse, allowed = ctx.saved_tensors
        with torch.autocast(query.device.type, enabled=False):  # the dtypes below are chosen, not autocast's
            dq, dk, dv = attention_backward(query, key, value, out, lse, allowed, d_out, ctx.scale)
        return dq, dk, dv, None, None


def _high_low(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32 or wider) as hi + lo in ``dtype`` (lo = the rounding error of hi, itself rounded), each
    [..., 1]; lo is zero where ``dtype`` holds x."""
    high = x.to(dtype)
    return high.unsqueeze(-1), (x - high.to(x.dtype)).to(dtype).unsqueeze(-1)


def attention_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    allowed: torch.Tensor | None,
    d_out: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of the module docstring's equations, a block of ``BLOCK`` queries at a time.

    query, key [B, H, T, Dq]; value, out, d_out [B, H, T, Dv]; lse [B, H, T] fp32 (−inf for a query that may
    see no key: its P row is masked to zero); allowed [B, 1, T, T] bool (causal) or None (causal).
    """
    dtype, T = query.dtype, query.shape[-2]
    wide = torch.promote_types(dtype, torch.float32)  # P's product and the accumulators
    d_out = d_out.to(dtype)
    delta = (d_out.to(wide) * out.to(wide)).sum(-1)  # Δ_i = dO_i · O_i  [B, H, T]
    ones = query.new_ones(*query.shape[:-1], 1)
    shift = torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1).to(wide)
    queries = torch.cat((query.to(wide) * scale, -shift), dim=-1)  # [s·q_i ; −lse_i]
    keys = torch.cat((key.to(wide), ones.to(wide)), dim=-1)  # [k_j ; 1]
    grads = torch.cat((d_out, *_high_low(-delta, dtype)), dim=-1)  # [dO_i ; −Δ_i]
    values = torch.cat((value, ones, ones), dim=-1)  # [v_j ; 1 ; 1]
    blocked = None if allowed is None else ~allowed
    dq = torch.empty_like(query)
    dk = torch.zeros(key.shape, dtype=wide, device=key.device)
    dv = torch.zeros(value.shape, dtype=wide, device=value.device)
    for start in range(0, T, BLOCK):
        stop = min(start + BLOCK, T)
        rows = slice(start, stop)
        probs = (
            (queries[..., rows, :] @ keys[..., :stop, :].mT).clamp_(min=-EXP_FLOOR).exp_()
        )  # [B, H, b, stop]
        if blocked is None:
            probs[..., start:].masked_fill_(_upper(stop - start, query.device), 0.0)
        else:
            probs.masked_fill_(blocked[..., rows, :stop], 0.0)
        dv[..., :stop, :] += probs.to(dtype).mT @ d_out[..., rows, :]
        d_scores = probs.mul_(grads[..., rows, :] @ values[..., :stop, :].mT).mul_(scale).to(dtype)  # s·dS
        torch.matmul(d_scores, key[..., :stop, :], out=dq[..., rows, :])
        dk[..., :stop, :] += d_scores.mT @ query[..., rows, :]
    return dq, dk.to(dtype), dv.to(dtype)


def _upper(size: int, device: torch.device) -> torch.Tensor:
    """[size, size] bool, True above the diagonal (the keys after each query of a diagonal block)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).triu_(1)
