"""A raw stdio JSON-RPC MCP server whose tools/list pages hold malformed tool entries (no SDK: it would
refuse to send them), for the harvest tests.

Page 1: ``good``; ``no_schema`` (no inputSchema) and ``string_schema`` (``{"type": "string"}``), which harvest
gives an empty object schema with a warning; ``bad_hint`` (a non-boolean annotation), an entry without a
name and one that is not an object, which harvest skips and reports. Page 2 (``nextCursor``): ``later``.
"""

from __future__ import annotations

import json
import sys

OBJECT = {"type": "object", "properties": {"q": {"type": "string"}}}
PAGES = [
    [
        {"name": "good", "description": "Fine.", "inputSchema": OBJECT},
        {"name": "no_schema", "description": "No inputSchema at all."},
        {"name": "string_schema", "inputSchema": {"type": "string"}},
        {"name": "bad_hint", "inputSchema": OBJECT, "annotations": {"readOnlyHint": "sometimes"}},
        {"description": "No name.", "inputSchema": OBJECT},
        5,
    ],
    [{"name": "later", "inputSchema": OBJECT}],
]


def result(method: str, params: dict) -> dict | None:
    """The result of a request, or None for a method this server does not know."""
    if method == "initialize":
        return {
            "protocolVersion": params["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "malformed", "version": "0"},
        }
    if method == "tools/list":
        page = int((params or {}).get("cursor") or 0)
        following = {"nextCursor": str(page + 1)} if page + 1 < len(PAGES) else {}
        return {"tools": PAGES[page], **following}
    return None


def main() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        if "id" not in message:
            continue  # a notification
        answer = result(message["method"], message.get("params") or {})
        reply = {"jsonrpc": "2.0", "id": message["id"]}
        if answer is None:
            reply["error"] = {"code": -32601, "message": f"unknown method {message['method']}"}
        else:
            reply["result"] = answer
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
