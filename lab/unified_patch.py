"""Apply a unified diff (as `diff -u` writes it) to one file's text, exactly: every hunk's context
and removed lines must match where the hunk says (no fuzz), or ValueError. The lab keeps the
variants the product no longer ships as such patches of the product's sources
(lab/patches/*.patch), so a change of the product's source that a patch no longer fits shows up
in lab/tests instead of a silently different variant."""

from __future__ import annotations

import re
from pathlib import Path

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def apply(text: str, diff: str) -> str:
    """`text` with `diff` applied."""
    src = text.split("\n")
    out: list[str] = []
    at = 0  # next line of src not yet copied
    lines = diff.split("\n")
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        i += 1
    while i < len(lines):
        m = _HUNK.match(lines[i])
        if m is None:
            if lines[i].strip():
                raise ValueError(f"not a hunk header: {lines[i]!r}")
            i += 1
            continue
        start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        if start < at:
            raise ValueError(f"overlapping hunk at line {start + 1}")
        out += src[at:start]
        at = start
        i += 1
        while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\"):
            tag, body = lines[i][:1], lines[i][1:]
            if tag in (" ", "-"):
                if at >= len(src) or src[at] != body:
                    raise ValueError(f"hunk does not fit line {at + 1}: {body!r}")
                if tag == " ":
                    out.append(body)
                at += 1
            elif tag == "+":
                out.append(body)
            i += 1
    return "\n".join(out + src[at:])


def patch_file(path: Path, patch: Path) -> str:
    return apply(path.read_text(encoding="utf-8"), patch.read_text(encoding="utf-8"))
