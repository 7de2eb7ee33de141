"""Tool schemas the enforcer cannot serve are refused with 400 before generation, not a 500 during it."""

from __future__ import annotations

import httpx
import pytest

from tests.runtime.test_enforcer import UNENDING, recursive
from tests.serve.test_server import KEY, served


@pytest.fixture(scope="module")
def server(small_tokenizer):
    yield from served(small_tokenizer, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_recursion_without_end_gets_400(server, stream):
    """A forced call to a tool whose every value holds itself again answered 500 ("Too many items …
    ff_tokens", from the grammar mid-generation); it is a 400 naming the tools, streamed or not."""
    body = {"model": "nano", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
            "tools": [recursive(UNENDING["object"])], "tool_choice": "required", "stream": stream}  # fmt: skip
    response = httpx.post(
        server[0] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "admit no finite value" in error["message"] and error["param"] == "tools"
