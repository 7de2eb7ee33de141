"""An MCP server that never answers (harvest must time it out and carry on)."""

import time

while True:
    time.sleep(1)
