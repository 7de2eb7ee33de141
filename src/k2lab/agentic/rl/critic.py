"""Self-critique rubric rewards (K2): a critic model compares candidate answers pairwise under rubrics.

For a prompt x and candidates a, b the critic reads a rubric prompt (the core and prescriptive rubrics,
the question, "Answer A" and "Answer B") followed by the generation prompt, and its next-token logits
ℓ_A, ℓ_B of the tokens "A" and "B" give

    p_A(a, b) = exp ℓ_A / (exp ℓ_A + exp ℓ_B)
    P(a ≻ b)  = ½ · (p_A(a, b) + 1 − p_A(b, a))           (both orders: no position bias)

and candidate j of a group of K gets the reward

    w_j = 1/(K−1) · Σ_{k≠j} P(y_j ≻ y_k)                   (its win rate within the group, in [0, 1]).

The critic is refreshed from verifiable rollouts (K2: "verifiable on-policy rollouts also update the
critic"): for pairs of a group whose verifiable rewards differ, a few cross-entropy steps on the two-way
logits teach it to prefer the better answer in both orders,

    L_critic = −½ · (log p_A(better, worse) + log (1 − p_A(worse, better))).

The rubric prompt is rendered in the critic model's chat format (``chat_format_of``: K2's, or K3's XTML for a
K3-family model whose tokenizer has the XTML tokens); a K3 critic answers in the response channel (thinking
off: the generation prompt ends in ``<|open|>response<|sep|>``), so "A" / "B" is its next token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from k2lab.data.tokenizer import special_tokens_for
from k2lab.infer.generate import last_positions, left_pad
from k2lab.runtime.chat_format import ChatFormat, K3ChatFormat, chat_format_of

__all__ = ["CORE_RUBRICS", "PRESCRIPTIVE_RUBRICS", "Preference", "RubricCritic", "rubric_prompt"]

CORE_RUBRICS = (
    "Clarity and relevance: the answer addresses the request directly and is easy to follow.",
    "Conversational fluency: the answer reads naturally and stays on topic.",
    "Objective interaction: the answer is factual and not sycophantic.",
)
PRESCRIPTIVE_RUBRICS = (
    "No initial praise: do not open by complimenting the question.",
    "No explicit justification: do not explain why the answer is good.",
)


@dataclass(frozen=True)
class Preference:
    """A verifiable pair: ``better`` earned a higher verifiable reward than ``worse`` for ``prompt``."""

    prompt: str
    better: str
    worse: str


def rubric_prompt(prompt: str, answer_a: str, answer_b: str, rubrics: Sequence[str] | None = None) -> str:
    """The critic's user message: rubrics, the question, both answers, and the A/B question."""
    rubrics = list(rubrics) if rubrics is not None else [*CORE_RUBRICS, *PRESCRIPTIVE_RUBRICS]
    lines = "\n".join(f"- {rubric}" for rubric in rubrics)
    return (
        f"Compare two answers under these rubrics:\n{lines}\n\nQuestion: {prompt}\n\n"
        f"Answer A: {answer_a}\n\nAnswer B: {answer_b}\n\nWhich answer is better? Reply A or B."
    )


def answer_format(chat_format: ChatFormat) -> ChatFormat:
    """The format a critic answers in: the model's, with K3's thinking off (the answer is the next token)."""
    return replace(chat_format, thinking=False) if isinstance(chat_format, K3ChatFormat) else chat_format


class RubricCritic:
    """Pairwise rubric judge over a ``CausalLM`` (the policy's own weights or another checkpoint)."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, rubrics: Sequence[str] | None = None, lr: float = 1e-4
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.rubrics = list(rubrics) if rubrics is not None else [*CORE_RUBRICS, *PRESCRIPTIVE_RUBRICS]
        self.token_a = tokenizer.encode("A", allow_special=False)[0]
        self.token_b = tokenizer.encode("B", allow_special=False)[0]
        self.chat_format = answer_format(chat_format_of(model, tokenizer=tokenizer))
        self.reserved = special_tokens_for(self.chat_format.family)  # removed from the prompt's text
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def _logits(self, pairs: Sequence[tuple[str, str, str]]) -> torch.Tensor:
        """Two-way logits [N, 2] (ℓ_A, ℓ_B) for (prompt, a, b) triples."""
        rows = [
            self.chat_format.encode_chat(
                self.tokenizer,
                [{"role": "user", "content": _clean(rubric_prompt(p, a, b, self.rubrics), self.reserved)}],
                add_generation_prompt=True,
            ).ids
            for p, a, b in pairs
        ]
        ids, valid = left_pad(rows)  # left-padded: the last position is every row's next token
        device = next(self.model.parameters()).device
        valid = valid.to(device)
        logits = self.model(
            ids.to(device), attention_mask=valid, logits_mask=last_positions(valid)
        ).logits.float()
        return logits[:, [self.token_a, self.token_b]]

    @torch.no_grad()
    def prefer_a(self, prompt: str, answer_a: str, answer_b: str) -> float:
        """p_A(a, b): the probability the critic puts on "A" against "B"."""
        return float(self._logits([(prompt, answer_a, answer_b)]).softmax(-1)[0, 0])

    @torch.no_grad()
    def win_rates(self, prompt: str, answers: Sequence[str]) -> list[float]:
        """w_j = 1/(K−1) Σ_{k≠j} P(y_j ≻ y_k) with P(a ≻ b) = ½ (p_A(a, b) + 1 − p_A(b, a))."""
        count = len(answers)
        if count < 2:
            return [0.5] * count
        was_training = self.model.training
        self.model.eval()
        ordered = [(prompt, answers[j], answers[k]) for j in range(count) for k in range(count) if j != k]
        p_a = self._logits(ordered).softmax(-1)[:, 0].tolist()
        self.model.train(was_training)
        table = {(j, k): p for (j, k), p in zip(_off_diagonal(count), p_a, strict=True)}
        return [
            sum(0.5 * (table[j, k] + 1 - table[k, j]) for k in range(count) if k != j) / (count - 1)
            for j in range(count)
        ]

    def loss(self, preferences: Sequence[Preference]) -> torch.Tensor:
        """L_critic = −½ (log p_A(better, worse) + log(1 − p_A(worse, better))), averaged over pairs."""
        triples = [
            t for p in preferences for t in ((p.prompt, p.better, p.worse), (p.prompt, p.worse, p.better))
        ]
        targets = torch.tensor([0, 1] * len(preferences), device=next(self.model.parameters()).device)
        return F.cross_entropy(self._logits(triples), targets)

    def refresh(self, preferences: Sequence[Preference], steps: int = 2) -> float | None:
        """A few AdamW steps of ``loss`` on verifiable preferences; returns the last loss (None: no pairs)."""
        if not preferences:
            return None
        was_training = self.model.training
        self.model.train()
        value = 0.0
        for _ in range(steps):
            loss = self.loss(preferences)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            value = float(loss.detach())
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train(was_training)
        return value

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _off_diagonal(count: int) -> list[tuple[int, int]]:
    return [(j, k) for j in range(count) for k in range(count) if j != k]


def _clean(text: str, reserved: Sequence[str]) -> str:
    """Text with the chat format's reserved strings removed (answers are model output)."""
    for token in reserved:
        text = text.replace(token, "")
    return text
