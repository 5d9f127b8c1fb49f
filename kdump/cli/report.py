from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("bundle", type=click.Path())
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write here, not stdout.")
@click.option("--replay", "do_replay", is_flag=True, help="Replay the bundle and add verdicts.")
@click.option(
    "--mode",
    "modes",
    type=click.Choice(["eager", "graph", "sanitizer", "all"]),
    multiple=True,
    help="--replay: mode(s) to replay in (repeatable; default eager).",
)
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    help="--replay: backend (auto, reference, deep_gemm, packaged, library).",
)
@click.option("--device", default="auto", show_default=True, help="--replay: auto, cpu, cuda:N.")
@click.option(
    "--redact", is_flag=True, help="Replace host names, user names, paths and env values."
)
def command(
    bundle: str,
    output: str | None,
    do_replay: bool,
    modes: tuple[str, ...],
    backend: str,
    device: str,
    redact: bool,
) -> int:
    """Write a Markdown bug report of BUNDLE, ready to paste into an issue: environment, every
    argument's layout and aliasing, routing metadata per group, replay verdicts (--replay), the
    commands that reproduce it, the file's size and SHA-256, and a privacy note.

    \b
    Examples:
      kdump report captures/contiguous_ue8m0.kdump -o report.md
      kdump report failing.kdump --replay --mode eager --mode graph --redact
    """
    from kdump.bundle import load_bundle
    from kdump.report.markdown import ReportOptions, render_report

    b = load_bundle(bundle)
    options = ReportOptions(redact, modes or ("eager",), backend, device)
    verdicts = []
    if do_replay:
        from kdump.replay import replay

        for mode in options.modes:
            verdicts += replay([bundle], mode=mode, backend=backend, device=device)
    text = render_report(b, bundle, verdicts, options)
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        click.echo(text, nl=False)
    return 0
