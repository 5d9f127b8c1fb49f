from __future__ import annotations

from pathlib import Path

import click


@click.command("salvage")
@click.argument("journals", nargs=-1, type=click.Path())
@click.option("-o", "--output", type=click.Path(), required=True, help="Folder for the bundles.")
@click.option("--exit-code", type=int, help="The dead process' exit status (negative: signal).")
@click.option(
    "--stderr", "stderr_file", type=click.Path(exists=True), help="File with the process' stderr."
)
@click.option(
    "--cuda-coredump",
    "coredump",
    type=click.Path(exists=True, dir_okay=False),
    help="The GPU core dump the process wrote (named in every salvaged call's crash context).",
)
@click.option("--keep", is_flag=True, help="Keep the journal files after salvaging them.")
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
def command(
    journals: tuple[str, ...],
    output: str,
    exit_code: int | None,
    stderr_file: str | None,
    coredump: str | None,
    keep: bool,
    quiet: bool,
) -> int:
    """Turn the flight-recorder journals of dead processes into bundles (one per complete slot)
    and remove the journals (with the device-tier files JOURNAL.cudaN that the salvage process of
    `kdump record` wrote). JOURNAL may be a file or a folder; default: the journals in /dev/shm
    (and in its kdump-run-* folders, left when `kdump record` itself was killed) whose process
    is gone.

    \b
    Example:
      kdump salvage -o crash-dumps/
      kdump salvage /dev/shm/kdump-journal-4711-18c2f -o crash-dumps/ --exit-code -9
    """
    import contextlib

    from kdump.format.journal import DEFAULT_DIR, RUN_PREFIX
    from kdump.progress import PLAIN_INTERVAL_S, progress
    from kdump.record.capture_dir import remove_stale_temporaries
    from kdump.record.flight.announce import device_files, is_device_file, pid_alive
    from kdump.record.flight.journal_reader import read_pid
    from kdump.record.flight.salvage import dead_journals, salvage_journal
    from kdump.text import visible as v  # names and paths may come from a journal

    for left in remove_stale_temporaries(output):  # a killed writer's partial files
        click.echo(f"removed {v(left)}: left by a writer that was killed", err=True)
    paths: list[Path] = []
    for j in journals or (str(DEFAULT_DIR),):
        p = Path(j)
        if p.is_dir():
            paths.extend(d for d in dead_journals(p) if not is_device_file(d))
        elif pid_alive(read_pid(p)):
            click.echo(f"skipped {v(p)}: its process is still running", err=True)
        else:
            paths.append(p)
    if not keep:
        for j in journals or (str(DEFAULT_DIR),):
            for folder in _left_run_folders(Path(j)):
                click.echo(f"removed {v(folder)}: left by a killed `kdump record`", err=True)
    if not paths:
        click.echo("no journals of dead processes found; nothing to salvage")
        return 0
    context: dict[str, object] | None = None
    if exit_code is not None or stderr_file or coredump:
        context = {}
        if coredump:
            context["cuda_coredump"] = str(Path(coredump).resolve())
        if exit_code is not None:
            context["exit_code" if exit_code >= 0 else "signal"] = abs(exit_code)
        if stderr_file:
            tail = Path(stderr_file).read_bytes()[-4096:]
            context["stderr_tail"] = tail.decode("utf-8", "replace")
    label = f"salvage to {output}"
    with progress(label, None, enabled=not quiet, quiet_for=PLAIN_INTERVAL_S) as bar:
        results = [
            (p, salvage_journal(p, output, context, remove=not keep, progress=bar)) for p in paths
        ]
    for p, res in results:
        if not keep:  # the salvage process' copies of its device tier go with it
            for f in device_files(p):
                f.unlink(missing_ok=True)
        click.echo(
            f"{v(p)}: {len(res.bundles)} bundles, {len(res.in_flight)} in flight, "
            f"{len(res.torn)} torn; report {v(res.report)}"
        )
        for b in res.bundles:
            click.echo(f"  {v(b)}")
    if not keep:  # a run folder of `kdump record` that held only these journals goes too
        for folder in {p.parent for p in paths if p.parent.name.startswith(RUN_PREFIX)}:
            with contextlib.suppress(OSError):
                folder.rmdir()
    click.echo(f"replay them with: kdump replay {v(output)}")
    return 0


def _left_run_folders(top: Path) -> list[Path]:
    """Remove what a killed `kdump record` left in its run folders under `top` (or in `top`, a
    run folder) besides journals: the status files of processes that are gone, then each folder
    that this left empty. A folder without such files is kept: it may belong to a live run."""
    import contextlib

    from kdump.format.journal import RUN_PREFIX
    from kdump.record.flight.announce import pid_alive
    from kdump.record.session import STATUS_PREFIX

    if not top.is_dir():
        return []
    folders = [top] if top.name.startswith(RUN_PREFIX) else sorted(top.glob(f"{RUN_PREFIX}*"))
    removed: list[Path] = []
    for folder in folders:
        gone = 0
        for status in folder.glob(f"{STATUS_PREFIX}*"):
            try:
                pid = int(status.name[len(STATUS_PREFIX) :].split("-")[0])
            except ValueError:
                continue
            if not pid_alive(pid):
                status.unlink(missing_ok=True)
                gone += 1
        if gone:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when nothing else is left in it
                removed.append(folder)
    return removed
