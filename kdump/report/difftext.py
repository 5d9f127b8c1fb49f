"""`kdump diff` as plain text that fits 80 columns, every bundle string escaped."""

from __future__ import annotations

import textwrap

from kdump.report.diff import SECTIONS, CallDiff
from kdump.report.escape import escape_text
from kdump.report.routing import RoutingDiff

WIDTH = 80

_TITLES = {
    "target": "Target",
    "tensor": "Tensor layouts",
    "aliasing": "Aliasing",
    "argument": "Other arguments",
    "routing": "Routing metadata",
    "library": "Library state and settings",
    "env": "Environment",
    "meta": "Call metadata",
}


def _wrap(text: str, indent: str, hang: str) -> list[str]:
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=hang, break_on_hyphens=False
    ) or [indent]


def _entry(item: str, a: str, b: str) -> list[str]:
    item, a, b = escape_text(item), escape_text(a), escape_text(b)
    line = f"  {item}: {a} -> {b}"
    if len(line) <= WIDTH:
        return [line]
    return [
        *_wrap(item, "  ", "    "),
        *_wrap(a, "    A: ", "       "),
        *_wrap(b, "    B: ", "       "),
    ]


def group_ids(groups: tuple[int, ...] | list[int]) -> str:
    """Group ids said as ids ("group 2", "groups 0, 5"), never a bare number read as a count."""
    if not groups:
        return "none"
    return f"group{'s' if len(groups) > 1 else ''} {', '.join(map(str, groups))}"


def routing_table(r: RoutingDiff) -> list[str]:
    name = escape_text(r.a.argument)
    layouts = r.a.layout if r.a.layout == r.b.layout else f"{r.a.layout} / {r.b.layout}"
    lines = [f"  {name} ({layouts}): tokens per group", f"    {'group':>8} {'A':>9} {'B':>9}  "]
    for g in r.groups:
        ca, cb = r.a.count(g), r.b.count(g)
        mark = "changed" if (ca or 0) != (cb or 0) else ""
        lines.append(
            f"    {g:>8} {'-' if ca is None else ca:>9} {'-' if cb is None else cb:>9}  {mark}"
        )
    lines.append(f"    {'total':>8} {r.a.tokens:>9} {r.b.tokens:>9}")
    if r.a.padding is not None or r.b.padding is not None:
        pa = "-" if r.a.padding is None else r.a.padding
        pb = "-" if r.b.padding is None else r.b.padding
        lines.append(f"    {'padding':>8} {pa:>9} {pb:>9}")
    if r.a.invalid or r.b.invalid:
        lines.append(f"    {'invalid':>8} {r.a.invalid:>9} {r.b.invalid:>9}")
    lines += _wrap(group_ids(r.a.empty_groups), "    empty in A: ", " " * 18)
    lines += _wrap(group_ids(r.b.empty_groups), "    empty in B: ", " " * 18)
    lines += _wrap(group_ids(r.changed), "    changed:    ", " " * 18)
    return [line.rstrip() for line in lines]


def render(diff: CallDiff) -> str:
    lines = [
        *_wrap(escape_text(diff.a_label), "A: ", "   "),
        *_wrap(escape_text(diff.b_label), "B: ", "   "),
    ]
    if diff.identical:
        lines.append("identical: same target, layouts, arguments, routing and environment")
        return "\n".join(lines)
    n = len(diff.differences)
    lines.append(f"{n} difference{'s' if n != 1 else ''}")
    for section in SECTIONS:
        found = diff.in_section(section)
        if not found:
            continue
        lines += ["", _TITLES[section]]
        if section == "routing":
            for r in diff.routing:
                if r.differs:
                    lines += routing_table(r)
            continue
        for d in found:
            lines += _entry(d.item, d.a, d.b)
    return "\n".join(lines)
