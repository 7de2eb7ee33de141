"""Harvested tool schemas with remote or dangling ``$ref``s: never fetched, refused with a one-line error."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from k2lab.agentic.factory.simulator import ToolSimulator
from k2lab.agentic.factory.tasks import ToolTaskEnvironment
from k2lab.agentic.factory.tools import build_repository
from k2lab.cli import main
from k2lab.errors import K2LabError

REMOTE = "http://127.0.0.1:9/exfil?secret=1"


def tools_file(folder: Path, ref: str) -> Path:
    """A one-tool harvest JSONL whose required argument ``x`` is ``{"$ref": ref}``."""
    parameters = {"type": "object", "properties": {"x": {"$ref": ref}}, "required": ["x"]}
    function = {"name": "lookup", "description": "d", "parameters": parameters}
    record = {"server": "s1", "name": "lookup", "original_name": "lookup", "parameters": parameters,
              "output_schema": None, "annotations": {}, "openai": {"type": "function", "function": function}}  # fmt: skip
    path = folder / "tools.jsonl"
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.fixture
def fetches(monkeypatch) -> list[str]:
    """Every URL anything tried to open (the attempt fails, as an unreachable host would)."""
    seen: list[str] = []

    def urlopen(url, *args, **kwargs):
        seen.append(getattr(url, "full_url", url))
        raise OSError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return seen


@pytest.mark.parametrize("ref", [REMOTE, "#/$defs/missing"])
def test_unresolvable_refs_are_refused_before_any_rollout(tmp_path, fetches, ref) -> None:
    repository = build_repository(0, 0, tools_file(tmp_path, ref))
    with pytest.raises(
        K2LabError, match=r"harvested tool 'lookup' has unusable parameters: .*does not resolve"
    ):
        ToolTaskEnvironment(repository, mcp_fraction=1.0, no_tool_fraction=0.0)
    observation = ToolSimulator(repository).execute({}, "lookup", {"x": "a"})  # used on its own: no fetch
    assert json.loads(observation.content)["ok"] is True
    assert fetches == []


def test_cli_reports_a_remote_ref_in_one_line(tmp_path, fetches, capsys) -> None:
    out = tmp_path / "out.jsonl"
    arguments = ["--n", "3", "--mcp-fraction", "1", "--no-tool-fraction", "0", "--variants-per-tool", "0"]
    with pytest.raises(SystemExit) as exit_info:
        main(
            ["factory", "generate", "--tools", str(tools_file(tmp_path, REMOTE)), *arguments, "-o", str(out)]
        )
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and not out.exists() and fetches == []
    assert "remote references are never fetched" in error and "Traceback" not in error
