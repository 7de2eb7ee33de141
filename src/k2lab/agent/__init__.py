"""The agent runtime: MCP tool harvesting, schema-constrained tool calls, the tool-use loop."""

from k2lab.agent.chat import (
    ChatEncoding,
    ChatFormatError,
    ToolCallParseError,
    encode_chat,
    normalize_messages,
    parse_assistant,
    parse_chat,
    render_chat,
    tool_call_id,
)
from k2lab.agent.tool_spec import (
    ToolSpecError,
    tools_to_json,
    tools_to_typescript,
    validate_tool,
    validate_tools,
)

__all__ = [
    "ChatEncoding",
    "ChatFormatError",
    "ToolCallParseError",
    "ToolSpecError",
    "encode_chat",
    "normalize_messages",
    "parse_assistant",
    "parse_chat",
    "render_chat",
    "tool_call_id",
    "tools_to_json",
    "tools_to_typescript",
    "validate_tool",
    "validate_tools",
]
