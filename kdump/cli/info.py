from __future__ import annotations

import click

from kdump.cli.common import console, emit_json, json_option, max_load_option
from kdump.text import human_bytes, markup


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
        emit_json(reports)  # always a list, also for one bundle
        return 0
    for rep in reports:
        _render(rep)
    return 0


def _render(rep: dict) -> None:
    from rich.table import Table

    from kdump.bundle.inspect import outputs_line
    from kdump.text import markup as m  # everything below comes from the bundle

    con = console()
    env = rep["env"]
    con.print(
        f"[bold]{m(rep['path'])}[/]  format v{m(rep['format_version'])}, {len(rep['calls'])} "
        f"call(s), {human_bytes(rep['file_bytes'])} on disk, {m(rep['blobs'])} blob(s) "
        f"({human_bytes(rep['blob_bytes'])}; {human_bytes(rep['logical_bytes'])} before dedup)"
        + ("  [green]checksums OK[/]" if rep["verified"] else "")
    )
    if env:

        def e(key: str, default: str) -> str:
            return markup(env.get(key, default))

        con.print(
            f"recorded on {m(env.get('hostname', '?'))} pid {m(env.get('pid', '?'))}: "
            f"{m(env.get('gpu_name', 'no GPU'))} (cc {m(env.get('compute_capability', '-'))}, "
            f"{m(env.get('sm_count', '-'))} SMs), torch {m(env.get('torch', '?'))}, "
            f"CUDA {m(env.get('torch_cuda', '-'))}, python {m(env.get('python', '?'))}"
        )
        libraries = env.get("libraries")
        for lib, state in (libraries if isinstance(libraries, dict) else {}).items():
            con.print(f"  {m(lib)}: {m(state)}")
        env_vars = env.get("env_vars")
        env_vars = env_vars if isinstance(env_vars, dict) else {}
        if env_vars:
            # Shown only: a replay applies none of them unless asked (--apply-env NAME).
            con.print("recorded environment (not applied by replay; see --apply-env):")
            for name, value in env_vars.items():
                con.print(f"  {m(name, 200)}={m(value, 500)}")
    for call in rep["calls"]:
        meta = call["meta"]
        extra = []
        if meta.get("capturing"):
            extra.append("recorded during CUDA-graph capture")
        if meta.get("exception"):
            extra.append(f"raised {m(meta['exception'])}")
        called_as = call["called_as"]
        con.print(
            f"\n[bold]call {m(call['index'])}[/] {m(call['target'])}"
            + (f" (called as {m(called_as)})" if called_as != call["target"] else "")
            + (f" — {'; '.join(extra)}" if extra else "")
        )
        table = Table(show_edge=False, pad_edge=False)
        # A column for how each storage is held, only when some storage is not a plain blob.
        held = any(t.get("source", "blob") != "blob" for t in call["tensors"])
        cols = ("arg", "dtype", "shape", "stride", "offset", "device", "align", "bytes")
        for col in (*cols, "held") if held else cols:
            table.add_column(
                col, justify="right" if col in ("offset", "align", "bytes") else "left"
            )
        for t in call["tensors"]:
            row = [
                m(t["name"]),
                m(t["dtype"]),
                m("×".join(map(str, t["shape"])) or "()"),
                m(",".join(map(str, t["stride"])) or "()"),
                m(t["storage_offset"]),
                m(t["device"]),
                m(t["alignment"]),
                human_bytes(t["bytes"]),
            ]
            if held:
                source = t.get("source", "blob")
                if source == "sparse":
                    source = f"sparse ({human_bytes(t.get('held_bytes', 0))} held)"
                elif source == "pieces":
                    source = f"{t.get('pieces', 0)} pieces"
                row.append(m(source))
            table.add_row(*row)
        con.print(table)
        if call["aliasing"]:
            groups = "; ".join(" = ".join(m(n) for n in g) for g in call["aliasing"])
            con.print("shared storage: " + groups)
        con.print(markup(outputs_line(call), None))
