"""A draft's reduced vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary): the draft proposes
only among N frequent tokens S = {s_1 < … < s_N} of the target's V, so its head is the N rows of the shared
lm_head W [V, D] instead of all V:

    z_S = h W_Sᵀ  [..., N],    z_v = z_S[j] if v = s_j else −∞  [..., V]

Full-vocabulary logits with −∞ outside S are what speculative decoding takes: greedy picks argmax z ∈ S
(verification is the target's own argmax, so the output is unchanged), and sampling's draft distribution
q = softmax(z / T) (then top-p) is exactly zero outside S, which the rejection rule handles exactly (a
drafted token always has q > 0; the residual max(0, p − q) is p outside S). Only acceptance can fall, by
how much of the target's own text lies outside S (``coverage``).

The sub-matrix W_S is taken once and taken again when the head's weight changes: its key is the weight's
``data_ptr`` (a new tensor: ``.to``, a reassigned parameter), ``_version`` (an in-place update:
``load_state_dict``, an optimizer step), dtype and device. It is taken outside inference mode and without
grad, so it serves eager, ``no_grad`` and ``inference_mode`` calls alike; when the weight itself requires
grad (and grad is on) W_S is indexed afresh per call so the gradient reaches W.
"""

from __future__ import annotations

import torch
from torch import nn

from k2lab.errors import K2LabError


def frequent_tokens(tokens: torch.Tensor, vocab_size: int, count: int) -> torch.Tensor:
    """The ``count`` most frequent ids of ``tokens`` (any shape; negative entries, e.g. −100, ignored) in a
    ``vocab_size`` vocabulary, ties to the lower id (unseen ids fill up in id order): ids [count], ascending."""
    check_size(count, vocab_size)
    seen = tokens.reshape(-1)
    counts = torch.bincount(seen[seen >= 0].long().cpu(), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)  # descending count, ascending id within a count
    return order[:count].sort().values


def check_size(count: int, vocab_size: int) -> None:
    """A draft vocabulary of ``count`` tokens must fit in 1 … V (``K2LabError`` otherwise)."""
    if not 1 <= count <= vocab_size:
        raise K2LabError(
            f"draft_vocab must be between 1 and the target's vocabulary {vocab_size}, got {count}"
        )


class DraftVocab:
    """The draft's tokens ids [N] (ascending, distinct, < V) and its head over them (module docstring)."""

    def __init__(self, ids: torch.Tensor, vocab_size: int) -> None:
        ids = torch.as_tensor(ids).long().reshape(-1)
        check_size(ids.numel(), vocab_size)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or bool((ids.diff() <= 0).any()):
            raise K2LabError(f"draft vocabulary ids must be ascending, distinct and in 0 … {vocab_size - 1}")
        self.ids, self.vocab_size = ids, vocab_size
        self._rows: torch.Tensor | None = None
        self._key: tuple | None = None

    def __len__(self) -> int:
        return self.ids.numel()

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """W_S [N, D] of the head's weight W [V, D] (cached; see the module docstring)."""
        if weight.requires_grad and torch.is_grad_enabled():
            return weight[self.ids.to(weight.device)]
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
        if key != self._key:
            with torch.inference_mode(False), torch.no_grad():
                self._rows = weight[self.ids.to(weight.device)].contiguous()
            self._key = key
        return self._rows

    def sub_logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """z_S = h W_Sᵀ: hidden [..., D] -> [..., N] (``head`` is the target's bias-free lm_head)."""
        return hidden @ self.rows(head.weight).t()

    def scatter(self, sub: torch.Tensor) -> torch.Tensor:
        """[..., N] -> [..., V]: z_S at the ids, −∞ elsewhere."""
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids.to(sub.device), sub)

    def logits(self, head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's full-vocabulary logits: hidden [..., D] -> [..., V], −∞ outside S."""
        return self.scatter(self.sub_logits(head, hidden))

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each token's index j in S (tokens [...] -> [...]), −1 where the token is not in S."""
        ids = self.ids.to(tokens.device)
        j = torch.searchsorted(ids, tokens.clamp(min=0)).clamp(max=len(ids) - 1)
        return torch.where(ids[j] == tokens, j, torch.full_like(j, -1))

    def coverage(self, tokens: torch.Tensor) -> float:
        """The fraction of ``tokens`` (negative entries ignored) inside S."""
        known = tokens[tokens >= 0]
        return float((self.positions(known) >= 0).float().mean()) if known.numel() else float("nan")
