"""What every command shares: error reporting, exit codes, JSON output, the console."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import click

from kdump.errors import ExitCode, KdumpError
from kdump.text import visible


def run_cli(group: click.Group, argv: list[str]) -> None:
    verbose = "-v" in argv or "--verbose" in argv
    try:
        rv = group.main(args=argv, prog_name="kdump", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("kdump: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:  # usage errors: one line, exit 2
        if "--json" in argv:
            emit_json({"exit_code": int(ExitCode.USAGE), "error": exc.format_message()})
        else:
            exc.show()
        sys.exit(ExitCode.USAGE)
    except KdumpError as exc:
        if verbose:
            _print_traceback()
        click.echo(f"kdump: error: {visible(exc)}", err=True)  # messages may quote a bundle
        sys.exit(int(exc.exit_code))
    except KeyboardInterrupt:
        click.echo("kdump: interrupted", err=True)
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as exc:
        if verbose:
            _print_traceback()
        click.echo(
            f"kdump: internal error: {type(exc).__name__}: {visible(exc)} (run with -v for the "
            "traceback and report it)",
            err=True,
        )
        sys.exit(ExitCode.INTERNAL)
    sys.exit(int(rv or 0))


def _print_traceback() -> None:
    click.echo(visible(traceback.format_exc(), None, newlines=True), err=True)


def _set_max_load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    from kdump.record.triggers import parse_bytes

    try:
        n = parse_bytes(value)
    except KdumpError as exc:
        raise click.BadParameter(str(exc))
    # Through the environment, so replay children apply the same limit.
    os.environ["KDUMP_MAX_LOAD_BYTES"] = str(n)


max_load_option = click.option(
    "--max-load-bytes",
    callback=_set_max_load,
    expose_value=False,
    is_eager=True,
    metavar="BYTES",
    help="Most bytes loading one call may allocate (e.g. 200G; default 64G) "
    "[KDUMP_MAX_LOAD_BYTES].",
)


def emit_json(obj: Any) -> None:
    """ASCII JSON: control characters and lone surrogates from a bundle become \\u escapes."""
    click.echo(json.dumps(obj, indent=2, default=str, ensure_ascii=True))


def console() -> Any:
    from rich.console import Console

    return Console()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")
