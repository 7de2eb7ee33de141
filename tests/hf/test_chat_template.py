"""The exported chat template against k2lab's renderer: transformers' ``apply_chat_template`` (tokenizer loaded
from an export) gives byte-identical text to ``render_chat`` over seeded random conversations, and the same ids
as ``encode_chat``; the exported tokenizer encodes any text (special-token strings included) as ours does.

The generator draws system / developer / user / assistant turns, assistant thinking (absent, empty or text),
tool calls (parallel ones, client ids absent, repeated or unknown, arguments as objects or JSON strings),
tool results in any order, content as strings or lists of text parts, unicode and empty texts, and tool specs
whose JSON Schemas use every construct ``k2lab.runtime.tool_spec`` renders (nested objects, arrays of unions,
enums, const, anyOf / oneOf / allOf, type lists, nullable, ``$ref`` incl. recursive, additionalProperties,
defaults, quoted property names, multi-line descriptions).
"""

from __future__ import annotations

import json
import random
import tomllib
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest

from k2lab.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from k2lab.hf.chat_template import TEMPLATE_FILE, chat_template
from k2lab.runtime.chat import GENERATION_PROMPT, ChatFormatError, encode_chat, render_chat
from tests.runtime.test_chat import CONVERSATION, GOLDEN, WEATHER
from tests.runtime.test_tool_spec import TREE, chain, function_tool, self_referencing

transformers = pytest.importorskip("transformers")

CASES = 300
PIECES = [
    "hello", " world", "x", "42", " ", "  ", "\n", "\n\n", "\r\n", "\t", "é", "日本語", "🎉", "ß", "\u2028",
    '"', "'", "\\", "\\n", "{", "}", "[", "]", "|", "&", "<", ">", "//", "<|", "think>", "<think", "</thin",
    "## Return of ", "functions.f:0", "null", "\u00a0", "\x85", "e\u0301",
]  # fmt: skip
NAMES = ["search", "get_weather", "run-code", "f", "Tool_9", "x-y_z"]
KEYS = ["query", "limit", "a-b", "1st", "$ok", "_p", "ünï", "mode", "items", "keys", "with space"]


def text(rng: random.Random, most: int = 6) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, most)))


def content(rng: random.Random) -> str | list[dict[str, str]]:
    if rng.random() < 0.2:
        return [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
    return text(rng)


def schema(rng: random.Random, depth: int) -> Any:
    """A random JSON Schema of at most ``depth`` nested levels."""
    kind = rng.choice(
        [
            "string",
            "number",
            "integer",
            "boolean",
            "null",
            "array",
            "object",
            "enum",
            "const",
            "anyOf",
            "oneOf",
        ]
        + ["allOf", "list", "ref", "record", "empty", "bool"]
    )
    if depth <= 0 and kind in ("array", "object", "anyOf", "oneOf", "allOf", "record"):
        kind = "string"
    out: dict[str, Any]
    if kind == "array":
        out = {"type": "array"} | ({"items": schema(rng, depth - 1)} if rng.random() < 0.8 else {})
    elif kind == "object":
        out = object_schema(rng, depth - 1)
    elif kind == "enum":
        out = {
            "enum": [
                rng.choice(["a", "b|c", 'q"t', 1, 2.5, None, True, "é"]) for _ in range(rng.randint(1, 3))
            ]
        }
    elif kind == "const":
        out = {"const": rng.choice(["on", 0, {"k": [1, "x"]}, False])}
    elif kind in ("anyOf", "oneOf", "allOf"):
        out = {kind: [schema(rng, depth - 1) for _ in range(rng.randint(1, 3))]}
    elif kind == "list":
        out = {
            "type": rng.sample(["string", "number", "integer", "null", "boolean", "array"], rng.randint(1, 3))
        }
    elif kind == "ref":
        out = {"$ref": rng.choice(["#/$defs/Node", "#/$defs/Name", "#/definitions/Missing", "http://x/y"])}
    elif kind == "record":
        out = {
            "type": "object",
            "additionalProperties": schema(rng, depth - 1) if rng.random() < 0.7 else True,
        }
    elif kind == "empty":
        out = {}
    elif kind == "bool":
        return rng.choice([True, False])
    else:
        out = {"type": kind}
    if rng.random() < 0.3:
        out["description"] = rng.choice(
            ["One line.", "  Two\n  lines  \n\n", "trailing  ", "", "\n", text(rng)]
        )
    if rng.random() < 0.15:
        out["nullable"] = True
    if rng.random() < 0.15:
        out["default"] = rng.choice([10, "x", None, [1, "é"], {"a": True}])
    return out


def object_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = rng.sample(KEYS, rng.randint(0, 4))
    out: dict[str, Any] = {"type": "object", "properties": {key: schema(rng, depth) for key in keys}}
    if keys and rng.random() < 0.6:
        out["required"] = rng.sample(keys, rng.randint(0, len(keys)))
    return out


def tool(rng: random.Random, name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if rng.random() < 0.7:
        function["description"] = rng.choice(["Search the web.", "Line one.\nLine two.  ", " ", text(rng)])
    roll = rng.random()
    if roll < 0.75:
        parameters = object_schema(rng, 2)
        node = {
            "type": "object",
            "properties": {"name": {"type": "string"}, "child": {"$ref": "#/$defs/Node"}},
        }
        parameters["$defs"] = {"Node": node, "Name": {"type": "string", "description": "A name."}}
        function["parameters"] = parameters
    elif roll < 0.85:
        function["parameters"] = None
    return {"type": "function", "function": function}


def tool_calls(rng: random.Random, used: list[str]) -> list[dict[str, Any]]:
    calls = []
    for _ in range(rng.randint(1, 3)):
        call: dict[str, Any] = {"type": "function", "function": {"name": rng.choice(NAMES)}}
        roll = rng.random()
        if roll < 0.6:
            call["id"] = rng.choice(used) if used and rng.random() < 0.2 else f"call_{rng.randrange(10**6)}"
            used.append(call["id"])
        elif roll < 0.7:
            call["id"] = ""
        arguments = {
            rng.choice(KEYS): rng.choice([text(rng), 3, [1.5, None], {"é": "日本"}]) for _ in range(2)
        }
        form = rng.random()
        if form < 0.45:
            call["function"]["arguments"] = arguments
        elif form < 0.9:
            call["function"]["arguments"] = json.dumps(
                arguments, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1])
            )
        calls.append(call)
    return calls


def assistant(rng: random.Random, used: list[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": rng.choice([None, "", content(rng)])}
    if rng.random() < 0.5:
        message["reasoning_content"] = rng.choice(["", text(rng, 10)])
    if rng.random() < 0.5:
        message["tool_calls"] = tool_calls(rng, used)
    elif rng.random() < 0.1:
        message["tool_calls"] = []
    return message


def results(rng: random.Random, calls: list[dict[str, Any]], seen: int) -> list[dict[str, Any]]:
    """Tool messages answering ``calls`` (in a random order), by client id, K2 id or an unknown id."""
    answers = []
    for index, call in enumerate(calls):
        k2_id = f"functions.{call['function']['name']}:{seen + index}"
        call_id = call.get("id") or k2_id
        call_id = rng.choice([call_id, call_id, k2_id, "unknown-7"])
        answers.append({"role": "tool", "tool_call_id": call_id, "content": content(rng)})
    rng.shuffle(answers)
    return answers


def conversation(rng: random.Random) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": rng.choice(["system", "developer"]), "content": content(rng)})
    used: list[str] = []
    seen = 0
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": content(rng)})
        for _ in range(rng.randint(0, 2)):
            turn = assistant(rng, used)
            messages.append(turn)
            calls = turn.get("tool_calls") or []
            messages += results(rng, calls, seen) if rng.random() < 0.9 else []
            seen += len(calls)
    return messages


def case(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str, bool]:
    """A conversation ``render_chat`` accepts, its tools (or None), tool format and generation prompt."""
    rng = random.Random(seed)
    while True:
        messages = conversation(rng)
        names = rng.sample(NAMES, rng.randint(0, 3))
        tools = [tool(rng, name) for name in names] or None
        tool_format = rng.choice(["typescript", "typescript", "json"])
        prompt = rng.random() < 0.5
        try:
            render_chat(messages, tools, tool_format, prompt)
        except ChatFormatError:
            continue  # e.g. content starting with <think> without reasoning: ours refuses, so does the test
        return messages, tools, tool_format, prompt


@pytest.fixture(scope="module")
def hf_tokenizer(exported: Path):
    return transformers.AutoTokenizer.from_pretrained(str(exported))


def test_the_template_is_package_data():
    """It ships in the wheel: pyproject's package-data for k2lab.hf matches the file."""
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["k2lab.hf"]
    assert any(fnmatch(TEMPLATE_FILE, pattern) for pattern in patterns)
    assert chat_template().startswith("{#- k2lab's chat template")


def test_the_export_carries_the_packaged_template(hf_tokenizer, exported: Path):
    assert hf_tokenizer.chat_template == chat_template()
    assert (exported / "chat_template.jinja").read_text() == chat_template()
    assert json.loads((exported / "tokenizer_config.json").read_text())["chat_template"] == chat_template()


@pytest.mark.parametrize("block", range(6))
def test_apply_chat_template_equals_render_chat(hf_tokenizer, tokenizer: Tokenizer, block: int):
    kinds = {"tools": 0, "calls": 0, "thinking": 0, "parallel": 0, "results": 0}
    for seed in range(block * CASES // 6, (block + 1) * CASES // 6):
        messages, tools, tool_format, prompt = case(seed)
        ours = render_chat(messages, tools, tool_format, prompt)
        theirs = hf_tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=prompt, tokenize=False, tool_format=tool_format
        )
        assert theirs == ours, f"seed {seed}"
        if seed % 5 == 0:  # and the ids transformers tokenises it to
            ids = hf_tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=prompt,
                tool_format=tool_format,
                return_dict=False,
            )
            assert list(ids) == encode_chat(tokenizer, ours).ids, f"seed {seed}"
        assistants = [m for m in messages if m["role"] == "assistant"]
        kinds["tools"] += tools is not None
        kinds["calls"] += any(m.get("tool_calls") for m in assistants)
        kinds["parallel"] += any(len(m.get("tool_calls") or []) > 1 for m in assistants)
        kinds["thinking"] += any(m.get("reasoning_content") is not None for m in assistants)
        kinds["results"] += any(m["role"] == "tool" for m in messages)
    assert min(kinds.values()) >= 5, kinds  # the generator reaches every feature


def test_the_golden_conversation_of_the_renderer_tests(hf_tokenizer):
    """``tests/runtime/test_chat.py``'s hand-checked text: thinking, a renumbered call, its result."""
    for prompt in (True, False):
        text = hf_tokenizer.apply_chat_template(
            CONVERSATION, tools=[WEATHER], add_generation_prompt=prompt, tokenize=False
        )
        assert text == (GOLDEN if prompt else GOLDEN.removesuffix(GENERATION_PROMPT))


def test_the_template_bounds_ref_inlining_as_render_chat_does(hf_tokenizer):
    """Recursive refs render ``any``, and inlining stops after 256 refs (of a DAG of 9841)."""
    tools = [
        function_tool(TREE, "tree"),
        function_tool(self_referencing(6), "wide"),
        function_tool(chain(3, 10), "dag"),
    ]
    messages = [{"role": "user", "content": "hi"}]
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text == render_chat(messages, tools) and len(text) < 50_000


@pytest.mark.parametrize("seed", range(4))
def test_exported_tokenizer_encodes_like_ours(hf_tokenizer, tokenizer: Tokenizer, seed: int):
    rng = random.Random(seed)
    pieces = [*PIECES, *SPECIAL_TOKENS, "<|im_end", "im_end|>", "<|unknown|>"]
    for _ in range(50):
        sample = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 20)))
        ids = tokenizer.encode(sample)
        assert hf_tokenizer.encode(sample, add_special_tokens=False) == ids, repr(sample)
        assert hf_tokenizer(sample)["input_ids"] == ids  # nothing added around the text
        assert hf_tokenizer.decode(ids) == tokenizer.decode(ids) == sample


def test_tokenizers_library_reads_the_export(exported: Path, tokenizer: Tokenizer):
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer.from_file(str(exported / "tokenizer.json"))
    sample = "<|im_user|>user<|im_middle|>héllo 🎉<|im_end|>"
    assert backend.encode(sample, add_special_tokens=False).ids == tokenizer.encode(sample)
