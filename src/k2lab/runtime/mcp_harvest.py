"""Harvest real tool specs from MCP servers: the data factory's source of tools (K2's agentic data synthesis).

``harvest(config)`` starts every stdio server of a Claude Desktop / Cursor style ``servers.json``
(``{"mcpServers": {"name": {"command", "args", "env", "cwd"}}}``) through the official ``mcp`` SDK client
(``stdio_client`` + ``ClientSession``), lists its tools (following ``nextCursor``) and normalises each one to
an OpenAI-compatible function spec. Servers are harvested concurrently; one that cannot be spawned, exits,
hangs past its timeout (the SDK then closes its stdin, and terminates it ~2 s later) or answers garbage is
reported with a reason and never stops the others. Stray non-JSON-RPC lines on a working server's stdout
are ignored with a warning.

Normalisation rules (one spec per tool, in config order then listing order):

* name: characters outside ``[a-zA-Z0-9_-]`` become ``_`` (an empty name becomes ``tool``).
* name: when the same (sanitised) name comes from two or more servers, every one of them is prefixed
  ``<server>__`` (server name sanitised the same way); tools of other servers keep their names.
* name: longer than 64 characters -> the first 55 characters, ``_`` and 8 hex digits of
  sha256(``server/original_name``), so truncated names stay unique and stable.
* name: a name that is still not unique (``a.b`` and ``a_b`` on one server) gets that same hash suffix; should
  the suffixed name be taken (a tool really named ``a_b_<hash>``), the hash is redrawn until it is free.
* a tool listed twice by the same server keeps its first listing (warning).
* ``original_name`` and ``server`` are kept in every spec, and the summary lists every renamed tool.
* parameters: the ``inputSchema`` exactly as served; a missing one, or one that is not an object schema
  (``"type": "object"``), becomes ``{"type": "object", "properties": {}}`` (warning).
* a malformed entry of a ``tools/list`` page never costs the page: each entry is repaired as above (the
  SDK would reject the whole page), and one still invalid (no name, a non-boolean hint, not an object) is
  skipped and reported with the SDK's reason.
* parameters: a schema that fails ``validator_for(schema).check_schema`` (its ``$schema`` dialect, 2020-12
  by default), or holds a ``$ref`` that does not resolve within the schema (a remote URL included: k2lab
  never fetches one), is not repaired: the tool is skipped and reported (``skipped_tools`` in the summary),
  since a broken schema cannot constrain tool calls.
* output_schema: kept when valid, dropped to ``null`` with a warning when it is not a valid JSON Schema (the
  same checks).
* annotations: ``readOnlyHint``, ``destructiveHint``, ``idempotentHint``, ``openWorldHint`` always present
  (``null`` when the server did not set them), plus any other annotation the server sent (e.g. ``title``).
* title: the tool's ``title``, else ``annotations.title``; description: as served (``null`` when absent,
  ``""`` in the OpenAI function).

Config notes: relative ``cwd`` is resolved against the config file's directory; ``env`` is merged over the
SDK's safe default environment (``HOME``, ``PATH``, ...), not the whole parent environment; entries with
``"disabled": true`` or only a ``url`` (remote transports) are reported as skipped; ``"timeout"`` (seconds)
overrides the per-server timeout; a top-level ``servers`` key (VS Code layout) is accepted too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, TextIO

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from rich.table import Table
from rich.text import Text

from k2lab.errors import K2LabError
from k2lab.fsutil import atomic_write_text
from k2lab.runtime.tool_spec import json_schema_problems

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_TIMEOUT",
    "HarvestConfig",
    "HarvestConfigError",
    "HarvestResult",
    "ServerConfig",
    "ServerReport",
    "aharvest",
    "assign_names",
    "check_schema",
    "harvest",
    "load_config",
    "print_summary",
    "sanitize_name",
    "summary_path_for",
]

DEFAULT_TIMEOUT = 30.0  # seconds per server: start, initialize and every tools/list page
DEFAULT_CONCURRENCY = 8  # servers harvested at once
MAX_NAME_LENGTH = 64
OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")
MAX_PAGES = 1000
STDERR_TAIL = 400
EXAMPLE = '{"mcpServers": {"name": {"command": "npx", "args": ["-y", "pkg"], "env": {"KEY": "value"}}}}'


class HarvestConfigError(K2LabError, ValueError):
    """A servers.json that cannot be used (missing, not JSON, wrong layout); the CLI exits with code 2."""


class _ServerFailure(Exception):
    """One server could not be harvested; the message is the reason shown in the summary."""


# ---------------------------------------------------------------------------------------------- config


class ServerConfig(BaseModel):
    """One entry of ``mcpServers`` (unknown keys such as ``autoApprove`` are ignored)."""

    model_config = ConfigDict(extra="ignore")

    command: str | None = Field(default=None, min_length=1)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    disabled: bool = False
    timeout: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _needs_command(self) -> ServerConfig:
        if self.command is None and self.url is None:
            raise ValueError("a server needs a 'command' to start it (stdio transport)")
        return self


ServerName = Annotated[str, Field(min_length=1)]


class HarvestConfig(BaseModel):
    """The ``{"mcpServers": {...}}`` document (other top-level keys are ignored)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    mcp_servers: dict[ServerName, ServerConfig] = Field(alias="mcpServers", min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _vscode_layout(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mcpServers" not in data and "servers" in data:
            return {**data, "mcpServers": data["servers"]}
        return data


def _format_errors(error: ValidationError) -> str:
    """``field: reason`` for each problem, joined with ``;``."""
    parts = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        parts.append(f"{location}: {message}" if location else message)
    return "; ".join(parts)


def parse_config(data: Any, source: str = "config", base_dir: Path | None = None) -> HarvestConfig:
    """Validate a parsed servers.json; relative ``cwd`` values are resolved against ``base_dir``."""
    if not isinstance(data, dict):
        raise HarvestConfigError(
            f"{source} should hold a JSON object like {EXAMPLE}, not {type(data).__name__}"
        )
    try:
        config = HarvestConfig.model_validate(data)
    except ValidationError as error:
        raise HarvestConfigError(
            f"{source} is not a valid MCP server config ({_format_errors(error)}). Expected {EXAMPLE}"
        ) from error
    if base_dir is not None:
        for server in config.mcp_servers.values():
            if server.cwd is not None and not Path(server.cwd).is_absolute():
                server.cwd = str((base_dir / server.cwd).resolve())
    return config


def load_config(path: str | Path) -> HarvestConfig:
    """Read and validate a servers.json; every problem is one ``HarvestConfigError`` naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise HarvestConfigError(
            f"cannot read the MCP server config {path}: {error.strerror or error}"
        ) from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise HarvestConfigError(
            f"{path} is not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})"
        ) from error
    return parse_config(data, source=str(path), base_dir=path.parent)


def _as_config(config: str | Path | HarvestConfig | Mapping[str, Any]) -> HarvestConfig:
    if isinstance(config, HarvestConfig):
        return config
    if isinstance(config, Mapping):
        return parse_config(dict(config))
    return load_config(config)


# ---------------------------------------------------------------------------------------- normalisation


def sanitize_name(name: str) -> str:
    """Map every character outside ``[a-zA-Z0-9_-]`` to ``_`` (``tool`` for an empty name)."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", name) or "tool"


def _short_hash(server: str, original: str, attempt: int = 0) -> str:
    key = f"{server}/{original}" + (f"#{attempt}" if attempt else "")
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def _with_hash(name: str, server: str, original: str, attempt: int = 0) -> str:
    return f"{name[: MAX_NAME_LENGTH - 9]}_{_short_hash(server, original, attempt)}"


def assign_names(keys: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """OpenAI-valid, unique names for ``(server, original_name)`` pairs (rules in the module docstring)."""
    base = {key: sanitize_name(key[1]) for key in keys}
    servers_of: defaultdict[str, set[str]] = defaultdict(set)
    for (server, _), name in base.items():
        servers_of[name].add(server)
    names: dict[tuple[str, str], str] = {}
    for (server, original), name in base.items():
        if len(servers_of[name]) > 1:
            name = f"{sanitize_name(server)}__{name}"
        names[(server, original)] = (
            name if len(name) <= MAX_NAME_LENGTH else _with_hash(name, server, original)
        )
    return _dedupe(names)


def _dedupe(names: dict[tuple[str, str], str]) -> dict[tuple[str, str], str]:
    """Names that are unique already stay; the others get a hash suffix, rehashed (``#1``, ``#2``, ...)
    until it is taken by no other tool, so a suffixed name never lands on an existing one."""
    counts = Counter(names.values())
    taken = {name for name in counts if counts[name] == 1}
    unique: dict[tuple[str, str], str] = {}
    for (server, original), name in names.items():
        if counts[name] > 1:
            attempt = 0
            while (candidate := _with_hash(name, server, original, attempt)) in taken:
                attempt += 1
            name = candidate
            taken.add(name)
        unique[(server, original)] = name
    return unique


def check_schema(schema: Any) -> str | None:
    """``None`` when ``schema`` is a valid JSON Schema (its ``$schema`` dialect, 2020-12 by default) whose
    every ``$ref`` resolves within it; else the problems, joined with ``;``."""
    return "; ".join(json_schema_problems(schema)) or None


def _annotations(raw: Any) -> dict[str, Any]:
    """The four behaviour hints (``None`` when unset) plus whatever else the server annotated."""
    given = raw if isinstance(raw, dict) else {}
    return {**{hint: given.get(hint) for hint in HINTS}, **given}


def _parameters(raw: dict[str, Any], warnings: list[str]) -> tuple[dict[str, Any] | None, str | None]:
    """(parameters, skip reason) for one wire-format tool; appends a warning when a default is used."""
    schema = raw.get("inputSchema")
    if not _is_object_schema(schema):
        warnings.append(_empty_schema_warning(raw.get("name")))
        return dict(EMPTY_PARAMETERS), None
    problem = check_schema(schema)
    if problem is not None:
        return None, f"inputSchema is not a valid JSON Schema: {problem}"
    return schema, None


def _is_object_schema(schema: Any) -> bool:
    """Whether ``schema`` can be a tool's parameters: a JSON object with ``"type": "object"``."""
    return isinstance(schema, dict) and schema.get("type") == "object"


def _empty_schema_warning(name: Any) -> str:
    return f"tool {name!r}: inputSchema missing or not an object schema; using an empty one"


def _output_schema(raw: dict[str, Any], warnings: list[str]) -> dict[str, Any] | None:
    schema = raw.get("outputSchema")
    if schema is None:
        return None
    problem = check_schema(schema) if isinstance(schema, dict) else "not an object"
    if problem is not None:
        warnings.append(f"tool {raw.get('name')!r}: outputSchema dropped ({problem})")
        return None
    return schema


def build_spec(server: str, raw: dict[str, Any], name: str, parameters: dict[str, Any], output: Any) -> dict:
    """The normalised spec of one tool (``raw`` in MCP wire format, camelCase keys)."""
    annotations = _annotations(raw.get("annotations"))
    description = raw.get("description")
    title = raw.get("title") or annotations.get("title")
    return {
        "server": server,
        "name": name,
        "original_name": raw["name"],
        "title": title,
        "description": description,
        "parameters": parameters,
        "output_schema": output,
        "annotations": annotations,
        "openai": {
            "type": "function",
            "function": {"name": name, "description": description or "", "parameters": parameters},
        },
    }


# ---------------------------------------------------------------------------------------------- results


@dataclass
class ServerReport:
    """How one server went: ``status`` is ``ok``, ``failed`` or ``skipped`` (with ``reason``)."""

    name: str
    status: str = "ok"
    reason: str | None = None
    tools: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    skipped_tools: list[dict[str, str]] = field(default_factory=list)


@dataclass
class HarvestResult:
    """Normalised tool specs (``tools``) and one report per configured server."""

    tools: list[dict[str, Any]]
    servers: list[ServerReport]

    @property
    def renamed(self) -> list[dict[str, str]]:
        """``{server, original_name, name}`` for every tool whose name had to change."""
        return [
            {"server": spec["server"], "original_name": spec["original_name"], "name": spec["name"]}
            for spec in self.tools
            if spec["name"] != spec["original_name"]
        ]

    @property
    def failed(self) -> dict[str, str]:
        """Failed server -> reason."""
        return {report.name: report.reason or "" for report in self.servers if report.status == "failed"}

    def summary(self) -> dict[str, Any]:
        """The JSON summary written next to the output."""
        statuses = Counter(report.status for report in self.servers)
        return {
            "tools": len(self.tools),
            "servers_ok": statuses["ok"],
            "servers_failed": statuses["failed"],
            "servers_skipped": statuses["skipped"],
            "servers": [asdict(report) for report in self.servers],
            "renamed": self.renamed,
        }

    def write(self, out: str | Path) -> Path:
        """Write the JSONL (one spec per line) and the summary, each atomically; returns the summary path."""
        out = Path(out)
        lines = "".join(json.dumps(spec, ensure_ascii=False) + "\n" for spec in self.tools)
        atomic_write_text(out, lines)
        summary = summary_path_for(out)
        atomic_write_text(summary, json.dumps({"output": str(out), **self.summary()}, indent=2) + "\n")
        return summary


def summary_path_for(out: Path) -> Path:
    """``tools.jsonl`` -> ``tools.summary.json`` (same directory)."""
    return out.with_name(f"{out.stem}.summary.json")


# ------------------------------------------------------------------------------------------ MCP client


def _wire_tool(tool: Any) -> dict[str, Any]:
    """An SDK ``Tool`` as a wire-format dict; the schemas are the served dicts, untouched."""
    annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else None
    return {
        "name": tool.name,
        "title": tool.title,
        "description": tool.description,
        "inputSchema": tool.input_schema,
        "outputSchema": tool.output_schema,
        "annotations": annotations,
    }


class _ListingRepair:
    """The transport's read stream with every ``tools/list`` page repaired entry by entry before the SDK
    validates it, which would reject the whole page for one malformed tool (rules in the module docstring).

    A page is a response whose result holds a ``tools`` list (no other result of a harvest session does);
    entries are checked against the MCP types of the protocol version the server's initialize result
    names. Repairs go to ``report.warnings``, entries still invalid to ``report.skipped_tools``.
    """

    def __init__(self, stream: Any, report: ServerReport):
        self._stream, self._report = stream, report
        self._version = "2025-11-25"  # the SDK's own assumption before a handshake

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __aiter__(self) -> _ListingRepair:
        return self

    async def __anext__(self) -> Any:
        return self._repaired(await self._stream.__anext__())

    async def receive(self) -> Any:
        return self._repaired(await self._stream.receive())

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def __aenter__(self) -> _ListingRepair:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _repaired(self, item: Any) -> Any:
        result = getattr(getattr(item, "message", None), "result", None)
        if isinstance(result, dict) and isinstance(result.get("protocolVersion"), str):
            self._version = result["protocolVersion"]
        if isinstance(result, dict) and isinstance(result.get("tools"), list):
            result["tools"] = [tool for tool in map(self._entry, result["tools"]) if tool is not None]
        return item

    def _entry(self, tool: Any) -> dict[str, Any] | None:
        """The entry, its inputSchema defaulted when unusable; None (reported) when still invalid."""
        from mcp_types import methods  # lazy, as for every mcp import here

        name = tool.get("name") if isinstance(tool, dict) else None
        if isinstance(tool, dict) and not _is_object_schema(tool.get("inputSchema")):
            self._report.warnings.append(_empty_schema_warning(name))
            tool = {**tool, "inputSchema": dict(EMPTY_PARAMETERS)}
        try:
            methods.validate_server_result("tools/list", self._version, {"tools": [tool]})
        except ValidationError as error:
            shown = name if isinstance(name, str) else _one_line(repr(tool), 80)
            self._report.skipped_tools.append({"name": shown, "reason": _listing_problem(error)})
            return None
        except (KeyError, ValueError):  # a protocol version the SDK cannot check: it decides
            return tool
        return tool


def _listing_problem(error: ValidationError) -> str:
    """``invalid tool listing: field: reason`` for the first problem of one entry's validation."""
    first = error.errors()[0]
    where = ".".join(str(part) for part in first["loc"][2:])  # past ("tools", 0)
    return f"invalid tool listing: {where + ': ' if where else ''}{_brief(error)}"


async def _list_all_tools(session: Any, stage: list[str]) -> list[dict[str, Any]]:
    """Every page of ``tools/list`` (``nextCursor`` pagination, loop-protected)."""
    from mcp import types  # lazy: mcp takes ~0.9 s to import and only a harvest needs it

    tools: list[dict[str, Any]] = []
    cursor: str | None = None
    seen: set[str] = set()
    for page in range(1, MAX_PAGES + 1):
        stage[0] = f"tools/list page {page}"
        params = types.PaginatedRequestParams(cursor=cursor) if cursor is not None else None
        result = await session.list_tools(params=params)
        tools.extend(_wire_tool(tool) for tool in result.tools)
        cursor = result.next_cursor
        if cursor is None:
            return tools
        if cursor in seen:
            raise _ServerFailure(f"tools/list pagination loops (cursor {cursor!r} came back)")
        seen.add(cursor)
    raise _ServerFailure(f"tools/list returned more than {MAX_PAGES} pages")


async def _session_tools(
    server: ServerConfig,
    errlog: TextIO,
    stage: list[str],
    on_garbage: Callable[[Exception], Any],
    report: ServerReport,
) -> list[dict[str, Any]]:
    """Spawn the server, initialise a session and list its tools (listing repairs go to ``report``)."""
    from mcp import ClientSession, StdioServerParameters, stdio_client  # lazy: mcp (0.9 s), harvest only

    params = StdioServerParameters(
        command=server.command or "", args=server.args, env=server.env or None, cwd=server.cwd
    )

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception):
            on_garbage(message)

    async with (
        stdio_client(params, errlog=errlog) as (read_stream, write_stream),
        ClientSession(
            _ListingRepair(read_stream, report), write_stream, message_handler=on_message
        ) as session,
    ):
        stage[0] = "initialize"
        await session.initialize()
        return await _list_all_tools(session, stage)


def _leaf(error: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stderr_tail(errlog: TextIO) -> str:
    try:
        errlog.seek(0)
        text = errlog.read()
    except (OSError, ValueError):
        return ""
    return f"; stderr: {_one_line(text[-STDERR_TAIL:])}" if text.strip() else ""


def _brief(error: BaseException) -> str:
    """A short one-line account of an exception (the first problem of a pydantic error)."""
    if isinstance(error, ValidationError) and error.errors():
        first = error.errors()[0]
        more = f" (+{error.error_count() - 1} more)" if error.error_count() > 1 else ""
        return _one_line(str(first["msg"]), 160) + more
    return _one_line(str(error), 160) or type(error).__name__


def _describe(error: BaseException) -> str:
    error = _leaf(error)
    if isinstance(error, _ServerFailure):
        return str(error)
    if isinstance(error, OSError):
        return f"cannot start the server: {error.strerror or error}" + (
            f" ({error.filename})" if error.filename else ""
        )
    if isinstance(error, ValidationError):
        return f"invalid response from the server: {_brief(error)}"
    return f"{type(error).__name__}: {_one_line(str(error)) or 'no detail'}"


def _garbage_note(garbage: list[Exception]) -> str:
    """``; N stdout line(s) not JSON-RPC, first: '...'`` (empty when there were none)."""
    if not garbage:
        return ""
    first = garbage[0]
    if isinstance(first, ValidationError) and first.errors():
        shown = _one_line(repr(first.errors()[0].get("input")), 80)
    else:
        shown = _brief(first)
    return f"; {len(garbage)} stdout line(s) not JSON-RPC, first: {shown}"


async def _fetch_tools(server: ServerConfig, timeout: float, report: ServerReport) -> list[dict[str, Any]]:
    """The raw (wire-format) tools of one server; every failure is a ``_ServerFailure`` with a reason.

    Lines on the server's stdout that are not JSON-RPC (banners, stray prints) are ignored with a warning
    as long as the server answers; when it never does, the reason quotes the first such line.
    """
    stage = ["spawn"]
    garbage: list[Exception] = []
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
        with anyio.move_on_after(timeout):
            try:
                tools = await _session_tools(server, errlog, stage, garbage.append, report)
            except Exception as error:  # any server fault becomes a reported reason
                reason = _describe(error) + _garbage_note(garbage) + _stderr_tail(errlog)
                raise _ServerFailure(reason) from None
            if garbage:
                report.warnings.append(f"ignored{_garbage_note(garbage).removeprefix(';')}")
            return tools
        reason = f"timed out after {timeout:g} s during {stage[0]}"
        raise _ServerFailure(reason + _garbage_note(garbage) + _stderr_tail(errlog))


async def _harvest_server(
    name: str, server: ServerConfig, timeout: float, limiter: anyio.CapacityLimiter
) -> tuple[ServerReport, list[dict[str, Any]]]:
    """Report and raw tools of one server (never raises for a server fault)."""
    report = ServerReport(name)
    if server.disabled or server.command is None:
        report.status = "skipped"
        report.reason = (
            "disabled in the config"
            if server.disabled
            else f"remote server ({server.url}): only stdio servers (command) are harvested"
        )
        return report, []
    async with limiter:
        start = time.perf_counter()
        try:
            raw = await _fetch_tools(server, server.timeout or timeout, report)
        except _ServerFailure as failure:
            report.status, report.reason, raw = "failed", str(failure), []
        report.seconds = round(time.perf_counter() - start, 3)
    return report, raw


def _checked_tools(report: ServerReport, raw: list[dict[str, Any]]) -> list[tuple[dict, dict, Any]]:
    """(raw tool, parameters, output schema) for the tools kept; skips and warnings go to ``report``."""
    kept: list[tuple[dict, dict, Any]] = []
    seen: set[str] = set()
    for tool in raw:
        if tool["name"] in seen:
            report.warnings.append(f"tool {tool['name']!r} listed twice; the first listing is kept")
            continue
        seen.add(tool["name"])
        parameters, problem = _parameters(tool, report.warnings)
        if parameters is None:
            report.skipped_tools.append({"name": tool["name"], "reason": problem or ""})
            continue
        kept.append((tool, parameters, _output_schema(tool, report.warnings)))
    report.tools = len(kept)
    return kept


@contextmanager
def _quiet_sdk_logging() -> Iterator[None]:
    """Silence the SDK's tracebacks for misbehaving servers; the summary reports them instead."""
    logger = logging.getLogger("mcp")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


async def aharvest(
    config: str | Path | HarvestConfig | Mapping[str, Any],
    timeout: float = DEFAULT_TIMEOUT,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> HarvestResult:
    """Harvest the tools of every configured server (async core of :func:`harvest`)."""
    config = _as_config(config)
    if not timeout > 0 or concurrency < 1:
        raise HarvestConfigError(f"timeout must be > 0 and concurrency >= 1 (got {timeout}, {concurrency})")
    limiter = anyio.CapacityLimiter(concurrency)
    outcomes: dict[str, tuple[ServerReport, list[dict[str, Any]]]] = {}

    async def run(name: str, server: ServerConfig) -> None:
        outcomes[name] = await _harvest_server(name, server, timeout, limiter)

    with _quiet_sdk_logging():
        async with anyio.create_task_group() as group:
            for name, server in config.mcp_servers.items():
                group.start_soon(run, name, server)
    return _assemble(config, outcomes)


def _assemble(config: HarvestConfig, outcomes: dict[str, tuple[ServerReport, list[dict]]]) -> HarvestResult:
    """Check schemas, assign names and build the specs, in config order."""
    reports, checked = [], []
    for name in config.mcp_servers:
        report, raw = outcomes[name]
        reports.append(report)
        checked.extend((name, *entry) for entry in _checked_tools(report, raw))
    names = assign_names([(server, tool["name"]) for server, tool, _, _ in checked])
    specs = [
        build_spec(server, tool, names[(server, tool["name"])], parameters, output)
        for server, tool, parameters, output in checked
    ]
    return HarvestResult(tools=specs, servers=reports)


def harvest(
    config: str | Path | HarvestConfig | Mapping[str, Any],
    timeout: float = DEFAULT_TIMEOUT,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> HarvestResult:
    """Start the configured MCP servers, list their tools and normalise them (blocking wrapper).

    ``config`` is a servers.json path, its parsed dict or a ``HarvestConfig``; ``timeout`` bounds each
    server (spawn, initialize and every tools/list page). Call :func:`aharvest` from async code.
    """
    return anyio.run(aharvest, config, timeout, concurrency)


# ---------------------------------------------------------------------------------------------- display


def print_summary(result: HarvestResult, console: Any) -> None:
    """Servers (status, tools, time, reason), renamed tools and warnings as rich tables."""
    table = Table(title="MCP servers")
    for column in ("server", "status", "tools", "skipped", "seconds", "reason"):
        numeric = column in ("tools", "skipped", "seconds")
        table.add_column(column, justify="right" if numeric else "left", overflow="fold")
    styles = {"ok": "green", "failed": "red", "skipped": "yellow"}
    for report in result.servers:
        table.add_row(
            Text(report.name),
            Text(report.status, style=styles[report.status]),
            str(report.tools),
            str(len(report.skipped_tools)),
            f"{report.seconds:.1f}",
            Text(report.reason or ""),
        )
    console.print(table)
    if result.renamed:
        renamed = Table(title="renamed tools")
        for column in ("server", "original name", "name"):
            renamed.add_column(column, overflow="fold")
        for row in result.renamed:
            renamed.add_row(Text(row["server"]), Text(row["original_name"]), Text(row["name"]))
        console.print(renamed)
    for report in result.servers:
        for skipped in report.skipped_tools:
            console.print(f"{report.name}: skipped {skipped['name']!r}: {skipped['reason']}", markup=False)
        for warning in report.warnings:
            console.print(f"{report.name}: {warning}", markup=False)
