"""``/v1/completions``, ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` as vLLM's OpenAI server has them.

**Completions** (OpenAI's legacy API with vLLM's semantics): ``prompt`` is a string, a list of strings, a list
of token ids or a list of lists of token ids — one choice per prompt (``n`` each, index
``prompt_index * n + j``). ``max_tokens`` (default 16) new tokens are sampled by the engine with
``temperature`` / ``top_p`` / ``seed``; ``stop`` strings end a choice and are cut from its text
(``finish_reason: "stop"``, ``stop_reason``: the string; ``include_stop_str_in_output`` keeps it).
``echo`` puts the prompt before the completion; ``max_tokens: 0`` with ``echo`` only scores the prompt.

``logprobs: k`` (0 … 20) adds vLLM's ``logprobs`` object for every returned token (prompt tokens too with
``echo``): ``tokens`` (each decoded alone), ``token_logprobs``, ``top_logprobs`` (the token itself, then the
k most likely, as ``{text: logprob}``; tokens of the same text, such as partial UTF-8 bytes, share one key
with the highest of their log-probs, where vLLM keeps the last one's) and ``text_offset`` (running sum of the
tokens' text lengths). The
first prompt token has nothing before it: ``None`` in both lists. The log-probabilities are the model's raw
distribution (before temperature or top-p, as vLLM's default), from one scoring forward over the prompt and
the completion, ids t_0 … t_{T-1} [T] → logits z [T-1, V]:

    token_logprobs[i] = log p(t_i | t_<i) = z_{i-1}[t_i] − logsumexp_v z_{i-1}[v],   i = 1 … T-1,

clamped at −9999 as vLLM does. That forward runs in a worker thread beside the engine's (a forward without a
cache changes no state of the model), one at a time.

``stream: true`` sends ``text_completion`` chunks as SSE and ``data: [DONE]``; text is held back while it
could still be the start of a stop string or half a UTF-8 character. With ``logprobs`` a choice's chunk
comes once it has finished (its log-probabilities come from the one scoring forward). ``usage`` counts each
prompt once and every generated token (a stop token is not counted: the engine does not deliver it).
A client that disconnects cancels its request, streaming or not (``k2lab.serve.disconnect``): every choice's
batch row is freed at the engine's next step.

**Tokenizer endpoints** (outside ``/v1``, as vLLM's): ``POST /tokenize`` with ``prompt`` (text) or
``messages`` (rendered with K2's chat template) → ``{count, max_model_len, tokens, token_strs}``;
``POST /detokenize`` ``{tokens}`` → ``{prompt}``; ``GET /tokenizer_info`` → the special tokens
(lm-evaluation-harness's remote tokenizer reads it). k2lab's tokenizer adds no BOS, so
``add_special_tokens`` changes nothing.

Prompts are tokenized (and chats rendered) in a worker thread: a long one does not stall ``/health`` or other
streams. Bad requests get 400 with OpenAI's error body; an unknown ``model`` 404; a failed engine step 500.
Fields k2lab does not implement (``suffix``, ``best_of``, ``logit_bias``, ``frequency_penalty``,
``presence_penalty``) are refused with 400 unless at their defaults, never silently ignored
(``k2lab.serve.unsupported``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from k2lab.data.tokenizer import Tokenizer
from k2lab.runtime.chat_format import ChatFormat
from k2lab.runtime.tool_spec import ToolSpecError, validate_tools
from k2lab.serve.disconnect import cancel_on_disconnect
from k2lab.serve.engine import Engine, SamplingParams
from k2lab.serve.engine import Request as EngineRequest
from k2lab.serve.errors import APIError, check_model, check_unicode, parse_body
from k2lab.serve.holdback import settled
from k2lab.serve.render import render_prompt
from k2lab.serve.threads import in_worker_thread
from k2lab.serve.unsupported import Refusals, UnimplementedSampling, refuse_unsupported

__all__ = [
    "MAX_LOGPROBS",
    "CompletionRequest",
    "DetokenizeRequest",
    "TokenizeRequest",
    "add_completion_routes",
    "token_logprobs",
]

#: The most ``logprobs`` a request may ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: vLLM's floor for a log-probability (−inf is not JSON).
LOGPROB_FLOOR = -9999.0
PROMPT_SHAPES = (
    "prompt must be a non-empty string, list of strings, list of token ids or list of lists of token ids"
)


class ServedModel(Protocol):
    """What the routes need of the server's state (``k2lab.serve.server``)."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    max_context: int
    stop_ids: tuple[int, ...]
    chat_format: ChatFormat


class StreamOptions(BaseModel):
    include_usage: bool = False


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CompletionRequest(UnimplementedSampling):
    """OpenAI's completion request with vLLM's extensions that k2lab implements (unknown fields are ignored;
    known ones it does not implement are refused unless at their defaults: ``refusals``). Values are JSON
    types (strict): "5" for max_tokens, "0" for temperature or "yes" for echo are refused, as on
    /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    best_of: int | None = None  # refused unless 1 (``refusals``), as the penalties and logit_bias
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # vLLM's extensions
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value) or all(_is_id(v) for v in value):
                return value
            if all(isinstance(v, list) and v and all(_is_id(t) for t in v) for v in value):
                return value
        raise ValueError(PROMPT_SHAPES)

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.max_tokens is None:
            self.max_tokens = 16
        if self.max_tokens == 0 and not self.echo:
            raise ValueError(
                "max_tokens=0 only scores the prompt: set echo=true (or ask for max_tokens >= 1)"
            )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        return self

    def refusals(self) -> Refusals:
        """The fields k2lab cannot honour (``refuse_unsupported``)."""
        return {
            "suffix": (bool(self.suffix), ""),
            "best_of": (self.best_of not in (None, 1), " other than 1"),
            **self.sampling_refusals(),
        }

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop or [] if s]


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text ``prompt`` or chat ``messages`` (with optional ``tools``)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class CompletionError(APIError):
    """``APIError`` with its type from the status (what every error of these endpoints is)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message, param=param, code=code)


# ---- scoring ---------------------------------------------------------------------------------------------
def token_logprobs(
    model: torch.nn.Module, ids: Sequence[int], top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``ids`` t_0 … t_{T-1} under ``model`` (one forward over t_0 … t_{T-2}).

    Returns ``chosen`` [T-1] = log p(t_i | t_<i) for i = 1 … T-1, and the ``top`` most likely tokens at each
    of those positions: log-probabilities [T-1, top] (descending) and their ids [T-1, top].
    """
    if len(ids) < 2:
        empty = torch.empty(0, top)
        return torch.empty(0), empty, empty.long()
    device = next(model.parameters()).device
    inputs = torch.tensor([list(ids[:-1])], device=device)
    targets = torch.tensor(list(ids[1:]), device=device)
    with torch.inference_mode():
        logp = model(inputs).logits[0].float().log_softmax(dim=-1)  # [T-1, V]
        chosen = logp.gather(-1, targets[:, None])[:, 0]
        values, indices = logp.topk(top, dim=-1) if top else (logp[:, :0], targets[:, None][:, :0])
    return chosen.cpu(), values.cpu(), indices.cpu()


class _Scorer:
    """Scoring forwards over the served model, one at a time, in a worker thread."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.lock = model, threading.Lock()

    def _run(self, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        with self.lock:
            chosen, values, indices = token_logprobs(self.model, ids, top)
        steps: list[tuple[float, list[tuple[int, float]]] | None] = [None]
        for lp, vals, idx in zip(chosen.tolist(), values.tolist(), indices.tolist(), strict=True):
            steps.append((lp, list(zip(idx, vals, strict=True))))
        return steps

    async def steps(self, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per token of ``ids``: None for the first, else (its log-prob, [(id, log-prob)] of the top ones)."""
        return await in_worker_thread(self._run, ids, top)


def _logprobs_object(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    steps: Sequence[tuple[float, list[tuple[int, float]]] | None],
    offset: int = 0,
) -> dict[str, list]:
    """vLLM's completion ``logprobs``: the token's own entry first in ``top_logprobs``, then the top ones."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, step in zip(ids, steps, strict=True):
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if step is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob, alternatives = step
        out["token_logprobs"].append(max(logprob, LOGPROB_FLOOR))
        ranked = dict.fromkeys([token, *(i for i, _ in alternatives)])
        values = {token: logprob, **dict(alternatives)}
        top: dict[str, float] = {}
        for i in ranked:  # tokens whose text is the same (e.g. partial UTF-8) share the key: keep the best
            key, value = tokenizer.decode([i]), max(values[i], LOGPROB_FLOOR)
            top[key] = max(value, top.get(key, value))
        out["top_logprobs"].append(top)
    return out


# ---- one choice ------------------------------------------------------------------------------------------
class _Choice:
    """One choice: its prompt, the tokens the engine sampled, and the text (cut at a stop string)."""

    def __init__(self, index: int, prompt: list[int], prompt_text: str, params: SamplingParams):
        self.index, self.prompt, self.prompt_text, self.params = index, prompt, prompt_text, params
        self.tokens: list[int] = []
        self.text = ""
        self.finish: str | None = None
        self.stop_reason: str | None = None
        self.done = params.max_tokens == 0
        if self.done:
            self.finish = "length"
        self.request: EngineRequest | None = None
        self.sent = 0  # characters of text streamed

    def add(self, token: int, tokenizer: Tokenizer, body: CompletionRequest) -> bool:
        """Take a sampled token; True when it completes a stop string (the text is then cut before it)."""
        self.tokens.append(token)
        text = tokenizer.decode(self.tokens, skip_special_tokens=body.skip_special_tokens)
        hits = [(text.find(s), s) for s in body.stops if s in text]
        if not hits:
            self.text = text
            return False
        at, stop = min(hits)
        self.text = text[: at + (len(stop) if body.include_stop_str_in_output else 0)]
        self.finish, self.stop_reason = "stop", stop
        return True

    def streamable(self, stops: list[str]) -> str:
        """Text not yet streamed that can no longer change: all of it once finished, else the text less what
        could still begin a stop string or end in half a UTF-8 character."""
        if self.done:
            return self.text[self.sent :]
        safe = settled(self.text, stops, self.sent)
        return self.text[self.sent : safe] if safe > self.sent else ""

    def returned_ids(self, echo: bool) -> list[int]:
        return self.prompt + self.tokens if echo else self.tokens


def _check_vocabulary(ids: Sequence[int], vocab: int, param: str, where: str = "") -> None:
    """400 naming the first id outside [0, vocab)."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise CompletionError(400, f"{where}token id {bad[0]} is outside the vocabulary [0, {vocab})", param)


def _plan(state: ServedModel, body: CompletionRequest) -> list[_Choice]:
    """Every prompt as ids and text, checked against the vocabulary and the context; ``n`` choices each."""
    tokenizer, vocab = state.tokenizer, state.engine.config.vocab_size
    raw = body.prompt
    if isinstance(raw, str) or _is_id(raw[0]):  # one prompt
        raw = [raw]
    prompts: list[tuple[list[int], str]] = []
    for i, prompt in enumerate(raw):
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            prompts.append((tokenizer.encode(prompt), prompt))
            if not prompts[-1][0]:
                raise CompletionError(400, f"prompt {i} is empty", "prompt")
            continue
        _check_vocabulary(prompt, vocab, "prompt", f"prompt {i}: ")
        prompts.append((list(prompt), tokenizer.decode(prompt)))
    budget = body.max_tokens or 0
    for ids, _ in prompts:
        if len(ids) + budget > state.max_context:
            raise CompletionError(
                400,
                f"This model's maximum context length is {state.max_context} tokens. However, you requested "
                f"{len(ids) + budget} tokens ({len(ids)} in the prompt, {budget} in the completion). Please "
                "reduce the length of the prompt or completion.",
                "prompt",
                "context_length_exceeded",
            )
    _check_vocabulary(body.stop_token_ids or [], vocab, "stop_token_ids")
    stop_ids = tuple(body.stop_token_ids or ()) + (() if body.ignore_eos else state.stop_ids)
    seed = body.seed if body.seed is not None else int(uuid.uuid4().int % 2**31)
    choices = []
    for ids, text in prompts:
        for j in range(body.n):
            params = SamplingParams(
                max_tokens=budget,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=seed + j,
                stop_token_ids=stop_ids,
            )
            choices.append(_Choice(len(choices), ids, text, params))
    return choices


# ---- generation ------------------------------------------------------------------------------------------
async def _generate(
    state: ServedModel, body: CompletionRequest, choices: list[_Choice]
) -> AsyncIterator[_Choice]:
    """Run every choice through the engine; yields a choice each time its text grows and when it is done."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[_Choice, str, Any]] = asyncio.Queue()

    def submit(choice: _Choice) -> EngineRequest:
        def on_token(token: int) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (choice, "token", token))

        def on_finish(reason: str) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (choice, "finish", reason))

        request = EngineRequest(
            prompt=choice.prompt, params=choice.params, on_token=on_token, on_finish=on_finish
        )
        return state.engine.submit(request)

    running = [c for c in choices if not c.done]
    for choice in running:
        choice.request = submit(choice)
    try:
        left = len(running)
        while left:
            choice, kind, value = await queue.get()
            if kind == "finish":
                left -= 1
                if value.startswith("error"):
                    raise CompletionError(500, f"generation failed: {value}")
                choice.finish = choice.finish or ("length" if value == "length" else "stop")
                choice.done = True
                yield choice
            elif choice.finish is None:  # tokens sampled after a stop string are dropped
                if choice.add(value, state.tokenizer, body):
                    choice.request.cancel()
                yield choice
    finally:
        for choice in running:
            choice.request.cancel()  # a client that went away frees its rows; a no-op once finished


class _Completion:
    """One ``/v1/completions`` request in flight."""

    def __init__(self, state: ServedModel, scorer: _Scorer, body: CompletionRequest) -> None:
        self.state, self.scorer, self.body = state, scorer, body
        self.choices = _plan(state, body)
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())

    async def logprobs(self, choice: _Choice) -> dict[str, list] | None:
        if self.body.logprobs is None:
            return None
        ids = choice.prompt + choice.tokens
        steps = await self.scorer.steps(ids, self.body.logprobs)
        if not self.body.echo:
            steps = steps[len(choice.prompt) :]
        return _logprobs_object(self.state.tokenizer, choice.returned_ids(self.body.echo), steps)

    def cancel(self) -> None:
        """Stop generating every choice (a client that left): their rows are freed at the engine's next step."""
        for choice in self.choices:
            if choice.request is not None:
                choice.request.cancel()

    def text(self, choice: _Choice) -> str:
        return (choice.prompt_text if self.body.echo else "") + choice.text

    def usage(self) -> dict[str, int]:
        prompt = sum(len(c.prompt) for c in self.choices[:: self.body.n])
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.state.model_name, "choices": choices}  # fmt: skip

    async def response(self) -> dict[str, Any]:
        async for _ in _generate(self.state, self.body, self.choices):
            pass
        choices = [
            {"index": c.index, "text": self.text(c), "logprobs": await self.logprobs(c),
             "finish_reason": c.finish, "stop_reason": c.stop_reason, "prompt_logprobs": None}
            for c in self.choices
        ]  # fmt: skip
        return {**self.envelope(choices), "usage": self.usage()}

    def _chunk(self, choice: _Choice, text: str, logprobs: dict | None = None, last: bool = False) -> str:
        entry = {"index": choice.index, "text": text, "logprobs": logprobs,
                 "finish_reason": choice.finish if last else None,
                 "stop_reason": choice.stop_reason if last else None}  # fmt: skip
        return f"data: {json.dumps(self.envelope([entry]))}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        body, scored = self.body, self.body.logprobs is not None
        try:
            if body.echo and not scored:
                for choice in self.choices:
                    yield self._chunk(choice, choice.prompt_text)
            for choice in [c for c in self.choices if c.done]:  # max_tokens=0: nothing to generate
                yield await self._finished_chunk(choice)
            async for choice in _generate(self.state, body, self.choices):
                if choice.done:
                    yield await self._finished_chunk(choice)
                elif not scored and (delta := choice.streamable(body.stops)):
                    choice.sent += len(delta)
                    yield self._chunk(choice, delta)
            if body.stream_options and body.stream_options.include_usage:
                yield f"data: {json.dumps({**self.envelope([]), 'usage': self.usage()})}\n\n"
        except CompletionError as error:
            yield f"data: {json.dumps(json.loads(error.response().body))}\n\n"
        yield "data: [DONE]\n\n"

    async def _finished_chunk(self, choice: _Choice) -> str:
        if self.body.logprobs is None:
            return self._chunk(choice, choice.streamable(self.body.stops), last=True)
        return self._chunk(choice, self.text(choice), await self.logprobs(choice), last=True)


# ---- routes ----------------------------------------------------------------------------------------------
def _tokenize(state: ServedModel, body: TokenizeRequest) -> dict[str, Any]:
    if body.messages is not None:
        try:
            tools = validate_tools(body.tools) if body.tools else None
        except ToolSpecError as error:
            raise CompletionError(400, str(error), "tools") from error
        text = render_prompt(
            state.chat_format, body.messages, tools, add_generation_prompt=body.add_generation_prompt
        )
    else:
        text = body.prompt or ""
    check_unicode(text, "messages" if body.messages is not None else "prompt")
    chat = body.messages is not None  # as chat completions encode it: only the format's markup is special
    tokens = state.chat_format.encode_text(state.tokenizer, text) if chat else state.tokenizer.encode(text)
    strs = [state.tokenizer.backend.id_to_token(t) for t in tokens] if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": state.max_context, "tokens": tokens, "token_strs": strs}


def _tokenizer_info(state: ServedModel) -> dict[str, Any]:
    tokenizer = state.tokenizer
    name = {i: s for s, i in tokenizer.special_tokens.items()}
    pad = state.engine.config.pad_token_id
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": name.get(tokenizer.eos_id),
        "bos_token": None if tokenizer.bos_id is None else name.get(tokenizer.bos_id),
        "pad_token": None if pad is None else name.get(pad),
        "model_max_length": state.max_context,
        "vocab_size": tokenizer.vocab_size,
        "added_tokens": sorted(tokenizer.special_tokens),
    }


def add_completion_routes(app: FastAPI, state: ServedModel) -> None:
    """Serve ``/v1/completions``, ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` on ``app`` (whose
    ``APIError`` handler answers a malformed body, ``parse_body``: JSON whatever the Content-Type, as the chat
    route takes it, and a ``CompletionError``)."""
    scorer = _Scorer(state.engine.model)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse_body(request, CompletionRequest)
        check_model(state.model_name, body.model)
        refuse_unsupported(body.refusals())
        completion = await in_worker_thread(_Completion, state, scorer, body)  # tokenizing off the loop
        if body.stream:
            return StreamingResponse(completion.stream(), media_type="text/event-stream")
        async with cancel_on_disconnect(request, completion.cancel):
            return await completion.response()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest)
        check_model(state.model_name, body.model)
        return await in_worker_thread(_tokenize, state, body)  # a long prompt must not stall /health, streams

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest)
        check_model(state.model_name, body.model)
        vocab = state.tokenizer.vocab_size
        _check_vocabulary(body.tokens, vocab, "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return _tokenizer_info(state)
