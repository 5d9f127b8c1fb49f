from __future__ import annotations

import textwrap
from typing import Any

import click

from kdump.cli.common import console, emit_json, json_option, max_load_option, trust_options
from kdump.errors import ExitCode, bisect_exit_code, bisect_text, exit_codes_help
from kdump.kernels.registry import backend_names
from kdump.replay.options import MODES, ORACLES, TOOLS
from kdump.text import markup


class _BackendChoice(click.Choice):
    """The registry's backend names, read when used (plug-ins may add backends)."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return backend_names()

    @choices.setter
    def choices(self, value: object) -> None:
        pass


class _ReplayCommand(click.Command):
    """Under --bisect a command line click rejects aborts the bisection (128) instead of
    exiting 2, which `git bisect run` would read as a bad commit."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        bisecting = "--bisect" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if not bisecting:
                raise
            exc.show()
            raise click.exceptions.Exit(bisect_exit_code(ExitCode.USAGE))


BISECT_HELP = "\n\b\n" + textwrap.fill(bisect_text().replace("`", ""), width=92)

EPILOG = (
    exit_codes_help()
    + BISECT_HELP
    + """
\b
Examples:
  kdump replay captures/contiguous_ue8m0.kdump
  kdump replay dumps/ --backend deep_gemm --repeat 5 --json
  kdump replay a.kdump --mode graph --then b.kdump --save-failing repro/
  kdump replay mine.kdump --mode graph --allow-target 'mymod:*' --routing groups:labels
  kdump replay a.kdump --mode sanitizer --tool memcheck --tool racecheck
"""
)


@click.command("replay", cls=_ReplayCommand, epilog=EPILOG)
@click.argument("bundles", nargs=-1, required=True, type=click.Path())
@max_load_option
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default=None,
    help="eager: run and compare; graph: capture, identical replay, replays after in-place "
    "mutations, a shrinking batch, a replay after an eager call at changed addresses; "
    "sanitizer: compute-sanitizer; all: the three in one summary. Default: graph for bundles "
    "the flight recorder salvaged from a graph replay, else eager; a call where "
    "production died of a GPU fault then goes on under memcheck when the replay finds nothing.",
)
@click.option(
    "--backend",
    type=_BackendChoice(),
    default="auto",
    show_default=True,
    help="auto = installed library on a GPU, else packaged kernel on a GPU, else the torch "
    "reference. packaged-faulty: the packaged kernel with a planted stale-schedule bug (fault "
    "injection, to prove graph/sanitizer modes catch it).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option(
    "--call", "calls", type=int, multiple=True, help="Replay only this call (repeatable)."
)
@click.option(
    "--repeat",
    type=click.IntRange(1, 1000),
    default=2,
    show_default=True,
    help="Eager runs per call; runs after the first must agree with it (within tolerance).",
)
@click.option(
    "--bitwise",
    is_flag=True,
    help="Float differences within the dtype tolerance fail (default: a note).",
)
@click.option(
    "--oracle",
    type=click.Choice(ORACLES),
    default="auto",
    show_default=True,
    help="fresh: also compare every replay with an eager run of its inputs in a fresh process "
    "(auto: only for targets without a reference).",
)
@click.option(
    "--then",
    "then",
    multiple=True,
    metavar="OTHER.kdump[:CALL]",
    help="graph: after capturing, replay with this call's inputs written in place (repeatable; "
    "same shapes, strides and dtypes required).",
)
@click.option(
    "--mutations",
    type=click.IntRange(0, 1000),
    default=3,
    show_default=True,
    help="graph: random routing draws on top of the fixed synthesised phases.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="graph: seed of the draws.")
@click.option(
    "--routing",
    metavar="NAME:LAYOUT",
    help="graph: the routing argument the shrinking-batch step shrinks, for a kernel whose "
    "spec names none. NAME:labels: a row's group, -1 marks an invalid row; NAME:counts: the "
    "valid rows of each group (like masked_m).",
)
@click.option(
    "--save-failing",
    type=click.Path(file_okay=False),
    help="graph: write a bundle (capture call + failing replay call) for each failing replay.",
)
@click.option(
    "--halo",
    type=click.IntRange(0, 1 << 30),
    default=4096,
    show_default=True,
    help="eager/graph: bytes of poisoned guard around every tensor (0 = off).",
)
@click.option(
    "--tool",
    "tools",
    type=click.Choice((*TOOLS, "all")),
    multiple=True,
    help="sanitizer: tool(s) to run (default memcheck).",
)
@click.option("--graph", "sanitize_graph", is_flag=True, help="sanitizer: also the graph chain.")
@click.option("--sanitizer", type=click.Path(dir_okay=False), help="compute-sanitizer binary.")
@click.option("--kernel-filter", help="sanitizer: check only kernels whose name contains this.")
@click.option(
    "--sanitizer-logs",
    type=click.Path(file_okay=False),
    help="sanitizer: keep compute-sanitizer's raw reports in this folder.",
)
@click.option("--force", is_flag=True, help="Launch even when the call violates the contract.")
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds before a replay counts as a hang and is killed.",
)
@click.option(
    "--interpreter-budget",
    type=click.FloatRange(min=0, min_open=True),
    default=120.0,
    show_default=True,
    help="Seconds Triton's interpreter may run one launch as the oracle of a GPU replay.",
)
@click.option(
    "--jobs", type=click.IntRange(1, 64), default=1, help="Replays at once (one per GPU)."
)
@click.option("--in-process", is_flag=True, help="Do not isolate replays in a child process.")
@click.option("-v", "--verbose", is_flag=True, help="Show every comparison row.")
@trust_options(
    allow_help="Run this target although no kernel plug-in knows it (repeatable; globs like "
    "'mod:*'). Only for bundles you trust: the bundle chooses the arguments.",
    path_help="Folder the replay imports targets from (repeatable); the current folder never is.",
)
@click.option(
    "--apply-env",
    "apply_env",
    multiple=True,
    metavar="NAME",
    help="Set this recorded environment variable in the replay (repeatable), e.g. "
    "DG_JIT_CACHE_DIR; others are only shown.",
)
@click.option(
    "--bisect",
    is_flag=True,
    help="Exit with git bisect run's codes: 0 good, 1 bad, 125 skip, 128 abort (see below).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="A replay that ran without an oracle (no reference, no recorded output, no fresh "
    "eager run to compare with) exits 1 instead of 0: for CI.",
)
@click.option(
    "-q", "--quiet", is_flag=True, help="No progress display while replaying several calls."
)
@json_option
def command(bisect: bool, **kwargs: Any) -> int:
    """Replay the calls in BUNDLES (files or capture folders) and say which step fails and how.

    Each replay runs in a child process, so a crash becomes a verdict. Outputs are poisoned
    before each run so unwritten elements show, every tensor sits between poisoned guard bytes,
    and results are compared with the torch reference, with the output recorded in the bundle
    (bitwise when backend, library version and GPU match the recording) and across runs.

    """
    if not bisect:
        return _replay(**kwargs)
    from kdump.errors import KdumpError
    from kdump.text import visible

    try:
        code = _replay(**kwargs)
    except KdumpError as exc:
        click.echo(f"kdump: error: {visible(exc)}", err=True)
        code = int(exc.exit_code)
    except Exception as exc:  # a kdump bug must abort, not mark the commit bad
        click.echo(f"kdump: internal error: {type(exc).__name__}: {visible(exc)}", err=True)
        code = int(ExitCode.INTERNAL)
    mapped = bisect_exit_code(code)
    click.echo(f"kdump: bisect: replay exit {code} -> {mapped}", err=True)
    return mapped


def _replay(
    bundles: tuple[str, ...],
    mode: str | None,
    calls: tuple[int, ...],
    tools: tuple[str, ...],
    in_process: bool,
    sanitizer_logs: str | None,
    verbose: bool,
    quiet: bool,
    as_json: bool,
    strict: bool = False,
    **flat: Any,
) -> int:
    """`flat`: the other options, by their keyword names (kdump.replay.options.KEYWORDS)."""
    from kdump.errors import KdumpError, UsageError, worst_exit_code
    from kdump.record.flight.salvage import salvaged_graph_replays
    from kdump.replay.options import from_keywords

    escalate = mode is None  # a crash bundle's default replay escalates to memcheck
    if mode is None:
        graph_bundles = salvaged_graph_replays(bundles)
        mode = "graph" if graph_bundles else "eager"
        if graph_bundles and not calls:
            calls = (0,)  # call 0 is captured; the salvaged replay's values are its phase

    try:
        if tools and mode not in ("sanitizer", "all"):
            raise UsageError(f"--tool applies to --mode sanitizer (or all), not {mode}")
        options = from_keywords(
            None,
            mode=mode,
            isolate=not in_process,
            escalate=escalate,
            tools=TOOLS if "all" in tools else (tools or ("memcheck",)),
            sanitizer_log_dir=sanitizer_logs,
            **flat,
        )
        verdicts = _replay_with_progress(bundles, options, calls, not (quiet or as_json))
    except KdumpError as exc:
        if not as_json:
            raise
        emit_json({"exit_code": int(exc.exit_code), "error": str(exc), "verdicts": []})
        return int(exc.exit_code)
    code = worst_exit_code([v.strict_exit_code() if strict else v.exit_code for v in verdicts])
    counts = summary(verdicts)
    if as_json:
        emit_json(
            {
                "exit_code": code,
                "summary": counts,
                "verdicts": [v.to_json() for v in verdicts],
            }
        )
    else:
        render(verdicts, verbose=verbose, strict=strict)
        if len(verdicts) > 1:
            console().print(f"\n{summary_line(counts)}: exit {code}")
    return code


def summary(verdicts: list) -> dict[str, int]:
    """How many replays were clean, ran without an oracle, or found something."""
    from kdump.replay.verdict import CLEAN, FAILED, NO_ORACLE

    outcomes = [v.outcome for v in verdicts]
    return {
        "replays": len(verdicts),
        "clean": outcomes.count(CLEAN),
        "no_oracle": outcomes.count(NO_ORACLE),
        "failed": outcomes.count(FAILED),
    }


def summary_line(counts: dict[str, int]) -> str:
    """'3 replays: 1 clean, 1 ran without an oracle, 1 failed' (parts that are 0 left out,
    except clean)."""
    parts = [f"{counts['clean']} clean"]
    if counts["no_oracle"]:
        parts.append(f"{counts['no_oracle']} ran without an oracle")
    if counts["failed"]:
        parts.append(f"{counts['failed']} failed")
    return f"{counts['replays']} replays: " + ", ".join(parts)


def _replay_with_progress(
    bundles: tuple[str, ...], options: Any, calls: tuple[int, ...], shown: bool
) -> list:
    """replay(), with a progress display once there is more than one replay to wait for."""
    from kdump.progress import progress
    from kdump.replay import replay

    label = "replay " + (bundles[0] if len(bundles) == 1 else f"{len(bundles)} paths")
    with progress(label, None, enabled=shown) as bar:

        def done(_verdict: Any, total: int) -> None:
            if total > 1:
                bar.total = total
                bar.advance()

        return replay(bundles, options, calls=list(calls) or None, on_done=done)


_STATUS = {
    "ok": "[green]ok[/]",
    "fail": "[red]FAIL[/]",
    "error": "[red]ERROR[/]",
    "skipped": "[yellow]skip[/]",  # a step that cannot run for this call (the detail says why)
}


def rows(v, verbose: bool = False) -> list[tuple[str, str, str]]:
    """(step, status, detail) per step: one row per step name (the worst status of its
    comparisons wins); per-tensor comparison rows only where they fail, all with `verbose`."""
    out: dict[str, list[str]] = {}
    status: dict[str, str] = {}
    rank = {"error": 0, "fail": 1, "ok": 2, "skipped": 3}
    for s in v.steps:
        base = s.name.split(" vs ")[0]
        status.setdefault(base, s.status)
        if rank.get(s.status, 3) < rank.get(status[base], 3):
            status[base] = s.status
        detail = out.setdefault(base, [])
        is_cmp = " vs " in s.name
        if s.message and (verbose or not is_cmp or s.status != "ok"):
            oracle = f"vs {s.name.split(' vs ', 1)[1]}: " if is_cmp else ""
            detail.append(oracle + s.message)
    return [(name, status[name], "; ".join(out[name])) for name in out]


def render(verdicts: list, verbose: bool = False, strict: bool = False) -> None:
    from rich.table import Table

    con = console()
    for v in verdicts:
        colour = {"clean": "green", "no_oracle": "yellow"}.get(v.outcome, "red")
        code = v.strict_exit_code() if strict else v.exit_code
        con.print(
            f"\n[bold]{markup(v.bundle)}[/] call {v.call} {markup(v.target)}: {v.mode}, "
            f"{markup(v.backend or '?')}, {markup(v.device or '?')}"
        )
        table = Table(show_edge=False, pad_edge=False, box=None, width=min(con.width, 80))
        table.add_column("step", overflow="fold", max_width=30)
        table.add_column("status", width=6)
        table.add_column("detail", overflow="fold", ratio=1)
        for name, st, detail in rows(v, verbose):
            limit = None if verbose else 200
            table.add_row(markup(name), _STATUS.get(st, markup(st)), markup(detail, limit))
        if v.steps:
            con.print(table)
        for note in v.notes:
            con.print(f"note: {markup(note)}")
        con.print(f"[{colour} bold]verdict: {markup(v.headline())}[/] (exit {code})")


__all__ = ["command", "render", "rows"]
