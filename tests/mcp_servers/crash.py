"""An MCP server that dies at start (harvest must report it and carry on)."""

import sys

print("crash server: missing API key FAKE_TOKEN", file=sys.stderr)
sys.exit(3)
