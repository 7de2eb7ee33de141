"""MCP tool harvesting against real stdio servers (tests/mcp_servers): normalised specs, failures, the CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from k2lab.runtime.mcp_harvest import (
    EMPTY_PARAMETERS,
    HarvestConfigError,
    ServerReport,
    _assemble,
    assign_names,
    check_schema,
    harvest,
    load_config,
    parse_config,
    sanitize_name,
)

SERVERS = Path(__file__).parents[1] / "mcp_servers"
OPENAI_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
LONG_NAME = "fetch_the_complete_hourly_weather_forecast_for_a_city_over_the_next_fourteen_days_in_detail"
HANG_TIMEOUT = 3  # per-server override; the others get the --timeout of 30 s (robust on a loaded machine)


def server(script: str, **extra) -> dict:
    return {"command": sys.executable, "args": [str(SERVERS / script)], **extra}


def write_config(folder: Path, servers: dict) -> Path:
    path = folder / "servers.json"
    path.write_text(json.dumps({"mcpServers": servers, "globalShortcut": "Ctrl+Space"}))
    return path


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict], dict]:
    """One end-to-end `python -m k2lab tools harvest` over good, colliding, crashing, hanging servers."""
    folder = tmp_path_factory.mktemp("harvest")
    config = write_config(
        folder,
        {
            "weather": server("weather.py"),
            "files": {"command": sys.executable, "args": ["files.py"], "cwd": str(SERVERS)},
            "crash": server("crash.py"),
            "hang": server("hang.py", timeout=HANG_TIMEOUT),
            "garbage": server("garbage.py", timeout=HANG_TIMEOUT),
            "missing": {"command": str(folder / "no-such-server")},
            "remote": {"url": "https://example.invalid/mcp"},
            "off": server("weather.py", disabled=True),
        },
    )
    out = folder / "out" / "tools.jsonl"
    command = [sys.executable, "-m", "k2lab", "tools", "harvest", "--config", str(config), "--out", str(out)]
    result = subprocess.run([*command, "--timeout", "30"], capture_output=True, text=True, timeout=60)
    specs = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    summary_path = folder / "out" / "tools.summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return result, specs, summary


def by_original(specs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(spec["server"], spec["original_name"]): spec for spec in specs}


def test_cli_writes_jsonl_and_summary(cli_run) -> None:
    result, specs, summary = cli_run
    assert result.returncode == 0, result.stderr
    assert "MCP servers" in result.stdout and "wrote 7 tools" in result.stdout
    assert len(specs) == 7 and summary["tools"] == 7
    assert list(by_original(specs)) == [
        ("weather", "get_weather"),
        ("weather", "weather.alerts"),
        ("weather", LONG_NAME),
        ("weather", "search"),
        ("files", "search"),
        ("files", "read file"),
        ("files", "stat"),
    ]  # config order, then listing order; the files server's two pages were both followed


def test_names_are_openai_valid_and_mapped(cli_run) -> None:
    _, specs, summary = cli_run
    names = [spec["name"] for spec in specs]
    assert all(OPENAI_NAME.match(name) for name in names) and len(set(names)) == len(names)
    tools = by_original(specs)
    assert tools[("weather", "get_weather")]["name"] == "get_weather"  # no collision: unchanged
    assert tools[("weather", "weather.alerts")]["name"] == "weather_alerts"
    assert tools[("files", "read file")]["name"] == "read_file"
    assert tools[("weather", "search")]["name"] == "weather__search"  # collision: both prefixed
    assert tools[("files", "search")]["name"] == "files__search"
    long = tools[("weather", LONG_NAME)]["name"]
    assert (
        len(long) == 64 and long.startswith(LONG_NAME[:55] + "_") and re.fullmatch(r"[0-9a-f]{8}", long[56:])
    )
    renamed = {(row["server"], row["original_name"]): row["name"] for row in summary["renamed"]}
    assert renamed == {key: spec["name"] for key, spec in tools.items() if spec["name"] != key[1]}
    for spec in specs:
        assert spec["openai"]["function"]["name"] == spec["name"]


def test_schemas_and_annotations_kept(cli_run) -> None:
    _, specs, _ = cli_run
    tools = by_original(specs)
    weather = tools[("weather", "get_weather")]
    assert weather["parameters"] == {
        "type": "object",
        "title": "get_weatherArguments",
        "properties": {
            "city": {"title": "City", "type": "string"},
            "units": {"default": "c", "enum": ["c", "f"], "title": "Units", "type": "string"},
            "days": {"default": 1, "title": "Days", "type": "integer"},
        },
        "required": ["city"],
    }
    assert weather["output_schema"]["properties"]["celsius"] == {"title": "Celsius", "type": "number"}
    assert weather["title"] == "Current weather"
    assert weather["annotations"] == {
        "readOnlyHint": True,
        "destructiveHint": None,
        "idempotentHint": True,
        "openWorldHint": True,
    }
    assert tools[("weather", "search")]["annotations"] == {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": False,
        "openWorldHint": None,
    }
    search = tools[("files", "search")]
    assert search["parameters"] == {
        "type": "object",
        "properties": {"pattern": {"type": "string", "description": "glob"}},
        "required": ["pattern"],
        "additionalProperties": False,
    }
    assert search["openai"] == {
        "type": "function",
        "function": {
            "name": "files__search",
            "description": "Search files by glob.",
            "parameters": search["parameters"],
        },
    }
    stat = tools[("files", "stat")]
    assert stat["parameters"] == {"type": "object"} and stat["description"] is None
    assert stat["openai"]["function"]["description"] == ""


def test_failures_are_reported_with_reasons(cli_run) -> None:
    result, _, summary = cli_run
    reports = {report["name"]: report for report in summary["servers"]}
    assert (summary["servers_ok"], summary["servers_failed"], summary["servers_skipped"]) == (2, 4, 2)
    assert reports["weather"]["tools"] == 4 and reports["files"]["tools"] == 3
    assert reports["files"]["warnings"] == [
        "ignored 1 stdout line(s) not JSON-RPC, first: 'files server ready'"
    ]
    assert reports["files"]["skipped_tools"][0]["name"] == "broken"
    assert "not a valid JSON Schema" in reports["files"]["skipped_tools"][0]["reason"]
    assert "FAKE_TOKEN" in reports["crash"]["reason"]  # the server's stderr tail explains the crash
    assert f"timed out after {HANG_TIMEOUT} s during initialize" in reports["hang"]["reason"]
    assert reports["hang"]["seconds"] < HANG_TIMEOUT + 6  # killed, not waited for
    assert "not JSON-RPC" in reports["garbage"]["reason"]
    assert "cannot start the server" in reports["missing"]["reason"]
    assert reports["remote"]["status"] == reports["off"]["status"] == "skipped"
    assert "Traceback" not in result.stderr


def test_python_api_matches_cli(cli_run, tmp_path) -> None:
    _, specs, _ = cli_run
    config = {
        "mcpServers": {
            "weather": server("weather.py"),
            "files": {"command": sys.executable, "args": ["files.py"], "cwd": str(SERVERS)},
        }
    }
    result = harvest(config, timeout=20)
    assert [report.status for report in result.servers] == ["ok", "ok"]
    assert result.tools == specs  # deterministic: same names, same schemas
    summary = result.write(tmp_path / "api.jsonl")
    assert summary == tmp_path / "api.summary.json" and not list(tmp_path.glob(".*"))  # no temp files left


def test_a_malformed_tool_entry_does_not_cost_the_page() -> None:
    result = harvest({"mcpServers": {"m": server("malformed.py")}}, timeout=20)
    (report,) = result.servers
    assert report.status == "ok" and report.tools == 4, report.reason
    specs = {spec["name"]: spec for spec in result.tools}
    assert list(specs) == ["good", "no_schema", "string_schema", "later"]  # page 2 still followed
    assert specs["no_schema"]["parameters"] == specs["string_schema"]["parameters"] == EMPTY_PARAMETERS
    assert specs["good"]["parameters"]["properties"] == {"q": {"type": "string"}}
    assert [w.split(":")[0] for w in report.warnings] == ["tool 'no_schema'", "tool 'string_schema'"]
    reasons = {skipped["name"]: skipped["reason"] for skipped in report.skipped_tools}
    assert reasons["bad_hint"].startswith("invalid tool listing: annotations.readOnlyHint:")
    assert reasons["5"].startswith("invalid tool listing:") and len(reasons) == 3  # and the nameless one


def test_assign_names_rules() -> None:
    names = assign_names(
        [
            ("a", "x.y"),
            ("a", "x_y"),
            ("b", "find"),
            ("c", "find"),
            ("c", "ok"),
            ("my server", "ok2"),
            ("d", ""),
        ]
    )
    assert names[("b", "find")] == "b__find" and names[("c", "find")] == "c__find"
    assert names[("c", "ok")] == "ok" and names[("d", "")] == "tool"
    assert names[("a", "x.y")] != names[("a", "x_y")]  # same server, same sanitised name: hash suffixes
    assert all(name.startswith("x_y_") for key, name in names.items() if key[0] == "a")
    prefixed = assign_names([("my server!", "z" * 70), ("other", "z" * 70)])
    assert all(OPENAI_NAME.match(name) for name in prefixed.values()) and len(set(prefixed.values())) == 2
    assert sanitize_name("ns/tool:v2 é") == "ns_tool_v2__"


def test_hash_suffixes_never_land_on_an_existing_name() -> None:
    suffixed = assign_names([("s1", "a.b"), ("s1", "a_b")])[("s1", "a_b")]  # a_b_ + its hash
    keys = [("s1", "a.b"), ("s1", "a_b"), ("s1", suffixed)]
    names = assign_names(keys)
    assert len(set(names.values())) == 3 and names[("s1", suffixed)] == suffixed  # a unique name stays
    assert all(OPENAI_NAME.match(name) for name in names.values()) and assign_names(keys) == names


def test_missing_and_invalid_schemas() -> None:
    assert check_schema({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    assert "not valid" in check_schema({"type": "object", "properties": {"a": {"type": 3}}})
    report = ServerReport("s")
    raw = [
        {"name": "no_schema", "description": "d"},
        {"name": "bad_output", "inputSchema": {"type": "object"}, "outputSchema": {"type": "nope"}},
        {"name": "no_schema", "inputSchema": {"type": "object"}},
    ]
    config = parse_config({"mcpServers": {"s": {"command": "x"}}})
    result = _assemble(config, {"s": (report, raw)})
    assert [spec["name"] for spec in result.tools] == ["no_schema", "bad_output"]
    assert result.tools[0]["parameters"] == EMPTY_PARAMETERS and result.tools[1]["output_schema"] is None
    assert len(report.warnings) == 3 and report.tools == 2  # missing schema, dropped output, listed twice


def test_unresolvable_refs_are_skipped_without_fetching(monkeypatch) -> None:
    fetched: list[object] = []
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, *a, **k: fetched.append(url))
    remote = {"type": "object", "properties": {"x": {"$ref": "http://127.0.0.1:9/exfil?secret=1"}}}
    dangling = {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}
    local = {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "string"}}}
    assert check_schema(local) is None and "remote references are never fetched" in check_schema(remote)
    raw = [
        {"name": "remote", "inputSchema": remote},
        {"name": "dangling", "inputSchema": dangling},
        {"name": "local", "inputSchema": local, "outputSchema": remote},
    ]
    report = ServerReport("s")
    result = _assemble(parse_config({"mcpServers": {"s": {"command": "x"}}}), {"s": (report, raw)})
    assert [spec["name"] for spec in result.tools] == ["local"] and result.tools[0]["output_schema"] is None
    assert [skip["name"] for skip in report.skipped_tools] == ["remote", "dangling"]
    assert "'#/$defs/missing' does not resolve within the schema" in report.skipped_tools[1]["reason"]
    assert "outputSchema dropped" in report.warnings[0] and fetched == []


def test_config_layouts_and_errors(tmp_path) -> None:
    vscode = parse_config(
        {"servers": {"s": {"type": "stdio", "command": "x", "cwd": "sub"}}}, base_dir=tmp_path
    )
    assert vscode.mcp_servers["s"].cwd == str(tmp_path / "sub")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "empty.json").write_text('{"mcpServers": {}}')
    (tmp_path / "broken.json").write_text('{"mcpServers": ')
    for name, message in [
        ("list.json", "should hold a JSON object"),
        ("empty.json", "at least 1 item"),
        ("broken.json", "is not valid JSON"),
        ("absent.json", "cannot read"),
    ]:
        with pytest.raises(HarvestConfigError, match=message):
            load_config(tmp_path / name)


def test_cli_bad_config_exits_2(tmp_path, capsys) -> None:
    from k2lab.cli import main

    config = write_config(tmp_path, {"a": {"args": ["no command"]}, "b": {"command": "x", "env": {"K": 1}}})
    with pytest.raises(SystemExit) as exit_info:
        main(["tools", "harvest", "--config", str(config), "--out", str(tmp_path / "t.jsonl")])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr and "\n\n" not in stderr.strip()  # one paragraph
    message = " ".join(stderr.split())
    assert "mcpServers.a: a server needs a 'command'" in message and "mcpServers.b.env.K" in message
    assert not (tmp_path / "t.jsonl").exists()


def test_cli_strict_exit_code(tmp_path, capsys) -> None:
    from k2lab.cli import main

    gone = {"command": str(tmp_path / "no-such-server")}
    config = write_config(tmp_path, {"weather": server("weather.py"), "gone": gone})
    out = tmp_path / "t.jsonl"
    for flags, code in [([], 0), (["--strict"], 1)]:  # a failed server is reported; --strict also fails
        with pytest.raises(SystemExit) as exit_info:
            main(["tools", "harvest", "--config", str(config), "--out", str(out), *flags])
        assert exit_info.value.code == code
        assert len(out.read_text().splitlines()) == 4 and "cannot start the server" in capsys.readouterr().out


def test_cli_writes_nothing_when_every_server_failed(tmp_path, capsys) -> None:
    """Zero tools because every server failed replaced an earlier tools.jsonl by an empty one (exit code 0);
    now the failures are named, exit code 2, and the earlier output is kept."""
    from k2lab.cli import main

    config = write_config(tmp_path, {"gone": {"command": str(tmp_path / "no-such-server")}})
    out = tmp_path / "t.jsonl"
    out.write_text('{"name": "earlier"}\n')
    with pytest.raises(SystemExit) as exit_info:
        main(["tools", "harvest", "--config", str(config), "--out", str(out)])
    assert exit_info.value.code == 2
    message = " ".join(capsys.readouterr().err.split())
    assert "no tools harvested" in message and "gone: cannot start the server" in message
    assert out.read_text() == '{"name": "earlier"}\n' and not (tmp_path / "t.summary.json").exists()


@pytest.mark.parametrize("target", ["servers.json", "servers.summary.json", "folder"])
def test_cli_refuses_its_input_or_a_directory_as_output_before_harvesting(tmp_path, capsys, target) -> None:
    """-o servers.json emptied the servers file (its summary path is checked too); -o DIR failed with a
    traceback after every server had run."""
    from k2lab.cli import main

    config = write_config(tmp_path, {"weather": server("weather.py")})
    (tmp_path / "folder").mkdir()
    out = tmp_path / ("servers.jsonl" if target == "servers.summary.json" else target)
    if target == "servers.summary.json":
        config = config.rename(tmp_path / target)
    before = config.read_text()
    with pytest.raises(SystemExit) as exit_info:
        main(["tools", "harvest", "--config", str(config), "--out", str(out)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "MCP servers" not in captured.out and "Traceback" not in captured.err  # refused before any work
    assert ("is a directory" if target == "folder" else "is also an input") in " ".join(captured.err.split())
    assert config.read_text() == before


def test_cli_runs_a_harvest_recipe_with_the_library_defaults(tmp_path, capsys) -> None:
    """`tools harvest` runs a HarvestRun: a TOML recipe and --set reach it, its defaults are harvest()'s."""
    import inspect

    from k2lab.cli import main
    from k2lab.cli.runtime import HarvestRun

    parameters = inspect.signature(harvest).parameters
    for name in ("timeout", "concurrency"):
        assert HarvestRun.model_fields[name].default == parameters[name].default
    config = write_config(tmp_path, {"gone": {"command": str(tmp_path / "no-such-server")}})
    out = tmp_path / "from-recipe.jsonl"
    recipe = tmp_path / "harvest.toml"
    recipe.write_text(f"servers = {json.dumps(str(config))}\nout = {json.dumps(str(out))}\nstrict = true\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["tools", "harvest", "--recipe", str(recipe), "--set", "timeout=5"])
    assert exit_info.value.code == 2 and not out.exists()  # every server failed: nothing written
    write_config(tmp_path, {"weather": server("weather.py"), "gone": {"command": "/no-such-server"}})
    with pytest.raises(SystemExit) as exit_info:
        main(["tools", "harvest", "--recipe", str(recipe), "--set", "timeout=5"])
    assert exit_info.value.code == 1 and out.is_file()  # strict, from the recipe
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["tools", "harvest", "--recipe", str(recipe), "--concurrency", "0"])
    assert exit_info.value.code == 2 and "concurrency" in capsys.readouterr().err
