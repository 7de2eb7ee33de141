"""A low-level MCP server whose tools list comes in two pages (nextCursor) for the harvest tests.

``search`` collides with the weather server's tool; ``broken`` has an input schema that is not valid JSON
Schema (it must be reported and skipped); ``read file`` has a space in its name. It prints a banner on
stdout before speaking JSON-RPC, as some real servers do (harvest must tolerate it with a warning).
"""

from __future__ import annotations

import anyio
from mcp import types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

PAGES = [
    [
        types.Tool(
            name="search",
            description="Search files by glob.",
            input_schema={
                "type": "object",
                "properties": {"pattern": {"type": "string", "description": "glob"}},
                "required": ["pattern"],
                "additionalProperties": False,
            },
            annotations=types.ToolAnnotations(read_only_hint=True),
        ),
        types.Tool(
            name="read file",
            description="Read a file.",
            input_schema={"type": "object", "properties": {"path": {"type": "string", "minLength": 1}}},
        ),
    ],
    [
        types.Tool(
            name="broken",
            description="Its input schema is not a valid JSON Schema.",
            input_schema={"type": "object", "properties": {"x": {"type": "nonsense"}}},
        ),
        types.Tool(name="stat", input_schema={"type": "object"}),
    ],
]


async def list_tools(context, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
    page = int(params.cursor) if params is not None and params.cursor else 0
    following = str(page + 1) if page + 1 < len(PAGES) else None
    return types.ListToolsResult(tools=PAGES[page], next_cursor=following)


server = Server("files", on_list_tools=list_tools)


async def main() -> None:
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    print("files server ready", flush=True)
    anyio.run(main)
