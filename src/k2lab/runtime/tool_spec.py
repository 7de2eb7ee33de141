"""OpenAI tool specs: validation and K2's tool-declaration text (TypeScript by default, JSON as the option).

A tool spec is OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}`` with
``parameters`` a JSON Schema object. K2's tool-call guidance: "Declarations are primarily expressed in
TypeScript to save context, with some JSON retained for framework compatibility." ``tools_to_typescript``
renders one ``namespace functions`` block, one ``type`` per tool, descriptions as ``//`` comments::

    namespace functions {
    // Search the web.
    type search = (_: {
      // The query.
      query: string;
      limit?: number; // default: 10
      mode?: "fast" | "deep";
      tags?: string[];
      filter?: {
        site?: string;
      };
    }) => any;
    }

Type mapping: string/boolean/null keep their names, number and integer are ``number``, ``enum`` / ``const``
become unions of JSON literals, arrays ``T[]`` (``(A | B)[]`` for unions, ``any[]`` without ``items``),
objects with ``properties`` are written inline (a property without a ``required`` entry gets ``?``),
objects without them ``object`` or ``Record<string, T>`` (``additionalProperties`` schema), type lists /
``anyOf`` / ``oneOf`` unions, ``allOf`` intersections, ``nullable: true`` adds ``| null``, local
``$ref`` (``#/$defs/X``, ``#/definitions/X``) is inlined, anything else ``any``. A ``$ref`` becomes ``any``
instead when it is recursive (already being inlined on the path to it), 8 references deep, or past the
declaration's first 256 inlinings: a small schema cannot render to a huge prompt (K2's Hugging Face template
does the same). A tool without parameters (or with no properties) is ``type name = () => any;``.

``tools_to_json`` is the JSON form: the validated tool list as compact JSON (separators ``,`` and ``:``,
non-ASCII kept), as K2's Hugging Face template writes ``tools | tojson``.

``validate_tools`` checks specs and raises ``ToolSpecError`` listing every problem with its path
(``tools[1].function.name: ...``); the server reuses it for request validation.

``schema_validator`` is the one way the project builds a ``jsonschema`` validator for a tool's schema: its
``$ref``s resolve inside the schema (and the bundled metaschemas) only, so a harvested schema can never make
k2lab fetch a URL. ``json_schema_problems`` says why a schema cannot be used that way (it breaks its
metaschema, or a ``$ref`` does not resolve within it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k2lab.errors import K2LabError
from k2lab.runtime.schema_bounds import DATA_KEYS

if TYPE_CHECKING:
    from jsonschema.protocols import Validator
    from referencing import Registry, Resolver, Specification

__all__ = [
    "TOOL_NAME_PATTERN",
    "ToolSpecError",
    "json_schema_problems",
    "render_tool_declaration",
    "schema_validator",
    "schema_to_typescript",
    "tool_to_typescript",
    "tools_to_json",
    "tools_to_typescript",
    "validate_tool",
    "validate_tools",
]

TOOL_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
JSON_TYPES = ("string", "number", "integer", "boolean", "null", "array", "object")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
INDENT = "  "
MAX_REF_DEPTH = 8  # references inlined inside one another
MAX_REF_EXPANSIONS = 256  # references inlined in one declaration
# objects and arrays nested in one parameters schema (the renderers and the enforcer recurse through them)
MAX_SCHEMA_DEPTH = 64
REF_KEYWORDS = ("$ref", "$dynamicRef")
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


class ToolSpecError(K2LabError):
    """One or more tool specs are invalid; ``problems`` lists each as ``path: what is wrong``."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        count = len(self.problems)
        super().__init__(f"invalid tool spec ({count} problem{'s' * (count != 1)}): " + "; ".join(problems))


# --------------------------------------------------------------------------------------------- validation


def validate_tools(tools: object) -> list[dict[str, Any]]:
    """The tools as a list of spec dicts (``parameters`` defaulted to an empty object schema).

    Raises ``ToolSpecError`` naming every problem: not a list, a spec that is not
    ``{"type": "function", "function": {...}}``, a name not matching ``^[a-zA-Z0-9_-]{1,64}$``, a
    duplicate name, a non-string description, parameters that are not an object schema or nest objects and
    arrays more than ``MAX_SCHEMA_DEPTH`` deep, malformed properties / required / enum / items / type entries.
    """
    if not isinstance(tools, Sequence) or isinstance(tools, str | bytes):
        raise ToolSpecError([f"tools: must be a list of tool specs, got {type(tools).__name__}"])
    problems: list[str] = []
    names: dict[str, int] = {}
    for index, tool in enumerate(tools):
        problems += _tool_problems(tool, f"tools[{index}]")
        name = _name_of(tool)
        if name is not None and name in names:
            problems.append(
                f"tools[{index}].function.name: duplicate name {name!r} (also tools[{names[name]}])"
            )
        elif name is not None:
            names[name] = index
    if problems:
        raise ToolSpecError(problems)
    return [_with_defaults(tool) for tool in tools]


def validate_tool(tool: object) -> dict[str, Any]:
    """One spec, validated as by ``validate_tools`` (paths read ``tool.function...``)."""
    problems = _tool_problems(tool, "tool")
    if problems:
        raise ToolSpecError(problems)
    return _with_defaults(tool)  # type: ignore[arg-type]


def _name_of(tool: object) -> str | None:
    function = tool.get("function") if isinstance(tool, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    return name if isinstance(name, str) else None


def _with_defaults(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(tool["function"])
    if function.get("parameters") is None:
        function["parameters"] = dict(EMPTY_PARAMETERS)
    return {**tool, "type": "function", "function": function}


def _tool_problems(tool: object, path: str) -> list[str]:
    if not isinstance(tool, Mapping):
        return [f"{path}: must be an object {{'type': 'function', 'function': {{...}}}}"]
    problems = []
    if tool.get("type") != "function":
        problems.append(f"{path}.type: must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        return [*problems, f"{path}.function: must be an object with name, description, parameters"]
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        problems.append(f"{path}.function.name: must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        problems.append(f"{path}.function.description: must be a string, got {type(description).__name__}")
    parameters = function.get("parameters")
    if parameters is not None and (depth := _nesting_problems(parameters, f"{path}.function.parameters")):
        problems += depth  # checked first: the checks below recurse through the schema
    elif parameters is not None:
        problems += _parameters_problems(parameters, f"{path}.function.parameters")
    return problems


def _nesting_problems(value: object, path: str) -> list[str]:
    """A problem when ``value`` nests objects and arrays more than ``MAX_SCHEMA_DEPTH`` deep (counted without
    recursion: such a schema would exhaust Python's stack in the renderers and the enforcer)."""
    level, deepest = [value], 0
    while level:
        deepest += 1
        if deepest > MAX_SCHEMA_DEPTH:
            return [
                f"{path}: objects and arrays nested more than {MAX_SCHEMA_DEPTH} deep; flatten the schema"
            ]
        level = [
            child
            for node in level
            for child in (
                node.values() if isinstance(node, Mapping) else node if isinstance(node, list) else ()
            )
            if isinstance(child, Mapping | list)
        ]
    return []


def _parameters_problems(parameters: object, path: str) -> list[str]:
    if not isinstance(parameters, Mapping):
        return [f"{path}: must be a JSON Schema object, got {type(parameters).__name__}"]
    if parameters.get("type") != "object":
        return [
            f"{path}.type: the parameters must be an object schema (type 'object'), got "
            f"{parameters.get('type')!r}"
        ]
    return _schema_problems(parameters, path)


def _schema_problems(schema: object, path: str) -> list[str]:
    """Structural problems of a (sub)schema: types, properties, required, enum, items, combinators."""
    if isinstance(schema, bool):  # JSON Schema allows true / false
        return []
    if not isinstance(schema, Mapping):
        return [f"{path}: a schema must be an object, got {type(schema).__name__}"]
    problems = _type_problems(schema.get("type"), path)
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, Mapping):
            problems.append(f"{path}.properties: must be an object mapping names to schemas")
        else:
            for key, sub in properties.items():
                problems += _schema_problems(sub, f"{path}.properties.{key}")
    required = schema.get("required")
    if required is not None:
        problems += _required_problems(required, properties, path)
    enum = schema.get("enum")
    if enum is not None and (not isinstance(enum, list) or not enum):
        problems.append(f"{path}.enum: must be a non-empty list, got {enum!r}")
    for key in ("items", "additionalProperties"):
        if key in schema and not isinstance(schema[key], bool):
            problems += _schema_problems(schema[key], f"{path}.{key}")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            options = schema[key]
            if not isinstance(options, list) or not options:
                problems.append(f"{path}.{key}: must be a non-empty list of schemas")
            else:
                for i, option in enumerate(options):
                    problems += _schema_problems(option, f"{path}.{key}[{i}]")
    return problems


def _type_problems(kind: object, path: str) -> list[str]:
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None:
        return []
    bad = [k for k in kinds if k not in JSON_TYPES]
    if bad or not kinds:
        return [f"{path}.type: unknown type {kind!r} (expected one of {', '.join(JSON_TYPES)} or a list)"]
    return []


def _required_problems(required: object, properties: object, path: str) -> list[str]:
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return [f"{path}.required: must be a list of property names, got {required!r}"]
    known = properties if isinstance(properties, Mapping) else {}
    missing = [r for r in required if r not in known]
    return [f"{path}.required: {', '.join(map(repr, missing))} not among the properties"] if missing else []


# --------------------------------------------------------------------------------------- JSON Schema


def schema_validator(schema: Mapping[str, Any] | bool) -> Validator:
    """A ``jsonschema`` validator for ``schema`` (its ``$schema`` dialect, 2020-12 by default) that never
    retrieves anything: without an explicit registry jsonschema would ``urlopen`` any remote ``$ref``, so a
    harvested tool could make k2lab fetch URLs. An unresolvable ``$ref`` raises
    ``referencing.exceptions.Unresolvable`` while validating; ``json_schema_problems`` finds those first."""
    return _validator_class(schema)(schema, registry=_local_registry())


def _validator_class(schema: object) -> type[Validator]:
    from jsonschema.validators import Draft202012Validator, validator_for

    return validator_for(schema, default=Draft202012Validator)


def _local_registry() -> Registry:
    """A registry whose retrieve refuses every URI: references outside the schema are never fetched."""
    from referencing import Registry
    from referencing.exceptions import NoSuchResource

    def refuse(uri: str) -> Any:
        raise NoSuchResource(ref=uri)

    return Registry(retrieve=refuse)


def json_schema_problems(schema: object) -> list[str]:
    """Why ``schema`` cannot validate tool calls: it breaks its dialect's metaschema (one problem, with
    its location), or ``$ref`` / ``$dynamicRef`` values do not resolve within it (remote ones included,
    since nothing is fetched). Empty when the schema is usable."""
    from jsonschema.exceptions import SchemaError
    from referencing.jsonschema import DRAFT202012, specification_with

    try:
        _validator_class(schema).check_schema(schema)
    except SchemaError as error:
        where = "/".join(str(part) for part in error.absolute_path)
        return [error.message + (f" (at /{where})" if where else "")]
    if not isinstance(schema, Mapping):
        return []
    specification = specification_with(schema.get("$schema", ""), default=DRAFT202012)
    resolver = _local_registry().resolver_with_root(specification.create_resource(schema))
    return _ref_problems(schema, "", resolver, specification, schema_map=False)


def _ref_problems(
    node: object, path: str, resolver: Resolver, specification: Specification, schema_map: bool
) -> list[str]:
    """Unresolvable references in ``node`` (a schema, a list of schemas, or a name -> schema map);
    instance data (``enum``, ``const``, ``default``, ``examples``) is not searched."""
    if isinstance(node, list):
        return [
            problem
            for index, item in enumerate(node)
            for problem in _ref_problems(item, f"{path}/{index}", resolver, specification, False)
        ]
    if not isinstance(node, Mapping):
        return []
    if not schema_map and path and isinstance(node.get("$id"), str):
        resolver = resolver.in_subresource(specification.create_resource(node))
    problems = []
    for key, value in node.items():
        if not schema_map and key in REF_KEYWORDS and isinstance(value, str):
            problems += _lookup_problem(resolver, value, f"{path}/{key}")
        elif schema_map or key not in DATA_KEYS:
            child_is_map = not schema_map and key in SCHEMA_MAPS
            problems += _ref_problems(value, f"{path}/{key}", resolver, specification, child_is_map)
    return problems


def _lookup_problem(resolver: Resolver, ref: str, path: str) -> list[str]:
    from referencing.exceptions import Unresolvable

    try:
        resolver.lookup(ref)
    except Unresolvable:
        remote = "" if ref.startswith("#") else "; remote references are never fetched"
        return [f"{ref!r} does not resolve within the schema (at {path}{remote})"]
    return []


# ------------------------------------------------------------------------------------------- TypeScript


def render_tool_declaration(tools: object, tool_format: str = "typescript") -> str:
    """The declaration text for K2's ``tool_declare`` system message: TypeScript or JSON."""
    if tool_format == "typescript":
        return tools_to_typescript(tools)
    if tool_format == "json":
        return tools_to_json(tools)
    raise ToolSpecError([f"tool_format: must be 'typescript' or 'json', got {tool_format!r}"])


def tools_to_json(tools: object) -> str:
    """The validated tools as compact JSON (``[{"type":"function","function":{...}}]``)."""
    return json.dumps(validate_tools(tools), ensure_ascii=False, separators=(",", ":"))


def tools_to_typescript(tools: object) -> str:
    """``namespace functions { ... }`` with one ``type name = (_: {...}) => any;`` per validated tool."""
    body = [tool_to_typescript(tool) for tool in validate_tools(tools)]
    return "namespace functions {\n" + "\n".join(body) + "\n}"


def tool_to_typescript(tool: Mapping[str, Any]) -> str:
    """One tool's ``// description`` lines and ``type name = (_: {...}) => any;`` (no namespace)."""
    function = validate_tool(tool)["function"]
    lines = _comment_lines(function.get("description"), "")
    parameters = function["parameters"]
    if parameters.get("properties"):
        arguments = _object_literal(parameters, _Inlining(parameters), "", ())
        lines.append(f"type {function['name']} = (_: {arguments}) => any;")
    else:
        lines.append(f"type {function['name']} = () => any;")
    return "\n".join(lines)


def schema_to_typescript(schema: object, root: object | None = None) -> str:
    """The TypeScript type of a JSON Schema (objects inline and multi-line, indented from column 0)."""
    return _type(schema, _Inlining(schema if root is None else root), "", ())


@dataclass
class _Inlining:
    """The document a declaration's ``$ref``s point into and how many more of them may still be inlined."""

    root: object
    left: int = MAX_REF_EXPANSIONS


def _comment_lines(text: object, indent: str) -> list[str]:
    if not isinstance(text, str) or not text.strip():
        return []
    return [f"{indent}// {line}".rstrip() for line in text.strip().splitlines()]


def _object_literal(
    schema: Mapping[str, Any], inlining: _Inlining, indent: str, active: tuple[str, ...]
) -> str:
    """``{`` + one ``// desc`` / ``name?: type;`` group per property + ``}``, properties one level in."""
    inner = indent + INDENT
    required = set(schema.get("required") or [])
    lines = ["{"]
    for key, sub in schema["properties"].items():
        sub_schema = sub if isinstance(sub, Mapping) else {}
        lines += _comment_lines(sub_schema.get("description"), inner)
        optional = "" if key in required else "?"
        line = f"{inner}{_property_name(key)}{optional}: {_type(sub_schema, inlining, inner, active)};"
        if "default" in sub_schema:
            line += f" // default: {json.dumps(sub_schema['default'], ensure_ascii=False)}"
        lines.append(line)
    return "\n".join([*lines, indent + "}"])


def _property_name(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$]*", key) else json.dumps(key, ensure_ascii=False)


def _type(schema: object, inlining: _Inlining, indent: str, active: tuple[str, ...]) -> str:
    """The TypeScript type of ``schema``; ``indent`` is the column nested object literals start at."""
    if not isinstance(schema, Mapping):
        return "any"
    if "$ref" in schema:
        return _ref_type(schema["$ref"], inlining, indent, active)
    if "const" in schema:
        return _literal(schema["const"])
    if isinstance(schema.get("enum"), list):
        text = " | ".join(_literal(value) for value in schema["enum"])
    elif "anyOf" in schema or "oneOf" in schema:
        text = _union([_type(s, inlining, indent, active) for s in schema.get("anyOf") or schema["oneOf"]])
    elif "allOf" in schema:
        text = " & ".join(_wrap(_type(s, inlining, indent, active)) for s in schema["allOf"])
    else:
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        text = _union([_single_type(kind, schema, inlining, indent, active) for kind in kinds])
    return _union([text, "null"]) if schema.get("nullable") is True else text


def _single_type(
    kind: object, schema: Mapping[str, Any], inlining: _Inlining, indent: str, active: tuple[str, ...]
) -> str:
    if kind in ("string", "boolean", "null"):
        return str(kind)
    if kind in ("number", "integer"):
        return "number"
    if kind == "array":
        items = schema.get("items")
        return f"{_wrap(_type(items, inlining, indent, active))}[]" if isinstance(items, Mapping) else "any[]"
    if kind == "object" or (kind is None and "properties" in schema):
        return _object_type(schema, inlining, indent, active)
    return "any"


def _object_type(schema: Mapping[str, Any], inlining: _Inlining, indent: str, active: tuple[str, ...]) -> str:
    if isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        return _object_literal(schema, inlining, indent, active)
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        return f"Record<string, {_type(extra, inlining, indent, active)}>"
    return "object"


def _ref_type(ref: object, inlining: _Inlining, indent: str, active: tuple[str, ...]) -> str:
    """Inline a local ``#/$defs/X`` or ``#/definitions/X`` reference. It is ``any`` when it is already being
    inlined on this path (recursion), is ``MAX_REF_DEPTH`` references deep, comes after the declaration's
    ``MAX_REF_EXPANSIONS`` inlinings, or does not point at a schema: so every declaration stays small."""
    if not isinstance(ref, str) or not ref.startswith("#/") or ref in active or len(active) >= MAX_REF_DEPTH:
        return "any"
    target: object = inlining.root
    for part in ref[2:].split("/"):
        target = target.get(part) if isinstance(target, Mapping) else None
    if not isinstance(target, Mapping) or inlining.left <= 0:
        return "any"
    inlining.left -= 1
    return _type(target, inlining, indent, (*active, ref))


def _literal(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _union(parts: list[str]) -> str:
    unique = list(dict.fromkeys(parts))
    return "any" if "any" in unique else " | ".join(unique)


def _wrap(text: str) -> str:
    """Parenthesise a union or intersection used as an array element or intersection member."""
    return f"({text})" if _is_compound(text) else text


def _is_compound(text: str) -> bool:
    """Whether ``text`` has a ``|`` or ``&`` outside brackets, string literals and ``//`` comments."""
    depth, index = 0, 0
    while index < len(text):
        char = text[index]
        if char == '"':
            index = _string_end(text, index)
        elif text.startswith("//", index):
            newline = text.find("\n", index)
            index = len(text) if newline < 0 else newline
        elif char in "{[(<":
            depth += 1
        elif char in "}])>":
            depth -= 1
        elif char in "|&" and depth == 0:
            return True
        index += 1
    return False


def _string_end(text: str, start: int) -> int:
    """Index of the quote closing the JSON string literal opening at ``start``."""
    index = start + 1
    while index < len(text) and text[index] != '"':
        index += 2 if text[index] == "\\" else 1
    return index
