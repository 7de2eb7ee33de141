"""An MCP server that answers every request with text that is not JSON-RPC."""

import sys

for _line in sys.stdin:
    print("hello, this is not JSON-RPC", flush=True)
