"""The language-model head and its cross-entropy in one pass over row chunks (fused linear cross-entropy).

For hidden states H [N, D], the head W [V, D] and labels y [N] (``ignore_index`` where a position has none):

    z_i = W h_i,   ℓ_i = logsumexp(z_i) − z_i[y_i],   L = Σ_{i valid} ℓ_i / n_valid
    ∂L/∂z_i = (softmax(z_i) − onehot(y_i)) / n_valid  (0 for ignored rows)
    ∂L/∂H = G W,   ∂L/∂W = Gᵀ H   with G [N, V] the rows ∂L/∂z_i

Unfused, the logits [N, V] are written, log_softmax writes a second [N, V], NLL's backward a zeroed third,
and log_softmax's backward reads two of them and takes a second exp. Here the rows are taken ``chunk_rows``
at a time (at most 64 MiB of fp32 logits a chunk); the chunk's loss and its gradient rows
softmax − onehot come from one softmax pass per row (``_losses_and_grad``), the 1/n_valid goes on the
products' [n, D] sides, and ∂L/∂H, ∂L/∂W are computed right away (the gradient in the forward pass, as
Liger-Kernel's fused linear cross-entropy does); backward only scales them by the incoming gradient. The
matrix products are the unfused ones (2·N·D·V forward, 4·N·D·V backward); under autocast they run in its
dtype and the softmax in fp32, as ``F.cross_entropy(F.linear(H, W).float(), y)`` does. What it buys is
memory: a k2-mini forward + backward at 8 × 1,024 tokens adds 2.3 GB instead of 3.3 GB; on K2's
163,840-way vocabulary the logits of one 8 × 4,096 micro-batch alone would be 21 GB in fp32. Speed on a
CPU (AVX2 Zen 3): the head and the loss 1.07× with the freed memory kept mapped (``k2lab.allocator``),
1.3–1.4× without; the whole k2-mini step unchanged with it; on an AVX512-BF16 Zen 5 the head and the loss
1.18× the unfused ones in bf16 (docs/performance.md, "The head and its loss fused").

Traced by ``torch.compile`` the plain expression is used instead: inductor fuses it itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k2lab.ops.autocast import matmul_operand

IGNORE_INDEX = -100  # F.cross_entropy's default
# fp32 logits of one chunk at most (k2-mini's 2,048 × 8,192 rows in one; K2's 163,840-way vocabulary: 102 rows)
CHUNK_BYTES = 64 << 20
# ℓ = −log p_y up to this loss (p_y = e⁻⁸⁰ ≈ 1.8e-35, a normal fp32 with full relative precision); above it
# logsumexp(z) − z_y (see _losses_and_grad)
LOSS_FROM_PROBABILITY_MAX = 80.0


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk so that its fp32 logits [rows, V] take at most ``CHUNK_BYTES`` (at least 16 rows)."""
    return max(16, CHUNK_BYTES // (4 * vocab))


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of logits ``hidden @ weight.T`` against ``labels``, without the [N, V] logits.

    hidden [N, D] (or [B, T, D]), weight [V, D], labels [N] (or [B, T]); returns a scalar, equal to
    ``F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=ignore_index)``.
    """
    return _fused(hidden, weight, labels, ignore_index, chunk_rows, False)[0]


def linear_cross_entropy_hits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear_cross_entropy`` and, from the same softmax pass, the scored rows whose most likely token is the
    label: (mean loss, hits: an int64 count without gradient, #{i valid : argmax_v z_iv = y_i}, the first
    maximum on ties as ``argmax``)."""
    return _fused(hidden, weight, labels, ignore_index, chunk_rows, True)


def _fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_rows: int | None,
    count_hits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"{hidden.shape[0]} hidden rows but {labels.shape[0]} labels")
    if torch.compiler.is_compiling():
        logits = F.linear(hidden, weight)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
        hits = ((logits.argmax(-1) == labels) & (labels != ignore_index)).sum() if count_hits else None
        return loss, hits
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    # autograd's needs_input_grad stays True for a parameter under no_grad: scoring must not form gradients
    track = torch.is_grad_enabled()
    loss, hits = _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, rows, track, count_hits)
    return loss, hits if count_hits else None


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_rows, track, count_hits):  # noqa: ANN001, ANN205 - torch's API
        want_hidden, want_weight = (track and wanted for wanted in ctx.needs_input_grad[:2])
        valid = labels != ignore_index
        count = valid.sum()
        scale = valid / count.clamp(min=1)  # ∂L/∂ℓ_i: 1 / n_valid, 0 where ignored
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.zeros((), dtype=torch.int64, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h = hidden[rows]
            logits = F.linear(h, weight)  # [n, V], in autocast's dtype where it is on
            target = labels[rows].clamp(min=0)[:, None]
            losses, grad, best = _losses_and_grad(logits, target, h, weight, count_hits)
            total += (losses * valid[rows]).sum()
            if best is not None:
                hits += ((best == target[:, 0]) & valid[rows]).sum()
            if want_hidden or want_weight:
                into = None if grad_hidden is None else grad_hidden[rows]
                _chunk_grads(grad, h, weight, scale[rows], into, grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(hits)
        return total / count, hits

    @staticmethod
    def backward(ctx, grad_loss, grad_hits):  # noqa: ANN001, ANN205 - torch's API
        grad_hidden, grad_weight = ctx.saved_tensors
        dh = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        dw = None if grad_weight is None else grad_weight * grad_loss
        return dh, dw, None, None, None, None, None


def _losses_and_grad(
    logits: torch.Tensor, target: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, best: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """ℓ [n], the rows of softmax(z) − onehot(y) [n, V] fp32 over a chunk's logits z = hidden Wᵀ [n, V]
    (any float dtype; the softmax runs in fp32; fp32 logits on CPU are overwritten) and, with ``best``, each
    row's argmax [n] (of the probabilities before the one-hot is taken off: argmax z, first on ties).

    One fused softmax pass per row (max, exp and sum, normalise, over a row that stays in cache), where the
    chain max, subtract, exp, sum and scale made five passes over the whole chunk (half as fast on a Zen 5
    at k2-mini's [2,048, 8,192]). On CPU ℓ = −log p_y, which carries p_y's relative error (≈ 1e-7) as an
    absolute one; where ℓ > ``LOSS_FROM_PROBABILITY_MAX`` (p_y nearing fp32's smallest normal) the row's ℓ is
    logsumexp(z) − z_y of its logits, formed again. On an accelerator that check would stop the host once a
    chunk, so ℓ = logsumexp(z) − z_y for every row (:func:`_exact_losses`, one more pass over the chunk).
    """
    if not _host_reads_cheaply(logits.device):
        losses = _exact_losses(logits, target)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top = probs.argmax(-1) if best else None
        return losses, probs.scatter_add_(1, target, torch.full_like(losses, -1.0).unsqueeze(1)), top
    if logits.dtype == torch.float32:
        probs = torch.ops.aten._softmax.out(logits, -1, False, out=logits)  # in place, row by row
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = probs.argmax(-1) if best else None
    picked = probs.gather(1, target)  # [n, 1]
    losses = picked.log().neg_().squeeze(1)
    large = losses > LOSS_FROM_PROBABILITY_MAX
    if bool(large.any()):  # rare: far from fp32's range only for a badly wrong, confident model
        losses[large] = _exact_losses(F.linear(hidden[large], weight), target[large])
    probs.scatter_add_(1, target, torch.full_like(picked, -1.0))
    return losses, probs, top


def _host_reads_cheaply(device: torch.device) -> bool:
    """Whether reading a value back to Python (``bool(tensor.any())``) costs nothing much: on CPU, not on an
    accelerator, where it waits for the queued kernels."""
    return device.type == "cpu"


def _exact_losses(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """ℓ = logsumexp(z) − z_y [n] in fp32 for logits z [n, V] and targets [n, 1]."""
    z = logits.float()
    return torch.logsumexp(z, -1) - z.gather(1, target).squeeze(1)


def _chunk_grads(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> None:
    """A chunk's ∂L/∂H = diag(s) G W into ``grad_hidden`` [n, D] and ∂L/∂W += Gᵀ diag(s) H into ``grad_weight``
    [V, D] fp32 (each where given), G [n, V] the unscaled rows softmax − onehot and s [n] = ∂L/∂ℓ_i: the row
    scale goes on the [n, D] sides rather than on G (one pass over [n, V] fewer). In place when everything is
    fp32 and autocast is off (no [V, D] temporary a chunk), else through the products autocast gives. Under
    autocast G is cast to its dtype once for both products (autocast would cast it, and its transpose, once
    each: the same values, one 2·n·V-byte pass fewer; ≈ 3 ms of k2-mini's step on a Zen 5)."""
    autocast = torch.is_autocast_enabled(grad.device.type)
    grad = matmul_operand(grad, otherwise=hidden.dtype)
    scale = scale[:, None].float()  # 1 / n_valid stays fp32 (in bf16 it would be off by up to 0.4 %)
    if grad_hidden is not None:
        torch.mul(grad @ weight, scale, out=grad_hidden)
    if grad_weight is None:
        return
    scaled = (hidden * scale).to(hidden.dtype)  # rounded once, as G·s was before the products
    if grad.dtype == hidden.dtype == grad_weight.dtype and not autocast:
        grad_weight.addmm_(grad.mT, scaled)
    else:
        grad_weight += grad.mT @ scaled
