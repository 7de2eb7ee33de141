"""Rollouts: a policy talks to an environment, every assistant turn recorded as exact token ids.

    rollout = run_episode(env, policy, seed=3, token_limit=256)
    rollout.episode          # the Episode (messages, reward, outcome)
    rollout.turns            # per assistant turn: prompt ids, completion ids, the iteration that sampled it

Policies implement ``respond(messages, tools, *, seed) -> (assistant_message, completion_token_ids)``:

* ``LocalPolicy`` renders with ``encode_chat`` in the model family's chat format
  (``k2lab.runtime.chat_format``: K2's, or K3's XTML for a K3-family model), samples with ``generate`` under the
  tool-call decoding enforcer (with a ``PrefixCache`` kept across turns and episodes: shared system
  prompts, tool declarations and earlier turns prefill once; emptied whenever the weights change) (tool calls are always well-formed and name a declared tool), stops at
  ``<|im_end|>`` and parses with ``parse_assistant``. Output that does not parse, contains reserved
  special-token strings, or never reaches ``<|im_end|>`` raises ``PolicyOutputError`` ("malformed" /
  "truncated"), which ends the episode with that reason (its tokens are still recorded for training).
* ``EndpointPolicy`` calls any OpenAI-compatible server (``k2lab serve``, vLLM ...) through the official
  ``openai`` client; with a tokenizer it re-encodes the prompt and the reply in its ``chat_format`` (K2's by
  default; ``chat_format_of(model, tokenizer=...)`` of the served model: K3's XTML for a K3-family one) so
  its turns can be trained on too. A thinking model's reasoning (``reasoning_content``; vLLM's newer
  ``reasoning``) stays in the message, as ``LocalPolicy``'s parsed replies keep it: the transcript carries
  it back in later turns and the reply's ids hold it as the model wrote it.

``run_episodes`` plays many rollouts of a ``LocalPolicy`` together: each round, the next turn of every
rollout still playing goes through one batched ``generate`` (per-row enforcer and per-row sampling seed),
so RL groups and evaluations cost a few batched calls per turn index instead of one call per turn.

Partial rollouts (K1.5 / K3): with ``token_limit`` a rollout stops between turns once it has generated that
many tokens in this call and comes back unfinished (``rollout.partial``); the next iteration passes it to
``run_episode`` again and it continues where it stopped. ``save_rollouts`` / ``load_rollouts`` persist
unfinished rollouts as JSON lines (written to a temporary file, fsynced, renamed: a crash leaves the old
file or the new one).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from k2lab.agentic.episodes.env import Environment, Episode
from k2lab.infer.generate import GenerationConfig, generate
from k2lab.infer.prefix_cache import PrefixCache
from k2lab.nn.mla import max_logits_paused
from k2lab.runtime.chat import ChatFormatError, ToolCallParseError
from k2lab.runtime.chat_format import ChatFormat, K2ChatFormat, chat_format_of
from k2lab.runtime.enforcer import ToolCallGrammar, pack_token_mask

__all__ = [
    "EndpointPolicy",
    "LocalPolicy",
    "Policy",
    "PolicyOutputError",
    "Rollout",
    "Turn",
    "describe_failures",
    "failure_counts",
    "load_rollouts",
    "run_episode",
    "run_episodes",
    "save_rollouts",
]

IM_END = "<|im_end|>"
#: ``LocalPolicy``'s default prefix-cache cap (k2-mini in fp32: about 70k tokens).
PREFIX_CACHE_BYTES = 128 << 20
#: Where an OpenAI-compatible reply holds its thinking: ``k2lab serve`` and vLLM's reasoning parsers write
#: ``reasoning_content``, newer vLLM ``reasoning``; the first present is the message's ``reasoning_content``.
REASONING_FIELDS = ("reasoning_content", "reasoning")


class PolicyOutputError(Exception):
    """Generated output that cannot become an assistant message; ``completion_ids`` are what was sampled."""

    def __init__(self, reason: str, completion_ids: Sequence[int] = (), detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.completion_ids, self.detail = reason, list(completion_ids), detail


#: What a policy turn yields: the assistant message and its completion ids, or the error it ended with.
Reply = tuple[dict[str, Any], list[int]] | PolicyOutputError


class Policy(Protocol):
    """Anything that answers a conversation with one assistant message and the token ids it generated."""

    def respond(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, seed: int = 0
    ) -> tuple[dict[str, Any], list[int]]: ...


@dataclass
class Turn:
    """One assistant turn: the exact prompt ids the policy saw, the ids it generated, and the RL iteration
    that sampled it (a partial rollout's earlier turns come from earlier iterations)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    iteration: int = 0


@dataclass
class Rollout:
    """An episode and its recorded turns; ``partial`` while the episode is not done."""

    episode: Episode
    turns: list[Turn] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return not self.episode.done

    def to_dict(self) -> dict[str, Any]:
        return {"episode": self.episode.to_dict(), "turns": [asdict(turn) for turn in self.turns]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Rollout:
        return cls(Episode.from_dict(data["episode"]), [Turn(**turn) for turn in data["turns"]])


def failure_counts(rollouts: Iterable[Rollout]) -> dict[str, int]:
    """The rollouts that did not succeed, counted per outcome reason ("unfinished": no outcome), by reason."""
    reasons = Counter(
        r.episode.outcome.reason if r.episode.outcome else "unfinished"
        for r in rollouts
        if not (r.episode.outcome and r.episode.outcome.success)
    )
    return dict(sorted(reasons.items()))


def describe_failures(failures: Mapping[str, int]) -> str:
    """``failure_counts`` as "reason count, ..." ("" when there are none)."""
    return ", ".join(f"{reason} {count}" for reason, count in failures.items())


# ------------------------------------------------------------------------------------------ policies


class LocalPolicy:
    """Sample from a local ``CausalLM`` in K2's chat format with the tool-call enforcer.

    ``temperature`` and ``max_new_tokens`` may be changed between calls (the RL loop decays temperature).
    ``prefix_cache_bytes`` caps the automatic prefix cache (``k2lab.infer.prefix_cache``; 0: none), which
    changes no output, only what is recomputed. ``drop_finished``: a row that ends its turn leaves the
    batched decode (``GenerationConfig.drop_finished``), so a call no longer decodes every row until its
    longest one ends; the tokens are the same up to the rounding of a smaller batch.

    Calls from several threads take turns (a lock around ``respond_batch``): PARL's ``SwarmEnv`` calls its
    workers from a thread pool, and a ``LocalPolicy`` there shares one model, its prefix cache and the
    model's eval/train and max-logit switches that a call sets and restores. Concurrent generation would
    also give each thread an OpenMP team of its own on the same cores.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        temperature: float = 1.0,
        max_new_tokens: int = 64,
        top_p: float = 1.0,
        tool_format: str = "typescript",
        prefix_cache_bytes: int = PREFIX_CACHE_BYTES,
        drop_finished: bool = False,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.prefix_cache = PrefixCache.for_model(model, prefix_cache_bytes) if prefix_cache_bytes else None
        self.temperature, self.max_new_tokens, self.top_p = temperature, max_new_tokens, top_p
        self.tool_format, self.drop_finished = tool_format, drop_finished
        self.chat_format = chat_format_of(model, tool_format, tokenizer)  # K2's, or K3's XTML (K3 family)
        self.im_end = tokenizer.special_tokens[self.chat_format.turn_end]
        self._grammars: dict[str, Any] = {}
        self._turn = threading.Lock()  # one respond_batch at a time (class docstring)

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The ids the model continues: the conversation and the generation prompt."""
        return self.chat_format.encode_chat(
            self.tokenizer, messages, tools or None, add_generation_prompt=True
        ).ids

    def _grammar(self, tools: list[dict[str, Any]]) -> Any:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._grammars:
            vocab = self.model.config.vocab_size
            markup = self.chat_format.markup
            self._grammars[key] = ToolCallGrammar.build(self.tokenizer, vocab, tools or None, markup=markup)
        return self._grammars[key]

    def allowed_tokens(
        self, tools: list[dict[str, Any]], completion_ids: Sequence[int]
    ) -> torch.Tensor | None:
        """The enforcer's mask at each generated position, replayed over ``completion_ids`` and packed
        (``pack_token_mask``): uint8 [len(completion_ids), ⌈V/8⌉], bit set where the token could be sampled;
        None when no position was constrained. The sampling policy is the model renormalised over these
        tokens."""
        constraint = self._grammar(tools).constraint()
        rows: list[torch.Tensor | None] = []
        for token in completion_ids:
            rows.append(constraint.allowed_tokens())
            try:
                constraint.advance(int(token))
            except Exception:  # noqa: BLE001 - not generated under this grammar: leave the rest free
                break
        if all(row is None for row in rows):
            return None
        vocab = self.model.config.vocab_size
        full = torch.ones(len(completion_ids), vocab, dtype=torch.bool)
        for position, (row, token) in enumerate(zip(rows, completion_ids, strict=False)):
            if row is not None:
                full[position] = row
                full[position, int(token)] = True  # it was sampled there, so it was allowed
        return pack_token_mask(full)

    def turn_masks(self, pairs: Sequence[tuple[Rollout, Turn]]) -> list[torch.Tensor | None]:
        """``allowed_tokens`` of each (rollout, turn): the masks each turn's completion was sampled under."""
        return [self.allowed_tokens(rollout.episode.tools, turn.completion_ids) for rollout, turn in pairs]

    def respond(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, seed: int = 0
    ) -> tuple[dict[str, Any], list[int]]:
        result = self.respond_batch([(messages, tools, seed)])[0][1]
        if isinstance(result, PolicyOutputError):
            raise result
        return result

    def respond_batch(
        self, requests: Sequence[tuple[list[dict[str, Any]], list[dict[str, Any]], int]], batch_size: int = 16
    ) -> list[tuple[list[int], Reply]]:
        """``respond`` for many (messages, tools, seed) requests at once: ``generate`` over sub-batches of
        ``batch_size`` prompts (sorted by length), each row with its own enforcer constraint and its own
        sampling seed, so a request gets the tokens it would get alone (up to batched rounding). Returns
        (prompt ids, reply or ``PolicyOutputError``) per request, in order."""
        prompts = [self.encode_prompt(messages, tools) for messages, tools, _ in requests]
        replies: list[Reply | None] = [None] * len(requests)
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        rows = []
        for i, prompt in enumerate(prompts):
            if limit is not None and len(prompt) + self.max_new_tokens > limit:
                detail = f"{len(prompt)} prompt tokens + {self.max_new_tokens}"
                replies[i] = PolicyOutputError("context overflow", (), detail)
            else:
                rows.append(i)
        rows.sort(key=lambda i: len(prompts[i]))
        config = GenerationConfig(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            eos_token_id=self.im_end,
            drop_finished=self.drop_finished,
        )
        with self._turn:
            self._generate(requests, prompts, rows, replies, config, batch_size)
        return [(prompt, reply) for prompt, reply in zip(prompts, replies, strict=True)]  # type: ignore[misc]

    def _generate(
        self,
        requests: Sequence[tuple[list[dict[str, Any]], list[dict[str, Any]], int]],
        prompts: list[list[int]],
        rows: list[int],
        replies: list[Reply | None],
        config: GenerationConfig,
        batch_size: int,
    ) -> None:
        """The replies of the requests ``rows`` (sorted by prompt length) into ``replies``, ``batch_size``
        prompts per ``generate``, the model in eval mode and recording no max logits meanwhile."""
        was_training = self.model.training
        self.model.eval()
        try:
            with max_logits_paused(self.model):  # rollouts are not the update's forwards
                for start in range(0, len(rows), batch_size):
                    chunk = rows[start : start + batch_size]
                    outputs = generate(
                        self.model,
                        [prompts[i] for i in chunk],
                        config,
                        constraints=[self._grammar(requests[i][1]).constraint() for i in chunk],
                        row_seeds=[requests[i][2] for i in chunk],
                        prefix_cache=self.prefix_cache,
                    )
                    for i, ids in zip(chunk, outputs, strict=True):
                        replies[i] = self._reply(ids)
        finally:
            self.model.train(was_training)

    def _reply(self, ids: list[int]) -> Reply:
        if not ids or ids[-1] != self.im_end:
            end = self.chat_format.turn_end
            return PolicyOutputError("truncated", ids, f"no {end} within {self.max_new_tokens} tokens")
        try:
            return parse_reply(self.tokenizer.decode(ids), self.chat_format), ids
        except PolicyOutputError as error:
            return PolicyOutputError(error.reason, ids, error.detail)


def parse_reply(text: str, chat_format: ChatFormat | None = None) -> dict[str, Any]:
    """An assistant message from generated text, or ``PolicyOutputError("malformed")``: the text must
    parse and the message must render again (no reserved special-token strings in its content); in
    ``chat_format`` (K2's by default)."""
    chat_format = chat_format or K2ChatFormat()
    try:
        message = chat_format.parse_assistant(text)
        chat_format.normalize_messages([message])
    except (ToolCallParseError, ChatFormatError) as error:
        raise PolicyOutputError("malformed", (), str(error)) from None
    return message


class EndpointPolicy:
    """A policy behind an OpenAI-compatible ``/v1/chat/completions`` endpoint (official ``openai`` client).

    Prompt and completion ids come from re-encoding the conversation and the reply with ``tokenizer`` in
    ``chat_format`` (K2's with ``tool_format`` when None: pass the served model's, ``chat_format_of``), when
    a tokenizer is given; otherwise they are empty and ``last_completion_tokens`` holds the server's
    ``usage.completion_tokens``. The reply keeps its thinking (``reply_message``), so its ids are the
    thinking markup, reasoning, content and calls as ``chat_format`` renders them: what the model wrote when
    it wrote them canonically (the server's sampled ids are not returned). A turn counts ``len(ids)`` tokens
    (``run_episode``: the budget penalty's count), the server's count only when there are no ids.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "EMPTY",
        temperature: float = 1.0,
        max_new_tokens: int = 256,
        tokenizer: Any = None,
        timeout_s: float = 120.0,
        chat_format: ChatFormat | None = None,
        tool_format: str = "typescript",
    ) -> None:
        from openai import OpenAI  # lazy: optional dependency openai

        self.chat_format = chat_format or K2ChatFormat(tool_format)

        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s)
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.last_completion_tokens = 0

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None:
            return []
        return self.chat_format.encode_chat(
            self.tokenizer, messages, tools or None, add_generation_prompt=True
        ).ids

    def respond(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, seed: int = 0
    ) -> tuple[dict[str, Any], list[int]]:
        request: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "seed": seed,
        }
        if tools:
            request["tools"] = tools
        response = self.client.chat.completions.create(**request)
        choice = response.choices[0]
        message = reply_message(choice.message.model_dump(exclude_none=True))
        self.last_completion_tokens = response.usage.completion_tokens if response.usage else 0
        truncated = choice.finish_reason == "length"
        ids = self._encode_reply(message, finished=not truncated)
        if truncated:
            raise PolicyOutputError("truncated", ids, "the server stopped at max_tokens")
        return message, ids

    def _encode_reply(self, message: dict[str, Any], finished: bool = True) -> list[int]:
        """The ids the model wrote for ``message`` after the generation prompt: its completion text
        (thinking included) encoded as the prompt of a later turn encodes it (``ChatFormat.encode_text``);
        without the end of turn when the reply was cut at ``max_tokens`` (the model never wrote it; the
        markup closing a cut thinking or a dropped tool-call section is still the format's guess)."""
        if self.tokenizer is None:
            return []
        try:
            text = self.chat_format.completion_text(message)
        except ChatFormatError:
            return []
        if not finished:
            text = text.removesuffix(self.chat_format.turn_end)
        return self.chat_format.encode_text(self.tokenizer, text)


def reply_message(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The assistant message of a server's reply (``message.model_dump(exclude_none=True)``): content, tool
    calls and the thinking as ``reasoning_content`` (``REASONING_FIELDS``), which the chat formats render
    and carry back in later turns; other fields (``refusal``, ``annotations`` ...) are left out."""
    message: dict[str, Any] = {"role": "assistant"}
    message.update({key: raw[key] for key in ("content", "tool_calls") if key in raw})
    reasoning = next((raw[key] for key in REASONING_FIELDS if raw.get(key) is not None), None)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return message


# ------------------------------------------------------------------------------------------ episodes


def run_episode(
    env: Environment,
    policy: Policy,
    seed: int,
    token_limit: int | None = None,
    rollout: Rollout | None = None,
    iteration: int = 0,
    sample_seed: int = 0,
) -> Rollout:
    """Play episode ``seed`` of ``env`` (or continue ``rollout``) until it is done or, with ``token_limit``,
    until this call has generated at least that many completion tokens (then it comes back partial).

    Turn ``t`` is sampled with seed ``sample_seed * 1000 + t`` (deterministic). A turn is never split: the
    limit is checked before each turn. ``PolicyOutputError`` ends the episode with its reason; any other
    exception from the policy ends it with "policy error", from ``env.step`` with "environment error".
    An episode still running after ``max_turns`` assistant turns ends with "max turns".
    """
    rollout = rollout if rollout is not None else Rollout(env.reset(seed))
    used = 0
    while _wants_turn(rollout, used, token_limit):
        used += _play_turn(env, policy, rollout, iteration, sample_seed * 1000 + len(rollout.turns))
    return rollout


def run_episodes(
    env: Environment,
    policy: LocalPolicy,
    rollouts: Sequence[Rollout],
    sample_seeds: Sequence[int],
    token_limit: int | None = None,
    iteration: int = 0,
    batch_size: int = 16,
) -> list[Rollout]:
    """``run_episode`` for many rollouts at once: every round, the next turn of every rollout that still
    plays goes through one ``LocalPolicy.respond_batch`` (turn t of rollout k with seed
    ``sample_seeds[k] * 1000 + t``, as alone), then each is handled exactly as ``run_episode`` handles it.
    With ``batch_size=1`` the outcomes equal ``run_episode``'s; larger batches are as deterministic. A round
    whose batched call raises (not a ``PolicyOutputError``) is replayed one rollout at a time, so only the
    rollout that causes it ends with "policy error"."""
    used = [0] * len(rollouts)
    while True:
        active = [k for k, r in enumerate(rollouts) if _wants_turn(r, used[k], token_limit)]
        if not active:
            return list(rollouts)
        requests = [
            (
                rollouts[k].episode.messages,
                rollouts[k].episode.tools,
                sample_seeds[k] * 1000 + len(rollouts[k].turns),
            )
            for k in active
        ]
        try:
            replies = policy.respond_batch(requests, batch_size)
        except Exception:  # noqa: BLE001 - replay the round one at a time: only the failing rollout fails
            for k, (_, _, seed) in zip(active, requests, strict=True):
                used[k] += _play_turn(env, policy, rollouts[k], iteration, seed)
            continue
        for k, (prompt, reply) in zip(active, replies, strict=True):
            used[k] += _apply_reply(env, policy, rollouts[k], prompt, reply, iteration)


def _wants_turn(rollout: Rollout, used: int, token_limit: int | None) -> bool:
    """Whether the rollout plays another turn now (ending it at its turn limit)."""
    episode = rollout.episode
    if not episode.done and episode.turns >= episode.max_turns:
        episode.finish(False, "max turns", reward=0.0)
    return not episode.done and (token_limit is None or used < token_limit)


def _play_turn(env: Environment, policy: Policy, rollout: Rollout, iteration: int, seed: int) -> int:
    """One assistant turn; returns the completion tokens it generated."""
    episode = rollout.episode
    try:
        prompt, reply = _respond(policy, episode, seed)
    except Exception as error:  # noqa: BLE001 - a failing endpoint fails this trajectory, not the run
        episode.finish(False, "policy error", reward=0.0, error=f"{type(error).__name__}: {error}"[:500])
        return 0
    return _apply_reply(env, policy, rollout, prompt, reply, iteration)


def _respond(policy: Policy, episode: Episode, seed: int) -> tuple[list[int], Reply]:
    """The prompt ids the policy saw and its reply (or the ``PolicyOutputError`` it ended with). A
    ``LocalPolicy`` encodes the prompt once, inside ``respond_batch``; other policies are asked for it."""
    if isinstance(policy, LocalPolicy):
        return policy.respond_batch([(episode.messages, episode.tools, seed)])[0]
    encode: Callable[..., list[int]] | None = getattr(policy, "encode_prompt", None)
    prompt = encode(episode.messages, episode.tools) if encode is not None else []
    try:
        return prompt, policy.respond(episode.messages, episode.tools, seed=seed)
    except PolicyOutputError as error:
        return prompt, error


def _apply_reply(
    env: Environment, policy: Policy, rollout: Rollout, prompt: list[int], reply: Reply, iteration: int
) -> int:
    """Record the turn, then end the episode on a policy error or step the environment; the tokens used."""
    episode = rollout.episode
    if isinstance(reply, PolicyOutputError):
        count = _record(rollout, policy, prompt, list(reply.completion_ids), iteration)
        episode.turns += 1
        episode.finish(False, reply.reason, reward=0.0, error=reply.detail[:500])
        return count
    message, ids = reply
    count = _record(rollout, policy, prompt, ids, iteration)
    try:
        env.step(episode, message)
    except Exception as error:  # noqa: BLE001 - environments should not raise; if one does, say so
        episode.finish(False, "environment error", reward=0.0, error=f"{type(error).__name__}: {error}"[:500])
    return count


def _record(rollout: Rollout, policy: Policy, prompt: list[int], ids: list[int], iteration: int) -> int:
    rollout.turns.append(Turn(list(prompt), list(ids), iteration))
    count = len(ids) or int(getattr(policy, "last_completion_tokens", 0) or 0)
    rollout.episode.completion_tokens += count
    return count


# ------------------------------------------------------------------------------------------ persistence


def save_rollouts(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> Path:
    """Write JSON-able records (e.g. ``Rollout.to_dict()`` or groups of them) as JSON lines, atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            for record in records:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def load_rollouts(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``save_rollouts`` file ([] when it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
