from __future__ import annotations

import click

from kdump.cli.common import emit_json, json_option


@click.command("diff")
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@json_option
def command(a: str, b: str, as_json: bool) -> int:
    """Show what differs between two recorded calls: target, shapes, strides, storage offsets,
    alignments, dtypes, aliasing, other arguments, routing metadata per group (tokens per group,
    changed and empty groups, padding rows), library settings and environment.

    A and B are FILE.kdump (call 0) or FILE.kdump#N (call N). Exit status 0 whether or not they
    differ; 2 for an unreadable bundle or a call that does not exist.

    \b
    Examples:
      kdump diff captures/contiguous_ue8m0.kdump captures/contiguous_ue8m0_b.kdump
      kdump diff failing.kdump#0 failing.kdump#1 --json
    """
    from kdump.report.diff import diff_calls
    from kdump.report.difftext import render
    from kdump.report.select import open_ref, parse_ref

    ra, rb = parse_ref(a), parse_ref(b)
    (ba, ca), (bb, cb) = open_ref(ra), open_ref(rb)
    diff = diff_calls(ba, ca, bb, cb, ra.label, rb.label)
    if as_json:
        emit_json(diff.to_json())
    else:
        click.echo(render(diff))
    return 0
