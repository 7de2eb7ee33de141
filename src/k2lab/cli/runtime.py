"""Agent runtime commands: ``tools harvest`` (MCP) and ``sandbox run``, each running a pydantic config
(``HarvestRun``, ``SandboxRun``) whose defaults come from the library (``k2lab.runtime``)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Annotated

import typer
from pydantic import BaseModel, ConfigDict, Field

from k2lab.cli.app import app, console
from k2lab.cli.options import Opt, runs_config
from k2lab.errors import K2LabError
from k2lab.fsutil import check_output_file
from k2lab.runtime.mcp_harvest import DEFAULT_CONCURRENCY, DEFAULT_TIMEOUT
from k2lab.runtime.sandbox import SandboxLimits

tools_app = typer.Typer(
    help="Tool specs for the agent data factory, harvested from real MCP servers.", no_args_is_help=True
)


app.add_typer(tools_app, name="tools")


class HarvestRun(BaseModel):
    """What ``k2lab tools harvest`` runs: the servers file, the output and the per-server limits."""

    model_config = ConfigDict(extra="forbid")

    servers: Path = Field(
        description='servers.json in the Claude Desktop / Cursor layout: {"mcpServers": {"name": {"command": '
        '..., "args": ..., "env": ..., "cwd": ...}}}.'
    )
    out: Path = Field(
        Path("tools.jsonl"), description="JSONL output; the summary goes to OUT's stem + .summary.json."
    )
    timeout: float = Field(
        DEFAULT_TIMEOUT, gt=0, description="Seconds per server for start, initialize and tools/list."
    )
    concurrency: int = Field(DEFAULT_CONCURRENCY, ge=1, description="Servers harvested at once.")
    strict: bool = Field(False, description="Exit with code 1 when any server failed.")


@tools_app.command("harvest")
@runs_config(
    HarvestRun,
    options={
        "config": Opt("servers", "--config", "-c"),
        "out": Opt("out", "-o"),
        "timeout": Opt("timeout"),
        "concurrency": Opt("concurrency"),
        "strict": Opt("strict"),
    },
)
def tools_harvest(config: HarvestRun) -> None:
    """Start the MCP servers of a config, list their tools and write OpenAI-ready normalised specs (JSONL).

    A server that fails to start, crashes, hangs or answers garbage is reported; the others go on.
    The summary is printed and written next to the output (OUT's stem + .summary.json). When no tool was
    harvested and a server failed, nothing is written (exit code 2).
    """
    from k2lab.runtime.mcp_harvest import harvest, print_summary, summary_path_for

    for target, what in ((config.out, "the tools"), (summary_path_for(config.out), "the harvest summary")):
        check_output_file(target, what, [config.servers])
    result = harvest(config.servers, timeout=config.timeout, concurrency=config.concurrency)
    print_summary(result, console)
    if not result.tools and result.failed:
        failures = "; ".join(f"{name}: {reason}" for name, reason in result.failed.items())
        raise K2LabError(
            f"no tools harvested and {len(result.failed)} server(s) failed ({failures}); nothing written to "
            f"{config.out}"
        )
    summary = result.write(config.out)
    console.print(
        f"wrote {len(result.tools)} tools to {config.out} (summary: {summary})",
        highlight=False,
        soft_wrap=True,
    )
    if config.strict and result.failed:
        raise typer.Exit(1)


sandbox_app = typer.Typer(help="Run untrusted Python in a contained sandbox.", no_args_is_help=True)


app.add_typer(sandbox_app, name="sandbox")


class SandboxRun(BaseModel):
    """What ``k2lab sandbox run`` runs under: ``SandboxLimits`` (its defaults) and the working directory.

    ``SandboxLimits`` stays a dataclass: ``k2lab/runtime/sandbox.py`` also runs as the sandbox's own init
    process under ``python -I -S``, where pydantic cannot be imported.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(SandboxLimits.timeout_s, gt=0, description="Wall-clock limit in seconds.")
    cpu_s: float | None = Field(
        SandboxLimits.cpu_s, gt=0, description="CPU-time limit in seconds; none: the timeout."
    )
    memory_mb: int = Field(SandboxLimits.memory_mb, gt=0, description="Address-space limit in MB.")
    max_processes: int = Field(
        SandboxLimits.max_processes, gt=0, description="RLIMIT_NPROC of the run's uid."
    )
    max_output_bytes: int = Field(
        SandboxLimits.max_output_bytes,
        gt=0,
        description="Bytes kept of stdout and of stderr; more kills the run.",
    )
    max_file_bytes: int = Field(
        SandboxLimits.max_file_bytes, gt=0, description="RLIMIT_FSIZE: the largest file it may write."
    )
    max_open_files: int = Field(
        SandboxLimits.max_open_files, gt=0, description="RLIMIT_NOFILE: open files at once."
    )
    workdir: Path | None = Field(None, description="Writable working directory; none: a fresh temp dir.")

    def limits(self) -> SandboxLimits:
        """The ``SandboxLimits`` of this run."""
        return SandboxLimits(**{f.name: getattr(self, f.name) for f in fields(SandboxLimits)})


@sandbox_app.command("run")
@runs_config(
    SandboxRun,
    options={
        "timeout": Opt("timeout_s", "--timeout"),
        "memory": Opt("memory_mb", "--memory"),
        "cpu": Opt("cpu_s", "--cpu"),
        "max_output": Opt("max_output_bytes", "--max-output"),
        "workdir": Opt("workdir", "--workdir"),
    },
)
def sandbox_run(
    config: SandboxRun, file: Annotated[Path, typer.Argument(help="The Python program to run.")]
) -> None:
    """Run FILE in the sandbox and print the JSON result (exit code 0 whenever the sandbox ran).

    The program gets its own network, mount and PID namespaces, a read-only filesystem except its working
    directory, an unprivileged uid, resource limits, and nothing of it survives the run; the result's
    `isolation` says what was actually contained on this machine.
    """
    from k2lab.runtime.sandbox import SandboxInputError, run_python

    if not file.is_file():
        raise K2LabError(f"cannot run {file}: it does not exist or is not a file")
    try:
        result = run_python(file, config.limits(), workdir=config.workdir)
    except SandboxInputError as error:
        raise K2LabError(str(error)) from error
    print(json.dumps(result.to_dict(), indent=2))
