"""The multi-token-prediction training objective (DeepSeek-V3 report §2.2, eq. 24–25):

    L_MTP^k = CE(P^k_{i+k+1}, t_{i+k+1}) over the positions that have a target
    L_MTP   = λ / K · Σ_k L_MTP^k,          added to the main next-token loss

With packed windows ``labels = window[1:]`` (labels[:, i] = t_{i+1}), depth k's logits at row i pair with
``labels[:, i + k]``: ``logits_k[:, : T - k]`` against ``labels[:, k:]``. Targets equal to the ignore index
(-100, SFT prompts, vision rows) are skipped exactly as the main loss skips them; like the main loss, a
packed window's predictions run across document ends (the EOS row predicts the next document's start).

``mtp_top1`` is the share of those positions where depth 1's argmax is the next-next token t_{i+2}: the
acceptance a one-token speculative draft would see under greedy decoding.

``mtp_loss`` takes each depth's logits [B, T, V] (the reference); ``fused_mtp_loss``, which training uses,
takes final_norm(h^k) and the head's weight and runs the head with its cross-entropy fused
(``k2lab.ops.linear_cross_entropy``), counting the top-1 hits in the same softmax pass, so no depth's
[B, T, V] logits exist: on k2-mini's 8 × 256 tokens in bf16 on a Zen 5, one depth's forward + backward
85.6 → 50.4 ms, the whole k2-mini + MTP training step 1.06× (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k2lab.ops.linear_cross_entropy import (  # the main loss's
    IGNORE_INDEX,
    linear_cross_entropy,
    linear_cross_entropy_hits,
)


@dataclass
class MTPLoss:
    """``loss``: mean over depths of the depth CE (a scalar with gradient); ``top1``: depth-1 agreement
    (a detached scalar); ``targets``: how many depth-1 targets were scored; ``depths``: each depth's CE
    [K] (``loss`` is their mean; data-parallel ranks weight each by its own target count)."""

    loss: torch.Tensor
    top1: torch.Tensor
    targets: int
    depths: torch.Tensor


def depth_pairs(logits: torch.Tensor, labels: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth ``depth`` logits [B, T, V] (or final-normed hidden states [B, T, D]) and labels [B, T] -> aligned
    [N, V] logits (or [N, D] states) and [N] targets, N = B · (T − depth)."""
    T = labels.shape[1]
    return logits[:, : T - depth].reshape(-1, logits.shape[-1]), labels[:, depth:].reshape(-1)


def _check_depths(depths: int, labels: torch.Tensor) -> None:
    if labels.shape[1] <= depths:
        raise ValueError(f"MTP depth {depths} needs windows longer than it, got T={labels.shape[1]}")


def mtp_loss(depth_logits: list[torch.Tensor], labels: torch.Tensor) -> MTPLoss:
    """depth_logits: K tensors [B, T, V] (``CausalLM.mtp_logits``); labels [B, T] (the main loss's).

    Needs T > K so that every depth has a target."""
    _check_depths(len(depth_logits), labels)
    losses = []
    for depth, logits in enumerate(depth_logits, start=1):
        flat_logits, targets = depth_pairs(logits, labels, depth)
        losses.append(F.cross_entropy(flat_logits.float(), targets, ignore_index=IGNORE_INDEX))
    with torch.no_grad():
        flat_logits, targets = depth_pairs(depth_logits[0], labels, 1)
        scored = targets != IGNORE_INDEX
        hits = (flat_logits.argmax(-1) == targets) & scored
        top1 = hits.sum() / scored.sum().clamp(min=1)
    stacked = torch.stack(losses)
    return MTPLoss(stacked.mean(), top1, int(scored.sum()), stacked)


def fused_mtp_loss(depth_hidden: list[torch.Tensor], weight: torch.Tensor, labels: torch.Tensor) -> MTPLoss:
    """``mtp_loss`` of the logits ``depth_hidden[k] @ weight.T`` without forming them: depth_hidden K tensors
    [B, T, D] (``CausalLM.mtp_hidden``), weight [V, D] (the shared lm_head), labels [B, T]."""
    _check_depths(len(depth_hidden), labels)
    losses, top1, targets = [], None, 0
    for depth, hidden in enumerate(depth_hidden, start=1):
        rows, scored = depth_pairs(hidden, labels, depth)
        if depth == 1:
            loss, hits = linear_cross_entropy_hits(rows, weight, scored)
            targets = int((scored != IGNORE_INDEX).sum())
            top1 = hits / max(targets, 1)
        else:
            loss = linear_cross_entropy(rows, weight, scored)
        losses.append(loss)
    stacked = torch.stack(losses)
    return MTPLoss(stacked.mean(), top1, targets, stacked)
