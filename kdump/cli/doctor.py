from __future__ import annotations

import click

from kdump.cli.common import console, emit_json, json_option


@click.command("doctor")
@click.option(
    "--selftest",
    is_flag=True,
    help="Run the packaged kernel on this GPU against the torch reference.",
)
@json_option
def command(selftest: bool, as_json: bool) -> int:
    """Say what this machine can replay: GPU, driver, torch, the usable backends (installed
    DeepGEMM, packaged kernel, reference) and compute-sanitizer — each with the fix when missing.
    Paste its output into bug reports.

    \b
    Examples:
      kdump doctor
      kdump doctor --selftest --json
    """
    from kdump.doctor import diagnose, run_selftest
    from kdump.text import markup as m  # details quote library versions, paths, exceptions

    report = diagnose()
    code = 0
    if selftest:
        report["selftest"] = run_selftest()
        code = report["selftest"]["exit_code"]
    if as_json:
        emit_json(report)
        return code
    con = console()
    for item in report["checks"]:
        mark = "[green]ok[/]  " if item["ok"] else "[yellow]--[/]  "
        line = f"{mark}{m(item['name'])}: {m(item['detail'])}"
        if not item["ok"] and item.get("fix"):
            line += f"\n      fix: {m(item['fix'])}"
        con.print(line)
    if selftest:
        st = report["selftest"]
        con.print(f"selftest: {m(st['summary'])} (exit {st['exit_code']})")
    return code
