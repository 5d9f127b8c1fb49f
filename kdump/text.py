"""Text kdump shows: strings from bundles made safe, and sizes in words.

A bundle is untrusted input: its target names, environment values and exception texts may hold
terminal escape sequences (an OSC 52 clipboard write, a screen clear), rich markup, lone
surrogates or megabytes of text. Everything kdump prints, renders or writes into Markdown or JSON
from a bundle goes through one of these functions first. Each is linear in the length of what it
returns.
"""

from __future__ import annotations

import re

DEFAULT_LIMIT = 2000  # characters of one value shown before it is cut

# C0 controls except tab and newline handled below, DEL, C1 controls, and the Unicode format
# characters that reorder or hide text (bidi overrides and isolates, zero-width marks).
_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff\ud800-\udfff]"
)
_MARKDOWN = re.compile(r"([\\`*_{}\[\]<>()#+!|~])")


def _escape_char(m: re.Match[str]) -> str:
    c = m.group(0)
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def visible(value: object, limit: int | None = DEFAULT_LIMIT, *, newlines: bool = False) -> str:
    """`value` as text with every control character, escape sequence, invisible format character
    and lone surrogate shown as a visible escape (`\\x1b`), cut to `limit` characters with a
    marker. Newlines and tabs are escaped too unless `newlines` is true."""
    text = value if isinstance(value, str) else str(value)
    cut = ""
    if limit is not None and len(text) > limit:
        cut = f"…[{len(text) - limit} more characters]"
        text = text[:limit]
    text = _UNSAFE.sub(_escape_char, text)
    if not newlines:  # (\r and the other C0 controls are already escaped above)
        text = text.replace("\t", "\\t").replace("\n", "\\n")
    return text + cut


# rich's emoji codes (':skull:', ':boom-emoji:'), as rich finds them (the same expression, so
# the same matches in the same order).
_EMOJI_CODE = re.compile(r"(:(\S*?)(?:(?:\-)(emoji|text))?:)")


def no_emoji(text: str) -> str:
    """`text` with the colon that opens each rich emoji code written as `\\x3a`, so rich shows
    the code as text instead of replacing it with an emoji (other colons stay as they are)."""
    try:
        from rich._emoji_codes import EMOJI
    except ImportError:  # a rich without emoji codes replaces none
        return text

    def one(m: re.Match[str]) -> str:
        code = m.group(0)
        return "\\x3a" + code[1:] if m.group(2).lower() in EMOJI else code

    while True:  # escaping one code can let rich pair other colons: until none is left
        escaped = _EMOJI_CODE.sub(one, text)
        if escaped == text:
            return text
        text = escaped


def markup(value: object, limit: int | None = DEFAULT_LIMIT) -> str:
    """For rich: visible text whose square brackets can never be read as markup and whose
    emoji codes are never replaced by emoji."""
    from rich.markup import escape

    return escape(no_emoji(visible(value, limit)))


def markdown(value: object, limit: int | None = DEFAULT_LIMIT) -> str:
    """For a Markdown table cell or inline text: visible, with Markdown and HTML syntax
    escaped so the text renders as itself."""
    return _MARKDOWN.sub(r"\\\1", visible(value, limit))


# --- sizes ---------------------------------------------------------------------------------------
def human_bytes(n: float) -> str:
    """A size for a summary line: '512 B', '1.5 MiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def exact_bytes(n: int) -> str:
    """A size that must stay exact (a halo read so far): '4 KiB' for whole KiB, else '5 bytes'."""
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n} byte" + "s" * (n != 1)
