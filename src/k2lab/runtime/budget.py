"""Shortest completions of a tool-call grammar: a short token sequence that closes the call from here.

The budget steering of the decoding enforcer needs, at each step, ``U(s)``: the length of a token
sequence that takes the grammar matcher from its state ``s`` to an accepting one (the section closed).
An exact shortest path is a search over the vocabulary at every depth; ``U(s)`` here is an upper bound
with a witness (the path itself), found greedily by consuming tokens on the matcher and rolling back:

1. a *closing* token if the grammar allows one, in the order ``<|tool_calls_section_end|>``,
   ``<|tool_call_end|>``, ``<|tool_call_argument_begin|>``, ``}``, ``]``, ``"``, ``,`` (a value, object,
   array or call index that may end here ends). Inside a string ``}`` and ``]`` are content, not closers:
   one after which ``"`` may follow (never so after a ``}`` or ``]`` that closes: JSON wants a comma first) is
   passed over, so ``"`` closes the string (taken as content, the path never left the string);
2. else the shortest value start: ``0``–``9`` (one digit), ``t`` / ``f`` / ``n``, ``[``, ``{``, ``-``;
3. else the grammar's forced tokens (llguidance's fast-forward tokens: a key, ``functions.{name}:``);
4. else (a choice the list does not cover: an enum's first letter, a pattern) the allowed token with the
   highest id (BPE merges come late: a long token).

The path is then re-tokenized: each run of ordinary tokens is replaced by the tokenizer's own encoding
of its bytes (``"}`` may be one token) when the result is accepted and shorter. Because the witness is a
real path, following it from ``s`` reaches acceptance in ``U(s)`` tokens, and after its first token the
rest of it bounds ``U`` of the next state by ``U(s) − 1``: the invariant the steering rests on.

Cost: one ``try_consume_tokens`` per tried token (~1 µs), a fast-forward computation (~35 µs) per
forced stretch, a mask (~30 µs at V = 300) per fallback choice.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from llguidance import LLMatcher, LLTokenizer

__all__ = ["CompletionSearch"]

_CLOSING_BYTES = b'}]",'
_VALUE_BYTES = b"0123456789tfn[{-"
_GREEDY_CAP = 512


class CompletionSearch:
    """Greedy shortest completions over one tokenizer (module doc). ``closers``: the special tokens that
    close a call or a section, most final first."""

    def __init__(self, tokenizer: LLTokenizer, vocab_size: int, closers: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        preferred = []
        for byte in _CLOSING_BYTES + _VALUE_BYTES:
            ids = tokenizer.tokenize_bytes(bytes([byte]))
            if len(ids) == 1:
                preferred.append(ids[0])
        self.preferred = [*closers, *preferred]
        quote = tokenizer.tokenize_bytes(b'"')
        self.quote = quote[0] if len(quote) == 1 else None
        self.brackets = {
            ids[0] for ids in (tokenizer.tokenize_bytes(b) for b in (b"}", b"]")) if len(ids) == 1
        }

    def shortest(self, matcher: LLMatcher, limit: int) -> list[int] | None:
        """A completion of at most ``limit`` tokens from the matcher's state (left as it was), or None
        when the greedy witness is longer (given up a quarter over ``limit``: re-tokenizing rarely gains
        more, and a search that cannot fit should cost little)."""
        path: list[int] = []
        try:
            while not matcher.is_accepting():
                if len(path) > limit + max(8, limit // 4) or len(path) > _GREEDY_CAP:
                    return None
                step = self._step(matcher)
                if not step:
                    return None
                path += step
        finally:
            matcher.rollback(len(path))
        path = self.retokenized(matcher, path)
        return path if len(path) <= limit else None

    def _step(self, matcher: LLMatcher) -> list[int]:
        """Consume the next piece of the greedy path on ``matcher``; returns its tokens ([] if stuck)."""
        for token in self.preferred:
            if matcher.try_consume_tokens([token]):
                if token in self.brackets and self._string_content(matcher):
                    matcher.rollback(1)
                    continue
                return [token]
        forced = matcher.compute_ff_tokens()
        if forced:
            return forced[: matcher.try_consume_tokens(forced)]
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[: self.vocab_size])
        if len(allowed) and matcher.try_consume_tokens([int(allowed[-1])]):
            return [int(allowed[-1])]
        return []

    def _string_content(self, matcher: LLMatcher) -> bool:
        """Whether the ``}`` or ``]`` just consumed was a string's content: ``"`` may follow it."""
        if self.quote is None or not matcher.try_consume_tokens([self.quote]):
            return False
        matcher.rollback(1)
        return True

    def retokenized(self, matcher: LLMatcher, path: list[int]) -> list[int]:
        """``path`` with its runs of ordinary tokens encoded afresh, if that is accepted and shorter."""
        tokens: list[int] = []
        run: list[int] = []
        for token in [*path, None]:
            if token is not None and not self.tokenizer.is_special_token(token):
                run.append(token)
                continue
            if run:
                tokens += self.tokenizer.tokenize_bytes(self.tokenizer.decode_bytes(run))
                run = []
            if token is not None:
                tokens.append(token)
        return tokens if len(tokens) < len(path) and self.completes(matcher, tokens) else path

    @staticmethod
    def completes(matcher: LLMatcher, tokens: list[int]) -> bool:
        """Whether ``tokens`` take the matcher to an accepting state (the matcher is left as it was)."""
        consumed = matcher.try_consume_tokens(tokens)
        done = consumed == len(tokens) and matcher.is_accepting()
        matcher.rollback(consumed)
        return done
