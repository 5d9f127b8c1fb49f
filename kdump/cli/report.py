from __future__ import annotations

from pathlib import Path

import click

from kdump.cli.common import trust_options


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
@click.option(
    "--no-plot", is_flag=True, help="With -o: do not write the routing plot (PNG) beside it."
)
@click.option(
    "--script",
    type=click.Path(dir_okay=False),
    help="Also write a standalone repro script here (needs torch and the kernel library only).",
)
@trust_options(
    allow_help="--script/--replay: also run this target (module:function, globs; repeatable).",
    path_help="--replay: folder the replays import targets from (repeatable); also written into "
    "the report's commands.",
    metavar="PATTERN",
)
def command(
    bundle: str,
    output: str | None,
    do_replay: bool,
    modes: tuple[str, ...],
    backend: str,
    device: str,
    redact: bool,
    no_plot: bool,
    script: str | None,
    allow_targets: tuple[str, ...],
    paths: tuple[str, ...],
) -> int:
    """Write a Markdown bug report of BUNDLE, ready to paste into an issue: environment, every
    argument's layout and aliasing, routing metadata per group (with -o also as a PNG plot,
    FILE-routing.png beside FILE.md; matplotlib, `kdump-gpu[report]`), replay verdicts
    (--replay), the commands that reproduce it, the file's size and SHA-256, and a privacy note.

    --script writes a Python script that reproduces the calls without kdump: it reads the
    bundle as data when it runs, calls only DeepGEMM's entry points and the targets allowed
    here, runs each call eagerly and, on a GPU, captures a CUDA graph with the first call and
    replays it with the later call's values; it exits 0 clean, 1 outputs differ, 2 refused,
    3 kernel error.

    \b
    Examples:
      kdump report captures/contiguous_ue8m0.kdump -o report.md
      kdump report failing.kdump --replay --mode eager --mode graph --redact
      kdump report failing.kdump --script repro.py && python repro.py
    """
    from dataclasses import replace

    from kdump.bundle import load_bundle
    from kdump.cli.common import check_output_path
    from kdump.report.markdown import ReportOptions, render_report

    # Before any work: a replay can take minutes. The script is renamed over its path.
    if output:
        check_output_path(output)
    if script:
        check_output_path(script, replaced=True)
    b = load_bundle(bundle)
    options = ReportOptions(redact, modes or ("eager",), backend, device, paths=paths)
    if script:
        from kdump.report.script import write_script

        write_script(script, bundle, [c.target for c in b.calls], allow_targets)
        options = replace(options, script=script)
    verdicts = []
    if do_replay:
        from kdump.replay import replay
        from kdump.replay.options import ReplayOptions

        for mode in options.modes:
            opts = ReplayOptions(
                mode=mode,
                backend=backend,
                device=device,
                allow_targets=allow_targets,
                paths=paths,
            )
            verdicts += replay([bundle], opts)
    if output and not no_plot:
        from kdump.report.plot import draw, plot_path

        options = replace(options, plot=draw(b, plot_path(output)))
    text = render_report(b, bundle, verdicts, options)
    if output:
        from kdump.errors import environment_error

        try:
            Path(output).write_text(text, encoding="utf-8")
        except OSError as exc:  # a full disk names no file: say which
            raise environment_error(exc, output) or exc
    else:
        click.echo(text, nl=False)
    if script:
        from kdump.doctor import quoted
        from kdump.text import visible

        run = quoted(["python", script, *(w for p in paths for w in ("--path", p))])
        click.echo(f"wrote {visible(script)}; run it with: {visible(run)}", err=True)
    return 0
