"""The agent runtime: K2's chat and tool-call format, tool specs, the decoding enforcer, MCP tool harvesting
and the sandbox. (The agentic data factory, RL environments and training built on it are ``k2lab.agentic``.)
"""

from k2lab.runtime.chat import (
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
from k2lab.runtime.tool_spec import (
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
