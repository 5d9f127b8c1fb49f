from __future__ import annotations

import click

from kdump.cmd.common import console, emit_json, json_option


@click.command("replay")
@click.argument("bundles", nargs=-1, required=True, type=click.Path())
@click.option(
    "--mode",
    type=click.Choice(["eager", "graph"]),
    default="eager",
    show_default=True,
    help="eager: run and compare; graph: the capture / replay / mutation chain.",
)
@click.option(
    "--backend",
    type=click.Choice(["auto", "reference", "deep_gemm", "packaged", "library"]),
    default="auto",
    show_default=True,
    help="auto = installed library on a GPU, else packaged kernel on a GPU, else the "
    "torch reference.",
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
    help="Runs per call; runs after the first must be bit-identical to it.",
)
@click.option("--force", is_flag=True, help="Launch even when the call violates the contract.")
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds before a replay step counts as a hang and is killed.",
)
@click.option("--in-process", is_flag=True, help="Do not isolate replays in a child process.")
@json_option
def command(
    bundles: tuple[str, ...],
    mode: str,
    backend: str,
    device: str,
    calls: tuple[int, ...],
    repeat: int,
    force: bool,
    timeout: float,
    in_process: bool,
    as_json: bool,
) -> int:
    """Replay the calls in BUNDLES (files or capture folders) and say which step fails and how.

    Each call runs in a child process: outputs are poisoned (NaN) before each run so unwritten
    elements show, then compared with the reference, with the output recorded in the bundle
    (bitwise when backend, library version and GPU match the recording) and across runs.

    \b
    Exit codes: 0 clean, 1 wrong results, 2 invalid bundle / usage, 3 kernel error or hang,
    4 memory finding, 5 contract violation, 70 internal error, 125 cannot run here.
    \b
    Examples:
      kdump replay captures/contiguous_ue8m0.kdump
      kdump replay dumps/ --backend deep_gemm --repeat 5 --json
    """
    from kdump.errors import worst_exit_code
    from kdump.replayer import replay

    verdicts = replay(
        bundles,
        mode=mode,
        backend=backend,
        device=device,
        calls=list(calls) or None,
        repeat=repeat,
        force=force,
        timeout=timeout,
        isolate=not in_process,
    )
    code = worst_exit_code([v.exit_code for v in verdicts])
    if as_json:
        emit_json({"exit_code": code, "verdicts": [v.to_json() for v in verdicts]})
    else:
        render(verdicts)
    return code


def render(verdicts: list) -> None:
    from rich.table import Table

    con = console()
    for v in verdicts:
        colour = "green" if v.clean else "red"
        con.print(
            f"\n[bold]{v.bundle}[/] call {v.call} {v.target} — mode {v.mode}, backend "
            f"{v.backend or '?'}, device {v.device or '?'}"
        )
        table = Table(show_edge=False, pad_edge=False)
        table.add_column("step")
        table.add_column("status")
        table.add_column("time", justify="right")
        table.add_column("detail", overflow="fold")
        for s in v.steps:
            st = {"ok": "[green]ok[/]", "fail": "[red]FAIL[/]", "error": "[red]ERROR[/]"}.get(
                s.status, s.status
            )
            table.add_row(s.name, st, f"{s.seconds * 1e3:.1f} ms" if s.seconds else "", s.message)
        if v.steps:
            con.print(table)
        for note in v.notes:
            con.print(f"note: {note}")
        con.print(f"[{colour} bold]verdict: {v.headline()}[/] (exit {v.exit_code})")
