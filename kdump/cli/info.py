from __future__ import annotations

import click

from kdump.cli.common import console, emit_json, human_bytes, json_option, max_load_option
from kdump.text import markup


@click.command("info")
@click.argument("bundles", nargs=-1, required=True, type=click.Path())
@click.option("--verify", is_flag=True, help="Check every blob's SHA-256.")
@max_load_option
@json_option
def command(bundles: tuple[str, ...], verify: bool, as_json: bool) -> int:
    """Show what is inside BUNDLES (files or capture folders): calls, targets, per-argument
    dtype / shape / stride / offset / alignment / bytes, aliasing groups, environment.

    \b
    Examples:
      kdump info captures/contiguous_ue8m0.kdump
      kdump info --verify --json dumps/
    """
    from kdump.bundle import iter_bundles, load_bundle
    from kdump.bundle.inspect import describe_bundle

    reports = []
    for path in iter_bundles(bundles):
        b = load_bundle(path)
        if verify:
            b.verify()
        rep = describe_bundle(b)
        rep["verified"] = verify
        reports.append(rep)
    if as_json:
        emit_json(reports if len(reports) > 1 else reports[0])
        return 0
    for rep in reports:
        _render(rep)
    return 0


def _render(rep: dict) -> None:
    from rich.table import Table

    con = console()
    env = rep["env"]
    con.print(
        f"[bold]{markup(rep['path'], None)}[/]  format v{rep['format_version']}, "
        f"{len(rep['calls'])} call(s), "
        f"{human_bytes(rep['file_bytes'])} on disk, {rep['blobs']} blob(s) "
        f"({human_bytes(rep['blob_bytes'])}; {human_bytes(rep['logical_bytes'])} before dedup)"
        + ("  [green]checksums OK[/]" if rep["verified"] else "")
    )
    if env:

        def e(key: str, default: str) -> str:
            return markup(env.get(key, default))

        con.print(
            f"recorded on {e('hostname', '?')} pid {e('pid', '?')}: "
            f"{e('gpu_name', 'no GPU')} (cc {e('compute_capability', '-')}, "
            f"{e('sm_count', '-')} SMs), torch {e('torch', '?')}, "
            f"CUDA {e('torch_cuda', '-')}, python {e('python', '?')}"
        )
        libraries = env.get("libraries")
        for lib, state in (libraries if isinstance(libraries, dict) else {}).items():
            con.print(f"  {markup(lib)}: {markup(state)}")
    for call in rep["calls"]:
        meta = call["meta"]
        extra = []
        if meta.get("capturing"):
            extra.append("recorded during CUDA-graph capture")
        if meta.get("exception"):
            extra.append(f"raised {markup(meta['exception'])}")
        con.print(
            f"\n[bold]call {call['index']}[/] {markup(call['target'])}"
            + (
                f" (called as {markup(call['called_as'])})"
                if call["called_as"] != call["target"]
                else ""
            )
            + (f" — {'; '.join(extra)}" if extra else "")
        )
        table = Table(show_edge=False, pad_edge=False)
        for col in ("arg", "dtype", "shape", "stride", "offset", "device", "align", "bytes"):
            table.add_column(
                col, justify="right" if col in ("offset", "align", "bytes") else "left"
            )
        for t in call["tensors"]:
            table.add_row(
                markup(t["name"]),
                t["dtype"],
                "×".join(map(str, t["shape"])) or "()",
                ",".join(map(str, t["stride"])) or "()",
                str(t["storage_offset"]),
                markup(t["device"]),
                str(t["alignment"]),
                human_bytes(t["bytes"]),
            )
        con.print(table)
        if call["aliasing"]:
            groups = "; ".join(" = ".join(map(markup, g)) for g in call["aliasing"])
            con.print("shared storage: " + groups)
        con.print(f"outputs recorded: {'yes' if call['outputs_recorded'] else 'no'}")
