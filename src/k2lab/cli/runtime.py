"""Agent runtime commands: ``tools harvest`` (MCP) and ``sandbox run``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from k2lab.cli.app import app, console
from k2lab.errors import K2LabError

tools_app = typer.Typer(
    help="Tool specs for the agent data factory, harvested from real MCP servers.", no_args_is_help=True
)


app.add_typer(tools_app, name="tools")


@tools_app.command("harvest")
def tools_harvest(
    config: Annotated[
        Path,
        typer.Option(
            "--config",
            "-c",
            help='servers.json in the Claude Desktop / Cursor layout: {"mcpServers": {"name": {"command": '
            '..., "args": ..., "env": ..., "cwd": ...}}}.',
        ),
    ],
    out: Annotated[
        Path,
        typer.Option("--out", "-o", help="JSONL output; the summary goes to OUT's stem + .summary.json."),
    ] = Path("tools.jsonl"),
    timeout: Annotated[
        float, typer.Option(help="Seconds per server for start, initialize and tools/list.")
    ] = 30.0,
    concurrency: Annotated[int, typer.Option(help="Servers harvested at once.")] = 8,
    strict: Annotated[
        bool, typer.Option("--strict", help="Exit with code 1 when any server failed.")
    ] = False,
) -> None:
    """Start the MCP servers of a config, list their tools and write OpenAI-ready normalised specs (JSONL).

    A server that fails to start, crashes, hangs or answers garbage is reported; the others go on.
    The summary is printed and written next to the output (OUT's stem + .summary.json).
    """
    from k2lab.runtime.mcp_harvest import harvest, print_summary

    result = harvest(config, timeout=timeout, concurrency=concurrency)
    summary = result.write(out)
    print_summary(result, console)
    console.print(f"wrote {len(result.tools)} tools to {out} (summary: {summary})", highlight=False)
    if strict and result.failed:
        raise typer.Exit(1)


sandbox_app = typer.Typer(help="Run untrusted Python in a contained sandbox.", no_args_is_help=True)


app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("run")
def sandbox_run(
    file: Annotated[Path, typer.Argument(help="The Python program to run.")],
    timeout: Annotated[float, typer.Option("--timeout", help="Wall-clock limit in seconds.")] = 10.0,
    memory: Annotated[int, typer.Option("--memory", help="Address-space limit in MB.")] = 512,
    cpu: Annotated[
        float | None, typer.Option("--cpu", help="CPU-time limit in seconds (default: the timeout).")
    ] = None,
    max_output: Annotated[
        int, typer.Option("--max-output", help="Bytes kept of stdout and of stderr; more kills the run.")
    ] = 1_000_000,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="Writable working directory (default: a fresh temp dir).")
    ] = None,
) -> None:
    """Run FILE in the sandbox and print the JSON result (exit code 0 whenever the sandbox ran).

    The program gets its own network, mount and PID namespaces, a read-only filesystem except its working
    directory, an unprivileged uid, resource limits, and nothing of it survives the run; the result's
    `isolation` says what was actually contained on this machine.
    """
    from k2lab.runtime.sandbox import SandboxLimits, run_python

    if not file.is_file():
        raise K2LabError(f"cannot run {file}: it does not exist or is not a file")
    if timeout <= 0 or memory <= 0 or max_output <= 0 or (cpu is not None and cpu <= 0):
        raise K2LabError("--timeout, --memory, --cpu and --max-output must be positive")
    limits = SandboxLimits(timeout_s=timeout, cpu_s=cpu, memory_mb=memory, max_output_bytes=max_output)
    result = run_python(file, limits, workdir=workdir)
    print(json.dumps(result.to_dict(), indent=2))
