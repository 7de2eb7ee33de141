"""Scoring visual RL's answers: log π of completions under a vision-language model with the prompt's pixel
inputs, and K1.5's loss of one group (``k2lab.vision.rl``).

``completion_logprobs``: for rows (prompt x with its image, completion y), one right-padded forward per
``batch`` rows over x + y with the pixel inputs concatenated in row order (the placeholders are filled in
reading order), the head at the positions predicting y only::

    log π(y_t | x, y_<t) = z_t[y_t] − log Σ_{v ∉ P} exp z_t[v]        z_t: logits [V]; P: image / video
                                                                    placeholder ids (never sampled)

``group_loss``: for K answers with rewards r [K] and per-token log-probs under π_θ and π_old::

    L = (1/K) Σ_j (r_j − r̄ − τ · Σ_t m_t (log π_θ(y_jt) − log π_old(y_jt)))²,   m_t = 1[|Δ_t| ≤ δ] or 1
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k2lab.infer.generate import media_placeholders
from k2lab.posttrain.objective import k15_loss
from k2lab.posttrain.scoring import offpolicy_mask, sequence_log_ratio
from k2lab.vision.vlm import VisionLanguageModel

__all__ = ["Media", "completion_logprobs", "group_loss"]

Media = dict[str, torch.Tensor]


def completion_logprobs(
    model: VisionLanguageModel,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    media: Sequence[Media],
    batch: int = 16,
) -> list[torch.Tensor]:
    """log π(y_t | x, y_<t) [len(y)] of each completion y after its prompt x with its pixel inputs (one
    ``media`` dict per row), temperature 1, over the vocabulary less the image / video placeholders (which
    ``generate`` never samples)::

        log π(y_t) = z_t[y_t] − log Σ_{v ∉ placeholders} exp z_t[v]      (z_t: logits predicting y_t)

    Rows are right-padded into forwards of ``batch`` rows; the head runs at the completion positions only.
    Gradients flow unless called under ``torch.no_grad()``.
    """
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for start in range(0, len(prompts), batch):
        rows = range(start, min(start + batch, len(prompts)))
        lengths = [len(prompts[r]) + len(completions[r]) for r in rows]
        ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
        wanted = torch.zeros_like(ids, dtype=torch.bool)
        for b, r in enumerate(rows):
            ids[b, : lengths[b]] = torch.tensor([*prompts[r], *completions[r]])
            wanted[b, len(prompts[r]) - 1 : lengths[b] - 1] = True  # the positions predicting y
        mask = torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        pixels = {key: torch.cat([media[r][key] for r in rows]).to(device) for key in media[start]}
        logits = model(
            ids.to(device), attention_mask=mask.to(device), logits_mask=wanted.to(device), **pixels
        ).logits.float()  # [Σ n, V], row-major
        placeholders = media_placeholders(model, logits.shape[-1])
        if placeholders:
            logits = logits.index_fill(-1, torch.tensor(placeholders, device=logits.device), -torch.inf)
        targets = torch.tensor([t for r in rows for t in completions[r]], device=logits.device)
        logp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        out += list(logp.split([len(completions[r]) for r in rows]))
    return out


def group_loss(
    rewards: torch.Tensor,
    logp_new: Sequence[torch.Tensor],
    logp_old: Sequence[torch.Tensor],
    tau: float,
    clip: float | None = None,
) -> tuple[torch.Tensor, int]:
    """K1.5's loss of one group of K answers (rewards [K], per-token log-probs under π_θ and π_old) and the
    number of tokens the off-policy clip δ masked."""
    masks = [offpolicy_mask(new, old, clip) for new, old in zip(logp_new, logp_old, strict=True)]
    ratios = torch.stack(
        [sequence_log_ratio(n, o, m) for n, o, m in zip(logp_new, logp_old, masks, strict=True)]
    )
    return k15_loss(rewards, ratios, tau), sum(int((~m).sum()) for m in masks)
