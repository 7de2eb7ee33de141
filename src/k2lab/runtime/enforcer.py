"""The decoding enforcer: once a tool call opens, only well-formed calls to declared tools can be sampled.

K2 (tech report): "A decoding enforcer guarantees syntax after a tool-call start token; it does not prove
that the model selected the right tool." After ``<|tool_calls_section_begin|>`` every sampled token must
keep the output a prefix of

    <|tool_call_begin|> functions.{name}:{idx} <|tool_call_argument_begin|> {json} <|tool_call_end|>  (×1..n)
    <|tool_calls_section_end|>

with ``name`` one of the declared tools and ``{json}`` an instance of that tool's JSON Schema (objects,
properties, required, string / number / integer / boolean / null, enums, arrays, nesting; ``minLength``,
``maxLength``, ``pattern``, ``minItems``, ``maxItems``, ``minimum``, ``maximum``, ``exclusiveMinimum``,
``exclusiveMaximum``, ``multipleOf``); the turn then ends with ``<|im_end|>``. The grammar is compiled by
llguidance (the structured-generation library that vLLM, SGLang and llama.cpp use) from a Lark grammar
with one inline ``%json`` schema per tool; the token mask is computed per step on CPU. Numbers are
bounded first (``k2lab.runtime.schema_bounds``: integers within int64, ≤ 19 digits; other numbers ≤ 17
significant digits, no exponent), so no number runs on. A schema with no finite value (a required ``$ref``
recursion with no way out) is refused at build (``require_finite_value``), as llguidance refuses the other
unsatisfiable ones.

**Budget.** A constraint built with ``max_tokens`` (``ToolCallGrammar.constraint(max_tokens)``) counts
its own ``advance`` calls, so at each step it knows ``left``, the tokens still to be sampled (this one
included), and ``U(s)``, the length of a known completion that closes the section from the matcher's
state (``k2lab.runtime.budget``). While ``left − 1 ≥ U(s) + slack`` (``slack`` = the length of a whole
shortest call: what opening another call adds to ``U``, and more than one token adds inside a call unless
it opens an optional property or ``anyOf`` branch whose own shortest value is longer than a whole call —
the case this bound does not cover) the grammar's mask is all. Nearer the end it
steers: a token ``t`` stays allowed only if a completion of ``≤ left − 1`` tokens is known after it. The
witness's next token always qualifies, and the model's most likely other allowed tokens are tested
(consume, search, roll back), at most ``STEER_CANDIDATES`` of them and only until the tested ones hold
``STEER_MASS`` of the softmax of the logits (a peaked model tests one or two). So a forced call closes within any ``max_tokens ≥ U``
of the start; with less the budget runs out (``finish_reason: "length"``). In ``"auto"`` mode a section
may only open while a whole shortest call still fits.

``tool_choice`` (OpenAI): ``"auto"`` leaves text free until the model opens a section; ``"required"``
and ``{"type": "function", "function": {"name": ...}}`` force a section from the first token (the latter
with that tool only); ``"none"`` forbids opening one. ``parallel_tool_calls=False`` allows one call.

**Markup.** The section's syntax is a ``Markup``: K2's (``K2_MARKUP``, the grammar above; its trigger is
the one token ``<|tool_calls_section_begin|>``) or K3's XTML tools channel (``k2lab.runtime.tool_grammar_k3``),
whose trigger ``<|open|>tools<|sep|>`` is several tokens. It is recognised on text, whatever pieces spell
it: after its first token (``<|open|>``) the constraint decodes what follows, and while that is a prefix of
the trigger's words (``tools``; no special token among them) the trigger's last token (``<|sep|>``) would
complete it once the words are whole. In ``"auto"`` mode sampling that token starts the grammar (fed the
tokens as sampled); ``"none"`` (or a budget too short for a whole call) masks it then.
A forced K3 section starts with the channels before it (closed, empty). Schemas compile the same way for
both (``tool_schema``: closed objects, bounded numbers, then llguidance's ``%json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any
from urllib.parse import unquote

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import K2LabError
from k2lab.runtime.budget import CompletionSearch
from k2lab.runtime.schema_bounds import DATA_KEYS, bounded_numbers

__all__ = [
    "JSON_OPTIONS",
    "K2_MARKUP",
    "GrammarError",
    "Markup",
    "ToolCallConstraint",
    "ToolCallGrammar",
    "ToolChoiceError",
    "lark_string",
    "ll_tokenizer",
    "pack_token_mask",
    "require_finite_value",
    "tool_name",
    "tool_schema",
    "unpack_token_mask",
]

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
TURN_END = "<|im_end|>"
STEER_CANDIDATES = 8  # allowed tokens (most likely first) tested per step when the budget is tight ...
STEER_MASS = 0.95  # ... until they hold this much of the masked distribution (softmax of the logits)
# compact JSON as K2 writes it (json.dumps separators), no free whitespace between tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def pack_token_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., V] → uint8 [..., ⌈V/8⌉]: bit b of byte i holds token 8i + b (the grammar matcher's little
    bit order). A replayed mask kept for training costs V/8 bytes per position instead of V."""
    pad = (-mask.shape[-1]) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).unflatten(-1, (-1, 8))
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def unpack_token_mask(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """uint8 [..., ⌈V/8⌉] (``pack_token_mask``) → bool [..., V]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).flatten(-2)[..., :vocab_size].bool()


class GrammarError(K2LabError):
    """A tool's schema or the tool set cannot be compiled into a decoding grammar."""


class ToolChoiceError(GrammarError):
    """``tool_choice`` asks for what the declared tools cannot give (an undeclared function, "required"
    without tools, an unknown mode): the request's ``tool_choice`` is at fault, not its ``tools``."""


@lru_cache(maxsize=8)
def _ll_tokenizer(serialized: str, n_vocab: int, eos: int) -> LLTokenizer:
    return LLTokenizer(serialized, n_vocab=n_vocab, eos_token=eos)


def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's view of a k2lab tokenizer (cached: building it walks the whole vocabulary)."""
    return _ll_tokenizer(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_id)


def tool_name(tool: Mapping[str, Any]) -> str:
    return tool["function"]["name"] if "function" in tool else tool["name"]


def tool_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema as the grammar compiles it: closed objects, bounded numbers."""
    function = tool.get("function", tool)
    schema = function.get("parameters") or {"type": "object", "properties": {}}
    return bounded_numbers(closed_objects(schema))


def closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that does not say otherwise.

    JSON Schema lets an object carry any extra key unless told not to; a tool call should hold the
    declared arguments only (OpenAI's strict mode does the same). Every output stays valid for the
    original schema.
    """
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    closed = {key: closed_objects(value) for key, value in schema.items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def require_finite_value(tool: Mapping[str, Any]) -> None:
    """Refuses a tool whose parameters have no finite value: a local ``$ref`` that every value requires
    again without end (an object whose required property, or an array whose ``minItems``, leads back to it
    on every branch). llguidance compiles such a schema, and a forced call then ran on until its
    fast-forward gave up mid-generation ("Too many items … ff_tokens"): a server error, not a refusal."""
    schema = tool_schema(tool)
    finite = _finite_refs(schema)
    if not _finite(schema, finite):
        unending = ", ".join(sorted(_local_refs(schema) - finite))
        raise GrammarError(
            f"the parameters of tool {tool_name(tool)!r} admit no finite value: the required recursion "
            f"through {unending} never ends"
        )


def _finite_refs(root: Any) -> set[str]:
    """The local ``$ref``s of ``root`` that have a finite value (the least fixed point: none known at first,
    then every one whose schema has a finite value with the ones known so far)."""
    refs, finite = _local_refs(root), set()
    while grown := {ref for ref in refs - finite if _finite(_pointed(root, ref), finite)}:
        finite |= grown
    return finite


def _finite(schema: Any, finite: set[str]) -> bool:
    """Whether ``schema`` has a finite value, the local ``$ref``s in ``finite`` known to have one (no type:
    any, so null). Only required recursion can rule one out here; llguidance judges every other conflict."""
    if not isinstance(schema, Mapping):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in finite:
        return False
    if "enum" in schema or "const" in schema:
        return True
    if not all(_finite(s, finite) for s in _schemas(schema.get("allOf"))):
        return False
    if any(
        key in schema and not any(_finite(s, finite) for s in _schemas(schema[key]))
        for key in ("anyOf", "oneOf")
    ):
        return False
    kinds = schema.get("type", "null")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return any(_finite_as(schema, kind, finite) for kind in kinds)


def _finite_as(schema: Mapping[str, Any], kind: Any, finite: set[str]) -> bool:
    """Whether ``schema`` has a finite value of type ``kind``: its required properties and items do."""
    if kind == "object":
        properties, extra = schema.get("properties"), schema.get("additionalProperties", True)
        properties = properties if isinstance(properties, Mapping) else {}
        names = [n for n in _schemas(schema.get("required")) if isinstance(n, str)]
        return all(_finite(properties.get(name, extra), finite) for name in names)
    if kind == "array":
        need = schema.get("minItems", 0) if isinstance(schema.get("minItems"), int) else 0
        prefix = _schemas(schema.get("prefixItems"))
        rest = need <= len(prefix) or _finite(schema.get("items", True), finite)
        return rest and all(_finite(item, finite) for item in prefix[:need])
    return True


def _schemas(value: Any) -> list[Any]:
    """``value`` if it is a list (of subschemas), else none."""
    return value if isinstance(value, list) else []


def _local_refs(schema: Any) -> set[str]:
    """Every ``$ref`` within the document (``#…``) in ``schema``, at any depth."""
    if isinstance(schema, list):
        return set().union(*map(_local_refs, schema))
    if not isinstance(schema, Mapping):
        return set()
    ref = schema.get("$ref")
    refs = {ref} if isinstance(ref, str) and ref.startswith("#") else set()
    return refs.union(*(_local_refs(v) for k, v in schema.items() if k not in DATA_KEYS))


def _pointed(root: Any, ref: str) -> Any:
    """The subschema of ``root`` that a local ``$ref`` (a JSON pointer after ``#``) names; None if none."""
    node = root
    for part in ref[1:].split("/")[1:]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lark string literal


def tool_calls_lark(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
    """The Lark grammar of one tool-call section over ``tools`` (OpenAI tool specs)."""
    if not tools:
        raise GrammarError("a tool-call grammar needs at least one tool")
    alternatives = []
    for i, tool in enumerate(tools):
        schema = {**tool_schema(tool), "x-guidance": JSON_OPTIONS}
        alternatives.append(
            f"tool_{i}: {lark_string('functions.' + tool_name(tool) + ':')} IDX {ARGUMENT_BEGIN} "
            f"%json {json.dumps(schema)}"
        )
    repeat = "+" if parallel else ""
    return "\n".join(
        [
            f"start: {SECTION_BEGIN} call{repeat} {SECTION_END}",
            f"call: {CALL_BEGIN} ({' | '.join(f'tool_{i}' for i in range(len(tools)))}) {CALL_END}",
            *alternatives,
            "IDX: /[0-9]{1,4}/",
        ]
    )


@dataclass(frozen=True)
class Markup:
    """A tool-call syntax: what opens a section (``trigger``, text), the special token that ends its grammar
    (``section_end``, accepted only when the grammar is complete), the token that then ends the turn, the
    special tokens that close a piece of it (most final first; ``k2lab.runtime.budget``) and its Lark
    grammar ``lark(tools, parallel, forced)`` (``forced``: from the first generated token on)."""

    trigger: str
    section_end: str
    turn_end: str
    closers: tuple[str, ...]
    lark: Callable[[Sequence[Mapping[str, Any]], bool, bool], str]


K2_MARKUP = Markup(
    SECTION_BEGIN,
    SECTION_END,
    TURN_END,
    (SECTION_END, CALL_END, ARGUMENT_BEGIN),
    lambda tools, parallel, forced: tool_calls_lark(tools, parallel),
)


@dataclass(frozen=True)
class ToolCallGrammar:
    """A compiled grammar for one request: tools, tool_choice and parallel_tool_calls."""

    grammar: str
    tokenizer: LLTokenizer
    forced: bool  # a section must start at the first generated token
    allowed: bool  # the model may open a section at all
    trigger: tuple[int, ...]  # the tokens that open a section (K2: one)
    section_end: int
    turn_end: int
    vocab_size: int
    closers: tuple[int, ...]  # special tokens that end a piece of the section, most final first

    @property
    def section_begin(self) -> int:
        """The trigger's last token: the one ``"none"`` masks."""
        return self.trigger[-1]

    @cached_property
    def pristine_matcher(self) -> LLMatcher:
        """A matcher at the grammar's start, never advanced: each section copies it (``deep_copy``, ~1 µs)
        instead of compiling the grammar again (``LLMatcher(...)``, ~2 ms)."""
        matcher = LLMatcher(self.tokenizer, self.grammar)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    @cached_property
    def trigger_words(self) -> bytes:
        """The bytes between the trigger's first and last tokens (K3: ``tools``; K2: none)."""
        return self.tokenizer.decode_bytes(list(self.trigger[1:-1]))

    @classmethod
    def build(
        cls,
        tokenizer: Tokenizer,
        vocab_size: int,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        markup: Markup = K2_MARKUP,
    ) -> ToolCallGrammar:
        tools = list(tools or [])
        forced, allowed = False, bool(tools)
        if isinstance(tool_choice, Mapping):
            name = (tool_choice.get("function") or {}).get("name")
            tools = [t for t in tools if tool_name(t) == name]
            if not tools:
                raise ToolChoiceError(
                    f"tool_choice names the function {name!r}, which is not among the tools"
                )
            forced = True
        elif tool_choice == "required":
            if not tools:
                raise ToolChoiceError('tool_choice "required" needs at least one tool')
            forced = True
        elif tool_choice == "none":
            allowed = False
        elif tool_choice != "auto":
            raise ToolChoiceError(
                f'tool_choice must be "auto", "none", "required" or a function, not {tool_choice!r}'
            )
        special = tokenizer.special_tokens
        missing = [t for t in (markup.section_end, markup.turn_end, *markup.closers) if t not in special]
        if missing:
            raise GrammarError(f"the tokenizer lacks the tool-call tokens {', '.join(missing)}")
        grammar = ""
        ll = ll_tokenizer(tokenizer, vocab_size)
        if allowed:
            grammar = LLMatcher.grammar_from_lark(markup.lark(tools, parallel_tool_calls, forced))
            problem = LLMatcher.validate_grammar(grammar, ll)
            if problem:
                raise GrammarError(
                    f"the tools' schemas cannot be compiled into a decoding grammar: {problem}"
                )
            for tool in tools:
                require_finite_value(tool)
        return cls(
            grammar,
            ll,
            forced,
            allowed,
            tuple(tokenizer.encode(markup.trigger)),
            special[markup.section_end],
            special[markup.turn_end],
            vocab_size,
            tuple(special[t] for t in markup.closers),
        )

    def constraint(self, max_tokens: int | None = None) -> ToolCallConstraint:
        """The per-sequence state machine for one generation of at most ``max_tokens`` tokens (None: no
        budget steering)."""
        return ToolCallConstraint(self, max_tokens)

    @cached_property
    def search(self) -> CompletionSearch:
        """Greedy shortest completions over this grammar's tokenizer."""
        return _search(self.tokenizer, self.vocab_size, self.closers)

    @cached_property
    def shortest_call(self) -> list[int]:
        """A shortest known whole section from its opening token on (``U`` of a fresh matcher)."""
        return list(_shortest_call(self.grammar, self.search)) if self.allowed else []


@lru_cache(maxsize=8)
def _search(tokenizer: LLTokenizer, vocab_size: int, closers: tuple[int, ...]) -> CompletionSearch:
    return CompletionSearch(tokenizer, vocab_size, closers)


@lru_cache(maxsize=64)
def _shortest_call(grammar: str, search: CompletionSearch) -> tuple[int, ...]:
    """Cached across requests: a server builds one grammar per request, mostly from the same tools."""
    path = search.shortest(LLMatcher(search.tokenizer, grammar), 4096)
    if path is None:
        raise GrammarError("the tools' schemas admit no tool call the enforcer can find")
    return tuple(path)


class ToolCallConstraint:
    """Per sequence: free text, then (inside a tool-call section) the grammar's mask, then ``<|im_end|>``.

    ``mask(logits)`` sets disallowed logits to −inf in place ([V]); ``advance(token)`` records the sampled
    token. ``in_call`` is True while a section is open. With ``max_tokens`` the mask also steers the call
    to close within the budget (module doc); ``allowed_tokens()`` is the grammar's mask alone.
    """

    def __init__(self, grammar: ToolCallGrammar, max_tokens: int | None = None) -> None:
        self.grammar, self.max_tokens = grammar, max_tokens
        self.matcher: LLMatcher | None = None
        self.finished_section = False
        self.used = 0  # tokens advanced so far
        self.path: list[int] | None = None  # a known completion from the matcher's state
        self.hopeless = False  # no completion fits the budget left
        self.reused = False  # ``path`` was carried over from an earlier state (maybe not the shortest)
        self._after: dict[int, tuple[list[int], bool]] = {}  # tested token -> (completion after it, reused)
        self.opening: list[int] = []  # outside a section: the trigger's first token and what followed it,
        self.spelled = b""  # ... while the bytes after it (these) are a prefix of the trigger's words
        if grammar.forced:
            self._open()

    @property
    def in_call(self) -> bool:
        return self.matcher is not None

    @property
    def left(self) -> int | None:
        """Tokens still to be sampled, the next one included (None without a budget)."""
        return None if self.max_tokens is None else self.max_tokens - self.used

    def _open(self) -> None:
        self.matcher = self.grammar.pristine_matcher.deep_copy()

    def _trigger_next(self) -> bool:
        """Whether the trigger's last token would complete it now: its first token was sampled and the text
        since spells its words, in any pieces (a one-token trigger: always, until a section finished)."""
        if self.finished_section:
            return False
        g = self.grammar
        return len(g.trigger) == 1 or (bool(self.opening) and self.spelled == g.trigger_words)

    def _track(self, token: int) -> None:
        """Follow a token sampled outside a section: does it start, continue or break a trigger?"""
        g = self.grammar
        if len(g.trigger) == 1:
            return
        if token == g.trigger[0]:
            self.opening, self.spelled = [token], b""
        elif self.opening:
            spelled = self.spelled + g.tokenizer.decode_bytes([token])
            if g.tokenizer.is_special_token(token) or not g.trigger_words.startswith(spelled):
                self.opening, self.spelled = [], b""
            else:
                self.opening, self.spelled = [*self.opening, token], spelled

    def _without_trigger(self) -> torch.Tensor:
        allowed = torch.ones(self.grammar.vocab_size, dtype=torch.bool)
        allowed[self.grammar.section_begin] = False
        return allowed

    def allowed_tokens(self) -> torch.Tensor | None:
        """Bool [V] of the tokens the grammar allows next, or None when any token may."""
        g = self.grammar
        if self.finished_section:
            allowed = torch.zeros(g.vocab_size, dtype=torch.bool)
            allowed[g.turn_end] = True
            return allowed
        if self.matcher is None:
            return None if g.allowed or not self._trigger_next() else self._without_trigger()
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[: g.vocab_size]
        return torch.from_numpy(bits.astype(bool))

    def mask(self, logits: torch.Tensor) -> None:
        allowed = self.allowed_tokens()
        if self.max_tokens is not None:
            allowed = self._steered(allowed, logits)
        if allowed is not None:
            logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def _steered(self, allowed: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
        """``allowed`` narrowed to the tokens after which the section can still close in budget."""
        g, left = self.grammar, self.left
        if self.matcher is None:
            rest = len(g.shortest_call) - (len(g.trigger) - 1)  # a whole call from the trigger's last token
            if allowed is None and rest > left and self._trigger_next():  # ... no longer fits
                allowed = self._without_trigger()
            return allowed
        if self.path is None and not self.hopeless:
            self.path = g.search.shortest(self.matcher, left)
            self.hopeless = self.path is None
        if self.hopeless or not self.path:  # it cannot close in budget any more: grammar only
            return allowed
        if left - 1 >= len(self.path) + len(g.shortest_call):
            return allowed
        if self.reused:  # a path carried over from an earlier state may be longer than needed
            self.path, self.reused = g.search.shortest(self.matcher, len(self.path) - 1) or self.path, False
        witness = self.path[0]
        keep = torch.zeros(g.vocab_size, dtype=torch.bool)
        keep[witness] = True
        self._after = {witness: (self.path[1:], False)}
        scores = logits.detach().float().cpu().masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(-1)
        covered = float(probs[witness])
        for token in scores.topk(min(STEER_CANDIDATES, g.vocab_size)).indices.tolist():
            if covered >= STEER_MASS or not allowed[token]:
                break
            if token == witness:
                continue
            covered += float(probs[token])
            self.matcher.consume_token(token)
            after = self._completion_after(token, left - 1)
            self.matcher.rollback(1)
            if after[0] is not None:
                keep[token], self._after[token] = True, after
        return keep

    def _completion_after(self, token: int, limit: int) -> tuple[list[int] | None, bool]:
        """With ``token`` just consumed: a completion of ``≤ limit`` tokens or None, and whether it is a
        reused one (the known path's rest or the known path itself, when they still complete) rather than
        a fresh search's."""
        path = self.path or []
        if path and path[0] == token:
            return path[1:], False
        for candidate in (path[1:], path):
            if candidate and len(candidate) <= limit and CompletionSearch.completes(self.matcher, candidate):
                return candidate, True
        return self.grammar.search.shortest(self.matcher, limit), False

    def advance(self, token: int) -> None:
        g = self.grammar
        self.used += 1
        if self.matcher is None:
            if token == g.section_begin and g.allowed and self._trigger_next():
                self._open()
                for piece in [*self.opening, token]:  # the trigger as sampled (opening: [] for one token)
                    self._consume(piece)  # the grammar reads its text
                return
            self._track(token)
            return
        self._consume(token)
        if token == g.section_end and self.matcher.is_accepting():
            self.matcher, self.finished_section = None, True
        elif self.max_tokens is not None and self.path:
            known = self._after.get(token)
            self.path, self.reused = known if known is not None else self._completion_after(token, self.left)
        self._after = {}

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} violates the tool-call grammar: {self.matcher.get_error()}")
