"""A linear layer over the few rows of a decode step, in the operand order CPU BLAS runs fastest.

    y = x Wᵀ        x [..., D] (N rows in all), W [O, D] -> y [..., O]

``F.linear`` hands MKL ``x @ Wᵀ``: with N = 1 a transposed GEMV, every output a D-long dot product ending in a
horizontal reduction, and with a few rows a GEMM whose small dimension is the wrong one. ``decode_linear``
computes the same products as ``(W @ xᵀ)ᵀ``, a GEMM with W [O, D] row-major as the left operand (one padding
row of zeros when N = 1, since MKL's GEMV for a single column takes the same slow path). Measured on the
shared Zen 4 VM (MKL 2024.2), 1 thread, CPU time, weights not in cache, medians:

    W [8192, 256] (the k2-mini LM head)   N = 1: 1.49 -> 0.71 ms    N = 4: 2.48 -> 1.02 ms
    W [768, 256]                          N = 1: 105 -> 60 µs       N = 4: 140 -> 80 µs
    W [256, 256]                          N = 1: 37 -> 30 µs        N = 4: 54 -> 28 µs
    W [128, 256]                          N = 1: 24 -> 21 µs        N = 4: 34 -> 24 µs
    W [256, 768] (a down projection)      N = 1: 97 -> 112 µs       N = 4: 127 -> 140 µs (slower)

so the swap applies where O ≥ D only, and for a single row only to weights of at least ``MIN_SINGLE_ROW``
elements: the padding and the copy back cost a few dispatches (µs each in eager mode) that a 256 × 256
product does not win back (eager generation at batch 1 measured 7 % slower with it). The same dot products
in another summation order: equal to ``F.linear`` within fp32 rounding (tests). It is a decode tier: CPU,
fp32 rows, no gradient, at most ``MAX_ROWS`` rows; anything else is the plain ``F.linear``. The weights are
fp32, or the bf16 copies of the compiled step's twin (``k2lab.infer.decode_weights``), which the reductions
widen to fp32 as they load them (the other products get a widened copy).

Under ``torch.compile`` a step of at most ``COMPILED_MAX_ROWS`` rows takes the **reduction tier**: y_no = Σ_d
W_od x_nd written as ``(W[None] * x[:, None]).sum(-1)``, which inductor turns into one vectorised reduction
over D that streams W, in parallel over the outputs, fused with its neighbours. MKL's GEMV and few-row GEMM on
weights that are not in cache stream them at ~6–8 GB/s on the 2-core Zen 4 VM, where a plain reduction reads
28 GB/s on one thread and 60+ on two (the k2-mini LM head, 8.4 MB, cold, 2 threads, one row: ``F.linear`` 1.03
ms, the compiled reduction 0.31 ms); a decode step reads 25–45 MB of weights, so it is bound by how they are
streamed. Compiled k2-mini decoding, in one process against the same step with ``F.linear`` for 2–6 rows:
batch 4 +20 % and +22 %, batch 2 +27 % (docs/generation.md). The reduction is written [N, O], each output row
a pass over W, except for weights above ``LARGE_WEIGHT_BYTES`` (the 8,192-wide head): those fall out of L2
between the row passes, so they are summed [O, N], each weight row read once for all N rows (the head alone, 4
rows, cold: 1.36 → 0.58 ms; batch-4 k2-mini steps 1.09× faster, median of 24 alternating runs; for the smaller
weights this order made the step slower, 0.71×). The swapped GEMM inside the graph gained only 9 %, and torch
2.13's CPU inductor miscompiled it at its default realize threshold (a transposed product inlined into the
next RMSNorm read wrong values at batch 2; tests/infer/test_compiled.py caught it). The rows are a buffer of
the graph before the product (``stored``): inlined into it, a producer such as an RMSNorm's scale could make
inductor store the whole [N, O, D] product instead of streaming it into the sum
(``k2lab.infer.compiled.REALIZE_OPCOUNT``). Past ``MAX_ROWS`` (a batch of chats, a speculative verify window)
the reduction still beats a GEMM over the twin's weights, widened to fp32 per call: ``COMPILED_MAX_ROWS``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Above this many rows MKL's GEMM no longer gains from the swap (N = 8 measured equal).
MAX_ROWS = 6
# Under torch.compile the reduction tier takes up to this many rows. Past MAX_ROWS it still beats MKL's
# few-row GEMM, which the bf16 twin's weights reach only as a whole widened fp32 copy per call. Measured on a
# Zen 5 (2 threads, compiled, alternating medians of 41) against F.linear of the widened bf16 weight:
#   the 8,192 × 256 head  N = 8: 0.28 against 1.23 ms; N = 20: 0.65 / 0.93; N = 32: 1.00 / 1.31; 64: 2.1 / 2.3
#   a 256 × 256 weight     N = 8: 24 against 37 µs;     N = 20: 58 / 66;     N = 32: 60 / 57
# so 32, where the two meet (F.linear over fp32 weights: 1.22 ms and 52 µs at N = 32).
COMPILED_MAX_ROWS = 32
# One row: only weights this large (768 × 256 gains 45 µs; 256 × 256 gains 7 µs, less than the extra ops).
MIN_SINGLE_ROW = 1 << 17
# Under torch.compile, several rows of a weight well above a core's L2 (1–2 MiB on current x86 server cores):
# written [N, O], the reduction streams the weight from memory once per row; written [O, N], once. In k2-mini
# only the 8 MiB head is above it (its next largest weight is 0.75 MiB); for full-size models, where most
# weights are, the order is unmeasured.
LARGE_WEIGHT_BYTES = 4 << 20


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., D], weight [O, D] -> x Wᵀ [..., O] (``F.linear`` without bias).

    Eager calls that take no tier leave after the cheapest checks (shapes first, no reshape): a decode step
    makes ~200 of them, most for weights the swap does not help (an expert's gate and up, O < D)."""
    O, D = weight.shape
    n = x.numel() // D
    if torch.compiler.is_compiling():
        if n > COMPILED_MAX_ROWS or not cpu_fp32_inference(x, weight):
            return F.linear(x, widened(weight, x))
        rows = stored(x.reshape(-1, D))
        if n == 1 or weight.numel() * weight.element_size() < LARGE_WEIGHT_BYTES:
            return (weight[None] * rows[:, None, :]).sum(-1).view(*x.shape[:-1], O)
        # [O, N]: each weight row read once for every input row, then the small result transposed
        return (weight[:, None, :] * rows[None]).sum(-1).T.contiguous().view(*x.shape[:-1], O)
    weight = widened(weight, x)  # a twin's bf16 weight gets here only past a graph break in its compiled step
    if n > MAX_ROWS or D > O or (n == 1 and O * D < MIN_SINGLE_ROW) or not cpu_fp32_inference(x, weight):
        return F.linear(x, weight)
    rows = x.reshape(n, D)
    if n == 1:
        rows = F.pad(rows, (0, 0, 0, 1))
    out = (weight @ rows.T).T[:n].contiguous()
    return out.view(*x.shape[:-1], O)


def stored(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as a buffer of the compiled graph (inductor's ``force_stride_order``, a no-op when it is one)."""
    from torch._inductor import inductor_prims  # noqa: F401 - registers the prim

    return torch.ops.prims.inductor_force_stride_order(rows, rows.stride())


def cpu_fp32_inference(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the decode tiers apply: CPU, fp32 activations, fp32 weights or the bf16 copies of the compiled
    step's twin (``k2lab.infer.decode_weights``; the reductions widen them as they load them), and no
    gradient to track."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype in (torch.float32, torch.bfloat16)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def widened(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` widened to fp32 when it is a twin's bf16 copy and ``x`` is fp32 (for the products that are
    not reductions: a whole fp32 copy), else ``weight`` itself."""
    return weight.float() if weight.dtype == torch.bfloat16 and x.dtype == torch.float32 else weight
