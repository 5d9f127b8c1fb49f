"""What every command shares: error reporting, exit codes, JSON output, the console."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click

from kdump.errors import (
    EXIT_INTERRUPTED,
    ExitCode,
    KdumpError,
    UserEnvironmentError,
    environment_error,
)
from kdump.text import visible


def _before_dashdash(argv: list[str]) -> list[str]:
    """The arguments kdump itself reads: everything after `--` is the program's (kdump record)."""
    return argv[: argv.index("--")] if "--" in argv else argv


def run_cli(group: click.Group, argv: list[str]) -> None:
    """The CLI's one error boundary: every outcome becomes one line (JSON with --json) and an
    exit code. The user's environment is 2, an interruption 130, only kdump's own bugs 70."""
    head = _before_dashdash(argv)
    verbose = "-v" in head or "--verbose" in head
    as_json = "--json" in head
    try:
        rv = group.main(args=argv, prog_name="kdump", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        # click turns Ctrl-C into Abort; a Ctrl-C outside click's handling arrives as is.
        _fail("interrupted", EXIT_INTERRUPTED, as_json)
    except click.ClickException as exc:  # usage errors: one line, exit 2
        if as_json:
            emit_json({"exit_code": int(ExitCode.USAGE), "error": exc.format_message()})
        else:
            exc.show()
        sys.exit(ExitCode.USAGE)
    except KdumpError as exc:
        _fail_typed(exc, verbose, as_json)
    except OSError as exc:
        typed = environment_error(exc)
        if typed is None:
            _fail_internal(exc, verbose, as_json)
        _fail_typed(typed, verbose, as_json)
    except SystemExit:
        raise
    except Exception as exc:
        _fail_internal(exc, verbose, as_json)
    sys.exit(int(rv or 0))


def _fail(message: str, code: int, as_json: bool, prefix: str = "") -> NoReturn:
    """One line on stderr, or with --json one object {"error", "exit_code"} on stdout (on
    stderr when stdout itself failed: a full disk, a closed pipe)."""
    stdout_ok = _flush_stdout()
    if as_json and stdout_ok:
        try:
            emit_json({"error": message, "exit_code": code})
            sys.exit(code)
        except OSError:
            _flush_stdout()
    click.echo(f"kdump: {prefix}{message}", err=True)
    sys.exit(code)


def _flush_stdout() -> bool:
    """Flush stdout; when it cannot take more, point it at /dev/null so that the interpreter's
    own flush at exit does not fail again (and change the exit code). False then."""
    try:
        sys.stdout.flush()
        return True
    except OSError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        return False


def _fail_typed(exc: KdumpError, verbose: bool, as_json: bool) -> NoReturn:
    if verbose:
        _print_traceback()
    # Messages may quote a bundle: escaped.
    _fail(visible(exc), int(exc.exit_code), as_json, prefix="error: ")


def _fail_internal(exc: BaseException, verbose: bool, as_json: bool) -> NoReturn:
    if verbose:
        _print_traceback()
    message = (
        f"internal error: {type(exc).__name__}: {visible(exc)} (run with -v for the "
        "traceback and report it)"
    )
    _fail(message, int(ExitCode.INTERNAL), as_json)


def _accept_verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """Nothing to do: run_cli reads -v from the command line, which may fail before any
    callback runs. The option exists so that every command accepts it."""


# `-v` is accepted anywhere before `--`: the group adds this option to every command that has no
# -v of its own (kdump replay's -v also shows every comparison row).
verbose_option = click.Option(
    ["-v", "--verbose"],
    is_flag=True,
    expose_value=False,
    callback=_accept_verbose,
    help="Show the traceback of an error.",
)


def check_output_path(path: str | os.PathLike[str], *, replaced: bool = False) -> None:
    """Raise UserEnvironmentError now, before any work, when `path` cannot be written as a file:
    its folder is missing or not a folder or not writable, or the path is a folder. `replaced`:
    the file is written beside and renamed over `path`, so it must not be a device or a pipe."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    shown = repr(str(p))
    if p.is_dir():
        raise UserEnvironmentError(f"{shown} is a folder: give a file name")
    if replaced and p.exists() and not p.is_file():
        raise UserEnvironmentError(f"{shown} is not a regular file: give a file name")
    if not parent.exists():
        raise UserEnvironmentError(
            f"the folder of {shown} does not exist: create it first (mkdir -p "
            f"{shlex.quote(str(parent))}) or choose another path"
        )
    if not parent.is_dir():
        raise UserEnvironmentError(f"a part of {shown} is a file, not a folder: check the path")
    writable = os.access(p, os.W_OK) if p.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        raise UserEnvironmentError(
            f"permission denied for {shown}: choose a location you can write, or fix its "
            "permissions"
        )


def _print_traceback() -> None:
    click.echo(visible(traceback.format_exc(), None, newlines=True), err=True)


def _set_max_load(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None:
        return
    from kdump.config import parse_bytes

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


def _strict(obj: Any) -> Any:
    """`obj` with every non-finite float as a string ("NaN", "Infinity", "-Infinity"): JSON has
    no such numbers, and strict parsers reject the bare tokens."""
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {(_strict(k) if isinstance(k, float) else k): _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def _strict_default(obj: Any) -> Any:
    # numpy and torch scalars or arrays: their Python values; anything else as its text.
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        try:
            return _strict(tolist())
        except Exception:
            pass
    return str(obj)


def dumps_strict(obj: Any, indent: int | None = 2) -> str:
    """Strict ASCII JSON: non-finite floats as strings, control characters and lone surrogates
    from a bundle as \\u escapes, unknown objects as their values or text."""
    return json.dumps(
        _strict(obj), indent=indent, default=_strict_default, ensure_ascii=True, allow_nan=False
    )


def emit_json(obj: Any) -> None:
    """Print `obj` as strict JSON on stdout (every --json output goes through here), flushed:
    a full disk or closed pipe is reported, not lost at exit."""
    click.echo(dumps_strict(obj))
    sys.stdout.flush()


def console() -> Any:
    from rich.console import Console

    return Console(emoji=False)  # bundle strings never become emoji (markup() escapes too)


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")


def trust_options(allow_help: str, path_help: str, metavar: str = "MOD:FN") -> Any:
    """`--allow-target` (patterns of targets to run beyond the plug-ins') and `--path` (folders
    the replays import targets from): the trust options of every command that replays, each
    command with its own help text."""
    allow = click.option(
        "--allow-target", "allow_targets", multiple=True, metavar=metavar, help=allow_help
    )
    path = click.option(
        "--path", "paths", multiple=True, type=click.Path(file_okay=False), help=path_help
    )
    return lambda f: allow(path(f))
