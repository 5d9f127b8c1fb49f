from __future__ import annotations

import click


@click.command("pack")
@click.argument("bundle", type=click.Path())
@click.option(
    "-o", "--output", type=click.Path(), help="Output file (default: BUNDLE.packed.kdump)."
)
def command(bundle: str, output: str | None) -> int:
    """Write BUNDLE as one self-contained file (blobs from the capture directory's shared store
    folded in, checksums verified), ready to attach to a bug report.

    \b
    Example:
      kdump pack dumps/host-1234/call-000017.kdump -o issue-4711.kdump
    """
    from pathlib import Path

    from kdump.bundle import pack
    from kdump.text import visible

    src = Path(bundle)
    dst = Path(output) if output else src.with_suffix(".packed.kdump")
    out = pack(src, dst)
    shown = visible(out)
    click.echo(f"wrote {shown} ({out.stat().st_size} bytes); replay it with: kdump replay {shown}")
    return 0
