"""TypeScript tool declarations stay small: recursive ``$ref``s render ``any``, inlining has a budget."""

from __future__ import annotations

from typing import Any

from k2lab.runtime.chat import render_chat
from k2lab.runtime.tool_spec import tool_to_typescript

TREE = {
    "type": "object",
    "properties": {"node": {"$ref": "#/$defs/node"}},
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
        }
    },
}


def function_tool(parameters: dict[str, Any], name: str = "t") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def self_referencing(width: int) -> dict[str, Any]:
    """One ``$def`` whose ``width`` properties each refer to it again (291 bytes at width 6)."""
    properties = {f"p{i}": {"$ref": "#/$defs/n"} for i in range(width)}
    return {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/n"}},
        "$defs": {"n": {"type": "object", "properties": properties}},
    }


def chain(width: int, length: int) -> dict[str, Any]:
    """A non-recursive chain of ``$defs``, each with ``width`` properties referring to the next."""
    defs: dict[str, Any] = {
        f"d{i}": {
            "type": "object",
            "properties": {f"p{j}": {"$ref": f"#/$defs/d{i + 1}"} for j in range(width)},
        }
        for i in range(length)
    }
    defs[f"d{length}"] = {"type": "string"}
    return {"type": "object", "properties": {"r": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def test_a_recursive_ref_renders_any_where_it_recurs() -> None:
    assert tool_to_typescript(function_tool(TREE, "tree")) == (
        "type tree = (_: {\n  node?: {\n    name?: string;\n    kids?: any[];\n  };\n}) => any;"
    )


def test_a_self_referencing_schema_renders_small() -> None:
    text = render_chat([{"role": "user", "content": "hi"}], [function_tool(self_referencing(6), "wide")])
    assert len(text) < 1000  # was 60.9 M characters (8.8 s), exponential in the width
    assert text.count("p5?: any;") == 1


def test_inlining_stops_at_the_budget() -> None:
    within = tool_to_typescript(function_tool(chain(2, 7)))  # 1 + 2 + ... + 128 = 255 inlinings: all of them
    assert within.count("string;") == 2**7 and "any" not in within.removesuffix("=> any;")
    beyond = tool_to_typescript(function_tool(chain(3, 10)))  # 9841 inlinings without the budget
    assert beyond.count("{") == 256 + 1 and len(beyond) < 50_000  # MAX_REF_EXPANSIONS, plus the root
