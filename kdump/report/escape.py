"""Make bundle strings safe to show: a bundle is untrusted input, and its target, paths and
environment values end up in terminals and issue trackers."""

from __future__ import annotations

import html
import unicodedata

# Characters that Markdown (CommonMark, GitHub's tables) gives a meaning inside a line; a
# backslash before ASCII punctuation makes it literal. Line-start syntax (#, -, 1.) is avoided by
# never starting a line with a bundle string.
_MD_SPECIAL = set("\\`*_[]|~")


def _visible(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape_text(value: object) -> str:
    """`str(value)` with control and format characters (ESC, newlines, bidi overrides) and lone
    surrogates written as escapes, so a string cannot move the cursor, change colours, reorder
    text or fail to encode."""
    out = []
    for ch in str(value):
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp"):  # Cs: lone surrogates
            out.append(_visible(ch))
        else:
            out.append(ch)
    return "".join(out)


def escape_md(value: object) -> str:
    """A string as literal Markdown text, safe inside a table cell: control characters escaped,
    HTML entities encoded, Markdown punctuation (pipes, backticks, brackets) backslashed."""
    text = escape_text(value)
    out = []
    for ch in text:
        if ch in "<>&":
            out.append(html.escape(ch))
        elif ch in _MD_SPECIAL:
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def code_fence(body: str) -> str:
    """A fenced code block whose fence is longer than any backtick run inside `body`."""
    longest = run = 0
    for ch in body:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return f"{fence}\n{body}\n{fence}"
