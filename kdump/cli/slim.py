from __future__ import annotations

from typing import Any

import click

from kdump.cli.common import emit_json, json_option, max_load_option, trust_options
from kdump.cli.replay import _BackendChoice
from kdump.errors import exit_codes_help

EPILOG = (
    exit_codes_help()
    + """
\b
kdump slim exits 0 when it wrote SMALL (the verdict held at the tier it stopped at, tier 0 being
the bundle rewritten self-contained); 2 when the original replays clean (nothing to reproduce),
for a bad bundle or a target no plug-in knows and the user did not allow; 125 when the original
cannot be replayed here; 70 for an internal error.
\b
Examples:
  kdump slim dumps/host-1234/call-000017.kdump -o small.kdump
  kdump slim big.kdump -o small.kdump --mode sanitizer --keep b
"""
)


@click.command("slim", epilog=EPILOG)
@click.argument("bundle", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="SMALL.")
@max_load_option
@click.option(
    "--mode",
    type=click.Choice(("eager", "graph", "sanitizer")),
    default="eager",
    show_default=True,
    help="The replay mode whose verdict must hold.",
)
@click.option(
    "--backend",
    type=_BackendChoice(),
    default="auto",
    show_default=True,
    help="The backend every replay runs on (as for kdump replay).",
)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--call", "call", type=int, default=0, show_default=True, help="Call to slim.")
@click.option(
    "--keep",
    multiple=True,
    metavar="NAME",
    help="Keep this argument exact (a parameter like 'b' or a path like 'a[1]'; repeatable).",
)
@click.option(
    "--max-tier", type=click.IntRange(0, 3), default=3, show_default=True, help="Last tier tried."
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**64 - 1),
    default=0,
    show_default=True,
    help="Base seed of the synthetic data (each storage derives its own).",
)
@click.option(
    "--repeat", type=click.IntRange(1, 100), default=2, show_default=True, help="Eager runs."
)
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds per replay.")
@trust_options(
    allow_help="Run this target although no kernel plug-in knows it (as for kdump replay).",
    path_help="Folder the replays import targets from (repeatable).",
)
@click.option("--tool", "tools", multiple=True, help="sanitizer: memcheck (default), racecheck…")
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
@json_option
def command(
    bundle: str,
    output: str,
    mode: str,
    backend: str,
    device: str,
    call: int,
    keep: tuple[str, ...],
    max_tier: int,
    seed: int,
    repeat: int,
    timeout: float,
    allow_targets: tuple[str, ...],
    paths: tuple[str, ...],
    tools: tuple[str, ...],
    quiet: bool,
    as_json: bool,
) -> int:
    """Write SMALL: BUNDLE as small as it gets while it still shows the failure.

    The call under test (--call) is replayed first for its verdict (finding kind and step).
    Then, each tier on top of the last one that held, replaying after each: (1) rows the call
    cannot touch are dropped (weights of groups without tokens, padding rows); (2) floating-
    point activations and scales become synthetic data with the recorded statistics, and the
    recorded outputs are dropped; (3) weights become synthetic too. Routing metadata stays
    exact. From tier 2 on the failure must show against an oracle other than the recorded
    output. SMALL records each tier (what was replaced, how, the seed).
    """
    from kdump.cli.common import check_output_path
    from kdump.replay.options import TOOLS, ReplayOptions, SanitizerOptions
    from kdump.report.slim import SlimOptions, describe, slim

    check_output_path(output, replaced=True)  # before the replays, which can take minutes
    chosen = TOOLS if "all" in tools else (tools or ("memcheck",))
    replay = ReplayOptions(
        mode=mode,
        backend=backend,
        device=device,
        repeat=repeat,
        timeout=timeout,
        allow_targets=allow_targets,
        paths=paths,
        sanitizer=SanitizerOptions(tools=tuple(chosen)),
    )
    opts = SlimOptions(replay=replay, call=call, keep=keep, seed=seed, max_tier=max_tier)

    from kdump.progress import progress

    with progress(f"slim {bundle}", None, enabled=not (quiet or as_json)) as bar:

        def step(label: str, done: int, total: int) -> None:
            bar.total = total
            bar.advance(done - bar.done)

        result = slim(bundle, output, opts, step)
    command_line = next_command(result, replay)
    if as_json:
        emit_json({"exit_code": 0, **result.to_json(), "next": command_line})
    else:
        for line in describe(result):
            click.echo(line)
        click.echo(f"next: {command_line}")
    return 0


def next_command(result: Any, options: Any) -> str:
    """The replay of SMALL, as it works here: the slim's mode, backend, device, allowed targets
    and --path folders (escaped: the output path may hold anything)."""
    from kdump.bundle import load_bundle
    from kdump.doctor import quoted, replay_words
    from kdump.text import visible

    words = ["kdump", "replay", str(result.output), "--mode", options.mode]
    for flag, value in (("--backend", options.backend), ("--device", options.device)):
        if value != "auto":
            words += [flag, value]
    targets = [c.target for c in load_bundle(result.output).calls]
    needs, _ = replay_words(targets, paths=list(options.paths))
    return visible(quoted([*words, *needs]))
