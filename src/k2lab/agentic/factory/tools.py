"""The data factory's tool repository: harvested MCP specs plus synthetic tools evolved over the domains.

Synthetic tools live in a hierarchy ``domain -> family -> base tool -> evolved variants``. The base tools,
with canonical parameters and **stateful semantics in Python** (``impl(world, canonical_args)``) acting on
the episode's world state (one JSON-able dict with a section per domain), are written in the domain
modules (``k2lab.agentic.domains``). ``evolve`` derives variants procedurally and deterministically from a
seed: another name, renamed parameters, extra optional (ignored) fields, other units or enum spellings
(money in cents, hours as minutes of the day, days as full names or indices, unit names spelled out: the
codecs of the parameter kinds the domains register). A variant converts its arguments back to the canonical
ones (``decode``) before running the base semantics, so every variant behaves the same on the world; an
agent that knows what it wants to do in canonical terms writes a variant's call with ``encode``.

Domain errors (unknown item, insufficient funds, calendar conflict ...) raise ``ToolError`` with a ``kind``.
Results are JSON-able dicts in canonical units (money in dollars, labelled ``currency``).

Harvested MCP tools (the JSONL of ``k2lab tools harvest``) are spec-only: the simulator invents
schema-conforming results for them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k2lab.agentic.domains import BASE_TOOLS, DOMAINS, PARAM_KINDS
from k2lab.agentic.domains.base import IDENTITY, BaseTool, Codec, CodecOption, string
from k2lab.errors import K2LabError
from k2lab.runtime.tool_spec import validate_tool

__all__ = [
    "SyntheticTool",
    "ToolRepository",
    "build_repository",
    "canonical_tool",
    "evolve",
    "load_mcp_tools",
    "unit_codecs",
]

#: Optional fields an evolved variant may add to its schema (the semantics ignore them).
EXTRAS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("note", string("Optional free-text note (stored in the audit log only).")),
    ("request_id", string("Optional idempotency key.")),
    ("locale", {"type": "string", "enum": ["en-US", "en-GB", "de-DE"], "description": "Response locale."}),
    ("verbose", {"type": "boolean", "description": "Return extra detail (ignored by this backend)."}),
    ("trace", {"type": "boolean", "description": "Enable request tracing."}),
)


def unit_codecs(kind: str) -> list[CodecOption]:
    """The codecs evolution may pick for a parameter kind, each with parameter names that fit it (empty:
    keep the canonical names and synonyms): the identity, then those the domains register for ``kind``."""
    extra = PARAM_KINDS.get(kind)
    return [(IDENTITY, ()), *(extra() if extra is not None else ())]


# ---------------------------------------------------------------------------------------- synthetic tool


@dataclass
class SyntheticTool:
    """One evolved tool: a spec (OpenAI format) over a base tool's semantics."""

    name: str
    base: BaseTool
    description: str
    arg_names: dict[str, str]  # canonical -> exposed
    codecs: dict[str, Codec] = field(default_factory=dict)
    extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    variant: int = 0

    @property
    def domain(self) -> str:
        return self.base.domain

    @property
    def family(self) -> str:
        return self.base.family

    @property
    def parameters(self) -> dict[str, Any]:
        """The JSON schema of the exposed arguments."""
        properties: dict[str, Any] = {}
        required = []
        for param in self.base.params:
            codec = self.codecs.get(param.name, IDENTITY)
            schema = {**param.schema, **dict(codec.schema)}
            if codec.kind == "enum" and "enum" in schema and schema.get("type") == "integer":
                schema.pop("minimum", None)
            exposed = self.arg_names[param.name]
            properties[exposed] = schema
            if param.required:
                required.append(exposed)
        properties.update(self.extras)
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    @property
    def spec(self) -> dict[str, Any]:
        """The OpenAI ``{"type": "function", "function": {...}}`` spec."""
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}

    def encode(self, canonical: dict[str, Any]) -> dict[str, Any]:
        """This tool's arguments for canonical ones (unknown canonical names are dropped)."""
        return {
            self.arg_names[key]: self.codecs.get(key, IDENTITY).encode(value)
            for key, value in canonical.items()
            if key in self.arg_names
        }

    def decode(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The canonical arguments of this tool's arguments (extras dropped)."""
        exposed = {v: k for k, v in self.arg_names.items()}
        return {
            exposed[key]: self.codecs.get(exposed[key], IDENTITY).decode(value)
            for key, value in arguments.items()
            if key in exposed
        }

    def execute(self, state: dict[str, Any], arguments: dict[str, Any]) -> Any:
        """Run the call on the world ``state`` (mutated in place); raises ``ToolError`` for domain errors."""
        return self.base.impl(state, self.decode(arguments))


def canonical_tool(base: BaseTool) -> SyntheticTool:
    """The base tool as a synthetic tool with its canonical names and units."""
    names = {param.name: param.name for param in base.params}
    return SyntheticTool(base.key, base, base.description, names)


def _variant(base: BaseTool, rng: random.Random, taken: set[str], variant: int) -> SyntheticTool:
    """One evolved variant of ``base`` with a name not in ``taken``."""
    name = _variant_name(base, rng, taken)
    codecs, names, notes = {}, {}, []
    for param in base.params:
        codec, codec_names = rng.choice(unit_codecs(param.kind))
        if codec is not IDENTITY:
            codecs[param.name] = codec
            notes.append(codec.note)
        options = codec_names or (param.name, *param.synonyms)
        names[param.name] = _fresh(rng.choice(options), names.values())
    extras = dict(rng.sample(EXTRAS, rng.choice((0, 0, 1, 2))))
    for key in list(extras):
        if key in names.values():
            del extras[key]
    description = base.description + (f" Note: {', '.join(notes)}." if notes else "")
    if rng.random() < 0.3:
        description = f"[{name.split('_')[0]}] {description}"
    return SyntheticTool(name, base, description, names, codecs, extras, variant)


def _fresh(name: str, used: Iterable[str]) -> str:
    used = set(used)
    candidate, index = name, 2
    while candidate in used:
        candidate, index = f"{name}{index}", index + 1
    return candidate


def _variant_name(base: BaseTool, rng: random.Random, taken: set[str]) -> str:
    stems = (base.key, *base.aliases)
    for _ in range(20):
        name = rng.choice(DOMAINS[base.domain].prefixes) * (rng.random() < 0.7) + rng.choice(stems)
        name += rng.choice(("", "", "_v2", "_v3", "_api"))
        if name not in taken:
            return name
    return _fresh(f"{rng.choice(DOMAINS[base.domain].prefixes)}{base.key}_x", taken)


def evolve(seed: int, n: int, taken: Iterable[str] = ()) -> list[SyntheticTool]:
    """``n`` evolved variants, round-robin over the base tools, deterministic in ``seed``; names are unique
    and avoid ``taken``."""
    rng = random.Random(f"evolve:{seed}")
    used = set(taken)
    tools = []
    for index in range(n):
        base = BASE_TOOLS[index % len(BASE_TOOLS)]
        tool = _variant(base, rng, used, index // len(BASE_TOOLS) + 1)
        used.add(tool.name)
        tools.append(tool)
    return tools


# ------------------------------------------------------------------------------------------- repository


def load_mcp_tools(path: str | Path) -> list[dict[str, Any]]:
    """The harvested tools of a ``k2lab tools harvest`` JSONL (the whole records; ``openai`` is the spec).
    Invalid lines or specs raise ``K2LabError`` naming the line."""
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            spec = record.get("openai") or {
                "type": "function",
                "function": {k: record[k] for k in ("name", "description", "parameters") if k in record},
            }
            record["openai"] = validate_tool(spec)
        except (ValueError, AttributeError, K2LabError) as error:
            raise K2LabError(f"{path}:{number}: not a harvested tool spec ({error})") from error
        records.append(record)
    return records


@dataclass
class ToolRepository:
    """Synthetic tools by name (with semantics) and spec-only MCP tools by name."""

    synthetic: dict[str, SyntheticTool] = field(default_factory=dict)
    mcp: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add_synthetic(self, tools: Iterable[SyntheticTool]) -> None:
        for tool in tools:
            if tool.name in self.synthetic or tool.name in self.mcp:
                raise K2LabError(f"duplicate tool name {tool.name!r}")
            self.synthetic[tool.name] = tool

    def add_mcp(self, records: Iterable[dict[str, Any]]) -> None:
        """Add harvested tools; a name clashing with a synthetic tool gets an ``mcp_`` prefix."""
        for record in records:
            spec = json.loads(json.dumps(record["openai"]))
            name = spec["function"]["name"]
            if name in self.synthetic or name in self.mcp:
                name = _fresh(f"mcp_{name}"[:60], set(self.synthetic) | set(self.mcp))
                spec["function"]["name"] = name
            self.mcp[name] = {**record, "name": name, "openai": spec}

    def evolve(self, seed: int, n: int) -> list[SyntheticTool]:
        """Evolve ``n`` more variants (deterministic in ``seed`` and the current names) and add them."""
        tools = evolve(seed, n, taken=set(self.synthetic) | set(self.mcp))
        self.add_synthetic(tools)
        return tools

    def spec(self, name: str) -> dict[str, Any]:
        return self.synthetic[name].spec if name in self.synthetic else self.mcp[name]["openai"]

    def specs(self) -> list[dict[str, Any]]:
        return [tool.spec for tool in self.synthetic.values()] + [r["openai"] for r in self.mcp.values()]

    def by_domain(self) -> dict[str, dict[str, list[SyntheticTool]]]:
        """domain -> base tool key -> its synthetic tools (the hierarchy, families implied by the bases)."""
        tree: dict[str, dict[str, list[SyntheticTool]]] = {}
        for tool in self.synthetic.values():
            tree.setdefault(tool.domain, {}).setdefault(tool.base.key, []).append(tool)
        return tree

    def hierarchy(self) -> dict[str, dict[str, int]]:
        """domain -> family -> number of tools."""
        counts: dict[str, dict[str, int]] = {}
        for tool in self.synthetic.values():
            family = counts.setdefault(tool.domain, {})
            family[tool.family] = family.get(tool.family, 0) + 1
        return counts

    def __len__(self) -> int:
        return len(self.synthetic) + len(self.mcp)


def build_repository(
    seed: int = 0, variants_per_tool: int = 12, mcp_path: str | Path | None = None
) -> ToolRepository:
    """The canonical tools, ``variants_per_tool`` evolved variants of each, and harvested MCP tools."""
    repository = ToolRepository()
    repository.add_synthetic(canonical_tool(base) for base in BASE_TOOLS)
    repository.evolve(seed, variants_per_tool * len(BASE_TOOLS))
    if mcp_path is not None:
        repository.add_mcp(load_mcp_tools(mcp_path))
    return repository
