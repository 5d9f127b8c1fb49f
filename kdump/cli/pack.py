from __future__ import annotations

import click


@click.command("pack")
@click.argument("bundle", type=click.Path())
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="Output file, or an existing folder to write into (default: see below).",
)
@click.option(
    "-q", "--quiet", is_flag=True, help="No progress display (shown for several or big bundles)."
)
@click.option(
    "--force", is_flag=True, help="Overwrite an existing output file that holds something else."
)
def command(bundle: str, output: str | None, quiet: bool, force: bool) -> int:
    """Write BUNDLE (a file, or every bundle of a capture folder) as self-contained files (blobs
    from the capture directory's shared store folded in, checksums verified), ready to attach to
    a bug report.

    The copy never goes inside the capture folder, so replaying that folder later does not
    replay it twice. By default it goes to ROOT.packed/ beside ROOT, under the bundle's path in
    ROOT, where ROOT is the outer of the folder given and the bundle's capture directory, else
    the bundle's own folder: dumps/host-1234/call-000017.kdump becomes
    dumps.packed/host-1234/call-000017.kdump. With -o naming an existing folder the copy goes
    into it under the bundle's name; any other -o is the file to write (one bundle only). A
    symlinked bundle is packed beside the link, under the link's name. An existing file that
    holds something else is never overwritten without --force (the same bytes are fine).

    \b
    Examples:
      kdump pack dumps/host-1234/call-000017.kdump -o issue-4711.kdump
      kdump pack dumps/ -o attachments/
    """
    import os
    from pathlib import Path

    from kdump.bundle import iter_bundles
    from kdump.bundle.packing import pack, pack_destination, packed_bytes
    from kdump.errors import UsageError
    from kdump.progress import BIG_BYTES, progress
    from kdump.text import visible

    src = Path(bundle)
    base = src if src.is_dir() else None
    sources = list(iter_bundles([src]))
    if len(sources) > 1 and output is not None and not Path(output).is_dir():
        raise UsageError(
            f"{visible(src)} holds {len(sources)} bundles: -o must be an existing folder"
        )
    # All destinations first: a refused one writes nothing. Those where a file exists go
    # first, so one that holds something else stops the pack before any other file is written.
    plan = [(s, pack_destination(s, output, base)) for s in sources]
    plan.sort(key=lambda item: not os.path.lexists(item[1]))
    total = sum(packed_bytes(s) for s, _ in plan)
    shown_bar = not quiet and (len(plan) > 1 or total >= BIG_BYTES)
    with progress(f"pack {bundle}", total, enabled=shown_bar, nbytes=True) as bar:
        for s, dst in plan:
            out = pack(s, dst, bar.advance, force=force)
            shown = visible(out)
            click.echo(
                f"wrote {shown} ({out.stat().st_size} bytes); replay it with: kdump replay {shown}"
            )
    return 0
