"""The `kdump` command: a thin click group. Each command lives in `kdump.cli.<name>` and is
imported only when used, so `kdump --help` stays fast and torch-free."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from kdump._version import __version__
from kdump.errors import exit_codes_help

COMMANDS = {
    "record": ("kdump.cli.record", "Run a program with recording active in all its processes."),
    "replay": ("kdump.cli.replay", "Replay bundles against a kernel and say which step fails."),
    "info": ("kdump.cli.info", "Show what is inside a bundle."),
    "diff": ("kdump.cli.diff", "Show what differs between two recorded calls or bundles."),
    "report": ("kdump.cli.report", "Write a Markdown bug report of a bundle, ready for an issue."),
    "pack": ("kdump.cli.pack", "Fold a bundle and its shared blobs into one file to attach."),
    "slim": ("kdump.cli.slim", "Shrink a failing call's bundle to one that still reproduces it."),
    "salvage": ("kdump.cli.salvage", "Turn a dead process' flight-recorder journal into bundles."),
    "doctor": (
        "kdump.cli.doctor",
        "Say what this machine can replay, and how to fix what it can't.",
    ),
}


def _add_verbose(command: click.Command) -> None:
    """Let `-v` (tracebacks of errors) follow the command name too, as in `kdump pack X -v`;
    a command with a -v of its own keeps it (kdump reads -v from the command line anyway)."""
    from kdump.cli.common import verbose_option

    if not any("-v" in p.opts or "--verbose" in p.opts for p in command.params):
        command.params.append(verbose_option)


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        command = importlib.import_module(COMMANDS[name][0]).command
        _add_verbose(command)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(n, h) for n, (_, h) in COMMANDS.items()])


EPILOG = (
    exit_codes_help()
    + """
\b
Examples:
  kdump replay captures/contiguous_ue8m0.kdump
  kdump record --target deep_gemm -- python -m sglang.launch_server ...
  kdump info dumps/ --json
"""
)


@click.group(cls=LazyGroup, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kdump")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """kdump: record the exact arguments of GPU kernel calls and replay them offline."""
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose


def main(argv: list[str] | None = None) -> Any:
    from kdump.cli.common import run_cli

    return run_cli(cli, argv if argv is not None else sys.argv[1:])
